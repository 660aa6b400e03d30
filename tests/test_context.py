"""Conversations that outlive the context window: context policies (rolling, summarize) keep the whole
history, show the model a window of it that fits, reuse the cache, and answer as a fresh session built
from what the model sees would."""

import dataclasses

from chatkit import (
    ChatMessage,
    ChatSession,
    ContextPolicy,
    ContextWindowExceededError,
    GenerateParams,
    InvalidParamsError,
    LoadedModel,
    Role,
    SummaryError,
)
from chatkit.session.context import SUMMARY_HEADER
from chatkit.testing import Scripted

import pytest
from conftest import assert_ledger_matches_cache
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

PARAMS = GenerateParams(max_tokens=8, temperature=0.0)
WINDOW = 320
PROMPTS = [f"Message number {i}: tell me something about the colour {c}." for i, c in
           enumerate(["red", "green", "blue", "yellow", "purple", "orange", "black", "white"] * 6)]


def small(lm, window=WINDOW):
    """The same model and weights, with a small context window."""
    return LoadedModel(lm.model, lm.tokenizer, {**lm.config, "max_position_embeddings": window}, lm.source)


@pytest.fixture
def lm(tiny):
    return small(tiny())


def session_over(lm, policy, **options):
    builder = ChatSession.builder(lm).instructions("Be brief.").generate_params(PARAMS).context_policy(policy)
    for name, value in options.items():
        builder = getattr(builder, name)(value)
    return builder.build()


def fresh_tokens(session, prompt):
    """The reply of a new session built from what ``session``'s model sees: the ground truth."""
    system, *kept = session.context
    assert system.role is Role.SYSTEM
    roomy = small(session.model, 4096)  # the same weights, a window the fresh session needs no policy in
    fresh = ChatSession.builder(roomy).instructions(system.content).history(kept).generate_params(PARAMS).build()
    with fresh.stream_respond(prompt) as stream:
        list(stream)
    return stream.tokens


def assert_answers_as_fresh(session, prompts):
    """Each turn that does not compact answers as a fresh session from the context before it (a
    compacting turn's model sees the new context, which the next turns check)."""
    checked = 0
    for prompt in prompts:
        expected = fresh_tokens(session, prompt)
        with session.stream_respond(prompt) as stream:
            list(stream)
        if not stream.stats.compacted:
            assert stream.tokens == expected
            checked += 1
        assert_ledger_matches_cache(session)
    assert checked


def talk(session, prompts):
    stats = []
    for prompt in prompts:
        session.respond(prompt)
        stats.append(session.last_stats)
    return stats


def test_the_default_policy_still_refuses_a_prompt_past_the_window(lm):
    session = session_over(lm, ContextPolicy.error())
    with pytest.raises(ContextWindowExceededError):
        talk(session, PROMPTS)
    assert len(session.history) % 2 == 0 and not session.busy


@pytest.mark.slow
def test_rolling_keeps_every_message_and_answers_as_a_fresh_session_from_its_context(lm):
    session = session_over(lm, ContextPolicy.rolling())
    stats = talk(session, PROMPTS[:-1])
    assert [m.content for m in session.history[::2]] == PROMPTS[:-1]  # the transcript is never lost
    compactions = [s for s in stats if s.compacted]
    assert compactions and len(compactions) <= len(stats) // 4, "low water: compactions are rare"
    assert all(s.dropped_tokens > 0 for s in compactions)
    # Between compactions a turn prefills its message (and the few tokens of a random model's reply that
    # re-tokenize differently), not the conversation.
    assert all(s.prefilled_tokens < 45 for s in stats[1:] if not s.compacted)
    assert all(s.prompt_tokens + PARAMS.max_tokens <= WINDOW for s in stats)
    assert session.dropped_messages == session.history[: len(session.dropped_messages)]
    assert session.context[1:] == session.history[len(session.dropped_messages):]
    assert session.token_count <= WINDOW
    assert_answers_as_fresh(session, PROMPTS[-6:])


def test_a_compaction_reuses_the_cache_before_what_it_dropped(lm):
    session = session_over(lm, ContextPolicy.rolling(low_water=0.5))
    stats = talk(session, PROMPTS[:20])
    first = next(s for s in stats if s.compacted)
    assert first.plan == "trim" and first.reused_tokens > 0  # the instructions stay in the cache
    assert first.prompt_tokens <= WINDOW * 0.5 + 40  # down to the low-water mark (plus this message)


def test_keep_first_keeps_the_first_exchanges(lm):
    session = session_over(lm, ContextPolicy.rolling(keep_first=1))
    talk(session, PROMPTS[:20])
    assert session.dropped_messages and session.context[1:3] == session.history[:2]


def test_a_window_starts_at_a_prompt_never_between_a_call_and_its_result(lm):
    session = session_over(lm, ContextPolicy.rolling())
    talk(session, PROMPTS[:16])
    window = session._state.conversation.window
    assert session.history[window.start].role is Role.USER


def test_undo_of_the_compacting_turn_shows_the_dropped_exchanges_again(lm):
    session = session_over(lm, ContextPolicy.rolling())
    for prompt in PROMPTS:
        before = (session.context, session.dropped_messages)
        session.respond(prompt)
        if session.last_stats.compacted:
            break
    session.undo()
    assert (session.context, session.dropped_messages) == before
    assert_ledger_matches_cache(session)


def test_save_restore_and_fork_keep_the_history_the_window_and_the_policy(lm, tmp_path):
    session = session_over(lm, ContextPolicy.rolling(keep_first=1))
    talk(session, PROMPTS[:16])
    path = tmp_path / "long.safetensors"
    session.save_cache(path)
    restored = ChatSession.builder(lm).cache(path).build()
    fork = session.fork()
    for other in (restored, fork):
        assert other.history == session.history and other.context == session.context
        assert other.context_policy == session.context_policy
    expected = fresh_tokens(session, PROMPTS[16])
    for other in (session, restored, fork):
        with other.stream_respond(PROMPTS[16]) as stream:
            list(stream)
        assert stream.tokens == expected


@pytest.mark.slow
def test_summarize_folds_dropped_exchanges_into_a_summary_after_the_instructions(lm):
    seen = []

    def summarizer(messages):
        seen.append(messages)
        told = [int(m.content.split(":")[0].split()[-1]) for m in messages if m.role is Role.USER]
        first = int(messages[0].content.split("from ")[1].split(" ")[0]) if messages[0].role is Role.SYSTEM else told[0]
        return f"Told from {first} to {told[-1]} (Message number {first} first)."

    session = session_over(lm, ContextPolicy.summarize(summarizer=summarizer))
    stats = talk(session, PROMPTS[:30])
    assert len(seen) >= 2 and seen[1][0].role is Role.SYSTEM and SUMMARY_HEADER in seen[1][0].content
    system = session.context[0].content
    assert system.startswith("Be brief.\n\n" + SUMMARY_HEADER) and "Message number 0" in system
    assert any(s.summary_tokens > 0 for s in stats if s.compacted)
    assert_answers_as_fresh(session, PROMPTS[30:34])


def test_the_model_itself_can_summarize(lm):
    session = session_over(lm, ContextPolicy.summarize())
    talk(session, PROMPTS[:16])
    summary = session._state.conversation.window.summary
    assert isinstance(summary, str) and summary and SUMMARY_HEADER in session.context[0].content


def test_a_long_history_compacted_at_once_is_summarized_from_what_fits(lm):
    """A session built with a history far past its window (a conversation sent whole, as a stateless
    server request is) drops most of it at its first turn: the model is shown the newest part of the
    dropped messages that fits its own window, not all of them (which could never fit)."""
    history = []
    for i, prompt in enumerate(PROMPTS * 2):
        history += [{"role": "user", "content": prompt}, {"role": "assistant", "content": f"Noted {i}, it is lovely."}]
    session = ChatSession.builder(lm).instructions("Be brief.").generate_params(PARAMS).history(history) \
        .context_policy(ContextPolicy.summarize()).build()
    session.respond("And what about grey?")
    assert session.last_stats.compacted and session.token_count <= session.context_window
    assert len(session.dropped_messages) > 150 and len(session.history) == len(history) + 2
    assert SUMMARY_HEADER in session.context[0].content


@pytest.mark.parametrize("bad", [lambda messages: 42, lambda messages: "", lambda messages: 1 / 0])
def test_a_failing_summarizer_changes_nothing(lm, bad):
    session = session_over(lm, ContextPolicy.summarize(summarizer=bad))
    with pytest.raises(SummaryError):
        talk(session, PROMPTS)
    history, context = session.history, session.context
    with pytest.raises(SummaryError):
        session.respond("once more")
    assert (session.history, session.context) == (history, context) and not session.busy
    session.context_policy = ContextPolicy.rolling()
    session.respond("once more")  # the conversation goes on


def test_token_counts_match_what_the_next_turn_prefills(lm):
    session = session_over(lm, ContextPolicy.rolling())
    talk(session, PROMPTS[:3])
    before, added = session.token_count, session.count_tokens(PROMPTS[3])
    session.respond(PROMPTS[3])
    assert session.last_stats.prompt_tokens == before + added and not session.last_stats.compacted
    assert session.context_window == WINDOW
    assert session.count_tokens([PROMPTS[0], PROMPTS[1]]) > session.count_tokens(PROMPTS[0])


@pytest.mark.parametrize("make", [
    lambda: ContextPolicy.rolling(low_water=0), lambda: ContextPolicy.rolling(low_water=1.5),
    lambda: ContextPolicy.rolling(keep_first=-1), lambda: ContextPolicy.rolling(reserve=0),
    lambda: ContextPolicy.summarize(high_water=0.4), lambda: ContextPolicy.summarize(fallback="later"),
    lambda: ContextPolicy.summarize(summarizer="model"), lambda: ContextPolicy("sometimes").checked(),
])
def test_bad_settings_are_refused_when_set(make):
    with pytest.raises(InvalidParamsError):
        make()


def test_a_window_too_small_for_the_instructions_and_one_exchange_leaves_the_session_unchanged(lm):
    session = session_over(small(lm, 96), ContextPolicy.rolling())
    session.respond("Hi.")
    history = session.history
    with pytest.raises(ContextWindowExceededError):
        session.respond("word " * 200)
    assert session.history == history and not session.busy
    with pytest.raises(InvalidParamsError):
        session.context_policy = "rolling"


def test_a_policy_is_plain_data_that_round_trips():
    policy = ContextPolicy.summarize(low_water=0.4, prompt="Sum up.", keep_first=2, reserve=64)
    assert ContextPolicy.from_dict(policy.to_dict()) == dataclasses.replace(policy, summarizer=None)


def test_a_compaction_prepared_between_turns_is_what_the_crossing_turn_uses(lm):
    calls = []

    def summarizer(messages):
        calls.append(len(messages))
        return f"Summary {len(calls)}."

    session = session_over(lm, ContextPolicy.summarize(summarizer=summarizer, high_water=0.7))
    prepared_at = None
    for i, prompt in enumerate(PROMPTS):
        if session.prepare_compaction():
            prepared_at = i
            break
        session.respond(prompt)
        assert not session.last_stats.compacted, "compacted before the high-water mark was passed"
    assert prepared_at is not None and len(calls) == 1  # the summary was written between turns
    for prompt in PROMPTS[prepared_at:]:
        session.respond(prompt)
        if session.last_stats.compacted:
            break
        assert session.prepare_compaction()  # between turns, as an app (or an async turn) does: a top-up
    stats = session.last_stats
    assert stats.compacted and len(calls) == 1, "the crossing turn did not write a summary again"
    assert stats.prefilled_tokens < 45 and session.context[0].content.endswith("Summary 1.")
    assert_answers_as_fresh(session, ["And now?", "Tell me more."])


def test_a_stale_preparation_is_not_used(lm):
    session = session_over(lm, ContextPolicy.rolling(high_water=0.6))
    while not session.prepare_compaction():
        session.respond(PROMPTS[len(session.history) // 2])
    session.undo()  # the conversation changed: the prepared compaction is for another history
    for prompt in PROMPTS:
        session.respond(prompt)
        if session.last_stats.compacted:
            break
    assert session.last_stats.compacted and session.last_stats.prefilled_tokens > 45  # compacted by itself
    assert_answers_as_fresh(session, ["And now?"])


def test_async_turns_prepare_the_next_compaction_by_themselves(lm):
    import asyncio

    calls = []

    def summarizer(messages):
        calls.append(len(messages))
        return f"Summary {len(calls)}."

    session = session_over(lm, ContextPolicy.summarize(summarizer=summarizer, high_water=0.7, fallback="wait"))

    async def chat():
        stats = []
        for prompt in PROMPTS[:24]:
            await session.arespond(prompt)
            stats.append(session.last_stats)
        return stats

    stats = asyncio.run(chat())
    crossing = [s for s in stats if s.compacted]
    assert crossing and all(s.prefilled_tokens < 45 for s in crossing)  # every compaction was ready
    assert len(calls) == len(crossing) + (1 if session._compactor.preparer.get(tuple(session.history), session._state.conversation.window) else 0)


def test_a_pooled_session_prepares_its_next_compaction_in_the_background(lm, tmp_path):
    from chatkit import SessionPool

    calls = []

    def summarizer(messages):
        calls.append(len(messages))
        return f"Summary {len(calls)}."

    policy = ContextPolicy.summarize(summarizer=summarizer, high_water=0.7, fallback="wait")
    pool = SessionPool(lm, folder=tmp_path, max_cache_bytes=2**30, configure=lambda b: b.instructions(
        "Be brief.").generate_params(PARAMS).context_policy(policy))
    stats = []
    for prompt in PROMPTS[:24]:
        session = pool.session("a")
        session.respond(prompt)  # a plain sync turn: the pool prepares after it, on a thread of its own
        stats.append(session.last_stats)
    assert pool.wait_idle(60)
    crossing = [s for s in stats if s.compacted]
    assert crossing and all(s.prefilled_tokens < 45 for s in crossing)  # every compaction was ready
    assert len(calls) >= len(crossing) and [m.content for m in session.history[::2]] == PROMPTS[:24]
    assert_answers_as_fresh(pool.session("a"), ["And now?", "And then?"])
    assert pool.wait_idle(60) and session._compactor.preparer.get(tuple(session.history), session._state.conversation.window)
    pool.enforce_budget()  # nothing to evict under the budget; with none, the prepared cache goes too
    pool._budget = 0
    assert pool.enforce_budget() == ["a"]
    assert session._compactor.preparer.get(tuple(session.history), session._state.conversation.window) is None


def test_a_pooled_turn_that_comes_during_a_preparation_never_fails(lm, tmp_path):
    import threading

    from chatkit import SessionPool

    started, release = threading.Event(), threading.Event()

    def summarizer(messages):
        started.set()
        release.wait(60)  # a slow summary: the next turns come while it is being written
        return "Slow summary."

    policy = ContextPolicy.summarize(summarizer=summarizer, high_water=0.6)  # fallback="rolling"
    pool = SessionPool(lm, folder=tmp_path, max_cache_bytes=2**30, configure=lambda b: b.instructions(
        "Be brief.").generate_params(PARAMS).context_policy(policy))
    stats = []
    for prompt in PROMPTS[:30]:
        pool.session("a").respond(prompt)
        stats.append(pool.session("a").last_stats)
    release.set()
    assert started.is_set() and pool.wait_idle(60)
    assert any(s.compacted for s in stats)  # compacted by itself, without a summary, while one was written
    session = pool.session("a")
    assert [m.content for m in session.history[::2]] == PROMPTS[:30] and session.token_count <= WINDOW


# -- any sequence of turns and edits under a policy, in a tiny window ---------------------------------

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather.",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
MACHINE_WINDOW = 256


class LongConversation(RuleBasedStateMachine):
    """The history holds every committed message but what undo removed; the context fits the window,
    never starts inside an exchange, and the next turn answers as a fresh session built from it would."""

    def __init__(self):
        super().__init__()
        from chatkit.testing import tiny_model

        self.lm = small(tiny_model(tokenizer="bpe-think"), MACHINE_WINDOW)
        self.session = session_over(self.lm, ContextPolicy.rolling(), tools=[WEATHER])
        self.expected = []  # the model of the history: every committed message

    def turn(self, prompt):
        s = self.session
        roomy = small(s.model, 4096)
        system, *kept = s.context
        fresh = (ChatSession.builder(roomy).instructions(system.content).history(kept).generate_params(PARAMS)
                 .tools([WEATHER], tool_execution="manual").build())
        with fresh.stream_respond(prompt) as expected:
            list(expected)
        history = s.history
        try:
            with s.stream_respond(prompt) as stream:
                list(stream)
        except ContextWindowExceededError:  # the kept exchanges and this message alone are too long
            assert s.history == history and not s.busy
            return
        if not stream.stats.compacted:
            assert stream.tokens == expected.tokens
        assert stream.stats.prompt_tokens + stream.stats.generation_tokens <= MACHINE_WINDOW
        self.expected += s.history[len(self.expected):]

    @rule(prompt=st.sampled_from(PROMPTS[:6] + ["ok", "Tell me a much longer story about the sea, please. " * 3]))
    def respond(self, prompt):
        self.turn(prompt)

    @rule(city=st.sampled_from(["Paris", "Rome"]))
    def tool_exchange(self, city):
        """A reply with a tool call (forced), then its result answered: a call and its result stay together."""
        s = self.session
        params = s.generate_params
        call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "' + city + '"}}\n</tool_call>'
        s.generate_params = params.copy(max_tokens=60, logits_processors=[Scripted(self.lm.tokenizer, [call])])
        history = s.history
        try:
            s.respond("What is the weather?")
        except ContextWindowExceededError:
            assert s.history == history and not s.busy
            return
        finally:
            s.generate_params = params
        self.expected += s.history[len(self.expected):]
        (pending,) = s.pending_tool_calls
        self.turn(ChatMessage.tool("Sunny, 21 C", name="get_weather", tool_call_id=pending.id))

    @precondition(lambda self: len(self.session.history) >= 2)
    @rule()
    def undo(self):
        dropped = self.session.undo()
        del self.expected[len(self.expected) - len(dropped):]

    @precondition(lambda self: len(self.session.history) >= 2 and self.session.history[-1].role is Role.ASSISTANT)
    @rule()
    def regenerate(self):
        self.session.regenerate()
        self.expected[-1] = self.session.history[-1]

    @rule()
    def fork(self):
        self.session = self.session.fork()

    @rule(data=st.data())
    def save_and_restore(self, data):
        import tempfile

        with tempfile.TemporaryDirectory() as folder:
            if self.session.history:
                self.session.save_cache(f"{folder}/c.safetensors")
                self.session = ChatSession.builder(self.lm).cache(f"{folder}/c.safetensors").tools(
                    [WEATHER]).generate_params(PARAMS).build()

    @rule(low=st.sampled_from([0.3, 0.5, 0.7]), keep=st.integers(0, 1), summarize=st.booleans())
    def change_policy(self, low, keep, summarize):
        self.session.context_policy = (
            ContextPolicy.summarize(low, summarizer=lambda ms: f"{len(ms)} messages.", keep_first=keep)
            if summarize else ContextPolicy.rolling(low, keep))

    @invariant()
    def the_transcript_is_never_lost(self):
        assert self.session.history == self.expected

    @invariant()
    def the_context_fits_and_starts_at_a_prompt(self):
        s, window = self.session, self.session._state.conversation.window
        ledger = s._state.conversation.cache.ledger
        assert ledger.opaque + len(ledger.tokens) <= MACHINE_WINDOW  # what the model has seen at once
        if window.start > window.head:
            assert s.history[window.start].role is Role.USER
        assert_ledger_matches_cache(s)


@pytest.mark.slow
def test_any_sequence_keeps_the_transcript_and_answers_from_the_context():
    run_state_machine_as_test(LongConversation, settings=settings(max_examples=8, stateful_step_count=14))


@pytest.mark.slow
@pytest.mark.parametrize("setup", ["prompt_lookup", "draft", "kv_bits", "engine"])
def test_rolling_works_with_speculation_quantized_caches_and_the_batch_engine(tiny, setup):
    from chatkit import BatchEngine, SpeculativeConfig

    lm = small(tiny())
    options = {
        "prompt_lookup": {"speculative": SpeculativeConfig("prompt_lookup")},
        "draft": {"speculative": SpeculativeConfig(small(tiny(seed=1)), num_draft_tokens=2)},
        "kv_bits": {"kv_bits": 8},
        "engine": {"engine": BatchEngine(lm, max_batch=2)},
    }[setup]
    session = session_over(lm, ContextPolicy.rolling(), **options)
    plain = session_over(lm, ContextPolicy.rolling())
    for prompt in PROMPTS[:20]:
        with session.stream_respond(prompt) as stream:
            list(stream)
        with plain.stream_respond(prompt) as expected:
            list(expected)
        assert stream.tokens == expected.tokens or setup == "kv_bits"  # quantized KV may change greedy picks
        assert stream.stats.compacted == expected.stats.compacted
        assert_ledger_matches_cache(session)
    assert session.dropped_messages and session.history == plain.history or setup == "kv_bits"
    if setup == "engine":
        options["engine"].close()


def test_preparing_a_compaction_that_keeps_nothing_prepares_nothing(lm):
    # No instructions and one exchange past the high-water mark: the next compaction drops it all, which
    # leaves no prompt to prefill ahead (this raised ValueError from a worker thread between turns).
    session = ChatSession.builder(lm).generate_params(PARAMS).context_policy(ContextPolicy.rolling(high_water=0.6)).build()
    session.respond(" ".join(PROMPTS[:13]))
    assert session.last_stats.prompt_tokens > 0.6 * WINDOW
    assert not session.prepare_compaction()
    session.respond("And now?")
    assert len(session.history) == 4 and session.history[-1].role is Role.ASSISTANT  # the next turn runs

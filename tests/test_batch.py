"""BatchEngine: concurrent sessions decoded together give exactly the tokens they give alone (greedy),
with joins and leaves mid-decode, a cancelled and a failing session; multi-turn reuse, the shared
prefix cache, the async API and SessionPool over an engine."""

import asyncio
import os
import threading
import weakref

from chatkit import BatchEngine, ChatSession, GenerateParams, SessionPool
from chatkit.cache.prefix import PrefixCache
from chatkit.errors import InvalidParamsError

import mlx.core as mx
import pytest
from conftest import assert_ledger_matches_cache, cache_state, fresh_reply, session_for
from hypothesis import given
from hypothesis import settings as hsettings
from hypothesis import strategies as st
from mlx_lm.models.cache import make_prompt_cache

WORDS = "the quick brown fox jumps over a lazy dog while seven cats watch from the old red barn".split()


@pytest.fixture(scope="module")
def lm():
    from chatkit.testing import tiny_model

    return tiny_model("qwen3", "bpe")


@pytest.fixture(scope="module")
def engine(lm):
    with BatchEngine(lm, max_batch=4, prefill_step_size=16) as e:
        yield e


def prompt_of(n, shift=0):
    return " ".join(WORDS[(i + shift) % len(WORDS)] for i in range(n))


def params_for(lm, max_tokens, no_eos):
    bias = {t: -1e9 for t in lm.tokenizer.eos_token_ids} if no_eos else None
    return GenerateParams(max_tokens=max_tokens, temperature=0.0, logit_bias=bias)


def alone(lm, prompt, params, instructions="Be brief."):
    session = session_for(lm, params=params.copy(), instructions=instructions)
    with session.stream_respond(prompt) as stream:
        for _ in stream:
            pass
    return stream.tokens


def turn_tokens(session, prompt):
    with session.stream_respond(prompt) as stream:
        for _ in stream:
            pass
    return stream.tokens


class Runner(threading.Thread):
    """One session's turn on its own thread, started after ``after`` is set; ``started`` is set once
    it has read ``signal_at`` tokens (others then join mid-decode); ``close_at`` closes the stream."""

    def __init__(self, session, prompt, after=None, signal_at=None, close_at=None):
        super().__init__(daemon=True)
        self.session, self.prompt, self.after = session, prompt, after
        self.signal_at, self.close_at = signal_at, close_at
        self.signal = threading.Event()
        self.tokens, self.error = None, None

    def run(self):
        try:
            if self.after is not None:
                assert self.after.wait(60)
            with self.session.stream_respond(self.prompt) as stream:
                for i, _ in enumerate(stream, 1):
                    if self.signal_at is not None and i >= self.signal_at:
                        self.signal.set()
                    if self.close_at is not None and i >= self.close_at:
                        break
            self.tokens = stream.tokens
        except BaseException as exc:  # handed to the test's thread
            self.error = exc
        finally:
            self.signal.set()
            mx.clear_streams()  # what MLX asks of a thread that ran MLX work, before it ends


def run_all(runners):
    for r in runners:
        r.start()
    for r in runners:
        r.join(120)
        assert not r.is_alive(), "a turn hung"


def gate(engine, holds):
    """A logits processor that holds the engine at its ``n``-th call until ``holds[n]`` turns were
    handed to the engine, so that turns join at the same points whatever the threads' timing."""
    calls = []

    def process(tokens, logits):
        calls.append(1)
        want = holds.get(len(calls))
        for _ in range(6000):  # at most a minute: a turn that never came fails the test, not hangs it
            if want is None or engine.turns >= want:
                break
            threading.Event().wait(0.01)
        return logits

    return process


@hsettings(max_examples=int(os.environ.get("CHATKIT_BATCH_EXAMPLES", "4")))
@given(
    lengths=st.lists(st.integers(1, 40), min_size=3, max_size=6),
    max_tokens=st.lists(st.integers(1, 14), min_size=6, max_size=6),
    no_eos=st.lists(st.booleans(), min_size=6, max_size=6),
)
def test_concurrent_sessions_produce_the_tokens_they_produce_alone(lm, lengths, max_tokens, no_eos):
    cases = [(prompt_of(n, i), params_for(lm, max_tokens[i], no_eos[i])) for i, n in enumerate(lengths)]
    cases[0] = (cases[0][0], params_for(lm, 30, no_eos=True))  # the first decodes while the others come and go
    expected = [alone(lm, p, params) for p, params in cases]
    immediate = [i for i in range(len(cases)) if i % 2 == 0]
    with BatchEngine(lm, max_batch=4, prefill_step_size=16) as engine:
        # the first waits for the immediate ones before its first token, for the others after 4 tokens
        held = cases[0][1].copy(logits_processors=[gate(engine, {1: len(immediate), 5: len(cases)})])
        first = Runner(session_for(lm, params=held, engine=engine), cases[0][0], signal_at=3)
        runners = [first] + [
            # the others join while the first decodes: some at once, some once it has read 3 tokens
            Runner(session_for(lm, params=params.copy(), engine=engine), p, after=None if i % 2 == 0 else first.signal)
            for i, (p, params) in enumerate(cases[1:], 1)
        ]
        run_all(runners)
        assert [r.error for r in runners] == [None] * len(runners)
        assert [r.tokens for r in runners] == expected
        for r in runners:
            assert_ledger_matches_cache(r.session)
        assert engine.peak_batch >= 2  # forward passes were shared
        assert engine.active == 0


def test_a_cancelled_and_a_failing_session_leave_the_others_intact(lm, engine):
    params = params_for(lm, 12, no_eos=True)
    prompts = [prompt_of(5 + 4 * i, i) for i in range(4)]
    expected = [alone(lm, p, params) for p in prompts]

    class Boom(Exception):
        pass

    calls = []

    def failing(tokens, logits):
        calls.append(1)
        if len(calls) > 3:
            raise Boom("processor failed")
        return logits

    bad = session_for(lm, params=params.copy(logits_processors=[failing]), engine=engine)
    sessions = [session_for(lm, params=params.copy(), engine=engine) for _ in prompts]
    runners = [Runner(s, p) for s, p in zip(sessions, prompts)]
    runners[1].close_at = 4  # cancelled mid-decode
    runners.append(Runner(bad, "This one fails."))
    run_all(runners)
    assert isinstance(runners[-1].error, Boom)
    assert bad.history == [] and not bad.busy  # a failed turn changes nothing
    assert [r.error for r in runners[:-1]] == [None] * 4
    assert runners[1].tokens == expected[1][:4]
    assert [r.tokens for i, r in enumerate(runners[:-1]) if i != 1] == [e for i, e in enumerate(expected) if i != 1]
    # The cancelled session committed what it read, and its cache holds exactly that: the next turn
    # (through the engine) answers as a fresh session with the same history.
    cancelled = sessions[1]
    assert cancelled.last_stats.finish_reason == "cancelled"
    assert_ledger_matches_cache(cancelled)
    expect_next = fresh_reply(cancelled, "And then?")
    assert turn_tokens(cancelled, "And then?") == expect_next
    assert cancelled.last_stats.reused_tokens > 0
    # The failing session works again once its processor does.
    bad.generate_params = params.copy()
    assert bad.respond("Now it works.") == session_for(lm, params=params.copy()).respond("Now it works.")


def test_during_a_batched_turn_only_the_batch_holds_the_cache_and_a_failed_turn_keeps_its_prompt(lm, engine):
    params = params_for(lm, 6, no_eos=True)
    session = session_for(lm, params=params.copy(), engine=engine)
    session.respond("Hello there!")
    held = [weakref.ref(layer) for layer in cache_state(session).layers]
    alive = []

    def watch(tokens, logits):
        alive.append(sum(ref() is not None for ref in held))
        return logits

    session.generate_params = params.copy(logits_processors=[watch])
    session.respond("And then?")
    # The session lets go of its cache when the prompt's prefill starts: from then on the engine's is
    # the only copy (the first token is sampled in the batch, as every other).
    assert len(alive) >= 6 and max(alive) == 0
    assert_ledger_matches_cache(session)

    class Boom(Exception):
        pass

    calls = []

    def boom(tokens, logits):
        calls.append(1)
        if len(calls) > 2:
            raise Boom("processor failed")
        return logits

    before = len(cache_state(session).ledger)
    session.generate_params = params.copy(logits_processors=[boom])
    with pytest.raises(Boom):
        session.respond("This one fails.")
    assert len(session.history) == 4  # the failed turn changed no message
    # The batch handed the cache back, cut to the failed turn's prompt: the next turn reuses it.
    state = cache_state(session)
    assert len(state.ledger) > before and not state.empty
    assert_ledger_matches_cache(session)
    session.generate_params = params.copy()
    expected = fresh_reply(session, "Go on.")
    assert turn_tokens(session, "Go on.") == expected
    assert session.last_stats.reused_tokens >= before
    assert_ledger_matches_cache(session)


def test_multi_turn_reuse_through_the_engine_equals_a_fresh_session(lm, engine):
    session = session_for(lm, params=GenerateParams(max_tokens=10, temperature=0.0), engine=engine)
    for i, prompt in enumerate(["Hello there!", "What is two and two?", "Tell me more."]):
        expected = fresh_reply(session, prompt)
        with session.stream_respond(prompt) as stream:
            for _ in stream:
                pass
        assert stream.tokens == expected, f"turn {i}"
        stats = session.last_stats
        assert stats.prompt_tokens == stats.reused_tokens + stats.prefilled_tokens
        if i:
            assert stats.plan in ("append", "trim") and stats.reused_tokens > 0
        assert_ledger_matches_cache(session)
    dropped = session.undo()
    assert len(dropped) == 2
    assert session.respond("Tell me more.") is not None
    assert_ledger_matches_cache(session)


def test_a_new_session_reuses_the_shared_instructions_prefix(lm):
    instructions = "You are a careful assistant. " + prompt_of(120)
    params = params_for(lm, 8, no_eos=False)
    with BatchEngine(lm, max_batch=4) as engine:
        first = session_for(lm, params=params.copy(), instructions=instructions, engine=engine)
        first.respond("Hello!")
        assert first.last_stats.reused_tokens == 0
        assert len(engine.prefix_cache) == 1
        second = session_for(lm, params=params.copy(), instructions=instructions, engine=engine)
        with second.stream_respond("What is the time?") as stream:
            for _ in stream:
                pass
        stats = second.last_stats
        system_tokens = len(lm.tokenizer.encode(instructions, add_special_tokens=False))
        assert stats.reused_tokens >= system_tokens, stats
        assert stats.plan == "append"
        assert stream.tokens == alone(lm, "What is the time?", params, instructions)
        assert_ledger_matches_cache(second)
        # The first session's cache was copied, never shared: its next turn is still a fresh session's.
        expected = fresh_reply(first, "Again?")
        assert turn_tokens(first, "Again?") == expected
        # After release_cache() the session's whole prompt is found again.
        first.release_cache()
        expected = fresh_reply(first, "Once more.")
        assert turn_tokens(first, "Once more.") == expected
        assert first.last_stats.reused_tokens >= system_tokens
    assert engine.prefix_cache.nbytes <= engine.prefix_cache.max_bytes


def test_async_turns_run_together(lm, engine):
    params = params_for(lm, 9, no_eos=True)
    prompts = [prompt_of(3 + 5 * i, 2 * i) for i in range(4)]
    expected = [alone(lm, p, params) for p in prompts]
    sessions = [session_for(lm, params=params.copy(), engine=engine) for _ in prompts]

    async def main():
        return await asyncio.gather(*(s.arespond(p) for s, p in zip(sessions, prompts)))

    asyncio.run(main())
    got = [list(cache_state(s).ledger.tokens[-len(e):]) for s, e in zip(sessions, expected)]
    assert got == expected


def test_session_pool_with_an_engine(lm, engine, tmp_path):
    params = params_for(lm, 8, no_eos=True)
    pool = SessionPool(lm, folder=tmp_path, max_cache_bytes=1 << 30, engine=engine,
                       configure=lambda b: b.generate_params(params.copy()).instructions("Be brief."))
    prompts = {f"user{i}": prompt_of(4 + 3 * i, i) for i in range(3)}
    expected = {k: alone(lm, p, params) for k, p in prompts.items()}
    runners = [Runner(pool.session(k), p) for k, p in prompts.items()]
    run_all(runners)
    assert {k: r.tokens for k, r in zip(prompts, runners)} == expected
    assert all(pool.session(k).engine is engine for k in prompts)
    with pytest.raises(InvalidParamsError):
        SessionPool(lm, folder=tmp_path, max_cache_bytes=0, engine=object())


def test_guided_turns_batch_with_plain_ones(lm, engine):
    """A guided reply's constraint is a logits processor: it runs in the batch, next to plain turns."""
    params = GenerateParams(max_tokens=24, temperature=0.0)
    regex = r"[0-9]{4}-[0-9]{2}-[0-9]{2}"
    expected_value = session_for(lm, params=params.copy()).respond("When?", regex=regex)
    expected_plain = alone(lm, prompt_of(20), params_for(lm, 16, no_eos=True))
    guided = session_for(lm, params=params.copy(), engine=engine)
    plain = session_for(lm, params=params_for(lm, 16, no_eos=True), engine=engine)
    other = Runner(plain, prompt_of(20))
    other.start()
    value = guided.respond("When?", regex=regex)
    other.join(60)
    assert value == expected_value
    assert other.error is None and other.tokens == expected_plain


@pytest.mark.parametrize("arch,tok,options", [
    ("qwen3", "bpe", {"max_kv_size": 64}),  # rotating KV
    ("gemma3_text", "gemma", {}),  # sliding-window layers
    ("qwen3_5", "bpe-think", {}),  # hybrid: recurrent layers
])  # (a draft model's session runs alone too: test_batch_lookup.py; prompt lookup runs in the batch)
def test_sessions_that_cannot_batch_run_alone_with_the_same_tokens(arch, tok, options):
    from chatkit.testing import tiny_model

    lm = tiny_model(arch, tok)
    with BatchEngine(lm, max_batch=2) as engine:
        session = session_for(lm, params=params_for(lm, 10, no_eos=True), engine=engine, **options)
        for turn in range(2):
            prompt = prompt_of(30, turn)
            expected = fresh_reply(session, prompt, **options)  # the same session without an engine
            assert turn_tokens(session, prompt) == expected
            assert_ledger_matches_cache(session)
        assert engine.turns == 0  # none of them entered the batch


def test_engine_errors(lm, tmp_path):
    other = __import__("chatkit.testing", fromlist=["tiny_model"]).tiny_model("llama", "bpe")
    with BatchEngine(other, max_batch=2) as foreign:
        with pytest.raises(InvalidParamsError, match="another model"):
            ChatSession.builder(lm).engine(foreign).build()
    with pytest.raises(InvalidParamsError):
        BatchEngine(lm, max_batch=0)
    with pytest.raises(InvalidParamsError):
        BatchEngine("not a model")
    engine = BatchEngine(lm, max_batch=2)
    session = session_for(lm, params=params_for(lm, 50, no_eos=True), engine=engine)
    stream = session.stream_respond("Hello")
    next(stream)
    engine.close()
    with pytest.raises(InvalidParamsError, match="closed"):
        for _ in stream:
            pass
    assert session.history == [] and not session.busy
    assert_ledger_matches_cache(session)
    with pytest.raises(InvalidParamsError, match="closed"):
        session.respond("Again")
    with pytest.raises(InvalidParamsError, match="closed"):
        ChatSession.builder(lm).engine(engine).build()


def test_prefix_cache_copies_and_keeps_to_its_budget(lm):
    def prefilled(tokens):
        layers = make_prompt_cache(lm.model)
        lm.model(mx.array([tokens]), cache=layers)
        mx.eval([c.state for c in layers])
        return layers

    a, b = list(range(10, 60)), list(range(10, 30)) + list(range(200, 230))
    probe = PrefixCache(max_bytes=1 << 30)
    probe.insert(a, prefilled(a))
    shared = PrefixCache(max_bytes=probe.nbytes * 3 // 2)  # room for one 50-token entry, not two
    shared.insert(a, prefilled(a))
    n, first = shared.fetch(a + [7])
    assert n == len(a) and all(c.offset == n for c in first)
    before = [mx.array(c.keys[..., :n, :]) for c in first]
    # Writing into a fetched copy (as a session's next turn does) leaves the stored entry as it was.
    for c in first:
        c.trim(5)
    lm.model(mx.array([[1, 2, 3, 4, 5]]), cache=first)
    n2, second = shared.fetch(a + [7])
    assert n2 == n
    assert all(mx.array_equal(x, c.keys[..., :n, :]).item() for x, c in zip(before, second))
    # A prompt sharing 20 tokens gets those (the stored entry trimmed), whole prompts give one token back.
    n3, _ = shared.fetch(b)
    assert n3 == 20
    assert shared.fetch(a)[0] == len(a) - 1
    # The budget holds one entry: a second evicts the first.
    shared.insert(b, prefilled(b))
    assert len(shared) == 1 and shared.nbytes <= shared.max_bytes
    assert shared.fetch(a + [7])[0] == 20


def test_pool_evictions_restore_onto_the_engine(lm, engine, tmp_path):
    params = params_for(lm, 6, no_eos=False)
    pool = SessionPool(lm, folder=tmp_path, max_cache_bytes=0, engine=engine,
                       configure=lambda b: b.generate_params(params.copy()).instructions("Be brief."))
    for turn in range(2):
        for key in ("a", "b"):
            session = pool.session(key)
            expected = fresh_reply(session, f"Turn {turn} for {key}.")
            assert turn_tokens(session, f"Turn {turn} for {key}.") == expected
            assert_ledger_matches_cache(session)
    assert pool.evicted("a")


def test_a_batched_turn_prefills_in_the_sessions_own_chunks(lm):
    """The session's ``prefill_step_size`` holds in the batch (at most the engine's per step)."""
    params = params_for(lm, 4, no_eos=True)
    seen = []
    with BatchEngine(lm, max_batch=2, prefill_step_size=512) as engine:
        session = session_for(lm, params=params.copy(), engine=engine, prefill_step_size=8,
                              prefill_progress=lambda done, total: seen.append((done, total)))
        tokens = turn_tokens(session, prompt_of(40))
        total = seen[-1][1]
        assert total > 40 and seen[0] == (0, total) and seen[-1] == (total, total)
        dones = [d for d, _ in seen[1:-1]]
        assert dones == list(range(8, total - 1, 8)) + ([total - 1] if (total - 1) % 8 else [])
        assert tokens == alone(lm, prompt_of(40), params)
    with BatchEngine(lm, max_batch=2, prefill_step_size=16) as engine:  # the engine's step is the bound
        seen.clear()
        session = session_for(lm, params=params.copy(), engine=engine, prefill_step_size=64,
                              prefill_progress=lambda done, total: seen.append((done, total)))
        turn_tokens(session, prompt_of(40))
        assert [d for d, _ in seen[1:3]] == [16, 32]


def test_a_prefill_step_smaller_than_the_waiting_turns_holds(lm, monkeypatch):
    """The engine's ``prefill_step_size`` bounds every shared prefill pass, padding included, even
    when fewer tokens than waiting turns: the group takes no more turns than the step has tokens."""
    from chatkit.decode.batch.prefill import Prefill

    fed, feed = [], Prefill.feed
    monkeypatch.setattr(Prefill, "feed", lambda self, budget: fed.append(feed(self, budget)) or fed[-1])
    params = params_for(lm, 3, no_eos=True)
    prompts = [prompt_of(150 + i, i) for i in range(4)]  # long: the others wait while the first prefills
    expected = [alone(lm, p, params) for p in prompts]
    with BatchEngine(lm, max_batch=4, prefill_step_size=2) as engine:
        runners = [Runner(session_for(lm, params=params.copy(), engine=engine), p) for p in prompts]
        run_all(runners)
    assert [r.tokens for r in runners] == expected
    assert fed and max(fed) <= 2


def test_closing_the_engine_mid_turn_leaves_the_session_its_cache(lm):
    params = params_for(lm, 60, no_eos=True)
    engine = BatchEngine(lm, max_batch=2)
    session = session_for(lm, params=params_for(lm, 5, no_eos=True), engine=engine)
    session.respond("Hello there!")
    held = len(cache_state(session).ledger)
    session.generate_params = params.copy()
    stream = session.stream_respond("Tell me a long story.")
    next(stream)
    engine.close()
    with pytest.raises(InvalidParamsError, match="closed"):
        for _ in stream:
            pass
    assert len(session.history) == 2 and not session.busy
    state = cache_state(session)
    assert len(state.ledger) > held  # the cache came back with the failed turn's prompt
    assert_ledger_matches_cache(session)
    # The same conversation, on a session without an engine, reuses that cache and answers as a fresh one.
    plain = session_for(lm, params=params_for(lm, 5, no_eos=True), history=session.history)
    plain._state.conversation.cache = state
    expected = fresh_reply(plain, "Go on.")
    assert turn_tokens(plain, "Go on.") == expected
    assert plain.last_stats.reused_tokens >= held


def test_a_turn_failing_during_the_shared_prefill_leaves_its_cache_usable_and_the_others_intact(lm):
    """Turns prefilled together: one fails after its first chunk (its progress callback raises, on its
    own thread); it gets its cache back from the group's batched layers, holding what was prefilled,
    and its next turn answers as a fresh session; the other turns decode their tokens alone."""
    params = params_for(lm, 6, no_eos=True)
    prompts = [prompt_of(30 + 3 * i, i) for i in range(3)]
    expected = [alone(lm, p, params) for p in prompts]

    class Boom(Exception):
        pass

    armed = []

    def progress(done, total):
        if armed and done > 0:
            raise Boom("stop here")

    with BatchEngine(lm, max_batch=4, prefill_step_size=24) as engine:
        bad = session_for(lm, params=params.copy(), engine=engine, prefill_progress=progress)
        bad.respond("Hello there!")
        before = len(cache_state(bad).ledger)
        armed.append(True)
        sessions = [session_for(lm, params=params.copy(), engine=engine) for _ in prompts]
        runners = [Runner(s, p) for s, p in zip(sessions, prompts)] + [Runner(bad, prompt_of(40, 7))]
        run_all(runners)
        assert isinstance(runners[-1].error, Boom)
        assert [r.tokens for r in runners[:-1]] == expected
        assert len(bad.history) == 2 and not bad.busy
        assert len(cache_state(bad).ledger) >= before  # its history's cache came back (and maybe some prompt)
        assert_ledger_matches_cache(bad)
        armed.clear()
        expect_next = fresh_reply(bad, "Go on.")
        assert turn_tokens(bad, "Go on.") == expect_next
        assert engine.active == 0

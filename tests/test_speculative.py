"""Speculative decoding: exact greedy output, caches kept across turns, the exclusivity rules."""

from chatkit import (
    CacheOptions,
    ChatSession,
    GenerateParams,
    IncompatibleDraftError,
    SpeculativeCacheRestoreError,
    SpeculativeConfig,
)
from chatkit.cache._mlx import layer_offset
from chatkit.decode.speculative import new_policy
from chatkit.decode.speculative.costs import pair_key
from chatkit.decode.speculative.policy import PLAIN_WINDOW, record_draft, record_plain
from chatkit.errors import InvalidParamsError

import mlx.core as mx
import pytest
from conftest import assert_ledger_matches_cache, cache_state, fresh_reply, session_for
from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test
from test_reuse import Conversation


def run(session, prompt, break_after=None):
    tokens = []
    with session.stream_respond(prompt) as stream:
        for k, chunk in enumerate(stream):
            tokens.append(chunk.token)
            if break_after is not None and k == break_after:
                break
    return tokens


def assert_draft_aligned(session):
    state = cache_state(session)
    assert_ledger_matches_cache(session)
    draft = layer_offset(state.draft_layers)
    assert draft == state.draft_length <= len(state.ledger)


@pytest.mark.slow
@pytest.mark.parametrize("num_draft", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_greedy_speculative_equals_standard_over_turns_breaks_undo_regenerate(tiny, arch, num_draft):
    lm, draft = tiny(arch=arch, tokenizer="bpe"), tiny(arch=arch, tokenizer="bpe", seed=1)
    spec = session_for(lm, params=GenerateParams(max_tokens=16), speculative=SpeculativeConfig(draft, num_draft))
    for i, prompt in enumerate(["Hello", "What is two plus two?", "Go on", "Again"]):
        expected = fresh_reply(spec, prompt)
        got = run(spec, prompt, break_after=5 if i == 2 else None)
        assert got == expected[: len(got)]
        assert_draft_aligned(spec)
        if i > 0:
            assert spec.last_stats.reused_tokens > 0
    spec.undo()
    assert_draft_aligned(spec)
    expected = fresh_reply(spec, "After undo")
    assert run(spec, "After undo") == expected
    regen_expected = fresh_reply(
        session_for(lm, params=GenerateParams(max_tokens=16), history=spec.history[:-2]), "After undo"
    )
    with spec.stream_regenerate() as stream:
        list(stream)
    assert stream.tokens == regen_expected
    assert_draft_aligned(spec)


def test_an_agreeing_draft_is_accepted(tiny):
    lm = tiny(arch="qwen3", tokenizer="bpe")
    session = session_for(lm, params=GenerateParams(max_tokens=24), speculative=SpeculativeConfig(lm, 4))
    run(session, "Hi")
    stats = session.last_stats
    assert stats.draft_tokens_proposed > 0
    assert stats.draft_tokens_accepted == stats.draft_tokens_proposed, "the draft is the target itself"
    with session.stream_respond("More") as stream:
        chunks = list(stream)
    assert sum(c.from_draft for c in chunks) == session.last_stats.draft_tokens_accepted > 0


def test_a_random_draft_is_mostly_rejected_but_exact(tiny):
    lm = tiny(arch="qwen3", tokenizer="bpe")
    session = session_for(lm, params=GenerateParams(max_tokens=16), speculative=SpeculativeConfig(tiny(seed=2), 3))
    expected = fresh_reply(session, "Hi")
    assert run(session, "Hi") == expected
    stats = session.last_stats
    assert stats.draft_tokens_accepted < stats.draft_tokens_proposed


def test_sampling_runs_and_respects_the_seed(tiny):
    lm = tiny(arch="qwen3", tokenizer="bpe")

    def reply(seed):
        params = GenerateParams(max_tokens=16, temperature=1.0, seed=seed)
        return run(session_for(lm, params=params, speculative=SpeculativeConfig(tiny(seed=1), 2)), "Hi")

    assert reply(5) == reply(5) and reply(5) != reply(6)


def test_speculative_with_a_restored_cache_fails_at_build(tiny, tmp_path):
    lm = tiny()
    plain = session_for(lm, params=GenerateParams(max_tokens=4))
    plain.respond("Hi")
    plain.save_cache(tmp_path / "c.safetensors")
    builder = ChatSession.builder(lm).cache(tmp_path / "c.safetensors").speculative(SpeculativeConfig(tiny(seed=1)))
    with pytest.raises(SpeculativeCacheRestoreError, match="drop"):
        builder.build()


def test_draft_with_another_tokenizer_is_refused(tiny):
    lm = tiny(arch="qwen3", tokenizer="bpe")
    with pytest.raises(IncompatibleDraftError, match="tokenizer"):
        ChatSession.builder(lm).speculative(SpeculativeConfig(tiny(arch="qwen3", tokenizer="spm"))).build()


@pytest.mark.parametrize("arch", ["gemma3_text", "qwen3_5"])
def test_models_whose_cache_cannot_rewind_are_refused(tiny, arch):
    tok = "gemma" if arch == "gemma3_text" else "bpe"
    lm = tiny(arch=arch, tokenizer=tok)
    with pytest.raises(IncompatibleDraftError, match="rewind"):
        ChatSession.builder(lm).speculative(SpeculativeConfig(tiny(arch=arch, tokenizer=tok, seed=1))).build()


def test_a_draft_model_with_a_rotating_cache_is_refused(tiny):
    lm = tiny()
    config = SpeculativeConfig(tiny(seed=1))
    with pytest.raises(InvalidParamsError, match="prompt_lookup"):
        ChatSession.builder(lm).max_kv_size(64).speculative(config).build()
    session = ChatSession.builder(lm).speculative(config).build()
    with pytest.raises(InvalidParamsError, match="max_kv_size"):
        session.cache_options = CacheOptions(max_kv_size=64)
    assert session.cache_options == CacheOptions()  # a refused call changes nothing
    with pytest.raises(InvalidParamsError):
        SpeculativeConfig(tiny(seed=1), num_draft_tokens=0)


def test_saving_a_speculative_session_restores_into_a_standard_one(tiny, tmp_path):
    lm = tiny()
    spec = session_for(lm, params=GenerateParams(max_tokens=10), speculative=SpeculativeConfig(tiny(seed=1), 3))
    run(spec, "Hi")
    run(spec, "Again")
    spec.save_cache(tmp_path / "s.safetensors")
    restored = ChatSession.builder(lm).cache(tmp_path / "s.safetensors").build()
    assert restored.history == spec.history
    expected = run(spec, "Third")
    assert run(restored, "Third") == expected


@pytest.mark.parametrize("num_draft", [1, 4])
def test_equivalence_state_machine_speculative(num_draft):
    from chatkit.testing import tiny_model

    class Speculative(Conversation):
        def __init__(self):
            super().__init__()
            # No tool turns here: the scripted processor that writes them forces one token per call,
            # which speculative decoding's draft rounds do not follow.
            self.tools, self.options = False, {}
            self.session = session_for(
                self.lm,
                params=GenerateParams(max_tokens=8),
                speculative=SpeculativeConfig(tiny_model(arch="qwen3", tokenizer="bpe", seed=1), num_draft),
            )

    run_state_machine_as_test(Speculative, settings=settings(max_examples=5, stateful_step_count=8))


def test_speculative_prefill_reports_progress_as_the_standard_path_does(tiny):
    lm, draft = tiny(), tiny(seed=1)
    prompt = "A prompt long enough to need several prefill chunks of eight tokens each, and then some."
    calls = {"standard": [], "speculative": []}
    for name, spec in (("standard", None), ("speculative", SpeculativeConfig(draft, 2))):
        session = session_for(lm, params=GenerateParams(max_tokens=4), speculative=spec, prefill_step_size=8,
                              prefill_progress=lambda done, total, name=name: calls[name].append((done, total)))
        session.respond(prompt)
    assert calls["speculative"] == calls["standard"]
    total = calls["standard"][0][1]
    assert calls["standard"] == [(0, total), *[(d, total) for d in range(8, total - 1, 8)], (total - 1, total),
                                 (total, total)]


def test_logits_processors_see_the_whole_conversation_with_a_draft(tiny):
    lm, draft = tiny(), tiny(seed=1)
    first_seen = {}

    def recorder(name):
        def processor(tokens, logits):
            first_seen.setdefault(name, tokens.tolist())
            return logits
        return processor

    replies = {}
    for name, spec in (("standard", None), ("speculative", SpeculativeConfig(draft, 3))):
        session = session_for(lm, params=GenerateParams(max_tokens=10, repetition_penalty=1.5), speculative=spec)
        session.respond("Tell me something")
        session.generate_params.logits_processors = [recorder(name)]
        replies[name] = session.respond("And more, please")
        prompt = cache_state(session).ledger.tokens[: session.last_stats.prompt_tokens]
        assert first_seen[name] == list(prompt), name
    assert replies["speculative"] == replies["standard"]


# -- adaptive length and prompt lookup (issue 18) ---------------------------------------------------


def copier(tokens, logits):
    """A logits processor that makes a model copy its context: the token that followed the latest
    earlier occurrence of the last two tokens gets a large bonus. A pure function of the tokens it
    is shown, so any path that shows it the right tokens decodes the same."""
    seen = tokens.tolist()
    for end in range(len(seen) - 1, 1, -1):
        if seen[end - 2 : end] == seen[-2:]:
            return logits + 30.0 * (mx.arange(logits.shape[-1]) == seen[end])
    return logits


COPYING = GenerateParams(max_tokens=16, logits_processors=[copier])
MODES = {
    "model-auto": lambda tiny: SpeculativeConfig(tiny(arch="qwen3", tokenizer="bpe", seed=1)),
    "lookup-auto": lambda tiny: SpeculativeConfig("prompt_lookup", ngram_min=1),
    "lookup-1": lambda tiny: SpeculativeConfig("prompt_lookup", 1, ngram_min=1, ngram_max=2),
    "lookup-5": lambda tiny: SpeculativeConfig("prompt_lookup", 5),
}


@pytest.mark.parametrize("params", [GenerateParams(max_tokens=16), COPYING], ids=["free", "copying"])
@pytest.mark.parametrize("mode", list(MODES))
def test_every_drafting_mode_decodes_as_standard_over_turns_breaks_undo_regenerate(tiny, mode, params):
    lm = tiny(arch="qwen3", tokenizer="bpe")
    spec = session_for(lm, params=params, speculative=MODES[mode](tiny))
    drafted = accepted = 0
    prompts = ["Say: the red fox jumps over the lazy dog", "Again: the red fox jumps", "Go on", "the lazy dog"]
    for i, prompt in enumerate(prompts):
        expected = fresh_reply(spec, prompt)
        got = run(spec, prompt, break_after=4 if i == 2 else None)
        assert got == expected[: len(got)]
        assert_draft_aligned(spec) if mode.startswith("model") else assert_ledger_matches_cache(spec)
        drafted += spec.last_stats.draft_tokens_proposed
        accepted += spec.last_stats.draft_tokens_accepted
    spec.undo()
    assert_ledger_matches_cache(spec)
    expected = fresh_reply(spec, "After undo, the red fox")
    assert run(spec, "After undo, the red fox") == expected
    regen_expected = fresh_reply(session_for(lm, params=params, history=spec.history[:-2]), "After undo, the red fox")
    with spec.stream_regenerate() as stream:
        list(stream)
    assert stream.tokens == regen_expected
    assert_ledger_matches_cache(spec)
    # An adaptive session may stop drafting after its first misses: a random draft model, or prompt
    # lookup over a random model's text, which seldom repeats (the copying replies must draft).
    if not mode.endswith("-auto") or params is COPYING:
        assert drafted > 0
    if params is COPYING and mode.startswith("lookup"):
        assert accepted > 0, "copied text is what prompt lookup drafts"


def test_prompt_lookup_speeds_up_copying_in_tokens_per_target_step(tiny):
    lm = tiny(arch="qwen3", tokenizer="bpe")
    spec = session_for(lm, params=COPYING.copy(max_tokens=40), speculative=SpeculativeConfig("prompt_lookup", 6))
    run(spec, "Say: one two three four five six seven eight nine ten eleven twelve thirteen")
    stats = spec.last_stats
    assert 0 < stats.draft_length <= 6
    # Once the reply falls into copying (after ~20 tokens here), whole runs come in one target step.
    assert stats.draft_tokens_accepted >= 10


def test_seeded_sampling_draws_as_standard_decoding_does(tiny):
    lm = tiny(arch="qwen3", tokenizer="bpe")
    params = GenerateParams(max_tokens=24, temperature=1.0, seed=7)
    expected = run(session_for(lm, params=params), "Hi there")
    for config in (SpeculativeConfig(lm, 3), SpeculativeConfig(lm), SpeculativeConfig("prompt_lookup", 3, ngram_min=1)):
        assert run(session_for(lm, params=params.copy(), speculative=config), "Hi there") == expected


def test_adaptive_length_persists_across_turns_and_stays_on_for_an_agreeing_draft(tiny):
    lm = tiny(arch="qwen3", tokenizer="bpe")
    # The target is its own draft: every draft token is accepted, whatever the length chosen.
    session = session_for(lm, params=GenerateParams(max_tokens=24), speculative=SpeculativeConfig(lm))
    for prompt in ("Hi", "More", "And more"):
        run(session, prompt)
        stats = session.last_stats
        assert stats.draft_tokens_accepted == stats.draft_tokens_proposed
    assert session._state.source.policy.acceptance > 0.5  # the session's evidence, carried from turn to turn


def test_prompt_lookup_works_with_a_restored_cache_file_and_a_raw_cache(tiny, tmp_path):
    lm = tiny()
    plain = session_for(lm, params=COPYING)
    run(plain, "Say: the red fox jumps over the lazy dog")
    plain.save_cache(tmp_path / "c.safetensors")
    lookup = SpeculativeConfig("prompt_lookup", ngram_min=1)
    restored = ChatSession.builder(lm).cache(tmp_path / "c.safetensors").speculative(lookup).build()
    reference = ChatSession.builder(lm).cache(tmp_path / "c.safetensors").build()
    assert run(restored, "Again: the red fox") == run(reference, "Again: the red fox")
    assert restored.last_stats.reused_tokens > 0
    assert_ledger_matches_cache(restored)

    raw = [c for c in cache_state(plain).layers]
    opaque = ChatSession.builder(lm).cache(raw).generate_params(COPYING).speculative(lookup).build()
    standard = ChatSession.builder(lm).cache(raw).generate_params(COPYING).build()
    assert run(opaque, "the lazy dog") == run(standard, "the lazy dog")
    assert_ledger_matches_cache(opaque)


def test_prompt_lookup_with_stop_strings_and_tool_results(tiny):
    lm = tiny()
    params = COPYING.copy(max_tokens=24)
    words = "alpha beta gamma delta epsilon zeta eta theta"
    replies = []
    for config in (None, SpeculativeConfig("prompt_lookup", ngram_min=1)):
        session = session_for(lm, params=params, speculative=config)
        first = session.respond(f"Say: {words}")
        session.generate_params.stop = [first[len(first) // 2 : len(first) // 2 + 3]] if len(first) > 6 else ["gamma"]
        second = session.respond(f"Tool says {words}", role="tool")
        replies.append((first, second, session.history))
    assert replies[0] == replies[1]


def test_prompt_lookup_refuses_caches_that_cannot_rewind(tiny):
    with pytest.raises(IncompatibleDraftError, match="rewind"):
        ChatSession.builder(tiny(arch="qwen3_5", tokenizer="bpe")).speculative(SpeculativeConfig("prompt_lookup")).build()


# -- quantized and rotating caches (issue 18) --------------------------------------------------------

COPY_PROMPTS = ["Say: the red fox jumps over the lazy dog and the red fox jumps again",
                "Again: the red fox jumps over the lazy dog", "the lazy dog and the red fox"]


def side_by_side(lm, speculative, params, prompts=COPY_PROMPTS, break_in=1, **options):
    """Each prompt's tokens and stats in a standard session and a speculative one with the same cache
    options (the truth here: with a rotating cache a fresh session would see another window); the
    stream of turn ``break_in`` is closed early."""
    standard = session_for(lm, params=params, **options)
    spec = session_for(lm, params=params.copy(), speculative=speculative, **options)
    turns = []
    for i, prompt in enumerate(prompts):
        want = run(standard, prompt, break_after=5 if i == break_in else None)
        got = run(spec, prompt, break_after=5 if i == break_in else None)
        assert got == want, (i, prompt)
        assert_ledger_matches_cache(spec)
        layers = cache_state(spec).layers
        assert [type(c) for c in layers] == [type(c) for c in cache_state(standard).layers]
        turns.append((spec.last_stats, {type(c).__name__ for c in layers}))
    return spec, turns


@pytest.mark.parametrize("bits", [8, 3])
@pytest.mark.parametrize("mode", ["lookup-auto", "lookup-5", "model-auto"])
def test_quantized_cache_decodes_as_standard_in_every_drafting_mode(tiny, mode, bits):
    lm = tiny(arch="qwen3", tokenizer="bpe")
    params = COPYING.copy(max_tokens=24)
    _, turns = side_by_side(lm, MODES[mode](tiny), params, kv_bits=bits)  # quantized from the first token
    assert all(kinds == {"QuantizedKVCache"} for _, kinds in turns)
    if mode == "lookup-5":  # the adaptive length may pause after the misses before the copying starts
        assert sum(stats.draft_tokens_accepted for stats, _ in turns) > 0


@pytest.mark.parametrize("num_draft", [4, 8, "auto"])
def test_drafting_never_crosses_the_step_where_the_cache_gets_quantized(tiny, num_draft):
    """quantized_kv_start inside the first reply: standard decoding quantizes after the step that
    reaches it, and a drafting step that crossed it would have shown its later tokens full-precision
    keys. The target drafts for itself (its drafts pass unless quantization changes its mind), and
    3-bit keys change its greedy tokens here: a crossing step gives other tokens."""
    lm = tiny(arch="qwen3", tokenizer="bpe")
    params = GenerateParams(max_tokens=24)
    probe = session_for(lm, params=params)
    run(probe, COPY_PROMPTS[0])
    start = probe.last_stats.prompt_tokens + 6  # the 6th generated token's step quantizes
    standard = session_for(lm, params=params)
    if num_draft == "auto":  # what earlier sessions learned: drafting with this pair pays (whatever the load now)
        drafting_pays(lm.model, lm.model)
    spec = session_for(lm, params=params.copy(), speculative=SpeculativeConfig(lm, num_draft))
    assert spec._state.source.policy.draft > 0 or num_draft != "auto"
    for session in (standard, spec):
        session.cache_options = CacheOptions(kv_bits=3, kv_group_size=32, quantized_kv_start=start)
    accepted = 0
    for prompt in COPY_PROMPTS:
        assert run(spec, prompt) == run(standard, prompt), prompt
        assert_ledger_matches_cache(spec)
        accepted += spec.last_stats.draft_tokens_accepted
        assert {type(c).__name__ for c in cache_state(spec).layers} == {"QuantizedKVCache"}
    assert accepted > 0


def drafting_pays(target, draft):
    """The process-wide record of what the (target, draft) pair costs says drafting pays: its rounds
    measured at 1.2 + 0.05 k plain steps with every drafted token accepted. A session of the pair
    starting now drafts from its first step, as one would after earlier sessions on a quiet machine."""
    policy = new_policy("auto", draft_model=True, key=pair_key(target, draft))
    for _ in range(PLAIN_WINDOW):
        record_plain(policy, 1.0)
    for k in (1, 2, 4, 8, 8, 8):
        record_draft(policy, k, k, 1.2 + 0.05 * k)
    assert policy.draft == 8


def test_prompt_lookup_with_a_rotating_cache_drafts_until_the_window_is_full(tiny):
    lm = tiny(arch="qwen3", tokenizer="bpe")
    params = COPYING.copy(max_tokens=24)
    probe = session_for(lm, params=params)
    run(probe, COPY_PROMPTS[0])
    run(probe, COPY_PROMPTS[1])  # the copier makes this reply copy the first one from its first token
    window = probe.last_stats.prompt_tokens + 10  # fills in the middle of the second reply
    for config in (SpeculativeConfig("prompt_lookup", 4, ngram_min=1), SpeculativeConfig("prompt_lookup", ngram_min=1)):
        _, turns = side_by_side(lm, config, params, break_in=None, max_kv_size=window)
        (_, kinds), (second, _), (third, _) = turns
        # Drafted while the window had room (the adaptive length may still pause after the first
        # reply's misses: only the fixed one must draft).
        assert second.draft_tokens_accepted < 10 and (config.adaptive or second.draft_tokens_accepted > 0)
        assert third.draft_tokens_proposed == 0 and third.generation_tokens == 24  # plain once it is full
        assert kinds == {"RotatingKVCache"}


@pytest.mark.parametrize("mode", ["model-auto", "lookup-auto"])
def test_equivalence_state_machine_new_modes(tiny, mode):
    from chatkit.testing import tiny_model

    config = MODES[mode](tiny_model)
    params = COPYING.copy(max_tokens=8) if mode.startswith("lookup") else GenerateParams(max_tokens=8)

    class Speculative(Conversation):
        def __init__(self):
            super().__init__()
            self.tools, self.options = False, {}  # no tool turns: see test_equivalence_state_machine_speculative
            self.session = session_for(self.lm, params=params.copy(), speculative=config)

    run_state_machine_as_test(Speculative, settings=settings(max_examples=5, stateful_step_count=8))

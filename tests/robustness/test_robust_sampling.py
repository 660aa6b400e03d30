"""Sampling settings that used to fail mid-turn (issue 33, items 7 and 8): temperatures near zero are
greedy decoding; a logits processor that returns something other than logits ends its turn with
``InvalidParamsError`` naming it, nothing committed, the session (and a batch engine) usable."""

from chatkit import BatchEngine, ChatSession, GenerateParams, InvalidParamsError
from chatkit.decode.speculative import SpeculativeConfig
from chatkit.params import GREEDY_BELOW

import mlx.core as mx
import pytest
from conftest import assert_ledger_matches_cache, session_for

PARAMS = GenerateParams(max_tokens=8)


@pytest.mark.parametrize("temperature", [5e-324, 1e-300, 1e-45, 1e-39, 1e-38, 1e-6, GREEDY_BELOW / 2])
def test_temperatures_near_zero_are_greedy(tiny, temperature):
    lm = tiny()
    greedy = session_for(lm, params=PARAMS).respond("Tell me a story.")
    params = GenerateParams(max_tokens=8, temperature=temperature, top_p=0.5, seed=3)
    assert session_for(lm, params=params).respond("Tell me a story.") == greedy


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
def test_the_smallest_sampled_temperature_never_overflows(dtype):
    # A flat distribution over 150k tokens: the best log-probability is about -12. Scaled by
    # 1/GREEDY_BELOW it stays finite in every dtype, so sampling never sees only -inf (or NaN).
    logits = mx.random.normal((1, 150_000), key=mx.random.key(0)) * 0.1
    logprobs = (logits - mx.logsumexp(logits, axis=-1, keepdims=True)).astype(dtype)
    top = logprobs.max().item()
    sampler = GenerateParams(temperature=GREEDY_BELOW).make_sampler()
    assert mx.isfinite(logprobs.max() * (1 / GREEDY_BELOW)).item()
    for _ in range(5):  # only tokens as likely as the best one, as far as the dtype can tell
        assert logprobs[0, sampler(logprobs).item()].item() >= top - 0.02
    # Below it: greedy (float16 logits sampled at 1e-4 used to give a uniformly random token).
    below = GenerateParams(temperature=GREEDY_BELOW / 10).make_sampler()
    assert below(logprobs).item() == mx.argmax(logprobs, axis=-1).item()


def _wider(tokens, logits):
    return mx.concatenate([logits, logits[:, :1]], axis=-1)  # one column past the vocabulary


BAD = {
    "none": (lambda tokens, logits: None, "returned None"),
    "list": (lambda tokens, logits: logits.tolist(), "returned a list"),
    "one-row": (lambda tokens, logits: logits[0], r"shape \(\d+,\)"),
    "wider": (_wider, "_wider"),
    "two-rows": (lambda tokens, logits: mx.concatenate([logits, logits]), r"shape \(2, \d+\)"),
    "ints": (lambda tokens, logits: logits.astype(mx.int32), "int32"),
}


def _check_turn_refused(session, processor, words):
    history, info = session.history, session.cache_info()
    session.generate_params.logits_processors = [processor]
    with pytest.raises(InvalidParamsError, match=words) as err:
        session.respond("And now?")
    assert "logits_processors[0]" in str(err.value)
    assert session.history == history and not session.busy  # nothing committed
    assert session.cache_info().tokens <= info.tokens + 200
    assert_ledger_matches_cache(session)
    session.generate_params.logits_processors = []
    expected = session_for(session.model, params=PARAMS, history=history).respond("And now?")
    assert session.respond("And now?") == expected  # usable, and answers as a fresh session


@pytest.mark.parametrize("name", sorted(BAD))
def test_a_processor_returning_no_logits_ends_its_turn_cleanly(tiny, name):
    processor, words = BAD[name]
    session = session_for(tiny(), params=PARAMS)
    session.respond("Hi")
    _check_turn_refused(session, processor, words)


def test_a_processor_failing_after_some_tokens_commits_nothing(tiny):
    calls = []

    def late(tokens, logits):
        calls.append(1)
        return logits if len(calls) < 4 else None

    session = session_for(tiny(), params=PARAMS)
    session.respond("Hi")
    history = session.history
    session.generate_params.logits_processors = [late]
    stream = session.stream_respond("Once more?")
    with pytest.raises(InvalidParamsError, match="returned None"):
        for _ in stream:
            pass
    assert session.history == history and not session.busy and len(calls) == 4
    session.generate_params.logits_processors = []
    assert session.respond("Once more?") == session_for(session.model, params=PARAMS, history=history).respond("Once more?")


def test_speculative_and_batched_turns_refuse_the_same_way(tiny):
    lm = tiny()
    processor, words = BAD["none"]
    lookup = ChatSession.builder(lm).generate_params(PARAMS).instructions("Be brief.") \
        .speculative(SpeculativeConfig(draft="prompt_lookup")).build()
    lookup.respond("Hi")
    _check_turn_refused(lookup, processor, words)
    engine = BatchEngine(lm)
    try:
        batched = ChatSession.builder(lm).generate_params(PARAMS).instructions("Be brief.").engine(engine).build()
        other = ChatSession.builder(lm).generate_params(PARAMS).instructions("Be brief.").engine(engine).build()
        batched.respond("Hi")
        _check_turn_refused(batched, processor, words)
        assert other.respond("Hello") == session_for(lm, params=PARAMS).respond("Hello")  # the engine still runs
    finally:
        engine.close()

"""Context shift (``ContextPolicy.rolling(shift=True)``): dropped exchanges leave the KV cache itself, the
kept keys re-rotated to their new positions."""

from chatkit import ChatSession, ContextPolicy, InvalidParamsError
from chatkit.cache.shift import plan_shift, rotate, shift_layers
from chatkit.model.rope import layer_ropes, rope_of

import mlx.core as mx
import mlx.nn as nn
import pytest
from conftest import assert_ledger_matches_cache, cache_state
from mlx_lm.models.cache import KVCache
from mlx_lm.models.rope_utils import Llama3RoPE, SuScaledRoPE, YarnRoPE
from test_context import PARAMS, PROMPTS, WINDOW, session_over, small

LLAMA3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
ROPES = {
    "plain": lambda: nn.RoPE(32, base=10000.0),
    "traditional": lambda: nn.RoPE(32, traditional=True, base=500000.0),
    "scaled": lambda: nn.RoPE(32, base=10000.0, scale=0.25),
    "partial": lambda: nn.RoPE(16, base=10000.0),
    "llama3": lambda: Llama3RoPE(32, max_position_embeddings=4096, base=500000.0, scaling_config=LLAMA3),
    "yarn": lambda: YarnRoPE(32, max_position_embeddings=4096, base=10000.0, scaling_factor=4.0,
                             original_max_position_embeddings=64, mscale=1.0, mscale_all_dim=0.5),
    "longrope": lambda: SuScaledRoPE(32, base=10000.0, max_position_embeddings=4096, original_max_position_embeddings=256,
                                     short_factor=1.0, long_factor=[1.0 + i / 16 for i in range(16)]),
}


@pytest.mark.parametrize("kind", sorted(ROPES))
def test_a_key_rotated_back_by_d_equals_the_key_computed_d_positions_earlier(kind):
    module = ROPES[kind]()
    raw = mx.random.normal((1, 2, 40, 32), key=mx.random.key(1))
    at_p = module(raw, offset=300)
    rope = rope_of(module)
    assert rope is not None
    for d in (1, 17, 299):
        expected = module(raw, offset=300 - d)
        assert mx.allclose(rotate(at_p, rope, d), expected, atol=2e-4).item(), (kind, d)


@pytest.mark.parametrize("kind", sorted(ROPES))
def test_a_shifted_cache_equals_the_cache_of_the_kept_tokens_at_their_new_positions(kind):
    module = ROPES[kind]()
    raw = mx.random.normal((1, 2, 50, 32), key=mx.random.key(2))
    values = mx.random.normal((1, 2, 50, 32), key=mx.random.key(3))
    layer = KVCache()
    layer.update_and_fetch(module(raw), values)
    (shifted,) = shift_layers([layer], [rope_of(module)], start=10, delta=15)
    kept = mx.concatenate([raw[..., :10, :], raw[..., 25:, :]], axis=2)
    assert shifted.offset == 35 and layer.offset == 50  # the old layer is left as it was
    assert mx.allclose(shifted.keys[..., :35, :], module(kept), atol=2e-4).item()
    assert mx.array_equal(shifted.values[..., 10:35, :], values[..., 25:, :]).item()


def test_a_shift_is_planned_only_where_what_is_left_renders_as_the_prompt():
    held = [1, 2, 3, 9, 9, 9, 4, 5, 6]
    assert plan_shift(held, [1, 2, 3, 4, 5, 6, 7], 3) == 3
    assert plan_shift(held, [1, 2, 3, 4, 5, 6, 7], 2) is None  # what is left would not match
    assert plan_shift(held, [1, 2, 3, 8, 8], 3) is None
    assert plan_shift(held, [1, 2, 3], 9) is None


@pytest.fixture
def lm(tiny):
    return small(tiny())


def shifted_and_plain(lm, prompts, **policy):
    shifted = session_over(lm, ContextPolicy.rolling(shift=True, **policy))
    plain = session_over(lm, ContextPolicy.rolling(**policy))
    stats = []
    for prompt in prompts:
        shifted.respond(prompt)
        plain.respond(prompt)
        stats.append((shifted.last_stats, plain.last_stats))
        assert_ledger_matches_cache(shifted)  # invariant 1 after every turn
        held = cache_state(shifted).ledger.tokens
        rendered = shifted._turns.rendered_ids(shifted._state.conversation.window, shifted._state.conversation.messages)
        assert rendered[: len(held) - PARAMS.max_tokens - 2] == list(held[: len(held) - PARAMS.max_tokens - 2])
    return shifted, plain, stats


@pytest.mark.slow
def test_a_shifting_turn_prefills_only_its_message_and_the_transcript_and_window_follow(lm):
    shifted, plain, stats = shifted_and_plain(lm, PROMPTS[:30])
    crossings = [(s, p) for s, p in stats if s.compacted]
    assert crossings and all(p.compacted for s, p in crossings)
    for s, p in crossings:
        assert s.reused_tokens > 3 * p.reused_tokens and s.prefilled_tokens < p.prefilled_tokens / 2
        assert s.prompt_tokens + PARAMS.max_tokens <= WINDOW and s.dropped_tokens > 0
    # The replies may differ (the shift is inexact): the transcript and the window follow all the same.
    assert [m.content for m in shifted.history[::2]] == PROMPTS[:30]
    assert shifted.context[1:] == shifted.history[len(shifted.dropped_messages):]
    assert cache_state(shifted).ledger.shifted > 0 and cache_state(plain).ledger.shifted == 0


@pytest.mark.slow
def test_keep_first_and_the_instructions_stay_in_the_shifted_cache(lm):
    shifted, _, _ = shifted_and_plain(lm, PROMPTS[:24], keep_first=1)
    assert shifted.dropped_messages and shifted.context[1:3] == shifted.history[:2]


def test_a_shifted_cache_saves_restores_and_forks_and_answers_as_the_uninterrupted_session(lm, tmp_path):
    session = session_over(lm, ContextPolicy.rolling(shift=True))
    for prompt in PROMPTS[:20]:
        session.respond(prompt)
    shifted = cache_state(session).ledger.shifted
    assert shifted > 0
    path = tmp_path / "shifted.safetensors"
    session.save_cache(path)
    restored = ChatSession.builder(lm).cache(path).build()
    fork = session.fork()
    assert cache_state(restored).ledger.shifted == shifted  # the file records the shift
    assert restored.context_policy == session.context_policy and restored.context_policy.shift
    replies = []
    for other in (session, restored, fork):
        with other.stream_respond(PROMPTS[20]) as stream:
            list(stream)
        replies.append(stream.tokens)
        assert stream.stats.reused_tokens > 50  # the shifted cache is what they go on from
        assert_ledger_matches_cache(other)
    assert replies[0] == replies[1] == replies[2]


def test_undo_and_regenerate_of_a_shifting_turn(lm):
    session = session_over(lm, ContextPolicy.rolling(shift=True))
    for prompt in PROMPTS:
        session.respond(prompt)
        if session.last_stats.compacted and cache_state(session).ledger.shifted:
            break
    reply = session.history[-1].content
    again = session.regenerate()
    assert again == reply and session.history[-1].content == reply
    assert_ledger_matches_cache(session)
    dropped = len(session.dropped_messages)
    session.undo()
    assert len(session.dropped_messages) < dropped  # the dropped exchanges are seen again
    assert_ledger_matches_cache(session)
    # The cache keeps only what precedes the first dropped exchange: the next turn (which compacts again)
    # re-prefills, and answers exactly as a fresh session from the context it saw.
    assert len(cache_state(session).ledger.tokens) < 40
    with session.stream_respond(PROMPTS[-1]) as stream:
        list(stream)
    assert stream.stats.compacted and stream.stats.prefilled_tokens > 100
    assert_ledger_matches_cache(session)
    system, *kept = session.context
    fresh = ChatSession.builder(small(lm, 4096)).instructions(system.content).history(kept[:-2]).generate_params(PARAMS)
    with fresh.build().stream_respond(PROMPTS[-1]) as expected:
        list(expected)
    assert stream.tokens == expected.tokens


@pytest.mark.parametrize("option", [{"kv_bits": 8}, {"max_kv_size": 256}])
def test_caches_that_cannot_shift_are_refused_when_the_session_is_built(lm, option):
    with pytest.raises(InvalidParamsError, match="shift=True"):
        session_over(lm, ContextPolicy.rolling(shift=True), **option)


@pytest.mark.parametrize("arch, why", [("gemma3_text", "sliding-window"), ("qwen3_5", "recurrent")])
def test_models_that_cannot_shift_are_refused_when_the_session_is_built(tiny, arch, why):
    lm = tiny(arch)
    assert isinstance(layer_ropes(lm.model), (list, str))
    with pytest.raises(InvalidParamsError, match=why):
        ChatSession.builder(lm).context_policy(ContextPolicy.rolling(shift=True)).build()
    session = ChatSession.builder(lm).build()
    with pytest.raises(InvalidParamsError, match=why):
        session.context_policy = ContextPolicy.rolling(shift=True)
    assert session.context_policy == ContextPolicy()  # a refused setting changes nothing


def test_a_speculative_session_cannot_shift(lm):
    from chatkit import SpeculativeConfig

    with pytest.raises(InvalidParamsError, match="draft"):
        session_over(lm, ContextPolicy.rolling(shift=True), speculative=SpeculativeConfig("prompt_lookup"))


def test_shift_is_a_rolling_setting_and_round_trips():
    with pytest.raises(InvalidParamsError):
        ContextPolicy("summarize", shift=True).checked()
    with pytest.raises(InvalidParamsError):
        ContextPolicy.rolling(shift="yes")  # type: ignore[arg-type]
    policy = ContextPolicy.rolling(shift=True)
    assert ContextPolicy.from_dict(policy.to_dict()) == policy
    assert "shift" not in ContextPolicy.rolling().to_dict()


def test_a_kv_budget_makes_the_window_the_tokens_that_fit(lm):
    per_token = lm.kv_bytes_per_token()
    assert lm.kv_bytes_per_token(8) < per_token  # quantized KV takes fewer bytes
    session = session_over(lm, ContextPolicy.rolling(shift=True), max_kv_bytes=per_token * 200 + 5)
    assert session.kv_bytes_per_token == per_token and session.context_window == 200
    for prompt in PROMPTS[:16]:
        session.respond(prompt)
        assert session.last_stats.prompt_tokens + PARAMS.max_tokens <= 200
        assert session.cache_info().nbytes <= per_token * 200 + 256 * per_token  # (mlx-lm grows buffers by 256)
    assert session.dropped_messages
    roomy = session_over(lm, ContextPolicy.rolling(), max_kv_bytes=per_token * 10**6)
    assert roomy.context_window == lm.context_length  # never more than the model's
    with pytest.raises(InvalidParamsError, match="max_kv_bytes"):
        session_over(lm, ContextPolicy.rolling(), max_kv_bytes=per_token * 20)


def test_chat_takes_a_kv_budget_as_a_size():
    from chatkit.cli.args import byte_size, parser

    assert [byte_size(x) for x in ("2GB", "512MiB", "1.5G", "1000")] == [2 * 10**9, 2**29, 15 * 10**8, 1000]
    assert parser().parse_args(["chat", "--max-kv-bytes", "2GB"]).max_kv_bytes == 2 * 10**9
    with pytest.raises(SystemExit):
        parser().parse_args(["chat", "--max-kv-bytes", "lots"])


def test_a_shifted_cache_gives_no_blocks_to_the_prompt_cache(lm):
    """Kept KV attended to tokens a shift dropped: another session must never start from it."""
    from chatkit import PromptCache

    pc = PromptCache(block_tokens=16)
    session = session_over(lm, ContextPolicy.rolling(shift=True), prompt_cache=pc)
    grew_after_shift = []
    for prompt in PROMPTS[:24]:
        before = pc.usage().blocks
        session.respond(prompt)
        if cache_state(session).ledger.shifted:
            grew_after_shift.append(pc.usage().blocks - before)
    assert grew_after_shift and not any(grew_after_shift) and pc.usage().blocks > 0


def test_a_fork_with_another_history_does_not_reuse_a_shifted_cache(lm):
    # The shifted keys were rotated past the exchanges the window dropped: they hold for that window only. A
    # branch with its own history is seen whole, so it prefills and answers as a fresh session does.
    from conftest import fresh_reply

    session = session_over(lm, ContextPolicy.rolling(shift=True))
    for prompt in PROMPTS[:20]:
        session.respond(prompt)
    assert cache_state(session).ledger.shifted > 0
    branch = session.fork(history=session.history[:4])
    assert cache_state(branch).empty and cache_state(session).ledger.shifted > 0  # the source keeps its cache
    expected = fresh_reply(branch, PROMPTS[20])
    with branch.stream_respond(PROMPTS[20]) as stream:
        list(stream)
    assert stream.tokens == expected and stream.stats.reused_tokens == 0
    assert_ledger_matches_cache(branch)

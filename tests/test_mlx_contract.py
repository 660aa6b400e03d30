"""What chatkit assumes about mlx-lm's insides (chatkit/cache/_mlx.py, chatkit/model/tokenizer.py), checked
against the installed mlx-lm: an upgrade that changes one of these fails here, loudly, instead of
corrupting caches or text. pyproject pins the mlx-lm range these pass on."""

from chatkit.cache import _mlx

import mlx.core as mx
import pytest
from mlx_lm.generate import TextStateMachine
from mlx_lm.models import cache as mlx_cache
from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, TokenizerWrapper


def kv(n, heads=2, dim=32):
    layer = mlx_cache.KVCache()
    layer.update_and_fetch(mx.ones((1, heads, n, dim)), mx.ones((1, heads, n, dim)))
    return layer


def test_cache_state_tuples_are_what_cut_to_offset_builds():
    layer = kv(5)
    keys, values, offset = layer.state  # (keys, values, offset), keys grown in steps past offset
    assert offset == 5 and keys.shape[2] >= 5
    cut = _mlx.cut_to_offset(layer)
    assert cut.offset == 5 and cut.keys.shape[2] == 5 and mx.array_equal(cut.keys, keys[..., :5, :])

    quantized = layer.to_quantized(group_size=32, bits=4)
    assert len(quantized.state) == 5 and quantized.state[2:] == (5, 32, 4)
    assert _mlx.cut_to_offset(quantized).keys[0].shape[2] == 5

    rotating = mlx_cache.RotatingKVCache(max_size=16, keep=4)
    rotating.update_and_fetch(mx.ones((1, 2, 3, 32)), mx.ones((1, 2, 3, 32)))
    state = rotating.state  # (keys, values, offset, keep, max_size, _idx)
    assert len(state) == 6 and state[2:] == (3, 4, 16, rotating._idx) and rotating._idx == 3
    restored = _mlx.cut_to_offset(rotating)
    assert restored.offset == 3 and restored.keys.shape[2] == 3 and restored.max_size == 16


def test_copies_trims_and_prompt_cache_helpers():
    layer = kv(6)
    copy = _mlx.copy_layer(layer)
    assert copy is not layer and copy.offset == 6
    assert _mlx.can_trim([layer, copy]) and _mlx.trim_layers([layer], 2) and layer.offset == 2 and copy.offset == 6
    assert _mlx.layer_offset([copy, kv(6)]) == 6 and _mlx.layer_offset([copy, layer]) is None
    full = mlx_cache.RotatingKVCache(max_size=8, keep=4)
    full.update_and_fetch(mx.ones((1, 2, 9, 32)), mx.ones((1, 2, 9, 32)))
    assert not _mlx.can_trim([full]) and _mlx.held_tokens(full) == 8


def test_text_state_machine_stops_on_a_transition_to_none():
    machine = TextStateMachine({"normal": [("STOP", None)]})
    state = machine.make_state()
    state, segments = TextStateMachine.split(state, "abST")
    assert "".join(t for _, t in segments) == "ab" and state[0] == "normal"  # "ST" held back
    state, segments = TextStateMachine.split(state, "OPxyz")
    assert state[0] is None and "".join(t for _, t in segments) == ""
    state = machine.make_state()
    state, _ = TextStateMachine.split(state, "abS")
    assert TextStateMachine.flush(state)[1] == "S"


def test_tokenizer_wrapper_surface(tiny):
    lm = tiny(arch="qwen3", tokenizer="bpe")
    wrapper = lm.tokenizer
    assert isinstance(wrapper, TokenizerWrapper)
    assert wrapper._tokenizer.backend_tokenizer is not None  # the HF tokenizer and its fast backend
    assert type(wrapper._detokenizer) is BPEStreamingDetokenizer
    detok = wrapper._detokenizer
    for name in ("tokenmap", "_unflushed", "text", "tokens", "_decode_bytes", "_maybe_trim_space", "reset"):
        assert hasattr(detok, name), name
    text = wrapper.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert isinstance(text, str) and text.endswith("assistant\n")


@pytest.mark.parametrize("name", ["KVCache", "RotatingKVCache", "QuantizedKVCache", "ArraysCache"])
def test_cache_classes_chatkit_files_name_exist(name):
    assert hasattr(mlx_cache, name)


def test_multi_token_steps_equal_one_token_steps_within_speculation_room(tiny):
    """What ``_mlx.speculation_room`` lets speculative decoding rely on: a step of several tokens gives
    the logits of one-token steps while a rotating cache has room and into a quantized cache (keys are
    quantized per token); a rotating cache that wraps within the step does not."""
    lm = tiny(arch="qwen3", tokenizer="bpe")
    prompt, step = mx.array([[5, 6, 7, 8, 9, 10, 11, 12]]), [13, 14, 15, 16]

    def logits(make, chunked):
        cache = make()
        lm.model(prompt, cache=cache)
        if isinstance(cache[0], mlx_cache.KVCache) and make is quantized:
            cache[:] = [c.to_quantized(group_size=32, bits=4) for c in cache]
        if chunked:
            return lm.model(mx.array([step]), cache=cache)[0]
        return mx.concatenate([lm.model(mx.array([[t]]), cache=cache)[0] for t in step])

    def rotating(size):
        return lambda: [mlx_cache.RotatingKVCache(max_size=size, keep=4) for _ in lm.model.layers]

    def quantized():
        return [mlx_cache.KVCache() for _ in lm.model.layers]

    roomy = rotating(len(step) + 8)  # the step ends exactly at max_size
    assert _mlx.speculation_room(roomy(), None, 0) == len(step) + 7
    for make in (roomy, quantized):
        assert mx.allclose(logits(make, True), logits(make, False), atol=1e-4), make
    wraps = rotating(10)
    assert not mx.allclose(logits(wraps, True), logits(wraps, False), atol=1e-4)
    layer = mlx_cache.KVCache()
    layer.update_and_fetch(mx.ones((1, 2, 7, 32)), mx.ones((1, 2, 7, 32)))
    assert _mlx.speculation_room([layer], 4, 12) == 3 and _mlx.speculation_room([layer], None, 12) > 1000

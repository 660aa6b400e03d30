"""What chatkit assumes about mlx-lm's insides (chatkit/cache/_mlx.py, chatkit/_tokenizer.py), checked
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

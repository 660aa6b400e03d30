"""What chatkit assumes about mlx-lm's insides (chatkit/cache/_mlx.py, chatkit/model/tokenizer.py: the only
modules that touch its private attributes, and transformers' one), checked against the installed mlx-lm:
an upgrade that changes one of these fails here, loudly, instead of corrupting caches or text. pyproject
pins the mlx-lm range these pass on. Formulas chatkit writes out because mlx-lm keeps their result
private (Llama 3's rope frequencies) and the test models' classes are checked against mlx-lm's too."""

import importlib

from chatkit.cache import _mlx
from chatkit.model import tokenizer as _tokenizer
from chatkit.model.gguf.arch import llama3_rope_freqs
from chatkit.testing import models as test_models
from chatkit.testing.tokenizers import tokenizer_files

import mlx.core as mx
import pytest
from mlx_lm.generate import TextStateMachine
from mlx_lm.models import cache as mlx_cache
from mlx_lm.models.rope_utils import Llama3RoPE
from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, TokenizerWrapper
from mlx_lm.utils import _get_classes


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


def test_the_fields_the_state_checks_read_come_back_from_a_file():
    # _mlx.state_problem judges a loaded layer by these fields: each is in its class's state tuple.
    chunked = mlx_cache.ChunkedKVCache(chunk_size=8)
    chunked.update_and_fetch(mx.ones((1, 2, 12, 32)), mx.ones((1, 2, 12, 32)))
    chunked.maybe_trim_front()
    assert chunked.state[2:] == (12, 8, 4) and chunked.start_position == 4
    arrays = mlx_cache.ArraysCache(2)
    assert arrays.state == ([None, None], None, None)
    rotating = mlx_cache.RotatingKVCache(max_size=8, keep=2)
    assert _mlx.window_of(rotating) == (8, 2) and _mlx.window_of(kv(3)) is None
    for layer in (chunked, arrays, rotating, kv(3), kv(3).to_quantized(group_size=32, bits=4)):
        assert _mlx.state_problem(type(layer).from_state(layer.state)) is None


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
    # has_chat_template: the wrapper's Python renderer (a chat-template module's) sits in _chat_template.
    assert wrapper._chat_template is None

    def render(*args, **kwargs):
        return "rendered"

    assert TokenizerWrapper(wrapper._tokenizer, chat_template=render)._chat_template is render
    assert _tokenizer.hf_tokenizer(wrapper) is wrapper._tokenizer
    assert _tokenizer.hf_tokenizer(wrapper._tokenizer) is wrapper._tokenizer  # a bare HF tokenizer as is


def test_the_detokenizer_chatkit_derives_keeps_a_leading_space_and_hands_text_out_at_once(tiny):
    """model/tokenizer.py's detokenizer overrides add_token (tokenmap, _unflushed, _decode_bytes) and
    _maybe_trim_space of mlx-lm's BPE detokenizer: its text is what the tokens decode to, as they come."""
    wrapper = tiny(arch="qwen3", tokenizer="bpe").tokenizer
    ids = wrapper.encode(" Hello there, caf\u00e9 \u2603!", add_special_tokens=False)
    detok = _tokenizer.new_detokenizer(wrapper)
    assert detok is not wrapper._detokenizer and detok.tokenmap is wrapper._detokenizer.tokenmap
    for i, token in enumerate(ids):
        detok.add_token(token)
        decoded = wrapper.decode(ids[: i + 1])
        if decoded.endswith("\ufffd"):  # a character's bytes still incomplete: held back
            assert decoded.startswith(detok.text)
        else:
            assert detok.text == decoded
    detok.finalize()
    assert detok.text == wrapper.decode(ids) and detok.text.startswith(" Hello")


def test_transformers_jinja_environment_has_the_template_helpers():
    """text/encoder.py renders a self-mutating template in jinja's plain sandbox with transformers'
    filters and globals, reached through transformers' private _compile_jinja_template."""
    env = _tokenizer.jinja_environment("{{ messages | tojson }}")
    assert {"tojson"} <= set(env.filters) and {"raise_exception", "strftime_now"} <= set(env.globals)


def test_llama3_rope_frequencies_are_mlx_lms():
    """model/gguf/arch.py writes out the formula of Llama3RoPE, whose result mlx-lm keeps in _freqs."""
    for dims, base, factor in ((64, 500000.0, 32.0), (128, 500000.0, 8.0), (32, 10000.0, 4.0)):
        scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 8192}
        rope = Llama3RoPE(dims, 8192, False, base, scaling)
        assert mx.array_equal(llama3_rope_freqs(dims, base, scaling), rope._freqs)


@pytest.mark.parametrize("arch", test_models.ARCHS)
def test_test_models_are_built_from_the_model_module_mlx_lm_loads(arch):
    """chatkit.testing builds a tiny model from ``mlx_lm.models.<model_type>``, which is what mlx-lm's
    loader picks (no remapping) for the test architectures."""
    config = test_models.model_config(arch, tokenizer_files("bpe", None))
    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    assert _get_classes(config) == (module.Model, module.ModelArgs)


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


def test_batch_layer_and_the_batch_cache_moves_the_batch_engine_makes():
    """``batch_layer`` writes BatchKVCache's fields as ``merge`` does; a verifying step's per-row drop
    (``prepare(right_padding=...)`` then ``finalize()``) keeps each row's tokens at the write position;
    ``extract`` gives each row back as a plain KVCache."""

    def rows_of(n, seed):
        layer = mlx_cache.KVCache()
        k = mx.random.normal((1, 2, n, 8), key=mx.random.key(seed))
        layer.update_and_fetch(k, k + 1)
        return layer, k

    (a, ka), (b, kb), (c, kc) = rows_of(5, 1), rows_of(3, 2), rows_of(7, 3)
    batch = _mlx.batch_layer(_mlx.batch_layer(None, [a, b]), [c])
    assert isinstance(batch, mlx_cache.BatchKVCache) and batch.size() == 7
    assert batch.offset.tolist() == [5, 3, 7] and batch.left_padding.tolist() == [2, 4, 0]
    assert batch.keys.shape[2] % mlx_cache.BatchKVCache.step == 0 and batch.keys.shape[2] > 7  # room to grow
    for i, (n, k) in enumerate(((5, ka), (3, kb), (7, kc))):
        row = batch.extract(i)
        assert row.offset == n and mx.array_equal(row.keys, k).item() and mx.array_equal(row.values, k + 1).item()
    # A 3-position step; rows keep 3, 1 and 2 of them: trim the common 0, then roll by (0, 2, 1).
    new = mx.random.normal((3, 2, 3, 8), key=mx.random.key(4))
    batch.update_and_fetch(new, new)
    batch.prepare(right_padding=[0, 2, 1])
    batch.finalize()
    assert batch.offset.tolist() == [8, 4, 9]
    for i, (k, kept) in enumerate(((ka, 3), (kb, 1), (kc, 2))):
        want = mx.concatenate([k, new[i : i + 1, :, :kept]], axis=2)
        assert mx.array_equal(batch.extract(i).keys, want).item()


def test_batch_layer_joins_batched_and_empty_rows():
    """A prefill group's batched layer (an empty row in it) joins the batch's rows in one new buffer:
    every row right-aligned, the empty one all padding; ``ahead`` leaves room for the prompts to come."""

    def row(n, seed):
        layer = mlx_cache.KVCache()
        k = mx.random.normal((1, 2, n, 8), key=mx.random.key(seed))
        layer.update_and_fetch(k, k + 1)
        return layer, k

    (a, ka), (b, kb), (c, kc) = row(4, 1), row(6, 2), row(2, 3)
    group = _mlx.batch_layer(None, [mlx_cache.KVCache(), c], ahead=300)
    assert group.keys.shape[2] >= 2 + 300 and group.left_padding.tolist() == [2, 0]
    assert _mlx.batch_layer(None, [mlx_cache.KVCache()]).keys is None  # nothing cached: allocated by the first step
    joined = _mlx.batch_layer(_mlx.batch_layer(None, [a, b]), [group])
    assert joined.size() == 6 and joined.offset.tolist() == [4, 6, 0, 2]
    assert joined.left_padding.tolist() == [2, 0, 6, 4]
    for i, k in ((0, ka), (1, kb), (3, kc)):
        assert mx.array_equal(joined.extract(i).keys, k).item()
    assert joined.extract(2).offset == 0


def test_a_tool_format_view_reads_as_a_wrapper_built_with_that_parser(tiny):
    """``with_tool_parser`` sets the private fields mlx-lm's constructor sets for ``tool_parser_type``:
    the public surface must then be that of a wrapper built with the parser."""
    from mlx_lm.tool_parsers import json_tools

    wrapper = tiny(arch="qwen3", tokenizer="spm").tokenizer
    view = _tokenizer.with_tool_parser(wrapper, "json_tools")
    built = TokenizerWrapper(wrapper._tokenizer, tool_parser=json_tools.parse_tool_call,
                             tool_call_start=json_tools.tool_call_start, tool_call_end=json_tools.tool_call_end)
    for name in ("has_tool_calling", "tool_call_start", "tool_call_end", "tool_call_start_tokens",
                 "tool_call_end_tokens", "tool_parser"):
        assert getattr(view, name) == getattr(built, name), name
    assert not wrapper.has_tool_calling and view._detokenizer is wrapper._detokenizer
    assert _tokenizer.tool_parser_type(view) == "json_tools" and _tokenizer.tool_parser_type(wrapper) is None

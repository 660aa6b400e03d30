"""Tests of chatkit.testing: tiny offline models and real-family tokenizers."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import chatkit  # noqa: E402, F401  (first: it loads OpenBLAS before mlx is imported)
from chatkit.errors import InvalidParamsError  # noqa: E402
from chatkit.model.load import load  # noqa: E402
from chatkit.model.loaded import LoadedModel
from chatkit.testing import ARCHS, TOKENIZERS, tiny_model, tiny_model_path  # noqa: E402

import mlx.core as mx  # noqa: E402
import pytest  # noqa: E402
from jinja2.exceptions import TemplateError  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402
from mlx_lm.generate import generate_step  # noqa: E402
from mlx_lm.models.cache import (  # noqa: E402
    ArraysCache,
    KVCache,
    RotatingKVCache,
    can_trim_prompt_cache,
    make_prompt_cache,
)
from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, SPMStreamingDetokenizer  # noqa: E402

TEXT = "Hello, world! Ça va? naïve café 你好，世界。こんにちは 🎉🦄👩‍💻 x=1+2 \n\n\tindented  spaces  "
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello! How can I help?"},
    {"role": "user", "content": "Tell me a joke."},
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]


def render(tokenizer: str, messages, **kwargs) -> str:
    tok = tiny_model("llama", tokenizer).tokenizer
    return tok.apply_chat_template(messages, tokenize=False, **kwargs)


def greedy(lm: LoadedModel, messages, n: int) -> list[int]:
    ids = lm.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    steps = generate_step(mx.array(ids), lm.model, max_tokens=n)
    return [int(token) for token, _ in steps]


def folder_digest(path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(path.iterdir())}


# --- models -------------------------------------------------------------------------------------


@pytest.mark.parametrize("tokenizer", TOKENIZERS)
@pytest.mark.parametrize("arch", ARCHS)
def test_every_arch_and_tokenizer_loads_and_runs(arch, tokenizer):
    path = tiny_model_path(arch=arch, tokenizer=tokenizer, seed=0)
    lm = load(path)
    assert isinstance(lm, LoadedModel)
    assert lm.config["model_type"] == arch
    assert lm.context_length == 4096
    vocab = len(lm.tokenizer)
    assert lm.config["vocab_size"] == vocab
    ids = lm.tokenizer.encode("Hello there, how are you?")
    logits = lm.model(mx.array(ids)[None])
    assert logits.shape == (1, len(ids), vocab)
    assert logits.dtype == mx.float32
    assert bool(mx.isfinite(logits).all())
    assert float(logits[0, -1].std()) > 1.0  # peaked distributions, not uniform noise
    params = dict(tree_flatten(lm.model.parameters()))
    assert all(v.dtype == mx.float32 for v in params.values())
    assert sum(v.size for v in params.values()) < 10_000_000


def test_mlx_lm_loads_the_folder_directly():
    from mlx_lm import load as mlx_load

    model, tokenizer = mlx_load(str(tiny_model_path("qwen3_5", "gemma")))
    assert model(mx.array([[2, 4, 5]])).shape == (1, 3, len(tokenizer))


def test_tiny_model_is_memoized_and_matches_path():
    lm = tiny_model()
    assert tiny_model("qwen3", "bpe", 0) is lm
    assert tiny_model(arch="qwen3", tokenizer="bpe", seed=0) is lm
    assert tiny_model_path() == tiny_model_path("qwen3", "bpe", 0)
    assert lm.source == str(tiny_model_path())
    assert tiny_model(seed=1) is not lm


def test_config_overrides_build_another_model_memoized_by_them():
    small = dict(hidden_size=64, num_hidden_layers=3, intermediate_size=96, num_attention_heads=2)
    lm = tiny_model("qwen3", "bpe", **small)
    assert lm is tiny_model("qwen3", "bpe", 0, **dict(reversed(list(small.items()))))
    assert lm is not tiny_model("qwen3", "bpe")
    assert tiny_model("qwen3", "bpe", hidden_size=128) is tiny_model("qwen3", "bpe")  # the default
    path = tiny_model_path("qwen3", "bpe", **small)
    assert path != tiny_model_path("qwen3", "bpe") and lm.source == str(path)
    config = json.loads((path / "config.json").read_text())
    assert {k: config[k] for k in small} == small
    assert config["num_key_value_heads"] == 2 and config["vocab_size"] == len(lm.tokenizer)
    assert len(lm.model.layers) == 3
    params = dict(tree_flatten(lm.model.parameters()))
    assert params["model.layers.2.mlp.gate_proj.weight"].shape == (96, 64)
    ids = lm.tokenizer.encode("Hello there, how are you?")
    logits = lm.model(mx.array(ids)[None])
    assert logits.shape == (1, len(ids), len(lm.tokenizer))
    assert 2.0 < float(logits[0, -1].std()) < 6.0  # as peaked as the default model's
    out = greedy(lm, CONVERSATION, 20)
    assert len(set(out)) >= 8


def test_config_overrides_are_validated():
    with pytest.raises(InvalidParamsError, match="override"):
        tiny_model("qwen3", "bpe", hidden_sise=64)
    with pytest.raises(InvalidParamsError, match="override"):
        tiny_model_path("qwen3", "bpe", vocab_size=100)  # set by the tokenizer
    with pytest.raises(InvalidParamsError, match="override"):
        tiny_model_path("qwen3", "bpe", sliding_window=16)  # gemma3_text's, not qwen3's
    for bad in (64.0, "64", True, 0, -8):
        with pytest.raises(InvalidParamsError, match="positive int"):
            tiny_model_path("qwen3", "bpe", hidden_size=bad)
    assert tiny_model_path("gemma3_text", "bpe", sliding_window=16).name.endswith("sliding_window16")


def test_same_seed_same_weights_other_seed_other_weights():
    a = dict(tree_flatten(tiny_model("qwen3_5", "bpe", 0).model.parameters()))
    b = dict(tree_flatten(load(tiny_model_path("qwen3_5", "bpe", 0)).model.parameters()))
    c = dict(tree_flatten(tiny_model("qwen3_5", "bpe", 1).model.parameters()))
    assert a.keys() == b.keys() == c.keys()
    for name in a:
        assert mx.array_equal(a[name], b[name]), name
        if a[name].ndim >= 2 or name.endswith("A_log"):  # norms are constants on purpose
            assert not mx.array_equal(a[name], c[name]), name


@pytest.mark.slow  # a subprocess
def test_files_are_identical_in_another_process():
    combos = [("gemma3_text", "spm", 3), ("qwen3", "bpe-think", 0)]
    code = (
        "import hashlib, json, sys\n"
        "from chatkit.testing import tiny_model_path\n"
        "out = {}\n"
        f"for arch, tok, seed in {combos!r}:\n"
        "    p = tiny_model_path(arch, tok, seed)\n"
        "    out[f'{arch}/{tok}/{seed}'] = {f.name: hashlib.sha256(f.read_bytes()).hexdigest()"
        " for f in sorted(p.iterdir())}\n"
        "print(json.dumps(out))\n"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
    )
    theirs = json.loads(result.stdout.strip().splitlines()[-1])
    for arch, tok, seed in combos:
        ours = folder_digest(tiny_model_path(arch, tok, seed))
        assert {"config.json", "model.safetensors", "tokenizer.json"} <= ours.keys()
        assert theirs[f"{arch}/{tok}/{seed}"] == ours


def test_building_and_loading_leave_mlx_random_state_alone():
    mx.random.seed(1234)
    expected = mx.random.uniform(shape=(4,))
    mx.random.seed(1234)
    tiny_model("llama", "gemma", seed=11)  # built and loaded here, not cached yet
    assert mx.array_equal(mx.random.uniform(shape=(4,)), expected)


def test_invalid_arguments_raise():
    with pytest.raises(InvalidParamsError, match="arch"):
        tiny_model_path(arch="gpt2")
    with pytest.raises(InvalidParamsError, match="tokenizer"):
        tiny_model(tokenizer="wordpiece")
    with pytest.raises(ValueError, match="seed"):
        tiny_model_path(seed=-1)


def test_cache_layer_classes():
    def classes(arch):
        return [type(c) for c in make_prompt_cache(tiny_model(arch).model)]

    assert set(classes("llama")) == {KVCache}
    assert set(classes("qwen3")) == {KVCache}
    gemma = classes("gemma3_text")
    assert RotatingKVCache in gemma and KVCache in gemma
    hybrid = classes("qwen3_5")
    assert ArraysCache in hybrid and KVCache in hybrid
    cache = make_prompt_cache(tiny_model("qwen3_5").model)
    assert not can_trim_prompt_cache(cache)
    rotating = make_prompt_cache(tiny_model("gemma3_text").model)
    assert rotating[0].max_size == 32 and can_trim_prompt_cache(rotating)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_output_is_not_degenerate_and_fast(arch):
    lm = tiny_model(arch, "bpe")
    ask = [{"role": "user", "content": "Tell me a story about a dragon who guards a castle."}]
    greedy(lm, ask, 5)  # warm-up (compiles mlx-lm's fused kernels)
    out = greedy(lm, ask, 30)
    assert out[0] not in lm.tokenizer.eos_token_ids
    assert len(set(out[:10])) >= 3
    assert len(set(out)) >= 8
    # Small enough that a suite of many turns stays fast: a size bound, not a timing (timings on a shared
    # machine measure its load; speed is the benchmarks' job).
    from mlx.utils import tree_flatten

    size = sum(v.size for _, v in tree_flatten(lm.model.parameters()))
    assert size < 2.5e6, f"{arch}: {size} parameters"


@pytest.mark.parametrize("group_size", [32, 64])
def test_kv_cache_quantization_works(group_size):
    lm = tiny_model("qwen3", "bpe")
    ids = lm.tokenizer.encode("Hello there, how are you today? " * 4)
    steps = generate_step(
        mx.array(ids), lm.model, max_tokens=4, kv_bits=4, kv_group_size=group_size, quantized_kv_start=0
    )
    assert len([t for t, _ in steps]) == 4


def test_eos_ids_come_from_the_config():
    assert tiny_model("llama", "bpe").tokenizer.eos_token_ids == {
        tiny_model("llama", "bpe").tokenizer.convert_tokens_to_ids(t)
        for t in ("<|im_end|>", "<|endoftext|>")
    }
    gemma = tiny_model("llama", "gemma").tokenizer
    assert gemma.convert_tokens_to_ids("<end_of_turn>") in gemma.eos_token_ids
    assert gemma.eos_token_id in gemma.eos_token_ids
    spm = tiny_model("llama", "spm").tokenizer
    assert spm.eos_token_ids == {spm.convert_tokens_to_ids("</s>")}
    config = json.loads((tiny_model_path("llama", "gemma") / "generation_config.json").read_text())
    assert set(config["eos_token_id"]) == gemma.eos_token_ids


# --- tokenizers ----------------------------------------------------------------------------------


@pytest.mark.parametrize("tokenizer", TOKENIZERS)
def test_round_trip_multilingual_and_emoji(tokenizer):
    tok = tiny_model("llama", tokenizer).tokenizer
    for text in (TEXT, "trailing space ", "日本語だけ", "🎉", "a\n\n\nb"):
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text
        detok = tok.detokenizer
        for i in ids:
            detok.add_token(i)
        detok.finalize()
        assert detok.text == text


def test_leading_space_quirks():
    """A text that starts with a space: what real tokenizers of each family (and mlx-lm) do."""
    text = " leading space"

    def both(tokenizer):
        tok = tiny_model("llama", tokenizer).tokenizer
        ids = tok.encode(text, add_special_tokens=False)
        detok = tok.detokenizer
        for i in ids:
            detok.add_token(i)
        detok.finalize()
        return tok.decode(ids), detok.text

    # Byte-level BPE decodes exactly, but mlx-lm's BPEStreamingDetokenizer drops a leading space.
    assert both("bpe") == (text, text[1:])
    # Llama (Metaspace, prepend_scheme "first"): the space becomes the dummy prefix and is lost.
    assert both("spm") == (text[1:], text[1:])
    # Gemma has no dummy prefix: exact both ways.
    assert both("gemma") == (text, text)


def test_bpe_ids_match_tiktoken_on_the_truncated_ranks():
    tiktoken = pytest.importorskip("tiktoken")
    from chatkit.testing.tokenizers import BPE_RANKS, QWEN2_PATTERN, _qwen_ranks

    ranks = _qwen_ranks()
    assert len(ranks) == BPE_RANKS
    specials = {"<|endoftext|>": BPE_RANKS, "<|im_start|>": BPE_RANKS + 1, "<|im_end|>": BPE_RANKS + 2}
    enc = tiktoken.Encoding("qwen-8k", pat_str=QWEN2_PATTERN, mergeable_ranks=ranks, special_tokens=specials)
    tok = tiny_model("llama", "bpe").tokenizer
    text = "<|im_start|>user\n" + TEXT + " 12345 don't<|im_end|>\n"
    assert tok.encode(text) == enc.encode(text, allowed_special="all")
    assert len(tok) == BPE_RANKS + 3 + 6
    assert tok.convert_tokens_to_ids(["<think>", "</think>"]) == [BPE_RANKS + 7, BPE_RANKS + 8]


def test_detokenizer_classes():
    assert isinstance(tiny_model("llama", "bpe").tokenizer.detokenizer, BPEStreamingDetokenizer)
    assert isinstance(tiny_model("llama", "bpe-think").tokenizer.detokenizer, BPEStreamingDetokenizer)
    spm = tiny_model("llama", "spm").tokenizer.detokenizer
    assert isinstance(spm, SPMStreamingDetokenizer) and spm.trim_space
    gemma = tiny_model("llama", "gemma").tokenizer.detokenizer
    assert isinstance(gemma, SPMStreamingDetokenizer) and not gemma.trim_space


def test_spm_byte_fallback_and_bos():
    tok = tiny_model("llama", "spm").tokenizer
    assert tok.convert_ids_to_tokens(tok.encode("🎉", add_special_tokens=False)) == [
        "▁", "<0xF0>", "<0x9F>", "<0x8E>", "<0x89>",
    ]  # fmt: skip
    assert tok.encode("Hello")[0] == tok.bos_token_id
    assert tok.encode("Hello", add_special_tokens=False)[0] != tok.bos_token_id
    assert 2000 <= len(tok) <= 4200


# --- chat templates ------------------------------------------------------------------------------


def test_chatml_template():
    text = render("bpe", CONVERSATION, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi there<|im_end|>\n"
        "<|im_start|>assistant\nHello! How can I help?<|im_end|>\n"
        "<|im_start|>user\nTell me a joke.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    # No default system prompt; without a generation prompt the text ends after the last turn.
    assert render("bpe", CONVERSATION[1:2]) == "<|im_start|>user\nHi there<|im_end|>\n"


def test_chatml_tools_and_tool_messages():
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
        },
        {"role": "tool", "content": '{"temp": 21}'},
        {"role": "tool", "content": '{"wind": 3}'},
    ]
    for name in ("bpe", "bpe-think"):
        text = render(name, messages, tools=TOOLS, add_generation_prompt=True)
        assert text.startswith("<|im_start|>system\n# Tools\n")
        assert "<tools>\n" + json.dumps(TOOLS[0]) + "\n</tools>" in text
        assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>' in text
        assert text.endswith(
            "<|im_start|>user\n<tool_response>\n{\"temp\": 21}\n</tool_response>\n"
            "<tool_response>\n{\"wind\": 3}\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
        )


def test_think_template_drops_earlier_reasoning_only():
    messages = [
        {"role": "user", "content": "First question"},
        {"role": "assistant", "content": "<think>\nold reasoning\n</think>\n\nFirst answer"},
        {"role": "user", "content": "Second question"},
        {"role": "assistant", "content": "<think>\nnew reasoning\n</think>\n\nSecond answer"},
    ]
    text = render("bpe-think", messages)
    assert "old reasoning" not in text
    assert "<|im_start|>assistant\nFirst answer<|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n<think>\nnew reasoning\n</think>\n\nSecond answer<|im_end|>\n")
    # reasoning_content is used like inline <think> content.
    messages[3] = {"role": "assistant", "content": "Second answer", "reasoning_content": "new reasoning"}
    assert render("bpe-think", messages).endswith("<think>\nnew reasoning\n</think>\n\nSecond answer<|im_end|>\n")
    # Plain ChatML keeps everything verbatim.
    assert "old reasoning" in render("bpe", messages[:2])


def test_think_template_enable_thinking():
    ask = CONVERSATION[1:2]
    assert render("bpe-think", ask, add_generation_prompt=True).endswith("<|im_start|>assistant\n")
    off = render("bpe-think", ask, add_generation_prompt=True, enable_thinking=False)
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    tok = tiny_model("llama", "bpe-think").tokenizer
    assert tok.has_thinking and tok.think_start == "<think>" and tok.think_end == "</think>"


def test_llama2_template():
    text = render("spm", CONVERSATION, add_generation_prompt=True)
    assert text == (
        "<s>[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nHi there [/INST] Hello! How can I help? </s>"
        "<s>[INST] Tell me a joke. [/INST]"
    )
    tok = tiny_model("llama", "spm").tokenizer
    ids = tok.apply_chat_template(CONVERSATION, add_generation_prompt=True)
    assert ids[0] == tok.bos_token_id and ids[1] != tok.bos_token_id  # a single leading <s>
    assert tok.encode(text, add_special_tokens=False) == ids
    with pytest.raises(TemplateError, match="alternate"):
        render("spm", [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    with pytest.raises(TemplateError, match="roles"):
        render("spm", [{"role": "user", "content": "a"}, {"role": "tool", "content": "b"}])


def test_gemma_template():
    text = render("gemma", CONVERSATION, add_generation_prompt=True)
    assert text == (
        "<bos><start_of_turn>user\nBe brief.\n\nHi there<end_of_turn>\n"
        "<start_of_turn>model\nHello! How can I help?<end_of_turn>\n"
        "<start_of_turn>user\nTell me a joke.<end_of_turn>\n"
        "<start_of_turn>model\n"
    )
    tok = tiny_model("llama", "gemma").tokenizer
    ids = tok.apply_chat_template(CONVERSATION, add_generation_prompt=True)
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1
    assert ids.count(tok.convert_tokens_to_ids("<end_of_turn>")) == 3
    with pytest.raises(TemplateError, match="alternate"):
        render("gemma", [{"role": "assistant", "content": "a"}])

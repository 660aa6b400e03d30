"""GGUF architectures onto mlx-lm models: the config, and tensor names and layouts.

llama.cpp's converter (``convert_hf_to_gguf.py``) renames Hugging Face tensors and, for the llama
family, permutes the rows of the Q and K projections for its rotary layout; this module undoes both,
so the result is an ordinary mlx-lm model folder (``model_type`` llama, qwen2 or qwen3).
"""

from __future__ import annotations

import re
from typing import Any

import mlx.core as mx

from ...errors import ModelLoadError
from .reader import value

# GGUF tensor names (per block, then global) -> mlx-lm (Hugging Face) module paths.
_BLOCK = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_SUFFIXES = ("weight", "bias", "scales", "biases")

# Architectures whose mapping is checked here, with what each needs beyond the llama layout.
SUPPORTED = {
    "llama": {"permute_qk": True},
    "qwen2": {"permute_qk": False},
    "qwen3": {"permute_qk": False},
}


def _need(meta: dict[str, Any], key: str) -> Any:
    v = value(meta, key)
    if v is None:
        raise ModelLoadError(f"The GGUF file has no {key!r} in its metadata; it cannot be converted.")
    return v


def llama3_rope_freqs(dims: int, base: float, scaling: dict[str, Any]) -> mx.array:
    """The rotary frequencies mlx-lm's ``Llama3RoPE`` uses for a ``rope_scaling`` config: its formula,
    written out because mlx-lm keeps the result private (``tests/test_mlx_contract.py`` checks the two agree)."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context = scaling["original_max_position_embeddings"]
    freqs = base ** (mx.arange(0, dims, 2) / dims)
    wavelens = 2 * mx.pi * freqs
    freqs = mx.where(wavelens > old_context / low, freqs * factor, freqs)
    medium = (wavelens > old_context / high) & (wavelens < old_context / low)
    smooth = (old_context / wavelens - low) / (high - low)
    return mx.where(medium, freqs / ((1 - smooth) / factor + smooth), freqs)


def _llama3_rope(freqs: mx.array, dims: int, base: float) -> dict[str, Any]:
    """Llama 3's rope scaling from the ``rope_freqs`` factors llama.cpp stores in place of its config.

    llama.cpp computes the factors from (factor, low/high frequency factors, original context); the
    factor is the largest of them, and the other three are the ones every Llama 3.x model uses. The
    guess is checked against the stored factors, so a file built otherwise is refused, not misread.
    """
    stored = freqs.astype(mx.float32)
    config = {
        "rope_type": "llama3",
        "factor": float(stored.max().item()),  # type: ignore[arg-type]
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    implied = llama3_rope_freqs(dims, base, config) / (base ** (mx.arange(0, dims, 2) / dims))
    if implied.shape != stored.shape or not mx.allclose(implied, stored, rtol=1e-3).item():
        raise ModelLoadError(
            "The GGUF file's rope_freqs tensor matches no Llama 3 rope scaling (factor "
            f"{config['factor']}, low 1, high 4, original context 8192); chatkit cannot convert it."
        )
    return config


def model_config(meta: dict[str, Any], tensors: dict[str, mx.array]) -> dict[str, Any]:
    """The mlx-lm ``config.json`` for a GGUF file's metadata; ``ModelLoadError`` if unsupported."""
    arch = value(meta, "general.architecture")
    if arch not in SUPPORTED:
        raise ModelLoadError(
            f"GGUF architecture {arch!r} is not supported by chatkit's converter (supported: "
            f"{', '.join(SUPPORTED)}). Convert the original Hugging Face model with mlx_lm.convert instead."
        )
    p = f"{arch}."
    heads = int(_need(meta, p + "attention.head_count"))
    hidden = int(_need(meta, p + "embedding_length"))
    # Without key_length (mlx-lm's writer stores none) the head size is Q's rows per head.
    head_dim = int(value(meta, p + "attention.key_length") or tensors["blk.0.attn_q.weight"].shape[0] // heads)
    base = float(value(meta, p + "rope.freq_base", 10000.0))
    config: dict[str, Any] = {
        "model_type": arch,
        "hidden_size": hidden,
        "num_hidden_layers": int(_need(meta, p + "block_count")),
        "intermediate_size": int(_need(meta, p + "feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(value(meta, p + "attention.head_count_kv") or heads),
        "head_dim": head_dim,
        "rms_norm_eps": float(_need(meta, p + "attention.layer_norm_rms_epsilon")),
        "rope_theta": base,
        "vocab_size": int(tensors["token_embd.weight"].shape[0]),
        "tie_word_embeddings": "output.weight" not in tensors,
    }
    if (ctx := value(meta, p + "context_length")) is not None:
        config["max_position_embeddings"] = int(ctx)
    rope_dims = value(meta, p + "rope.dimension_count")
    if rope_dims is not None and int(rope_dims) != head_dim:
        raise ModelLoadError(
            f"The GGUF file rotates {rope_dims} of {head_dim} head dimensions (partial rotary); "
            "chatkit's converter supports full rotary embeddings only."
        )
    scaling = value(meta, p + "rope.scaling.type")
    if "rope_freqs.weight" in tensors:
        config["rope_scaling"] = _llama3_rope(tensors["rope_freqs.weight"], head_dim, base)
    elif scaling == "linear":
        config["rope_scaling"] = {"type": "linear", "factor": float(_need(meta, p + "rope.scaling.factor"))}
    elif scaling not in (None, "none"):
        raise ModelLoadError(f"The GGUF file uses rope scaling {scaling!r}, which chatkit's converter does not map.")
    if arch == "llama":
        config["attention_bias"] = "blk.0.attn_q.bias" in tensors
        config["mlp_bias"] = "blk.0.ffn_up.bias" in tensors
    return config


def hf_name(name: str) -> str | None:
    """The mlx-lm name of a GGUF tensor, or None for one that is not a model weight."""
    if name == "rope_freqs.weight":  # folded into the config's rope_scaling
        return None
    stem, _, suffix = name.rpartition(".")
    if suffix not in _SUFFIXES:
        raise ModelLoadError(f"GGUF tensor {name!r} is not one chatkit's converter knows.")
    if m := re.fullmatch(r"blk\.(\d+)\.(\w+)", stem):
        if m.group(2) in _BLOCK:
            return f"model.layers.{m.group(1)}.{_BLOCK[m.group(2)]}.{suffix}"
    elif stem in _GLOBAL:
        return f"{_GLOBAL[stem]}.{suffix}"
    raise ModelLoadError(
        f"GGUF tensor {name!r} has no place in chatkit's mapping of this architecture "
        "(mixture-of-experts or other layers are not supported)."
    )


def _unpermute(x: mx.array, n_head: int) -> mx.array:
    """Undo llama.cpp's row permutation of Q/K (``permute`` in convert_hf_to_gguf.py) along axis 0."""
    rows = x.shape[0]
    return x.reshape(n_head, rows // n_head // 2, 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)


def map_weights(tensors: dict[str, mx.array], config: dict[str, Any]) -> dict[str, mx.array]:
    """The GGUF tensors under mlx-lm names and in Hugging Face layout (quantized ones stay packed)."""
    permute = SUPPORTED[config["model_type"]]["permute_qk"]
    out = {}
    for name, x in tensors.items():
        target = hf_name(name)
        if target is None:
            continue
        if permute and (".self_attn.q_proj." in target or ".self_attn.k_proj." in target):
            # Quantization groups run along each row, so whole rows (weight, scales, biases) move.
            heads = config["num_attention_heads" if ".q_proj." in target else "num_key_value_heads"]
            x = _unpermute(x, heads)
        out[target] = x
    return out


def quantization(weights: dict[str, mx.array]) -> dict[str, Any] | None:
    """mlx-lm's ``quantization`` config for packed weights: group 32 (MLX's GGUF reader), bits per layer."""
    layers = {}
    for name, scales in weights.items():
        if name.endswith(".scales"):
            prefix = name[: -len(".scales")]
            packed = weights[f"{prefix}.weight"]
            in_features = scales.shape[-1] * 32
            layers[prefix] = {"group_size": 32, "bits": packed.shape[-1] * 32 // in_features}
    if not layers:
        return None
    counts: dict[int, int] = {}
    for q in layers.values():
        counts[q["bits"]] = counts.get(q["bits"], 0) + 1
    bits = max(counts, key=counts.__getitem__)
    return {"group_size": 32, "bits": bits, **{k: q for k, q in layers.items() if q["bits"] != bits}}


def dequantized(weights: dict[str, mx.array], dtype: mx.Dtype) -> dict[str, mx.array]:
    """Every weight as ``dtype``; packed ones through ``mx.dequantize``."""
    out = {}
    for name, x in weights.items():
        if name.endswith((".scales", ".biases")):
            continue
        prefix = name[: -len(".weight")] if name.endswith(".weight") else None
        if prefix is not None and f"{prefix}.scales" in weights:
            # In float32: with float16 scales MLX would round every dequantized value to float16.
            scales, biases = (weights[f"{prefix}.{k}"].astype(mx.float32) for k in ("scales", "biases"))
            bits = x.shape[-1] * 32 // (scales.shape[-1] * 32)
            x = mx.dequantize(x, scales, biases, group_size=32, bits=bits)
        out[name] = x.astype(dtype)
    return out


__all__ = ["SUPPORTED", "dequantized", "hf_name", "llama3_rope_freqs", "map_weights", "model_config", "quantization"]

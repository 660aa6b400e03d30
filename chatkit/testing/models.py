"""Tiny random-weight models of real mlx-lm architectures, written to folders ``mlx_lm.load`` reads.

Weights are float32 and drawn from NumPy generators seeded by ``(seed, parameter name)``, so a
given ``(arch, tokenizer, seed, **config_overrides)`` gives the same bytes in every process.
Keyword overrides of the integer config entries (``hidden_size=512, num_hidden_layers=8`` ...)
give bigger (or smaller) models of the same architecture, e.g. for benchmarks. The init is scaled so
greedy decoding wanders through the vocabulary instead of repeating one token, and the final
norm is scaled so next-token distributions are peaked (top token ~25% on average) like a real
model's.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import importlib
import json
import numbers
import os
import shutil
import tempfile
import threading
import zlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import InvalidParamsError
from .tokenizers import FAMILIES, TOKENIZERS, TokenizerFiles, tokenizer_files

if TYPE_CHECKING:
    from ..model.loaded import LoadedModel

ARCHS: tuple[str, ...] = ("llama", "qwen3", "gemma3_text", "qwen3_5")

_COMMON: dict[str, Any] = {
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,  # a multiple of 32 and 64: KV-cache quantization with group size 32 or 64
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "torch_dtype": "float32",
}

_ARCH_CONFIGS: dict[str, dict[str, Any]] = {
    "llama": {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "num_hidden_layers": 2,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
    },
    "qwen3": {
        "model_type": "qwen3",
        "architectures": ["Qwen3ForCausalLM"],
        "num_hidden_layers": 2,
        "rope_theta": 1000000.0,
        "hidden_act": "silu",
    },
    # Layers 0 and 1 slide over 32 tokens (RotatingKVCache), layer 2 attends globally (KVCache).
    "gemma3_text": {
        "model_type": "gemma3_text",
        "architectures": ["Gemma3ForCausalLM"],
        "num_hidden_layers": 3,
        "num_key_value_heads": 1,
        "sliding_window": 32,
        "sliding_window_pattern": 3,
        "query_pre_attn_scalar": 64,
        "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0,
        "hidden_activation": "gelu_pytorch_tanh",
    },
    # Hybrid: gated-delta (linear attention, ArraysCache) and full attention (KVCache) layers
    # alternate.
    "qwen3_5": {
        "model_type": "qwen3_5",
        "architectures": ["Qwen3_5ForCausalLM"],
        "num_hidden_layers": 4,
        "full_attention_interval": 2,
        "linear_num_key_heads": 2,
        "linear_key_head_dim": 32,
        "linear_num_value_heads": 4,
        "linear_value_head_dim": 32,
        "linear_conv_kernel_dim": 4,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
        "hidden_act": "silu",
    },
}

_EMBED_STD = 0.02  # tied embeddings: input embeddings stay small next to the layers' outputs
_GAIN = 3.0  # other matrices: N(0, (_GAIN / sqrt(fan_in))^2), so the layers dominate the residual
_FINAL_NORM_SCALE = 16.0  # final norm weight: logits get a standard deviation of about 3.6
_BASE_HIDDEN = 128  # the hidden size _FINAL_NORM_SCALE is tuned for (scaled by sqrt(128 / hidden))


def _check(arch: str, tokenizer: str, seed: int) -> None:
    if arch not in ARCHS:
        raise InvalidParamsError(f"Unknown test arch {arch!r}; choose one of {', '.join(ARCHS)}.")
    if tokenizer not in TOKENIZERS + FAMILIES:
        raise InvalidParamsError(
            f"Unknown test tokenizer {tokenizer!r}; choose one of {', '.join(TOKENIZERS + FAMILIES)}."
        )
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or seed < 0:
        raise InvalidParamsError(f"seed must be a non-negative int, got {seed!r}.")


# Set from the tokenizer: not overridable.
_TOKENIZER_KEYS = frozenset({"vocab_size", "bos_token_id", "eos_token_id", "pad_token_id"})


def overridable_keys(arch: str) -> tuple[str, ...]:
    """The config entries of ``arch`` that ``tiny_model(..., **config_overrides)`` may set: its ints."""
    if arch not in ARCHS:
        raise InvalidParamsError(f"Unknown test arch {arch!r}; choose one of {', '.join(ARCHS)}.")
    config = {**_COMMON, **_ARCH_CONFIGS[arch]}
    return tuple(
        sorted(
            k
            for k, v in config.items()
            if isinstance(v, int) and not isinstance(v, bool) and k not in _TOKENIZER_KEYS
        )
    )


def _check_overrides(arch: str, overrides: dict[str, Any]) -> tuple[tuple[str, int], ...]:
    """Validated ``config_overrides`` as a sorted tuple (a memo key)."""
    known = overridable_keys(arch)
    for key, value in overrides.items():
        if key not in known:
            raise InvalidParamsError(
                f"Unknown config override {key!r} for {arch!r}; overridable: {', '.join(known)}."
            )
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
            raise InvalidParamsError(f"Config override {key}={value!r} must be a positive int.")
    base = {**_COMMON, **_ARCH_CONFIGS[arch]}
    # Values equal to the defaults are dropped: the same model gets the same memo key and folder.
    return tuple(sorted((k, int(v)) for k, v in overrides.items() if int(v) != base[k]))


def model_config(arch: str, tok: TokenizerFiles, overrides: Any = ()) -> dict[str, Any]:
    """The ``config.json`` of a tiny ``arch`` model over the tokenizer ``tok``, with ``overrides``
    (a mapping or pairs of integer config entries, see :func:`overridable_keys`) applied."""
    eos = list(tok.eos_token_ids)
    config = {**_COMMON, **json.loads(json.dumps(_ARCH_CONFIGS[arch]))}
    config.update(_check_overrides(arch, dict(overrides)))
    config.update(
        vocab_size=tok.vocab_size,
        bos_token_id=tok.bos_token_id,
        eos_token_id=eos[0] if len(eos) == 1 else eos,
        pad_token_id=tok.pad_token_id,
    )
    return config


def _init_weights(model, arch: str, seed: int) -> None:
    """Replace every parameter with seeded NumPy draws (float32), independently per name."""
    import mlx.core as mx
    import numpy as np
    from mlx.utils import tree_flatten, tree_unflatten

    # Gemma's RMSNorm scales by 1 + weight. Its post-attention/feed-forward norms also need a
    # scale above 1, or greedy decoding repeats a token or two.
    norm_offset, norm_scale = (1.0, 3.0) if arch == "gemma3_text" else (0.0, 1.0)
    new = []
    params: list[tuple[str, mx.array]] = tree_flatten(model.parameters())  # type: ignore[assignment]
    for name, p in params:
        rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
        shape = tuple(p.shape)
        if name.endswith("A_log"):  # gated delta decay rates, as mlx-lm initialises them
            value = np.log(rng.uniform(1.0, 16.0, shape))
        elif name.endswith("dt_bias"):
            value = np.ones(shape)
        elif name.endswith("model.norm.weight"):
            # Logits' spread grows as sqrt(hidden_size) (tied embeddings): keep it as at 128.
            scale = _FINAL_NORM_SCALE * np.sqrt(_BASE_HIDDEN / shape[-1])
            value = np.full(shape, scale - norm_offset)
        elif "norm" in name:
            value = np.full(shape, norm_scale - norm_offset)
        elif len(shape) == 1:  # biases
            value = np.zeros(shape)
        elif "embed_tokens" in name or "lm_head" in name:
            value = rng.standard_normal(shape) * _EMBED_STD
        else:  # Linear (out, in) and depthwise Conv1d (out, kernel, in) weights
            fan_in = int(np.prod(shape[1:]))
            value = rng.standard_normal(shape) * (_GAIN / np.sqrt(fan_in))
        new.append((name, mx.array(value.astype(np.float32))))
    model.update(tree_unflatten(new))
    mx.eval(model.parameters())


def _build(
    folder: Path, arch: str, tokenizer: str, seed: int, overrides: tuple[tuple[str, int], ...], chat_template: str | None
) -> None:
    from mlx_lm.utils import save_config, save_model

    tok = tokenizer_files(tokenizer, chat_template)
    config = model_config(arch, tok, overrides)
    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")  # no test arch is remapped
    model = module.Model(module.ModelArgs.from_dict(config))  # its random init is replaced below
    if arch == "gemma3_text":
        model.pop("lm_head")  # mlx-lm ties gemma3_text's embeddings when lm_head is absent
    _init_weights(model, arch, seed)
    partial = folder.with_name(folder.name + ".partial")  # complete folders only, even on errors
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    save_model(partial, model)
    save_config(dict(config), partial / "config.json")
    generation = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    (partial / "generation_config.json").write_text(json.dumps(generation, indent=2))
    tok.write(partial)
    partial.rename(folder)


@contextlib.contextmanager
def _keep_mlx_random_state():
    """Leave mlx's global random state as it was: building or loading a model draws from it
    (module constructors), and seeded tests must not depend on whether a model was cached."""
    import mlx.core as mx

    hi, lo = (int(x) for x in mx.random.state[0].tolist())
    try:
        yield
    finally:
        mx.random.seed((hi << 32) | lo)


_lock = threading.RLock()
_root: Path | None = None


def _root_dir() -> Path:
    """This process's folder of built models, removed when the process exits."""
    global _root
    if _root is None:
        _root = Path(tempfile.mkdtemp(prefix="chatkit-testing-"))
        owner = os.getpid()

        def cleanup(path: Path = _root) -> None:
            if os.getpid() == owner:  # not from a forked child
                shutil.rmtree(path, ignore_errors=True)

        atexit.register(cleanup)
    return _root


@functools.cache
def _model_path(
    arch: str, tokenizer: str, seed: int, overrides: tuple[tuple[str, int], ...] = (), chat_template: str | None = None
) -> Path:
    with _lock:
        name = f"{arch}-{tokenizer}-seed{seed}" + "".join(f"-{k}{v}" for k, v in overrides)
        if chat_template is not None:
            name += f"-template{zlib.crc32(chat_template.encode()):08x}"
        folder = _root_dir() / name
        with _keep_mlx_random_state():
            _build(folder, arch, tokenizer, seed, overrides, chat_template)
        return folder


@functools.cache
def _model(
    arch: str, tokenizer: str, seed: int, overrides: tuple[tuple[str, int], ...] = (), chat_template: str | None = None
) -> LoadedModel:
    from ..model.load import load

    path = _model_path(arch, tokenizer, seed, overrides, chat_template)
    with _lock, _keep_mlx_random_state():
        return load(path)


def tiny_model_path(
    arch: str = "qwen3",
    tokenizer: str = "bpe",
    seed: int = 0,
    *,
    chat_template: str | os.PathLike[str] | None = None,
    **config_overrides: int,
) -> Path:
    """The folder of a tiny random ``arch`` model with the test tokenizer ``tokenizer`` (one of
    TOKENIZERS, or of FAMILIES with ``chat_template``: a family's real template, text or a path).

    ``config_overrides`` set integer entries of the model's config (see :func:`overridable_keys`),
    e.g. ``hidden_size=512, num_hidden_layers=8, intermediate_size=1536`` for a ~30M model.
    Built once per process (per arguments) into a temporary directory (removed at exit);
    ``mlx_lm.load`` and ``chatkit.model.load.load`` read it. The same arguments give identical files
    in any process.
    """
    _check(arch, tokenizer, seed)
    overrides = _check_overrides(arch, config_overrides)
    with _lock:
        return _model_path(arch, tokenizer, int(seed), overrides, _template_text(chat_template))


def tiny_model(
    arch: str = "qwen3",
    tokenizer: str = "bpe",
    seed: int = 0,
    *,
    chat_template: str | os.PathLike[str] | None = None,
    **config_overrides: int,
) -> LoadedModel:
    """The :class:`chatkit.model.loaded.LoadedModel` of :func:`tiny_model_path`, loaded once per process.

    The instance is shared between callers: sessions may share it, but don't modify its weights.
    """
    _check(arch, tokenizer, seed)
    overrides = _check_overrides(arch, config_overrides)
    with _lock:
        return _model(arch, tokenizer, int(seed), overrides, _template_text(chat_template))


def _template_text(source: str | os.PathLike[str] | None) -> str | None:
    if source is None:
        return None
    from ..text.template import read_template

    return read_template(source)


__all__ = ["ARCHS", "model_config", "overridable_keys", "tiny_model", "tiny_model_path"]

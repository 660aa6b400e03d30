"""Shared bits of the benchmarks: the model they run on and a description of the machine."""

from __future__ import annotations

import ctypes
import os
import platform
import statistics
from importlib import metadata

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import chatkit  # noqa: E402  (first: it loads OpenBLAS before MLX)
import chatkit._blas  # noqa: E402
import mlx.core as mx  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402

# A Qwen3-shaped model of ~29M float32 parameters (4.2M of them the tied 8,201-token embedding).
MODEL_CONFIG = dict(
    hidden_size=512,
    num_hidden_layers=8,
    intermediate_size=1536,
    num_attention_heads=8,
    num_key_value_heads=4,
)


def load_model(tokenizer: str = "bpe", seed: int = 0):
    from chatkit.testing import tiny_model

    return tiny_model("qwen3", tokenizer, seed, **MODEL_CONFIG)


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def blas() -> str:
    path = chatkit._blas.BLAS
    if path is None:
        return "MLX's bundled BLAS (chatkit did not load OpenBLAS)"
    try:
        get_config = ctypes.CDLL(path).openblas_get_config
        get_config.restype = ctypes.c_char_p
        return f"{get_config().decode()} ({path}, loaded by chatkit._blas)"
    except (OSError, AttributeError):
        return f"{path} (loaded by chatkit._blas)"


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "-"


def describe(lm) -> str:
    """A few lines on the machine, the libraries and the model."""
    params = sum(v.size for _, v in tree_flatten(lm.model.parameters()))
    cfg = lm.config
    shape = ", ".join(
        f"{k}={cfg[k]}"
        for k in ("hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "vocab_size")
    )
    return "\n".join([
        f"machine : {cpu_model()}, {os.cpu_count()} cores, {platform.system()} {platform.machine()}, "
        f"Python {platform.python_version()}",
        f"mlx     : mlx {mx.__version__} (mlx-cpu {_version('mlx-cpu')}), mlx-lm {_version('mlx-lm')}, "
        f"chatkit {_version('chatkit')}",
        f"BLAS    : {blas()}",
        f"model   : {cfg['model_type']} {params / 1e6:.1f}M params float32 ({shape}), "
        "random weights from chatkit.testing.tiny_model",
    ])


def median(xs) -> float:
    return statistics.median(xs)

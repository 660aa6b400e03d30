"""Reading a GGUF file: tensors and metadata through ``mx.load``, tensor types from the header."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any, BinaryIO

import mlx.core as mx

from ...errors import ModelLoadError

MAGIC = b"GGUF"

# ggml tensor type ids (ggml.h) and the block quantizations MLX turns into its own affine quantized
# weights (group 32). Besides float types, MLX converts a few others to float16 while loading, and
# refuses the rest (checked: Q5_0 is refused).
GGML_TYPES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 9: "Q8_1",
    10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K", 16: "IQ2_XXS",
    17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S", 22: "IQ2_S", 23: "IQ4_XS",
    24: "I8", 25: "I16", 26: "I32", 27: "I64", 28: "F64", 29: "IQ1_M", 30: "BF16", 34: "TQ1_0",
    35: "TQ2_0", 39: "MXFP4",
}
KEPT_QUANTIZED = {"Q4_0", "Q4_1", "Q8_0"}

# GGUF metadata value types: struct formats of the fixed-size ones; 8 is a string, 9 an array.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


def is_gguf(path: str | Path) -> bool:
    """Whether ``path`` is a file that starts with the GGUF magic bytes."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == MAGIC
    except OSError:
        return False


def _read(f: BinaryIO, fmt: str) -> Any:
    size = struct.calcsize("<" + fmt)
    return struct.unpack("<" + fmt, f.read(size))[0]


def _string(f: BinaryIO) -> str:
    return f.read(_read(f, "Q")).decode("utf-8", errors="replace")


def _skip_value(f: BinaryIO, kind: int) -> None:
    if kind in _SCALARS:
        f.seek(struct.calcsize("<" + _SCALARS[kind]), 1)
    elif kind == 8:
        f.seek(_read(f, "Q"), 1)
    elif kind == 9:
        item, count = _read(f, "I"), _read(f, "Q")
        if item in _SCALARS:
            f.seek(count * struct.calcsize("<" + _SCALARS[item]), 1)
        else:
            for _ in range(count):
                _skip_value(f, item)
    else:
        raise ValueError(f"unknown metadata value type {kind}")


def tensor_types(path: str | Path) -> dict[str, str]:
    """Each tensor's ggml type name, read from the file's header (no tensor data is read).

    ``mx.load`` does not report the types it converted, and fails on those it cannot read without
    naming them; this small reader (the header layout of the GGUF spec) says which they are.
    """
    return {name: kind for name, (kind, _) in tensor_info(path).items()}


def tensor_info(path: str | Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Each tensor's ggml type name and element counts per dimension, from the file's header."""
    with open(path, "rb") as f:
        if f.read(4) != MAGIC:
            raise ModelLoadError(f"{path} is not a GGUF file (no GGUF magic bytes).")
        _version, n_tensors, n_kv = _read(f, "I"), _read(f, "Q"), _read(f, "Q")
        for _ in range(n_kv):
            _string(f)
            _skip_value(f, _read(f, "I"))
        types = {}
        for _ in range(n_tensors):
            name = _string(f)
            dims = tuple(_read(f, "Q") for _ in range(_read(f, "I")))
            kind = _read(f, "I")
            f.seek(8, 1)
            types[name] = (GGML_TYPES.get(kind, f"type {kind}"), dims)
    return types


def value(meta: dict[str, Any], key: str, default: Any = None) -> Any:
    """A metadata value as plain Python (``mx.load`` gives numbers and number arrays as arrays)."""
    v = meta.get(key, default)
    return v.tolist() if isinstance(v, mx.array) else v


def read(path: str | Path) -> tuple[dict[str, mx.array], dict[str, Any]]:
    """``(tensors, metadata)`` of a GGUF file, as ``mx.load(path, return_metadata=True)`` gives them.

    Raises ``ModelLoadError`` naming the tensor types MLX cannot read.
    """
    try:
        return mx.load(str(path), format="gguf", return_metadata=True)  # type: ignore[return-value]  # Ollama blobs have no extension
    except Exception as exc:  # MLX raises RuntimeError / ValueError without naming the tensor
        try:
            types = tensor_types(path)
        except Exception:
            raise ModelLoadError(f"Could not read GGUF file {path}: {exc} (is it complete?).") from exc
        odd = sorted({t for t in types.values() if t not in KEPT_QUANTIZED | {"F32", "F16", "BF16"}})
        raise ModelLoadError(
            f"MLX could not read GGUF file {path}: {exc}. Its tensor types besides F32/F16/BF16/Q4_0/"
            f"Q4_1/Q8_0: {', '.join(odd) or 'none'}. MLX's GGUF reader handles those six (and converts a "
            "few others to float16); use a Q4_0, Q4_1, Q8_0 or F16 file of the model (llama.cpp's "
            "llama-quantize makes one), or convert the original model with mlx_lm.convert."
        ) from exc


__all__ = ["GGML_TYPES", "KEPT_QUANTIZED", "MAGIC", "is_gguf", "read", "tensor_info", "tensor_types", "value"]

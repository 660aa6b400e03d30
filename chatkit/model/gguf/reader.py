"""Reading a GGUF file: tensors and metadata through ``mx.load``, tensor types from the header."""

from __future__ import annotations

import os
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
        if not os.path.isfile(path):  # a FIFO or device: opening it would block
            return False
        with open(path, "rb") as f:
            return f.read(4) == MAGIC
    except OSError:
        return False


class _Damaged(Exception):
    """The header ends early or holds what no GGUF writer writes (turned into ``ModelLoadError``)."""


class _Header:
    """The GGUF header of an open file, read field by field; a field past the end of the file (or a
    length longer than the file) raises ``_Damaged`` instead of ``struct.error``."""

    def __init__(self, f: BinaryIO, size: int) -> None:
        self._f, self._size = f, size

    def read(self, fmt: str) -> Any:
        size = struct.calcsize("<" + fmt)
        data = self._f.read(size)
        if len(data) != size:
            raise _Damaged(f"the header ends at byte {self._f.tell()}, inside a field")
        return struct.unpack("<" + fmt, data)[0]

    def skip(self, n: int) -> None:
        if n > self._size - self._f.tell():
            raise _Damaged(f"a field at byte {self._f.tell()} is {n} bytes long, past the end of the file")
        self._f.seek(n, 1)

    def string(self) -> str:
        n = self.read("Q")
        if n > self._size - self._f.tell():
            raise _Damaged(f"a string at byte {self._f.tell()} is {n} bytes long, past the end of the file")
        return self._f.read(n).decode("utf-8", errors="replace")

    def skip_value(self, kind: int, depth: int = 0) -> None:
        if kind in _SCALARS:
            self.skip(struct.calcsize("<" + _SCALARS[kind]))
        elif kind == 8:
            self.skip(self.read("Q"))
        elif kind == 9 and depth < _MAX_ARRAY_DEPTH:
            item, count = self.read("I"), self.read("Q")
            if item in _SCALARS:
                self.skip(count * struct.calcsize("<" + _SCALARS[item]))
            else:
                for _ in range(count):
                    self.skip_value(item, depth + 1)
        else:
            raise _Damaged(f"unknown metadata value type {kind}" if kind != 9 else "arrays nested too deeply")


_MAX_ARRAY_DEPTH = 64  # arrays of arrays: no writer nests deeper; a damaged file could recurse forever


def tensor_types(path: str | Path) -> dict[str, str]:
    """Each tensor's ggml type name, read from the file's header (no tensor data is read).

    ``mx.load`` does not report the types it converted, and fails on those it cannot read without
    naming them; this small reader (the header layout of the GGUF spec) says which they are.
    """
    return {name: kind for name, (kind, _) in tensor_info(path).items()}


def tensor_info(path: str | Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Each tensor's ggml type name and element counts per dimension, from the file's header.
    ``ModelLoadError`` naming the file when it is not a GGUF file, or is truncated or damaged."""
    try:
        with open(path, "rb") as f:
            if f.read(4) != MAGIC:
                raise ModelLoadError(f"{path} is not a GGUF file (no GGUF magic bytes).")
            return _tensor_info(_Header(f, os.fstat(f.fileno()).st_size))
    except _Damaged as exc:
        raise ModelLoadError(
            f"GGUF file {path} is truncated or damaged ({exc}): download or copy it again (compare its "
            "size and checksum with the original's)."
        ) from None
    except OSError as exc:
        raise ModelLoadError(f"Cannot read GGUF file {path}: {exc}.") from exc


def _tensor_info(h: _Header) -> dict[str, tuple[str, tuple[int, ...]]]:
    _version, n_tensors, n_kv = h.read("I"), h.read("Q"), h.read("Q")
    for _ in range(n_kv):
        h.string()
        h.skip_value(h.read("I"))
    types = {}
    for _ in range(n_tensors):
        name = h.string()
        n_dims = h.read("I")
        if n_dims > _MAX_DIMS:
            raise _Damaged(f"tensor {name!r} has {n_dims} dimensions")
        dims = tuple(h.read("Q") for _ in range(n_dims))
        kind = h.read("I")
        h.skip(8)  # the data offset
        types[name] = (GGML_TYPES.get(kind, f"type {kind}"), dims)
    return types


_MAX_DIMS = 8  # ggml's GGML_MAX_DIMS is 4; a larger count is damage


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
        if "past the end of the file" in str(exc):  # MLX's words for tensor data the file does not hold
            raise ModelLoadError(
                f"GGUF file {path} is truncated ({exc}): download or copy it again (compare its size and "
                "checksum with the original's)."
            ) from exc
        odd = sorted({t for t in types.values() if t not in KEPT_QUANTIZED | {"F32", "F16", "BF16"}})
        raise ModelLoadError(
            f"MLX could not read GGUF file {path}: {exc}. Its tensor types besides F32/F16/BF16/Q4_0/"
            f"Q4_1/Q8_0: {', '.join(odd) or 'none'}. MLX's GGUF reader handles those six (and converts a "
            "few others to float16); use a Q4_0, Q4_1, Q8_0 or F16 file of the model (llama.cpp's "
            "llama-quantize makes one), or convert the original model with mlx_lm.convert."
        ) from exc


__all__ = ["GGML_TYPES", "KEPT_QUANTIZED", "MAGIC", "is_gguf", "read", "tensor_info", "tensor_types", "value"]

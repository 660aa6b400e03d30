"""The safetensors header of a cache file, read and checked before MLX's native loader sees the file:
well-formed JSON, tensors that tile the data exactly, no giant list indices, known cache classes."""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeGuard

from ..errors import CacheFileError
from .atomic import path_text

# Cache classes a file may name; load_prompt_cache looks names up in mlx-lm's cache module.
_ALLOWED_CLASSES = {
    "KVCache",
    "RotatingKVCache",
    "QuantizedKVCache",
    "ArraysCache",
    "ChunkedKVCache",
    "ConcatenateKVCache",
    "MambaCache",
}
_MAX_HEADER = 256 * 2**20
# Bytes per element of the safetensors dtypes MLX reads and writes.
_DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "U16": 2, "I16": 2, "F16": 2, "BF16": 2,
    "U32": 4, "I32": 4, "F32": 4, "U64": 8, "I64": 8, "F64": 8, "C64": 8,
}

def read_target(path: Any) -> Path:
    text = path_text(path)
    target = Path(os.path.expanduser(text))
    where = repr(text)
    try:
        if target.is_dir():
            raise CacheFileError(f"{where} is a folder, not a cache file.")
        if not target.exists():
            raise CacheFileError(f"No cache file at {where}: check the path.")
        if not target.is_file():
            raise CacheFileError(f"{where} is not a regular file (a device, pipe or socket): not a cache file.")
    except OSError as exc:
        raise CacheFileError(f"Could not read {where}: {exc.strerror or exc}. Check the path.") from exc
    return target


def read_header(path: Path) -> tuple[dict[str, str], int, int]:
    """(metadata, tensor bytes, file bytes) of a safetensors file, its structure checked so that
    MLX's native loader only ever sees a well-formed header (no out-of-range offsets, no giant lists)."""
    where = repr(str(path))
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CacheFileError(f"{where} is empty or truncated: not a cache file.")
            (n,) = struct.unpack("<Q", head)
            if n > min(size - 8, _MAX_HEADER):
                raise CacheFileError(f"{where} is not a safetensors file (or is truncated).")
            header = json.loads(f.read(n).decode("utf-8"))
    except FileNotFoundError as exc:
        raise CacheFileError(f"No cache file at {where}: check the path.") from exc
    except OSError as exc:
        raise CacheFileError(f"Could not read {where}: {exc.strerror or exc}.") from exc
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CacheFileError(f"{where} is not a safetensors file: its header is not JSON.") from exc
    if not isinstance(header, dict):
        raise CacheFileError(f"{where} is not a safetensors file.")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CacheFileError(f"{where} is not a valid safetensors file: its metadata is not a map of strings.")
    regions = []
    for name, entry in header.items():
        try:
            dtype, shape, (start, stop) = entry["dtype"], entry["shape"], entry["data_offsets"]
            if not (dtype in _DTYPE_BYTES and isinstance(shape, list) and all(is_int(d) and d >= 0 for d in shape)
                    and is_int(start) and is_int(stop) and 0 <= start <= stop):
                raise ValueError
            if math.prod(shape) * _DTYPE_BYTES[dtype] != stop - start:
                raise ValueError
        except (TypeError, KeyError, ValueError) as exc:
            raise CacheFileError(f"{where} is not a valid safetensors file (tensor {short(name)}).") from exc
        regions.append((start, stop))
    end = 0
    for start, stop in sorted(regions):
        if start != end:
            raise CacheFileError(f"{where} is not a valid safetensors file: its tensors overlap or leave gaps.")
        end = stop
    if 8 + n + end > size:
        raise CacheFileError(f"{where} is truncated: its tensors need {8 + n + end} bytes, the file has {size}.")
    if 8 + n + end < size:
        raise CacheFileError(f"{where} is damaged: {size - 8 - n - end} unexpected bytes follow its tensors.")
    _check_names([*header, *metadata], where)
    return metadata, end, size


def _check_names(names: Sequence[str], where: str) -> None:
    """mlx-lm rebuilds lists from dotted names ("3.0"): an index larger than the number of entries
    would make it allocate a huge list, so refuse it."""
    limit = len(names)
    for name in names:
        for part in name.split("."):
            if part.isdigit() and (not part.isascii() or len(part) > 9 or int(part) > limit):
                raise CacheFileError(f"{where} is not a valid cache file (entry {short(name)}).")


def cache_classes(metadata: Mapping[str, str], where: str) -> tuple[str, ...]:
    classes = []
    i = 0
    while f"1.{i}" in metadata:
        classes.append(metadata[f"1.{i}"])
        i += 1
    if not classes:
        raise CacheFileError(
            f"{where} is a safetensors file but not a prompt cache (no cache layers in its metadata)."
        )
    unknown = sorted(set(classes) - _ALLOWED_CLASSES)
    if unknown:
        raise CacheFileError(f"{where} names cache classes chatkit does not know: {[short(c) for c in unknown]}.")
    return tuple(classes)


def is_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def is_text(value: Any) -> bool:
    """A str that is valid Unicode (JSON can carry lone surrogates, which no tokenizer takes)."""
    if not isinstance(value, str):
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


__all__ = ["cache_classes", "is_int", "is_text", "read_header", "read_target", "short"]

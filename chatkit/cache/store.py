"""The cache file: one ``.safetensors`` file in mlx-lm's prompt-cache layout plus chatkit's metadata.

``save`` writes atomically (temporary file in the same folder, fsync, rename); ``inspect`` reads the
header only; ``load`` checks everything it can before building cache objects. safetensors holds only
tensors and strings: loading a file never runs code.
"""

from __future__ import annotations

import json
import os
import struct
import tempfile
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Mapping, Sequence

import mlx.core as mx
from mlx_lm.models import cache as mlx_cache

from ..errors import CacheFileError, IncompatibleCacheError
from .ledger import Ledger
from .state import Checkpoint

FORMAT_VERSION = 1
_KEY = "chatkit"  # the metadata entry holding chatkit's JSON
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


@dataclass(frozen=True)
class CacheFileInfo:
    """What a cache file holds, read from its header without loading tensors.

    ``kind`` is ``"chatkit"`` (a session saved by chatkit) or ``"mlx-lm"`` (a raw prompt cache).
    ``tokens`` counts cached positions, ``opaque_tokens`` of them with unknown ids. ``messages`` and
    ``instructions`` are the saved transcript (chatkit files only).
    """

    path: str
    kind: str
    format_version: int | None
    tokens: int
    opaque_tokens: int
    layer_classes: tuple[str, ...]
    file_bytes: int
    tensor_bytes: int
    fingerprint: Mapping[str, str] | None = None
    instructions: str | None = None
    messages: tuple[Mapping[str, str], ...] = ()
    generate_params: Mapping[str, Any] | None = None
    cache_options: Mapping[str, Any] | None = None
    saved_at: str | None = None

    @property
    def turns(self) -> int:
        """Assistant replies in the saved transcript."""
        return sum(1 for m in self.messages if m.get("role") == "assistant")


@dataclass(frozen=True)
class LoadedCache:
    """A cache file turned back into mlx-lm cache layers, its ledger and its header."""

    layers: list[Any]
    ledger: Ledger
    info: CacheFileInfo
    checkpoints: tuple[Checkpoint, ...] = ()


def save(
    path: str | os.PathLike[str],
    layers: Sequence[Any],
    ledger: Ledger,
    *,
    fingerprint: Mapping[str, str],
    instructions: str | None,
    messages: Sequence[Mapping[str, str]],
    generate_params: Mapping[str, Any],
    cache_options: Mapping[str, Any],
    checkpoints: Sequence[Checkpoint] = (),
) -> int:
    """Write a session's cache and transcript to ``path`` atomically; returns the file's size.

    The file's cache list is the model's layers, then the copies held by ``checkpoints`` (layers
    that cannot rewind, e.g. hybrid models' ``ArraysCache``), so that a restored session can rewind
    as the live one could.
    """
    target = Path(path)
    if target.is_dir():
        raise CacheFileError(f"{str(target)!r} is a folder: give a file path such as chat.safetensors.")
    meta = {
        "format_version": FORMAT_VERSION,
        "fingerprint": dict(fingerprint),
        "ledger": {"tokens": list(ledger.tokens), "opaque": ledger.opaque},
        "instructions": instructions,
        "messages": list(messages),
        "generate_params": dict(generate_params),
        "cache_options": dict(cache_options),
        "layer_classes": [type(c).__name__ for c in layers],
        "checkpoints": [
            {"length": cp.length, "layers": [i for i, c in enumerate(cp.copies) if c is not None]}
            for cp in checkpoints
        ],
        "saved_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    extra = [c for cp in checkpoints for c in cp.copies if c is not None]
    cut = [_cut_to_offset(c) for c in [*layers, *extra]]
    folder = target.parent if str(target.parent) else Path(".")
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp.safetensors", dir=folder)
    os.close(fd)
    try:
        mlx_cache.save_prompt_cache(tmp, cut, {_KEY: json.dumps(meta, ensure_ascii=False)})
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, target)
        _fsync_folder(folder)
    except BaseException as exc:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(exc, (OSError, RuntimeError, ValueError)):
            raise CacheFileError(f"Could not write {str(target)!r}: {exc}. Any earlier file there is intact.") from exc
        raise
    return target.stat().st_size


def inspect(path: str | os.PathLike[str]) -> CacheFileInfo:
    """The header of a cache file; ``CacheFileError`` if it is not a readable cache file."""
    target = Path(path)
    metadata, tensor_bytes, file_bytes = _read_header(target)
    classes = _classes(metadata, target)
    raw = metadata.get(f"0.{_KEY}")
    if raw is None:
        return CacheFileInfo(
            path=str(target),
            kind="mlx-lm",
            format_version=None,
            tokens=-1,  # unknown until the tensors are loaded
            opaque_tokens=-1,
            layer_classes=classes,
            file_bytes=file_bytes,
            tensor_bytes=tensor_bytes,
        )
    try:
        meta = json.loads(raw)
        version = meta["format_version"]
        ledger = meta["ledger"]
        tokens, opaque = [int(t) for t in ledger["tokens"]], int(ledger["opaque"])
    except (ValueError, KeyError, TypeError) as exc:
        raise CacheFileError(f"{str(target)!r} has damaged chatkit metadata ({exc}).") from exc
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise CacheFileError(
            f"{str(target)!r} was written by a newer chatkit (format {version}, this one reads up to "
            f"{FORMAT_VERSION}): upgrade chatkit to read it."
        )
    return CacheFileInfo(
        path=str(target),
        kind="chatkit",
        format_version=version,
        tokens=opaque + len(tokens),
        opaque_tokens=opaque,
        layer_classes=classes[: len(meta.get("layer_classes") or classes)],
        file_bytes=file_bytes,
        tensor_bytes=tensor_bytes,
        fingerprint=meta.get("fingerprint"),
        instructions=meta.get("instructions"),
        messages=tuple(meta.get("messages") or ()),
        generate_params=meta.get("generate_params"),
        cache_options=meta.get("cache_options"),
        saved_at=meta.get("saved_at"),
    )


def load(path: str | os.PathLike[str]) -> LoadedCache:
    """The layers, ledger and header of a cache file (chatkit's or a raw mlx-lm one)."""
    info = inspect(path)
    try:
        layers = mlx_cache.load_prompt_cache(str(path))
        mx.eval([c.state for c in layers])
    except Exception as exc:  # MLX raises RuntimeError/ValueError on damaged data
        raise CacheFileError(f"Could not read the cache in {str(path)!r}: {exc}") from exc
    checkpoints: tuple[Checkpoint, ...] = ()
    if info.kind == "chatkit":
        meta = json.loads(_read_header(Path(path))[0][f"0.{_KEY}"])
        ledger = Ledger(tuple(int(t) for t in meta["ledger"]["tokens"]), int(meta["ledger"]["opaque"]))
        n = len(meta.get("layer_classes") or layers)
        layers, extra = layers[:n], layers[n:]
        try:
            checkpoints = _checkpoints(meta.get("checkpoints") or [], extra, n)
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            raise CacheFileError(f"{str(path)!r} has damaged checkpoint metadata ({exc}).") from exc
        offsets = {c.offset for c in layers if isinstance(getattr(c, "offset", None), int)}
        if offsets and offsets != {len(ledger)}:
            raise CacheFileError(
                f"{str(path)!r} is inconsistent: its layers hold {sorted(offsets)} tokens but its ledger {len(ledger)}."
            )
    else:
        offsets = {c.offset for c in layers if isinstance(getattr(c, "offset", None), int)}
        if len(offsets) != 1:
            raise CacheFileError(f"{str(path)!r}: its layers disagree on how many tokens they hold ({sorted(offsets)}).")
        ledger = Ledger((), offsets.pop())
        info = CacheFileInfo(**{**info.__dict__, "tokens": len(ledger), "opaque_tokens": len(ledger)})
    return LoadedCache(layers, ledger, info, checkpoints)


def _checkpoints(entries: Sequence[Mapping[str, Any]], extra: list[Any], n: int) -> tuple[Checkpoint, ...]:
    result, used = [], 0
    for entry in entries:
        copies: list[Any] = [None] * n
        for i in entry["layers"]:
            copies[int(i)] = extra[used]
            used += 1
        result.append(Checkpoint(int(entry["length"]), tuple(copies)))
    if used != len(extra):
        raise ValueError(f"{len(extra) - used} cache entries belong to no checkpoint")
    return tuple(result)


def check_fingerprint(expected: Mapping[str, str], found: Mapping[str, str] | None, where: str) -> None:
    """``IncompatibleCacheError`` naming every part of the fingerprint that differs."""
    if not found:
        raise IncompatibleCacheError(f"{where} has no model fingerprint: it cannot be checked against this model.")
    differ = sorted(k for k in set(expected) | set(found) if expected.get(k) != found.get(k))
    if differ:
        raise IncompatibleCacheError(
            f"{where} was saved from another model: its {', '.join(differ)} differ. "
            "Restore it into the model it came from, or start a new session."
        )


def _cut_to_offset(layer: Any) -> Any:
    """A copy of ``layer`` whose buffers end at the last cached token (mlx-lm grows them in steps)."""
    if isinstance(layer, (mlx_cache.KVCache, mlx_cache.QuantizedKVCache)) and layer.keys is not None:
        n = layer.offset

        def cut(x):
            return x[..., :n, :]

        if isinstance(layer, mlx_cache.QuantizedKVCache):
            keys, values = tuple(map(cut, layer.keys)), tuple(map(cut, layer.values))
            return type(layer).from_state((keys, values, n, layer.group_size, layer.bits))
        return type(layer).from_state((cut(layer.keys), cut(layer.values), n))
    if isinstance(layer, mlx_cache.RotatingKVCache) and layer.keys is not None and layer.offset < layer.max_size:
        n = layer._idx  # not wrapped yet: the buffer is in order and ends at _idx
        state = (layer.keys[..., :n, :], layer.values[..., :n, :], layer.offset, layer.keep, layer.max_size, n)
        return type(layer).from_state(state)
    return layer


def _read_header(path: Path) -> tuple[dict[str, str], int, int]:
    """(metadata, tensor bytes, file bytes) of a safetensors file, checking its structure."""
    where = repr(str(path))
    if path.is_dir():
        raise CacheFileError(f"{where} is a folder, not a cache file.")
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
    except (UnicodeDecodeError, ValueError) as exc:
        raise CacheFileError(f"{where} is not a safetensors file: its header is not JSON.") from exc
    if not isinstance(header, dict):
        raise CacheFileError(f"{where} is not a safetensors file.")
    metadata = header.pop("__metadata__", None) or {}
    end = 0
    for name, entry in header.items():
        try:
            start, stop = entry["data_offsets"]
        except (TypeError, KeyError, ValueError) as exc:
            raise CacheFileError(f"{where} is not a valid safetensors file (tensor {name!r}).") from exc
        end = max(end, stop)
    if 8 + n + end > size:
        raise CacheFileError(f"{where} is truncated: its tensors need {8 + n + end} bytes, the file has {size}.")
    return metadata, end, size


def _classes(metadata: Mapping[str, str], path: Path) -> tuple[str, ...]:
    classes = []
    i = 0
    while f"1.{i}" in metadata:
        classes.append(metadata[f"1.{i}"])
        i += 1
    if not classes:
        raise CacheFileError(
            f"{str(path)!r} is a safetensors file but not a prompt cache (no cache layers in its metadata)."
        )
    unknown = sorted(set(classes) - _ALLOWED_CLASSES)
    if unknown:
        raise CacheFileError(f"{str(path)!r} names cache classes chatkit does not know: {unknown}.")
    return tuple(classes)


def _fsync_folder(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return  # not supported on this platform
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


__all__ = ["CacheFileInfo", "FORMAT_VERSION", "LoadedCache", "check_fingerprint", "inspect", "load", "save"]

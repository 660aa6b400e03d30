"""The cache file: one ``.safetensors`` file in mlx-lm's prompt-cache layout plus chatkit's metadata.

``save`` writes atomically (temporary file in the same folder, fsync, rename) and stores checksums:
a CRC-32 of every cache tensor and of chatkit's metadata. ``inspect`` reads the header only and
checks its structure and the metadata's schema and checksum; ``load`` also verifies the tensors
(unless ``verify=False``) before building cache objects. Every problem with a file is a
``CacheFileError`` naming it. safetensors holds only tensors and strings: loading a file never runs
code, and chatkit checks the header before MLX's native loader sees it.
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import struct
import tempfile
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, TypeGuard

import mlx.core as mx
from mlx.utils import tree_flatten

from ..errors import CacheFileError, ChatKitError, IncompatibleCacheError
from ..messages import ChatMessage
from ..params import GenerateParams
from ._mlx import cut_to_offset, load_prompt_cache, save_prompt_cache
from .ledger import Ledger
from .state import CacheOptions, Checkpoint, layers_fit

try:  # POSIX: a temporary file is locked while it is written, so a stale one can be told apart
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

# 1: the first format; 2: CRC-32 checksums of the cache tensors and of chatkit's metadata.
FORMAT_VERSION = 2
_KEY = "chatkit"  # the metadata entry holding chatkit's JSON
_SUM_KEY = "chatkit_crc32"  # the CRC-32 of that JSON (an entry of its own: a checksum cannot cover itself)
_TEMP_SUFFIX = ".tmp.safetensors"
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
_ROLES = {"system", "user", "assistant", "tool"}


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


# -- saving -----------------------------------------------------------------------------------------
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
    as the live one could. ``path`` must end in ``.safetensors``; a symlink is written through (the
    file it points to is replaced). Temporary files left by killed saves to the same path are removed.
    """
    target = _save_target(path)
    where = repr(str(target))
    extra = [c for cp in checkpoints for c in cp.copies if c is not None]
    cut = [cut_to_offset(c) for c in [*layers, *extra]]
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
        "checksum": {"algorithm": "crc32", "state": _state_digest(cut)},
    }
    text = json.dumps(meta, ensure_ascii=False)
    folder = target.parent
    prefix = _temp_prefix(target)
    remove_stale_temps(folder, prefix)
    try:
        fd, tmp = tempfile.mkstemp(prefix=prefix, suffix=_TEMP_SUFFIX, dir=folder)
    except OSError as exc:
        raise CacheFileError(_write_problem(where, folder, exc)) from exc
    try:
        if fcntl is not None:
            fcntl.flock(fd, fcntl.LOCK_EX)  # released by the OS if this process dies: then it is stale
        save_prompt_cache(tmp, cut, {_KEY: text, _SUM_KEY: _crc_text(text)})
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
            raise CacheFileError(_write_problem(where, folder, exc)) from exc
        raise
    finally:
        os.close(fd)
    try:
        return target.stat().st_size
    except OSError as exc:  # e.g. the folder was removed right after the rename
        raise CacheFileError(_write_problem(where, folder, exc)) from exc


def remove_stale_temps(folder: str | os.PathLike[str], prefix: str = ".") -> list[str]:
    """Delete the temporary files of saves that were killed before they finished; returns their names.

    A save holds a lock on its temporary file while it writes, so files of saves still running (in
    this or another process) are left alone. Errors are ignored: this only tidies up.
    """
    if fcntl is None:
        return []
    removed = []
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return []
    for entry in entries:
        if not (entry.name.startswith(prefix) and entry.name.endswith(_TEMP_SUFFIX)):
            continue
        try:
            if not entry.is_file(follow_symlinks=False):
                continue
            fd = os.open(entry.path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.unlink(entry.path)
            removed.append(entry.name)
        except OSError:
            pass  # locked: a save is writing it
        finally:
            os.close(fd)
    return removed


def _save_target(path: Any) -> Path:
    """The file a save writes: checked before anything is written, a symlink followed."""
    text = _path_text(path)
    where = repr(text)
    if text.endswith(("/", os.sep)):
        raise CacheFileError(
            f"{where} ends with a path separator, so it names a folder: give a file path such as "
            f"{text}chat.safetensors."
        )
    target = Path(os.path.expanduser(text))
    name = target.name  # the name readers will open, also when it is a link
    try:
        if target.is_symlink():
            target = Path(os.path.realpath(target))  # replace the file the link points to, keep the link
            where = f"{where} (a link to {str(target)!r})"
        if target.is_dir():
            raise CacheFileError(f"{where} is a folder: give a file path such as chat.safetensors.")
        if target.exists() and not target.is_file():
            raise CacheFileError(
                f"{where} exists and is not a regular file (a device, pipe or socket): "
                "chatkit only replaces regular files; save to another path."
            )
        if not name.endswith(".safetensors"):
            raise CacheFileError(
                f"{where}: a cache file's name must end in .safetensors (mlx-lm and MLX read it by "
                f"its extension): save to {name}.safetensors instead."
            )
        folder = target.parent
        if not folder.exists():
            raise CacheFileError(
                f"Cannot save to {where}: the folder {str(folder)!r} does not exist. "
                "Create it first (e.g. mkdir -p) or save elsewhere."
            )
        if not folder.is_dir():
            raise CacheFileError(
                f"Cannot save to {where}: {str(folder)!r} is a file, not a folder. Save elsewhere."
            )
    except OSError as exc:
        raise CacheFileError(_write_problem(where, target.parent, exc)) from exc
    return target


def _path_text(path: Any) -> str:
    try:
        text = os.fspath(path)
    except TypeError:
        raise CacheFileError(f"A cache file path is a str or os.PathLike, got {type(path).__name__}.") from None
    if isinstance(text, bytes):
        text = os.fsdecode(text)
    if not text:
        raise CacheFileError("The cache file path is empty: give a path such as chat.safetensors.")
    if "\x00" in text:
        raise CacheFileError(f"{text!r} contains a NUL character, which no file name can hold: fix the path.")
    return text


def _temp_prefix(target: Path) -> str:
    name = target.name
    if len(os.fsencode(name)) > 100:  # keep the temporary name within the file system's limit
        name = hashlib.sha256(os.fsencode(name)).hexdigest()[:16]
    return f".{name}."


def _write_problem(where: str, folder: Path, exc: BaseException) -> str:
    """What went wrong writing ``where``, and what to do about it."""
    code = getattr(exc, "errno", None)
    hints = {
        errno.ENOENT: f"the folder {str(folder)!r} does not exist (any more): create it or save elsewhere",
        errno.ENOTDIR: "a part of the path is a file, not a folder: save elsewhere",
        errno.EACCES: f"no permission to write in {str(folder)!r}: save elsewhere or change its permissions",
        errno.EPERM: f"no permission to write in {str(folder)!r}: save elsewhere or change its permissions",
        errno.EROFS: f"{str(folder)!r} is on a read-only file system: save elsewhere",
        errno.ENAMETOOLONG: "the file name is too long for the file system: use a shorter name",
        errno.ENOSPC: "the disk is full: free some space or save elsewhere",
        errno.EDQUOT: "the disk quota is exceeded: free some space or save elsewhere",
    }
    reason = (hints.get(code) if isinstance(code, int) else None) or (getattr(exc, "strerror", None) or str(exc))
    return f"Could not write {where}: {reason}. Any earlier file there is intact."


def _crc_text(text: str) -> str:
    return f"{zlib.crc32(text.encode('utf-8', 'surrogatepass')):08x}"


def _state_digest(layers: Sequence[Any]) -> dict[str, Any]:
    """Per entry of the layers' states (named as in the file): dtype, shape and CRC-32 of an array's
    bytes, or a scalar's value as the file stores it. Computed the same way at save and at load."""
    digest: dict[str, Any] = {}
    flat: list[tuple[str, Any]] = tree_flatten([c.state for c in layers])  # type: ignore[assignment]
    arrays = [v for _, v in flat if isinstance(v, mx.array)]
    mx.eval(arrays)
    for name, value in flat:
        if isinstance(value, mx.array):
            data = value if value.size == 0 else mx.contiguous(value)
            mx.eval(data)
            digest[name] = [str(value.dtype), list(value.shape), zlib.crc32(memoryview(data))]  # type: ignore[arg-type]  # mx.array has the buffer protocol
        elif isinstance(value, (bool, int, float)):
            digest[name] = mx.array(value).item()  # mlx-lm stores scalars as MLX arrays
        else:
            digest[name] = value  # a str or None
    return digest


# -- reading ----------------------------------------------------------------------------------------
def inspect(path: str | os.PathLike[str]) -> CacheFileInfo:
    """The header of a cache file; ``CacheFileError`` if it is not a readable, undamaged cache file."""
    return _inspect(_read_target(path))[0]


def load(path: str | os.PathLike[str], *, verify: bool = True) -> LoadedCache:
    """The layers, ledger and header of a cache file (chatkit's or a raw mlx-lm one).

    ``verify=False`` skips the check of the tensors against their checksums (the header, metadata
    and the metadata's checksum are always checked).
    """
    target = _read_target(path)
    where = repr(str(target))
    info, meta = _inspect(target)
    try:
        layers = load_prompt_cache(str(target))
        mx.eval([c.state for c in layers])
    except Exception as exc:  # MLX raises RuntimeError/ValueError on damaged data
        raise CacheFileError(f"Could not read the cache in {where}: {exc}. The file is damaged.") from exc
    checkpoints: tuple[Checkpoint, ...] = ()
    if meta is not None:
        if verify and "checksum" in meta:
            try:
                digest = _state_digest(layers)
            except Exception as exc:
                raise CacheFileError(f"Could not read the cache in {where}: {exc}. The file is damaged.") from exc
            if digest != meta["checksum"]["state"]:
                bad = sorted(k for k in set(digest) | set(meta["checksum"]["state"])
                             if digest.get(k) != meta["checksum"]["state"].get(k))
                raise CacheFileError(
                    f"{where} is damaged: {len(bad)} of its cache tensors do not match their checksums "
                    f"(first: {bad[0]}). Use another copy, or start a new session."
                )
        ledger = Ledger(tuple(meta["ledger"]["tokens"]), meta["ledger"]["opaque"])
        n = len(meta["layer_classes"])
        layers, extra = layers[:n], layers[n:]
        try:
            checkpoints = _checkpoints(meta["checkpoints"], extra, n)
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            raise CacheFileError(f"{where} has damaged checkpoint metadata ({exc}).") from exc
        offsets = {c.offset for c in layers if isinstance(getattr(c, "offset", None), int)}
        if offsets and offsets != {len(ledger)}:
            raise CacheFileError(
                f"{where} is inconsistent: its layers hold {sorted(offsets)} tokens but its ledger {len(ledger)}."
            )
    else:
        offsets = {c.offset for c in layers if isinstance(getattr(c, "offset", None), int)}
        if len(offsets) != 1 or min(offsets) < 0:
            raise CacheFileError(f"{where}: its layers disagree on how many tokens they hold ({sorted(offsets)}).")
        ledger = Ledger((), offsets.pop())
        info = CacheFileInfo(**{**info.__dict__, "tokens": len(ledger), "opaque_tokens": len(ledger)})
    return LoadedCache(layers, ledger, info, checkpoints)


def _read_target(path: Any) -> Path:
    text = _path_text(path)
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


def _inspect(target: Path) -> tuple[CacheFileInfo, dict[str, Any] | None]:
    """The file's info and, for a chatkit file, its checked metadata."""
    where = repr(str(target))
    metadata, tensor_bytes, file_bytes = _read_header(target)
    classes = _classes(metadata, where)
    raw = metadata.get(f"0.{_KEY}")
    if raw is None and f"0.{_SUM_KEY}" in metadata:
        raise CacheFileError(f"{where} is damaged: it has a checksum of chatkit metadata but no metadata.")
    if raw is None:
        info = CacheFileInfo(
            path=str(target),
            kind="mlx-lm",
            format_version=None,
            tokens=-1,  # unknown until the tensors are loaded
            opaque_tokens=-1,
            layer_classes=classes,
            file_bytes=file_bytes,
            tensor_bytes=tensor_bytes,
        )
        return info, None
    meta = _parse_meta(raw, metadata.get(f"0.{_SUM_KEY}"), classes, where)
    tokens, opaque = meta["ledger"]["tokens"], meta["ledger"]["opaque"]
    info = CacheFileInfo(
        path=str(target),
        kind="chatkit",
        format_version=meta["format_version"],
        tokens=opaque + len(tokens),
        opaque_tokens=opaque,
        layer_classes=classes[: len(meta["layer_classes"])],
        file_bytes=file_bytes,
        tensor_bytes=tensor_bytes,
        fingerprint=meta["fingerprint"],
        instructions=meta["instructions"],
        messages=tuple(meta["messages"]),
        generate_params=meta["generate_params"],
        cache_options=meta["cache_options"],
        saved_at=meta["saved_at"],
    )
    return info, meta


def _parse_meta(raw: str, checksum: str | None, classes: tuple[str, ...], where: str) -> dict[str, Any]:
    """chatkit's metadata, checked field by field; ``CacheFileError`` naming the first problem."""

    def damaged(what: str) -> CacheFileError:
        return CacheFileError(
            f"{where} has damaged chatkit metadata ({what}): it cannot be restored. "
            "Use another copy, or start a new session."
        )

    try:
        meta = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # RecursionError: absurdly nested JSON
        raise damaged(f"not JSON: {type(exc).__name__}") from None
    if not isinstance(meta, dict):
        raise damaged(f"a JSON {type(meta).__name__}, not an object")
    version = meta.get("format_version")
    if not _is_int(version) or version < 1:
        raise damaged(f"format_version {_short(version)}")
    if version > FORMAT_VERSION:
        raise CacheFileError(
            f"{where} was written by a newer chatkit (format {version}, this one reads up to "
            f"{FORMAT_VERSION}): upgrade chatkit to read it."
        )
    if version >= 2:
        if checksum != _crc_text(raw):
            raise damaged("its checksum does not match: the metadata was changed or damaged")
        sums = meta.get("checksum")
        if not (isinstance(sums, dict) and sums.get("algorithm") == "crc32" and isinstance(sums.get("state"), dict)):
            raise damaged("checksum")
    fingerprint = meta.get("fingerprint")
    if not (isinstance(fingerprint, dict) and fingerprint
            and all(isinstance(k, str) and isinstance(v, str) for k, v in fingerprint.items())):
        raise damaged("fingerprint")
    ledger = meta.get("ledger")
    if not isinstance(ledger, dict):
        raise damaged("ledger")
    tokens, opaque = ledger.get("tokens"), ledger.get("opaque")
    if not (isinstance(tokens, list) and all(_is_int(t) and 0 <= t < 2**32 for t in tokens)):
        raise damaged("ledger tokens")
    if not (_is_int(opaque) and opaque >= 0):
        raise damaged("ledger opaque count")
    for name in ("instructions", "saved_at"):
        if meta.get(name) is not None and not _is_text(meta.get(name)):
            raise damaged(name)
    messages = meta.get("messages")
    if not isinstance(messages, list):
        raise damaged("messages")
    for i, m in enumerate(messages):
        try:
            ChatMessage.from_dict(m)
        except ChatKitError as exc:
            raise damaged(f"message {i}: {exc}") from None
        if not isinstance(m, dict) or m["role"] not in _ROLES or not _is_text(m["content"]) or not (
            m.get("name") is None or _is_text(m["name"])
        ):
            raise damaged(f"message {i}")
    params = meta.get("generate_params")
    if params is not None:
        try:
            GenerateParams.from_dict(params)
        except ChatKitError as exc:
            raise damaged(f"generate_params: {exc}") from None
    options = meta.get("cache_options")
    if options is not None:
        if not isinstance(options, dict):
            raise damaged("cache_options")
        try:
            CacheOptions(**{k: v for k, v in options.items() if k in CacheOptions.__dataclass_fields__}).validate()
        except ChatKitError as exc:
            raise damaged(f"cache_options: {exc}") from None
    names = meta.get("layer_classes")
    if not (isinstance(names, list) and names and tuple(names) == classes[: len(names)]):
        raise damaged("layer_classes do not match the file's cache layers")
    entries = meta.get("checkpoints")
    if not isinstance(entries, list):
        raise damaged("checkpoints")
    copies = 0
    for entry in entries:
        if not isinstance(entry, dict):
            raise damaged("checkpoints")
        length, layer_ids = entry.get("length"), entry.get("layers")
        if not (_is_int(length) and 0 <= length <= len(tokens)):
            raise damaged("checkpoint length")
        if not (isinstance(layer_ids, list) and all(_is_int(i) and 0 <= i < len(names) for i in layer_ids)
                and len(set(layer_ids)) == len(layer_ids)):
            raise damaged("checkpoint layers")
        copies += len(layer_ids)
    if len(names) + copies != len(classes):
        raise damaged(f"it names {len(names) + copies} cache entries, the file holds {len(classes)}")
    return meta


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


# -- checking against a model -------------------------------------------------------------------------
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


def check_layers(model: Any, saved: LoadedCache, where: str) -> None:
    """``IncompatibleCacheError`` unless the loaded layers (and checkpoint copies) fit ``model``:
    count, classes, batch, heads and widths. A fingerprint can be edited; the tensors cannot lie."""
    max_kv_size = (saved.info.cache_options or {}).get("max_kv_size")
    candidates = [saved.layers] + [
        [copy if copy is not None else layer for copy, layer in zip(cp.copies, saved.layers)]
        for cp in saved.checkpoints
    ]
    for layers in candidates:
        try:
            problem = layers_fit(model, layers, max_kv_size=max_kv_size)
        except Exception as exc:  # a layer whose arrays are not shaped like a cache at all
            problem = f"its layers cannot be read as this model's cache ({type(exc).__name__}: {exc})"
        if problem is not None:
            raise IncompatibleCacheError(
                f"{where} does not fit this model: {problem}. "
                "Restore it into the model it was made with (or pass verify=False if you are sure)."
            )


# -- the safetensors header -----------------------------------------------------------------------------
def _read_header(path: Path) -> tuple[dict[str, str], int, int]:
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
            if not (dtype in _DTYPE_BYTES and isinstance(shape, list) and all(_is_int(d) and d >= 0 for d in shape)
                    and _is_int(start) and _is_int(stop) and 0 <= start <= stop):
                raise ValueError
            if math.prod(shape) * _DTYPE_BYTES[dtype] != stop - start:
                raise ValueError
        except (TypeError, KeyError, ValueError) as exc:
            raise CacheFileError(f"{where} is not a valid safetensors file (tensor {_short(name)}).") from exc
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
                raise CacheFileError(f"{where} is not a valid cache file (entry {_short(name)}).")


def _classes(metadata: Mapping[str, str], where: str) -> tuple[str, ...]:
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
        raise CacheFileError(f"{where} names cache classes chatkit does not know: {[_short(c) for c in unknown]}.")
    return tuple(classes)


def _is_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_text(value: Any) -> bool:
    """A str that is valid Unicode (JSON can carry lone surrogates, which no tokenizer takes)."""
    if not isinstance(value, str):
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


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


__all__ = [
    "CacheFileInfo",
    "FORMAT_VERSION",
    "LoadedCache",
    "check_fingerprint",
    "check_layers",
    "inspect",
    "load",
    "remove_stale_temps",
    "save",
]

"""The cache file: one ``.safetensors`` file in mlx-lm's prompt-cache layout plus chatkit's metadata.

``save`` writes atomically (``atomic.py``) and stores checksums: a CRC-32 of every cache tensor and of
chatkit's metadata. ``inspect`` reads the header only (``header.py``) and checks its structure, the
metadata's schema and checksum; ``load`` also verifies the tensors (unless ``verify=False``) before
building cache objects. Every problem with a file is a ``CacheFileError`` naming it. safetensors holds
only tensors and strings: loading a file never runs code.

The cache layer owns the KV part (layers, ledger, checkpoints, fingerprint, cache options); the
conversation stored beside it (instructions, messages, sampling settings) is the session's, which
checks it (``chatkit.session.saved``): here it is JSON that is carried, not read.
"""

from __future__ import annotations

import json
import os
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

from ..errors import CacheFileError, ChatKitError, IncompatibleCacheError
from ..images import ImageSpan
from . import atomic
from ._mlx import cut_to_offset, load_prompt_cache, save_prompt_cache, state_problem
from .header import cache_classes, is_int, is_text, read_header, read_target, short
from .ledger import Ledger
from .state import CacheOptions, Checkpoint, layers_fit

# 1: the first format; 2: CRC-32 checksums of the cache tensors and of chatkit's metadata.
FORMAT_VERSION = 2
_KEY = "chatkit"  # the metadata entry holding chatkit's JSON
_SUM_KEY = "chatkit_crc32"  # the CRC-32 of that JSON (an entry of its own: a checksum cannot cover itself)
CONVERSATION_KEYS = ("instructions", "messages", "generate_params", "context", "mcp_servers", "settings")  # the session's part
MAX_TOKENS = 2**31  # MLX indexes a cache's positions with 32-bit ints


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
    context: Mapping[str, Any] | None = None  # what a context policy shows the model (session.saved reads it)
    mcp_servers: tuple[Mapping[str, Any], ...] = ()  # the MCP servers that supplied the tools: {"command": [...]} / {"url": ...}
    settings: Mapping[str, Any] | None = None  # the session's other settings that are data (session.saved reads them)

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


def damaged(where: str, what: str) -> CacheFileError:
    """The error for a file whose chatkit metadata fails a check."""
    return CacheFileError(
        f"{where} has damaged chatkit metadata ({what}): it cannot be restored. Use another copy, or start a new session."
    )


# -- saving -----------------------------------------------------------------------------------------
def save(
    path: str | os.PathLike[str],
    layers: Sequence[Any],
    ledger: Ledger,
    *,
    fingerprint: Mapping[str, str],
    conversation: Mapping[str, Any],
    cache_options: Mapping[str, Any],
    checkpoints: Sequence[Checkpoint] = (),
) -> int:
    """Write a session's cache and ``conversation`` (its JSON: ``CONVERSATION_KEYS``) to ``path``
    atomically; returns the file's size.

    The file's cache list is the model's layers, then the copies held by ``checkpoints`` (layers
    that cannot rewind, e.g. hybrid models' ``ArraysCache``), so that a restored session can rewind
    as the live one could. ``path`` must end in ``.safetensors``; a symlink is written through (the
    file it points to is replaced). Temporary files left by killed saves to the same path are removed.
    """
    target = atomic.save_target(path)
    extra = [c for cp in checkpoints for c in cp.copies if c is not None]
    cut = [cut_to_offset(c) for c in [*layers, *extra]]
    meta = {
        "format_version": FORMAT_VERSION,
        "fingerprint": dict(fingerprint),
        "ledger": {"tokens": list(ledger.tokens), "opaque": ledger.opaque,
                   **({"shifted": ledger.shifted} if ledger.shifted else {}),
                   **({"images": [[s.start, s.end, s.digest, list(s.layout)] for s in ledger.images]}
                      if ledger.images else {})},
        **{key: conversation.get(key) for key in CONVERSATION_KEYS},
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
    return atomic.write(target, repr(str(target)),
                        lambda tmp: save_prompt_cache(tmp, cut, {_KEY: text, _SUM_KEY: _crc_text(text)}))


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
    """The header of a cache file; ``CacheFileError`` if it is not a readable, undamaged cache file.
    (The saved conversation is checked by ``chatkit.session.saved.inspect``, ``chatkit.inspect_cache``.)"""
    return _inspect(read_target(path))[0]


def load(path: str | os.PathLike[str], *, verify: bool = True) -> LoadedCache:
    """The layers, ledger and header of a cache file (chatkit's or a raw mlx-lm one).

    ``verify=False`` skips the check of the tensors against their checksums (the header, metadata
    and the metadata's checksum are always checked).
    """
    target = read_target(path)
    where = repr(str(target))
    info, meta = _inspect(target)
    try:
        layers = load_prompt_cache(str(target))
        mx.eval([c.state for c in layers])
    except Exception as exc:  # MLX raises RuntimeError/ValueError on damaged data
        raise CacheFileError(f"Could not read the cache in {where}: {exc}. The file is damaged.") from exc
    if meta is None:
        return _raw(layers, info, where)
    if verify and "checksum" in meta:
        _verify_tensors(layers, meta["checksum"]["state"], where)
    _check_states(layers, where)
    images = tuple(ImageSpan(a, b, d, tuple(g)) for a, b, d, g in meta["ledger"].get("images", ()))
    ledger = Ledger(tuple(meta["ledger"]["tokens"]), meta["ledger"]["opaque"], images, meta["ledger"].get("shifted", 0))
    n = len(meta["layer_classes"])
    layers, extra = layers[:n], layers[n:]
    try:
        checkpoints = _checkpoints(meta["checkpoints"], layers, extra, ledger.opaque)
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise CacheFileError(f"{where} has damaged checkpoint metadata ({exc}).") from exc
    offsets = {c.offset for c in layers if isinstance(getattr(c, "offset", None), int)}
    if offsets and offsets != {len(ledger)}:
        raise CacheFileError(
            f"{where} is inconsistent: its layers hold {sorted(offsets)} tokens but its ledger {len(ledger)}."
        )
    return LoadedCache(layers, ledger, info, checkpoints)


def _raw(layers: list[Any], info: CacheFileInfo, where: str) -> LoadedCache:
    """A raw mlx-lm prompt cache: every position an opaque prefix."""
    _check_states(layers, where)
    offsets = {c.offset for c in layers if isinstance(getattr(c, "offset", None), int)}
    if len(offsets) != 1 or min(offsets) < 0:
        raise CacheFileError(f"{where}: its layers disagree on how many tokens they hold ({sorted(offsets)}).")
    ledger = Ledger((), offsets.pop())
    return LoadedCache(layers, ledger, replace(info, tokens=len(ledger), opaque_tokens=len(ledger)))


def _check_states(layers: Sequence[Any], where: str) -> None:
    """``CacheFileError`` for the first entry whose state disagrees with its own tensors (a forged
    file passes the checksums: its layers would fail mid-turn in MLX)."""
    for i, layer in enumerate(layers):
        problem = state_problem(layer)
        if problem is not None:
            raise CacheFileError(
                f"{where} is damaged: its cache entry {i} (a {type(layer).__name__}) {problem}. "
                "Use another copy, or start a new session."
            )


def _verify_tensors(layers: list[Any], expected: Mapping[str, Any], where: str) -> None:
    try:
        digest = _state_digest(layers)
    except Exception as exc:
        raise CacheFileError(f"Could not read the cache in {where}: {exc}. The file is damaged.") from exc
    if digest != expected:
        bad = sorted(k for k in set(digest) | set(expected) if digest.get(k) != expected.get(k))
        raise CacheFileError(
            f"{where} is damaged: {len(bad)} of its cache tensors do not match their checksums "
            f"(first: {bad[0]}). Use another copy, or start a new session."
        )


def _inspect(target: Path) -> tuple[CacheFileInfo, dict[str, Any] | None]:
    """The file's info and, for a chatkit file, its checked metadata."""
    where = repr(str(target))
    metadata, tensor_bytes, file_bytes = read_header(target)
    classes = cache_classes(metadata, where)
    raw = metadata.get(f"0.{_KEY}")
    if raw is None and f"0.{_SUM_KEY}" in metadata:
        raise CacheFileError(f"{where} is damaged: it has a checksum of chatkit metadata but no metadata.")
    sizes: dict[str, Any] = {"path": str(target), "file_bytes": file_bytes, "tensor_bytes": tensor_bytes}
    if raw is None:  # tokens unknown until the tensors are loaded
        return CacheFileInfo(kind="mlx-lm", format_version=None, tokens=-1, opaque_tokens=-1, layer_classes=classes,
                             **sizes), None
    meta = _parse_meta(raw, metadata.get(f"0.{_SUM_KEY}"), classes, where)
    tokens, opaque = meta["ledger"]["tokens"], meta["ledger"]["opaque"]
    info = CacheFileInfo(
        kind="chatkit", format_version=meta["format_version"], tokens=opaque + len(tokens), opaque_tokens=opaque,
        layer_classes=classes[: len(meta["layer_classes"])], fingerprint=meta["fingerprint"],
        instructions=meta["instructions"], messages=tuple(meta["messages"]), generate_params=meta["generate_params"],
        cache_options=meta["cache_options"], saved_at=meta["saved_at"], context=meta.get("context"),
        mcp_servers=tuple(meta.get("mcp_servers") or ()), settings=meta.get("settings"), **sizes,
    )
    return info, meta


def _parse_meta(raw: str, checksum: str | None, classes: tuple[str, ...], where: str) -> dict[str, Any]:
    """chatkit's metadata, checked field by field; ``CacheFileError`` naming the first problem."""
    try:
        meta = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # RecursionError: absurdly nested JSON
        raise damaged(where, f"not JSON: {type(exc).__name__}") from None
    if not isinstance(meta, dict):
        raise damaged(where, f"a JSON {type(meta).__name__}, not an object")
    _check_version(meta, raw, checksum, where)
    _check_ledger(meta, where)
    _check_conversation(meta, where)
    _check_layers_and_checkpoints(meta, classes, where)
    return meta


def _check_version(meta: Mapping[str, Any], raw: str, checksum: str | None, where: str) -> None:
    version = meta.get("format_version")
    if not is_int(version) or version < 1:
        raise damaged(where, f"format_version {short(version)}")
    if version > FORMAT_VERSION:
        raise CacheFileError(
            f"{where} was written by a newer chatkit (format {version}, this one reads up to "
            f"{FORMAT_VERSION}): upgrade chatkit to read it."
        )
    if version >= 2:
        if checksum != _crc_text(raw):
            raise damaged(where, "its checksum does not match: the metadata was changed or damaged")
        sums = meta.get("checksum")
        if not (isinstance(sums, dict) and sums.get("algorithm") == "crc32" and isinstance(sums.get("state"), dict)):
            raise damaged(where, "checksum")


def _check_ledger(meta: Mapping[str, Any], where: str) -> None:
    fingerprint = meta.get("fingerprint")
    if not (isinstance(fingerprint, dict) and fingerprint
            and all(isinstance(k, str) and isinstance(v, str) for k, v in fingerprint.items())):
        raise damaged(where, "fingerprint")
    ledger = meta.get("ledger")
    if not isinstance(ledger, dict):
        raise damaged(where, "ledger")
    tokens, opaque = ledger.get("tokens"), ledger.get("opaque")
    if not (isinstance(tokens, list) and all(is_int(t) and 0 <= t < 2**32 for t in tokens)):
        raise damaged(where, "ledger tokens")
    if not (is_int(opaque) and opaque >= 0):
        raise damaged(where, "ledger opaque count")
    if opaque + len(tokens) >= MAX_TOKENS:
        raise damaged(where, f"a ledger of {opaque + len(tokens)} tokens, more than any cache holds")
    images = ledger.get("images", [])
    if not (isinstance(images, list) and all(_image_entry(e, len(tokens)) for e in images)):
        raise damaged(where, "ledger images")


def _image_entry(entry: Any, tokens: int) -> bool:
    """Whether ``entry`` is a ledger image: ``[start, end, digest, layout]`` inside the ledger's tokens."""
    return (isinstance(entry, list) and len(entry) == 4 and is_int(entry[0]) and is_int(entry[1])
            and 0 <= entry[0] < entry[1] <= tokens and isinstance(entry[2], str) and len(entry[2]) == 64
            and isinstance(entry[3], list) and all(is_int(v) and v > 0 for v in entry[3]))


def _check_conversation(meta: Mapping[str, Any], where: str) -> None:
    """The shapes of the session's part (its contents are the session's to check) and the cache options."""
    for name in ("instructions", "saved_at"):
        if meta.get(name) is not None and not is_text(meta.get(name)):
            raise damaged(where, name)
    if not isinstance(meta.get("messages"), list):
        raise damaged(where, "messages")
    for name in ("generate_params", "context", "settings"):
        if meta.get(name) is not None and not isinstance(meta.get(name), dict):
            raise damaged(where, name)
    servers = meta.get("mcp_servers")
    if servers is not None and not (isinstance(servers, list) and all(_mcp_record(s) for s in servers)):
        raise damaged(where, "mcp_servers")
    options = meta.get("cache_options")
    if options is not None:
        if not isinstance(options, dict):
            raise damaged(where, "cache_options")
        try:
            CacheOptions(**{k: v for k, v in options.items() if k in CacheOptions.__dataclass_fields__}).validate()
        except ChatKitError as exc:
            raise damaged(where, f"cache_options: {exc}") from None


def _mcp_record(record: Any) -> bool:
    """Whether ``record`` is ``{"command": [str, ...]}`` or ``{"url": str}``."""
    if not isinstance(record, dict) or len(record) != 1:
        return False
    command, url = record.get("command"), record.get("url")
    return (isinstance(command, list) and bool(command) and all(is_text(c) for c in command)) or is_text(url)


def _check_layers_and_checkpoints(meta: Mapping[str, Any], classes: tuple[str, ...], where: str) -> None:
    names = meta.get("layer_classes")
    if not (isinstance(names, list) and names and tuple(names) == classes[: len(names)]):
        raise damaged(where, "layer_classes do not match the file's cache layers")
    entries = meta.get("checkpoints")
    if not isinstance(entries, list):
        raise damaged(where, "checkpoints")
    copies, previous = 0, -1
    for entry in entries:
        if not isinstance(entry, dict):
            raise damaged(where, "checkpoints")
        length, layer_ids = entry.get("length"), entry.get("layers")
        if not (is_int(length) and previous < length <= len(meta["ledger"]["tokens"])):
            raise damaged(where, "checkpoint length (lengths rise from 0 to the ledger's)")
        previous = length
        if not (isinstance(layer_ids, list) and all(is_int(i) and 0 <= i < len(names) for i in layer_ids)
                and len(set(layer_ids)) == len(layer_ids)):
            raise damaged(where, "checkpoint layers")
        copies += len(layer_ids)
    if len(names) + copies != len(classes):
        raise damaged(where, f"it names {len(names) + copies} cache entries, the file holds {len(classes)}")


def _checkpoints(entries: Sequence[Mapping[str, Any]], layers: list[Any], extra: list[Any],
                 opaque: int) -> tuple[Checkpoint, ...]:
    """The checkpoints, each copy of the class of the layer it stands for and (if it counts tokens)
    at the checkpoint's position; ``ValueError`` otherwise."""
    result, used = [], 0
    for entry in entries:
        copies: list[Any] = [None] * len(layers)
        for i in entry["layers"]:
            copy, length = extra[used], int(entry["length"])
            if type(copy) is not type(layers[i]):
                raise ValueError(f"a {type(copy).__name__} stands for layer {i}, which is of class {type(layers[i]).__name__}")
            if isinstance(getattr(copy, "offset", None), int) and copy.offset != opaque + length:
                raise ValueError(f"the copy of layer {i} holds {copy.offset} tokens, its checkpoint {opaque + length}")
            copies[int(i)] = copy
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
    if differ == ["adapter"]:
        raise IncompatibleCacheError(
            f"{where} was saved with another adapter (or with none where this session has one, or the other way "
            "round): restore it with the adapter it was saved with, or start a new session."
        )
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


__all__ = [
    "CONVERSATION_KEYS",
    "CacheFileInfo",
    "FORMAT_VERSION",
    "LoadedCache",
    "check_fingerprint",
    "check_layers",
    "damaged",
    "inspect",
    "load",
    "save",
]

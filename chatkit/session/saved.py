"""The saved conversation: what a cache file holds besides the KV cache (instructions, transcript,
sampling settings), written from a session and read back, checked, by everyone who reads it (the
builder, the REPL, the server, ``chatkit.inspect_cache``).

The KV part and the file's format are the cache layer's (``chatkit.cache.file``).
"""

from __future__ import annotations

import os
from collections.abc import Collection, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from .. import distributed
from ..cache import file
from ..cache._mlx import copy_layer, layer_offset
from ..cache.file import CacheFileInfo, LoadedCache
from ..cache.header import is_text
from ..cache.ledger import Ledger
from ..cache.state import CacheOptions, Checkpoint
from ..errors import ChatKitError, InvalidParamsError
from ..messages import ChatMessage, saved_dict
from ..model.loaded import LoadedModel
from ..model.switchable import ActiveAdapter
from ..params import GenerateParams
from ..tools.mcp import mcp_servers
from .config import SessionConfig
from .context import ContextPolicy, Window

_ROLES = {"system", "user", "assistant", "tool"}
# The rest of SessionConfig's data. Not the tool options: tools that are functions or schemas are not saved, and the
# builder gives its own options with its tools, so a file's would only reach a session that has none.
SETTINGS = ("chat_template", "max_kv_bytes", "allow_special_in_content")


@dataclass(frozen=True)
class SavedContext:
    """What a context policy showed the model: the policy, the window, and the windows earlier compactions
    replaced (so that undo works across them)."""

    policy: ContextPolicy | None = None
    window: Window = Window()
    earlier: tuple[tuple[int, Window], ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"policy": None if self.policy is None else self.policy.to_dict(), "window": self.window.to_dict(),
                "earlier": [[at, w.to_dict()] for at, w in self.earlier]}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None, messages: int) -> SavedContext:
        """The context saved with ``messages`` messages; ``InvalidParamsError`` (a ``ChatKitError``) if damaged."""
        if data is None:
            return cls()
        policy = None if data.get("policy") is None else ContextPolicy.from_dict(data["policy"])
        window = Window.from_dict(data.get("window") or {}, messages)
        earlier = data.get("earlier") or []
        if not isinstance(earlier, list) or not all(isinstance(e, list) and len(e) == 2 for e in earlier):
            raise InvalidParamsError(f"earlier windows: {earlier!r:.60}")
        return cls(policy, window, tuple((int(at), Window.from_dict(w, messages)) for at, w in earlier))


@dataclass(frozen=True)
class SavedConversation:
    """A saved session's conversation and settings, read from a cache file's header."""

    instructions: str | None
    messages: tuple[ChatMessage, ...]
    generate_params: GenerateParams | None
    cache_options: Mapping[str, Any] | None
    context: SavedContext = SavedContext()
    mcp_servers: tuple[Mapping[str, Any], ...] = ()  # ``MCPServer.to_dict`` of the servers that supplied the tools
    settings: Mapping[str, Any] = field(default_factory=dict)  # SETTINGS by name, as ``SessionConfig`` holds them

    @classmethod
    def of(cls, info: CacheFileInfo) -> SavedConversation:
        """The conversation of a checked header (:func:`inspect`); empty for a raw mlx-lm cache."""
        params = None if info.generate_params is None else GenerateParams.from_dict(info.generate_params)
        messages = tuple(ChatMessage.from_dict(m) for m in info.messages)
        context = SavedContext.from_dict(info.context, len(messages))
        return cls(info.instructions, messages, params, info.cache_options, context, tuple(info.mcp_servers),
                   settings_of(info.settings))

    @classmethod
    def of_session(cls, config: SessionConfig, messages: Sequence[ChatMessage], window: Window,
                   earlier: tuple[tuple[int, Window], ...]) -> SavedConversation:
        """What a file keeps of a session: its conversation and the settings of ``config`` that are data
        (instructions, sampling settings, cache options, context policy, the MCP servers of its tools, ``SETTINGS``)."""
        return cls(config.instructions, tuple(messages), config.generate_params, asdict(config.cache_options),
                   SavedContext(config.context_policy, window, earlier), tuple(mcp_servers(config.tools)),
                   {name: getattr(config, name) for name in SETTINGS})

    def onto(self, config: SessionConfig, keep: Collection[str] = ()) -> SessionConfig:
        """``config`` with this file's settings (instructions, sampling settings, context policy, ``SETTINGS``),
        but for those named in ``keep`` (a builder's own); the cache options are merged by the builder."""
        changes: dict[str, Any] = {name: value for name, value in self.settings.items() if name not in keep}
        if "instructions" not in keep:
            changes["instructions"] = self.instructions
        if "generate_params" not in keep and self.generate_params is not None:
            changes["generate_params"] = self.generate_params
        if "context_policy" not in keep and self.context.policy is not None:
            changes["context_policy"] = self.context.policy
        return replace(config, **changes)


def settings_of(data: Mapping[str, Any] | None) -> dict[str, Any]:
    """The ``SETTINGS`` a file's header holds (those it does not name are left out: files of older versions
    have none); ``InvalidParamsError`` (a ``ChatKitError``) naming a bad one."""
    out = {name: (data or {})[name] for name in SETTINGS if name in (data or {})}
    template, kv, special = out.get("chat_template"), out.get("max_kv_bytes"), out.get("allow_special_in_content", False)
    for name, good in (("chat_template", template is None or is_text(template)),
                       ("max_kv_bytes", kv is None or (isinstance(kv, int) and not isinstance(kv, bool) and kv >= 1)),
                       ("allow_special_in_content", isinstance(special, bool))):
        if not good:
            raise InvalidParamsError(f"settings.{name}={out[name]!r:.40}")
    return out


def check(info: CacheFileInfo) -> CacheFileInfo:
    """``info`` if its conversation reads back (every message and the settings), else the file's
    ``CacheFileError``: nothing unreadable is restored."""
    where = repr(info.path)
    for i, m in enumerate(info.messages):
        try:
            ChatMessage.from_dict(m)
        except ChatKitError as exc:
            raise file.damaged(where, f"message {i}: {exc}") from None
        if not isinstance(m, dict) or m["role"] not in _ROLES or not (is_text(m["content"]) or isinstance(m["content"], list)) or not (
            m.get("name") is None or is_text(m["name"])
        ):
            raise file.damaged(where, f"message {i}")
    if info.generate_params is not None:
        try:
            GenerateParams.from_dict(info.generate_params)
        except ChatKitError as exc:
            raise file.damaged(where, f"generate_params: {exc}") from None
    try:
        SavedContext.from_dict(info.context, len(info.messages))
    except (ChatKitError, TypeError, ValueError) as exc:
        raise file.damaged(where, f"context: {exc}") from None
    try:
        settings_of(info.settings)
    except ChatKitError as exc:
        raise file.damaged(where, str(exc)) from None
    return info


def inspect(path: str | os.PathLike[str]) -> CacheFileInfo:
    """What a cache file holds, read from its header without loading tensors; ``CacheFileError`` if it
    is not a readable, undamaged cache file (its conversation included)."""
    return check(file.inspect(path))


def read(path: str | os.PathLike[str]) -> SavedConversation:
    """The conversation saved in ``path`` (checked), without its tensors."""
    return SavedConversation.of(inspect(path))


def save(
    path: str | os.PathLike[str],
    lm: LoadedModel,
    layers: Sequence[Any],
    ledger: Ledger,
    checkpoints: Sequence[Checkpoint],
    conversation: SavedConversation,
    cache_options: CacheOptions,
    adapter: ActiveAdapter | None = None,
    *,
    images: bool = False,
) -> int:
    """Write the cache and the conversation to ``path`` (over a sharded model: this rank's file, and
    every rank must succeed); returns the file's size. The fingerprint names ``adapter`` too. Images are
    saved by their hash (and where their tokens are), with ``images`` their pixels too (PNG)."""
    params = conversation.generate_params or GenerateParams()
    document = {
        "instructions": conversation.instructions,
        "messages": [saved_dict(m, pixels=images) for m in conversation.messages],
        "generate_params": params.to_dict(),
        "context": conversation.context.to_dict(),
        "mcp_servers": [dict(s) for s in conversation.mcp_servers],
        "settings": dict(conversation.settings),
    }
    return distributed.agree(lm.distributed, "save the cache", lambda: file.save(
        distributed.shard_path(lm.distributed, path), layers, ledger, fingerprint=identity(lm, adapter),
        conversation=document, cache_options=asdict(cache_options), checkpoints=checkpoints,
    ))


def identity(lm: LoadedModel, adapter: ActiveAdapter | None) -> dict[str, str]:
    """What a saved cache must match: ``lm``'s fingerprint, and the session's adapter when it has one."""
    return {**lm.fingerprint, **({} if adapter is None else {"adapter": adapter.key})}


def load(lm: LoadedModel, source: str | os.PathLike[str] | Sequence[Any], *, verify: bool = True,
         raw: bool = True, adapter: ActiveAdapter | None = None) -> LoadedCache:
    """The cache to restore into a session over ``lm``: a file from ``save_cache`` (over a sharded model,
    this rank's, all ranks agreeing), a raw mlx-lm prompt-cache file, or (``raw``) a list of cache layers.
    chatkit files are checked against ``lm``'s fingerprint (and ``adapter``'s); the layers against the model unless
    ``verify=False`` (then the tensors are not checked against their checksums either)."""
    if isinstance(source, bytes):  # a path, as save_cache takes it
        source = os.fsdecode(source)
    if isinstance(source, (str, os.PathLike)):
        return distributed.restore(lm.distributed, source, lambda f: _load_file(lm, f, verify, raw, adapter))
    return _from_layers(lm, source, verify)


def _load_file(lm: LoadedModel, path: str | os.PathLike[str], verify: bool, raw: bool,
               adapter: ActiveAdapter | None) -> LoadedCache:
    saved = file.load(path, verify=verify)
    where = repr(str(path))
    if saved.info.kind == "chatkit" or not raw:
        check(saved.info)
        file.check_fingerprint(identity(lm, adapter), saved.info.fingerprint, where)
    if verify:
        file.check_layers(lm.model, saved, where)
    return saved


def _from_layers(lm: LoadedModel, source: Sequence[Any], verify: bool) -> LoadedCache:
    layers = [copy_layer(c) for c in source]
    offset = layer_offset(layers)
    if offset is None:
        raise InvalidParamsError("The cache layers disagree on how many tokens they hold: pass one model's cache.")
    info = CacheFileInfo(
        path="", kind="mlx-lm", format_version=None, tokens=offset, opaque_tokens=offset,
        layer_classes=tuple(type(c).__name__ for c in layers), file_bytes=0, tensor_bytes=0,
    )
    saved = LoadedCache(layers, Ledger((), offset), info)
    if verify:
        file.check_layers(lm.model, saved, "The cache passed to cache()")
    return saved


__all__ = ["SETTINGS", "SavedContext", "SavedConversation", "check", "inspect", "load", "read", "save", "settings_of"]

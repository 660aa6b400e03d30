"""``chatkit inspect FILE``: what a saved conversation holds, from its header."""

from __future__ import annotations

import sys
from typing import Any

SHOWN = 6  # messages shown without --all


def inspect(path: str, out: Any = None, *, show_all: bool = False, model: str | None = None) -> int:
    """Print the header of ``path`` to ``out`` (``sys.stdout`` as it is when called); with ``model``, also
    whether the file fits that model."""
    from ..cache.file import check_fingerprint
    from ..errors import CacheFileError, ChatKitError
    from ..session.saved import inspect as inspect_file

    try:
        info = inspect_file(path)
        lines = _describe(info, show_all)
    except ChatKitError:
        raise
    except Exception as exc:  # metadata of the wrong types: still one line naming the file
        raise CacheFileError(
            f"{path!r} could not be read ({type(exc).__name__}: {exc}): it is damaged or not a chatkit file."
        ) from exc
    if model is not None:
        from ..model.load import load

        lm = load(model)
        if info.kind == "chatkit":
            check_fingerprint(lm.fingerprint, info.fingerprint, repr(info.path))  # IncompatibleCacheError names the parts
            lines.append(f"fits {model}: yes (every fingerprint part matches)")
        else:
            lines.append(f"fits {model}: unknown until restored (a raw cache's layers are checked when it is loaded)")
    print("\n".join(lines), file=out if out is not None else sys.stdout)
    return 0


def _describe(info: Any, show_all: bool) -> list[str]:
    lines = [
        f"file: {info.path} ({info.file_bytes:,} bytes, {info.tensor_bytes:,} of tensors)",
        f"kind: {info.kind}" + (f", format {info.format_version}" if info.format_version else ""),
        f"layers: {len(info.layer_classes)} ({', '.join(sorted(set(info.layer_classes)))})",
    ]
    if info.kind == "chatkit":
        lines += [
            f"tokens: {info.tokens}" + (f" ({info.opaque_tokens} opaque)" if info.opaque_tokens else ""),
            f"turns: {info.turns}, messages: {len(info.messages)}, saved at {info.saved_at}",
            f"instructions: {info.instructions!r}",
        ]
        settings = []
        if info.generate_params is not None:  # damaged metadata fails here: one line naming the file
            p = info.generate_params
            settings.append(f"temperature {p.get('temperature')}, max tokens {p.get('max_tokens')}")
        if info.cache_options is not None:
            o = info.cache_options
            settings.append(f"max KV size {o.get('max_kv_size') or 'unlimited'}, KV bits {o.get('kv_bits') or 'none'}")
        if settings:
            lines.append("settings: " + "; ".join(settings))
        fingerprint = dict(info.fingerprint or {})
        lines.append("model fingerprint (hashes of what identifies the model; --model M checks a model against them):")
        lines += [f"  {part:<13} {value}" for part, value in fingerprint.items()]
        shown = info.messages if show_all or len(info.messages) <= SHOWN else info.messages[-SHOWN:]
        if len(shown) < len(info.messages):
            lines.append(f"the last {len(shown)} of {len(info.messages)} messages (--all shows every one):")
        else:
            lines.append(f"{len(shown)} message{'s' if len(shown) != 1 else ''}:")
        for m in shown:
            text = str(m.get("content", "")).replace("\n", " ")
            lines.append(f"  {m.get('role')}: {text[:70]}{'...' if len(text) > 70 else ''}")
    else:
        lines.append("a raw mlx-lm prompt cache: no transcript or fingerprint")
    return lines


__all__ = ["inspect"]

"""``conversations.json``: the list of a server's stored conversations (``--store``), with their tools
and adapters, written atomically beside their cache files and read back at start."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from .response_store import write_file

MANIFEST = "conversations.json"
log = logging.getLogger("chatkit.server")


def write(folder: Path, convs: list[str], tools: dict[str, list[Any]], adapters: dict[str, str]) -> None:
    """List ``convs`` (with those of ``tools`` and ``adapters`` that concern them) in ``folder``'s manifest."""
    data = json.dumps({"conversations": convs, "tools": {c: tools[c] for c in convs if c in tools},
                       "adapters": {c: adapters[c] for c in convs if c in adapters}}).encode()
    write_file(folder / MANIFEST, "the server's conversation list", data)


def read(folder: Path) -> tuple[list[str], dict[str, Any], dict[str, Any]]:
    """(conversations, tools, adapters) of ``folder``'s manifest; nothing when there is none, or a
    damaged one (logged: those conversations start over)."""
    try:
        if (folder / MANIFEST).exists() and not (folder / MANIFEST).is_file():  # a FIFO would block the start
            raise ValueError("not a regular file")
        manifest = json.loads((folder / MANIFEST).read_text())
        return list(manifest["conversations"]), dict(manifest.get("tools") or {}), dict(manifest.get("adapters") or {})
    except FileNotFoundError:
        pass
    except (ValueError, KeyError, TypeError) as exc:
        log.warning("ignoring a damaged %s: %s", MANIFEST, exc)
    return [], {}, {}


__all__ = ["MANIFEST", "read", "write"]

"""llama3 (Llama 3.1 / 3.2): ``<|python_tag|>{"name": ..., "parameters": {...}}`` to the end, or the same
JSON with no marker at all as the whole reply (how their templates render a custom tool's call;
llama.cpp reads a reply that starts with ``{"name"`` the same way)."""

from __future__ import annotations

from typing import Any

from .common import json_value

MARKERS = ("<|python_tag|>", "<|eom_id|>")

RESPONSE_FORMAT: dict[str, Any] = {"transitions": {"normal": [("<|python_tag|>", "tool")], "tool": []}}

_BARE_KEYS = ('"name"', '"type"')  # {"name": ..., "parameters": ...} or {"type": "function", "name": ...}


def parse_tool_call(text: str, tools: Any = None) -> dict[str, Any]:
    call = json_value(text)
    return {"name": call.get("name"), "arguments": call.get("parameters", call.get("arguments", {}))}


def bare_call(text: str, final: bool) -> bool | None:
    """A Llama 3 reply that is a JSON call: it starts (after whitespace) with ``{`` and then a
    ``"name"`` (or ``"type"``) key."""
    head = text.lstrip()
    if not head:
        return False if final else None
    if head[0] != "{":
        return False
    key = head[1:].lstrip()
    if any(key.startswith(k) for k in _BARE_KEYS):
        return True
    if not final and any(k.startswith(key) for k in _BARE_KEYS):
        return None
    return False

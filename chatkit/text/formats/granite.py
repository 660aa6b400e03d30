"""granite (Granite 3.x): ``<|tool_call|>[{"name": ..., "arguments": ...}]`` to the end."""

from __future__ import annotations

from typing import Any

from .common import as_list, json_value

MARKERS = ("<|tool_call|>", "<|start_of_role|>")

RESPONSE_FORMAT: dict[str, Any] = {"transitions": {"normal": [("<|tool_call|>", "tool")], "tool": []}}


def parse_tool_call(text: str, tools: Any = None) -> list[dict[str, Any]]:
    return [{"name": c.get("name"), "arguments": c.get("arguments", {})} for c in as_list(json_value(text))]

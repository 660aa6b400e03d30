"""command_r (Command R7B): ``<|START_THINKING|>`` reasoning, ``<|START_ACTION|>[{"tool_name", "parameters"}]``."""

from __future__ import annotations

from typing import Any

from .common import as_list, json_value

MARKERS = ("<|START_ACTION|>", "<|END_ACTION|>")

RESPONSE_FORMAT: dict[str, Any] = {
    "transitions": {
        "normal": [("<|START_THINKING|>", "reasoning"), ("<|START_ACTION|>", "tool"),
                   ("<|START_RESPONSE|>", "normal"), ("<|END_RESPONSE|>", "normal")],
        "reasoning": [("<|END_THINKING|>", "normal"), ("<|START_ACTION|>", "tool")],
        "tool": [("<|END_ACTION|>", "normal")],
    },
}


def parse_tool_call(text: str, tools: Any = None) -> list[dict[str, Any]]:
    return [{"name": c.get("tool_name"), "arguments": c.get("parameters", {})} for c in as_list(json_value(text))]

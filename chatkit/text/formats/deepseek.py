"""deepseek (R1 and V3.1): ``<｜tool▁call▁begin｜>...<｜tool▁call▁end｜>``, R1 with
``function<｜tool▁sep｜>NAME`` and fenced JSON, V3.1 with ``NAME<｜tool▁sep｜>ARGS``."""

from __future__ import annotations

from typing import Any

from .common import json_value

MARKERS = ("<｜tool▁call▁begin｜>", "<｜tool▁sep｜>")

RESPONSE_FORMAT: dict[str, Any] = {
    "transitions": {
        "normal": [("<｜tool▁calls▁begin｜>", "normal"), ("<｜tool▁call▁begin｜>", "tool"), ("<｜tool▁calls▁end｜>", "normal")],
        "tool": [("<｜tool▁call▁end｜>", "normal")],
    },
}


def parse_tool_call(text: str, tools: Any = None) -> dict[str, Any]:
    head, sep, body = text.partition("<｜tool▁sep｜>")
    if not sep:
        raise ValueError("a DeepSeek tool call without <｜tool▁sep｜>")
    if head.strip() == "function":  # R1: function<｜tool▁sep｜>NAME\n```json\n{...}\n```
        name, _, body = body.partition("\n")
        return {"name": name.strip(), "arguments": json_value(body)}
    return {"name": head.strip(), "arguments": json_value(body)}  # V3.1: NAME<｜tool▁sep｜>{...}

"""harmony (gpt-oss): ``<|channel|>analysis<|message|>`` is reasoning, ``final`` the answer,
``commentary to=functions.NAME ... <|message|>ARGS`` a tool call; ``<|end|>`` / ``<|start|>assistant`` go
back to the header between messages (whose text is dropped)."""

from __future__ import annotations

import re
from typing import Any

from .common import json_value

MARKERS = ("<|channel|>", "<|message|>")

RESPONSE_FORMAT: dict[str, Any] = {
    "initial_state": "header",
    "transitions": {
        "header": [("<|channel|>analysis<|message|>", "reasoning"), ("<|channel|>final<|message|>", "normal"),
                   ("<|channel|>commentary to=functions.", "tool"), (" to=functions.", "tool"),
                   ("<|channel|>commentary<|message|>", "normal"), ("<|start|>assistant", "header")],
        "reasoning": [("<|end|>", "header")],
        "normal": [("<|end|>", "header")],
        "tool": [("<|call|>", "header")],
    },
}

HIDDEN_STATES = ("header",)


def parse_tool_call(text: str, tools: Any = None) -> dict[str, Any]:
    # "get_weather <|constrain|>json<|message|>{...}" or "get_weather<|channel|>commentary json<|message|>{...}"
    head, sep, body = text.partition("<|message|>")
    if not sep:
        raise ValueError("a harmony tool call without <|message|>")
    name = re.split(r"\s|<\|", head.strip(), maxsplit=1)[0]
    return {"name": name, "arguments": json_value(body) if body.strip() else {}}

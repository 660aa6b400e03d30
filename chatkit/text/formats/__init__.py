"""Reply formats mlx-lm 0.32 does not segment or parse, one entry per format.

mlx-lm's ``TokenizerWrapper`` knows ``<think>`` blocks and the tool-call formats of its
``tool_parsers`` (Qwen/Hermes JSON, Mistral, Kimi, ...). For these families it knows neither, so each
is described here once: the text-state-machine transitions (as mlx-lm's chat-template modules give
``RESPONSE_FORMAT``), the state a reply starts in, and the parser of one tool-call segment:

* ``harmony`` (gpt-oss): ``<|channel|>analysis<|message|>`` is reasoning, ``final`` the answer,
  ``commentary to=functions.NAME ... <|message|>ARGS`` a tool call; ``<|end|>`` / ``<|start|>assistant``
  go back to the header between messages.
* ``llama3`` (Llama 3.1 / 3.2): ``<|python_tag|>{"name": ..., "parameters": {...}}`` to the end, or the
  same JSON with no marker at all as the whole reply (how their templates render a custom tool's call;
  llama.cpp reads a reply that starts with ``{"name"`` the same way).
* ``deepseek`` (R1 and V3.1): ``<｜tool▁call▁begin｜>...<｜tool▁call▁end｜>``, R1 with ``function<｜tool▁sep｜>NAME``
  and fenced JSON, V3.1 with ``NAME<｜tool▁sep｜>ARGS``.
* ``granite`` (Granite 3.x): ``<|tool_call|>[{"name": ..., "arguments": ...}]`` to the end.
* ``command_r`` (Command R7B): ``<|START_THINKING|>`` reasoning, ``<|START_ACTION|>[{"tool_name", "parameters"}]``.

Detection is by the family's special tokens in the vocabulary, checked only when mlx-lm found no
format of its own.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

Edges = dict[str, list[tuple[str, str]]]


@dataclass(frozen=True)
class Format:
    """One reply format: state-machine edges, the reply's initial state, the tool-call parser, and the
    machine states whose text is control (dropped)."""

    name: str
    markers: tuple[str, ...]  # special tokens that identify the family
    transitions: Edges
    parse: Callable[[str, Any], Any] | None = None
    initial_state: str = "normal"
    hidden: frozenset[str] = field(default_factory=frozenset)
    # A call written without a marker: given the reply's text so far, whether the reply is one (True),
    # is not (False) or cannot be told yet (None); ``final`` when no more text will come.
    bare_call: Callable[[str, bool], bool | None] | None = None


def _json(text: str) -> Any:
    text = text.strip()
    fenced = re.match(r"^```(?:json)?\s*(.*?)\s*```$", text, re.S)
    return json.loads(fenced.group(1) if fenced else text)


def _harmony_call(text: str, tools: Any = None) -> dict[str, Any]:
    # "get_weather <|constrain|>json<|message|>{...}" or "get_weather<|channel|>commentary json<|message|>{...}"
    head, sep, body = text.partition("<|message|>")
    if not sep:
        raise ValueError("a harmony tool call without <|message|>")
    name = re.split(r"\s|<\|", head.strip(), maxsplit=1)[0]
    return {"name": name, "arguments": _json(body) if body.strip() else {}}


def _llama3_call(text: str, tools: Any = None) -> dict[str, Any]:
    call = _json(text)
    return {"name": call.get("name"), "arguments": call.get("parameters", call.get("arguments", {}))}


_BARE_KEYS = ('"name"', '"type"')  # {"name": ..., "parameters": ...} or {"type": "function", "name": ...}


def _llama3_bare(text: str, final: bool) -> bool | None:
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


def _deepseek_call(text: str, tools: Any = None) -> dict[str, Any]:
    head, sep, body = text.partition("<｜tool▁sep｜>")
    if not sep:
        raise ValueError("a DeepSeek tool call without <｜tool▁sep｜>")
    if head.strip() == "function":  # R1: function<｜tool▁sep｜>NAME\n```json\n{...}\n```
        name, _, body = body.partition("\n")
        return {"name": name.strip(), "arguments": _json(body)}
    return {"name": head.strip(), "arguments": _json(body)}  # V3.1: NAME<｜tool▁sep｜>{...}


def _granite_calls(text: str, tools: Any = None) -> list[dict[str, Any]]:
    calls = _json(text)
    return [{"name": c.get("name"), "arguments": c.get("arguments", {})} for c in (calls if isinstance(calls, list) else [calls])]


def _command_r_calls(text: str, tools: Any = None) -> list[dict[str, Any]]:
    calls = _json(text)
    return [{"name": c.get("tool_name"), "arguments": c.get("parameters", {})} for c in (calls if isinstance(calls, list) else [calls])]


FORMATS: tuple[Format, ...] = (
    Format(
        "harmony", ("<|channel|>", "<|message|>"),
        {
            "header": [("<|channel|>analysis<|message|>", "reasoning"), ("<|channel|>final<|message|>", "normal"),
                       ("<|channel|>commentary to=functions.", "tool"), (" to=functions.", "tool"),
                       ("<|channel|>commentary<|message|>", "normal"), ("<|start|>assistant", "header")],
            "reasoning": [("<|end|>", "header")],
            "normal": [("<|end|>", "header")],
            "tool": [("<|call|>", "header")],
        },
        _harmony_call, initial_state="header", hidden=frozenset({"header"}),
    ),
    Format("llama3", ("<|python_tag|>", "<|eom_id|>"), {"normal": [("<|python_tag|>", "tool")], "tool": []}, _llama3_call,
           bare_call=_llama3_bare),
    Format(
        "deepseek", ("<｜tool▁call▁begin｜>", "<｜tool▁sep｜>"),
        {
            "normal": [("<｜tool▁calls▁begin｜>", "normal"), ("<｜tool▁call▁begin｜>", "tool"), ("<｜tool▁calls▁end｜>", "normal")],
            "tool": [("<｜tool▁call▁end｜>", "normal")],
        },
        _deepseek_call,
    ),
    Format("granite", ("<|tool_call|>", "<|start_of_role|>"), {"normal": [("<|tool_call|>", "tool")], "tool": []}, _granite_calls),
    Format(
        "command_r", ("<|START_ACTION|>", "<|END_ACTION|>"),
        {
            "normal": [("<|START_THINKING|>", "reasoning"), ("<|START_ACTION|>", "tool"),
                       ("<|START_RESPONSE|>", "normal"), ("<|END_RESPONSE|>", "normal")],
            "reasoning": [("<|END_THINKING|>", "normal"), ("<|START_ACTION|>", "tool")],
            "tool": [("<|END_ACTION|>", "normal")],
        },
        _command_r_calls,
    ),
)


def detect(vocabulary: Mapping[str, int]) -> Format | None:
    """The format whose special tokens are all in ``vocabulary``, if any."""
    return next((f for f in FORMATS if all(m in vocabulary for m in f.markers)), None)


__all__ = ["FORMATS", "Format", "detect"]

"""What a chat template can render, probed once per template, and messages adapted to it.

Chat templates disagree on what a conversation may hold: Gemma 2 has no system role and no tool role,
DeepSeek-R1 concatenates tool-call ``arguments`` as a string where Llama 3.1 wants an object, Hermes-3
loops over ``tools`` and fails on ``None`` where Llama 3.1 tests ``tools is not none``, Phi-3.5 drops
tool messages without an error. As llama.cpp does (minja's template capabilities), each template is
rendered once with small probe conversations, and the messages of every later rendering are adapted to
what it showed it can do, so that every template renders every conversation chatkit can hold:

* no system role: the instructions go into the first user message (as Gemma's docs do);
* no tool calls: an assistant's calls are written into its content, in the tokenizer's own call format
  when chatkit can write it (what its parser reads back), else as JSON;
* no tool role (or tool messages dropped): results become user text, merged with a neighbouring user
  message so roles still alternate;
* arguments as a string when the template concatenates them;
* images of a tool result that the template cannot place in a tool message (it has no tool role, or writes
  a tool message's content as a string): they go to the user message that follows the results, or to a
  user message of their own after them (text stays in the tool message; the images keep their order).

A template that ignores the ``tools`` it is given gets a warning (once).
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

Render = Callable[[list[dict[str, Any]], Any], str]  # (message dicts, tools) -> text; raises on failure

_ID = "a1b2c3d4e"  # 9 alphanumerics: the id form every template accepts (Mistral's require it)
_PROBE_TOOL = {"type": "function", "function": {"name": "probe_tool_x7", "description": "d",
                                                "parameters": {"type": "object", "properties": {}}}}


@dataclass(frozen=True)
class Capabilities:
    """What one template showed it renders."""

    no_tools: Any = None  # what to pass as ``tools`` when there are none: None, or [] for templates that loop over it
    system_role: bool = True
    tool_calls: bool = True
    arguments_as_string: bool = False
    tool_role: bool = True
    renders_tools: bool = True
    tool_images: bool = True  # a tool message's image parts are placed (Qwen2-VL, LLaVA); else they move (see adapt)


def _try(render: Render, messages: list[dict[str, Any]], tools: Any = None) -> str | None:
    try:
        text = render(messages, tools)
    except Exception:  # the template's own raise_exception, jinja errors, type errors: "cannot"
        return None
    return text if isinstance(text, str) else None


def probe(render: Render) -> Capabilities:
    """Probe a template through ``render`` with a few small conversations."""
    user = {"role": "user", "content": "probe_user_q1"}
    no_tools: Any = None
    if _try(render, [user], None) is None and _try(render, [user], []) is not None:
        no_tools = []
    system_text = _try(render, [{"role": "system", "content": "probe_sys_s1"}, user], no_tools)
    system_role = system_text is not None and "probe_sys_s1" in system_text

    def exchange(arguments: Any | None) -> list[dict[str, Any]]:
        call = {"id": _ID, "type": "function", "function": {"name": "probe_fn_f1", "arguments": arguments}}
        asked = ({"role": "assistant", "content": "", "tool_calls": [call]} if arguments is not None
                 else {"role": "assistant", "content": "probe_call_c1"})
        return [user, asked, {"role": "tool", "content": "probe_result_r1", "tool_call_id": _ID, "name": "probe_fn_f1"},
                {"role": "assistant", "content": "probe_answer_a1"}]

    def shows_call(text: str | None) -> bool:
        return text is not None and "probe_fn_f1" in text and "probe_value_v1" in text

    as_object = _try(render, exchange({"probe_arg": "probe_value_v1"}), no_tools)
    as_string = None if shows_call(as_object) else _try(render, exchange(json.dumps({"probe_arg": "probe_value_v1"})), no_tools)
    tool_calls = shows_call(as_object) or shows_call(as_string)
    arguments_as_string = not shows_call(as_object) and shows_call(as_string)
    # The tool role, apart from calls: some templates render tool results but not the calls themselves.
    shown = next((t for t in (as_object, as_string) if t is not None), None) if tool_calls else _try(render, exchange(None), no_tools)
    tool_role = shown is not None and "probe_result_r1" in shown
    with_tools = _try(render, [user], [_PROBE_TOOL])
    renders_tools = with_tools is not None and "probe_tool_x7" in with_tools
    return Capabilities(no_tools, system_role, tool_calls, arguments_as_string, tool_role, renders_tools,
                        tool_role and _places_tool_images(render, exchange(_calls(tool_calls, arguments_as_string)), no_tools))


def _calls(tool_calls: bool, as_string: bool) -> Any:
    """The probe call's arguments as the template renders them (``None``: it renders no calls)."""
    arguments = {"probe_arg": "probe_value_v1"}
    return None if not tool_calls else json.dumps(arguments) if as_string else arguments


def _places_tool_images(render: Render, messages: list[dict[str, Any]], no_tools: Any) -> bool:
    """Whether the template writes something for an image part of a tool message (``messages[2]``) and
    reads its parts (not their ``repr``)."""
    text = {"type": "text", "text": "probe_result_r1"}

    def with_content(content: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [*messages[:2], {**messages[2], "content": content}, *messages[3:]]

    plain = _try(render, with_content([text]), no_tools)
    shown = _try(render, with_content([{"type": "image"}, text]), no_tools)
    return plain is not None and "probe_result_r1" in plain and "'type'" not in plain and shown not in (None, plain)


WriteCalls = Callable[[list[dict[str, Any]]], "str | None"]  # calls -> their text in the model's own format


def adapt(messages: Sequence[Mapping[str, Any]], caps: Capabilities, write_calls: WriteCalls | None = None) -> list[dict[str, Any]]:
    """``messages`` (template dicts) rewritten into what ``caps`` says the template renders; ``write_calls``
    writes calls the template cannot render in the model's own format (``None`` from it: JSON)."""
    out: list[dict[str, Any]] = []
    was_converted = False  # the last message out is a tool result written as user text
    moved: list[dict[str, Any]] = []  # image parts of tool results the template cannot place there
    for m in messages:
        d = dict(m)
        if moved and d["role"] != "tool":
            _place(out, moved, d)
        if d["role"] == "tool" and isinstance(d.get("content"), list) and not caps.tool_images:
            moved.extend(p for p in d["content"] if p.get("type") == "image")
            d["content"] = "\n\n".join(p["text"] for p in d["content"] if p.get("type") == "text")
        if d.get("tool_calls"):
            if not caps.tool_calls:
                calls = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in d.pop("tool_calls")]
                native = write_calls(calls) if write_calls is not None else None
                text = native if native is not None else json.dumps({"tool_calls": calls}, ensure_ascii=False)
                d["content"] = f"{d['content']}\n{text}" if d.get("content") else text
            elif caps.arguments_as_string:
                d["tool_calls"] = [
                    {**c, "function": {**c["function"], "arguments": _as_string(c["function"]["arguments"])}}
                    for c in d["tool_calls"]
                ]
        converted = d["role"] == "tool" and not caps.tool_role
        if converted:
            response = {"tool_call_id": d.get("tool_call_id"), "name": d.get("name"), "content": d["content"]}
            d = {"role": "user", "content": json.dumps({"tool_response": response}, ensure_ascii=False)}
        if d["role"] == "user" and out and out[-1]["role"] == "user" and (converted or was_converted):
            out[-1] = {**out[-1], "content": _joined(out[-1]["content"], d["content"])}  # roles must alternate
            continue
        was_converted = converted
        out.append(d)
    if moved:
        _place(out, moved, None)
    if not caps.system_role and out and out[0]["role"] == "system":
        system, rest = out[0], out[1:]
        if rest and rest[0]["role"] == "user":
            rest[0] = {**rest[0], "content": f"{system['content']}\n\n{rest[0]['content']}"}
        else:
            rest.insert(0, {"role": "user", "content": system["content"]})
        out = rest
    return out


def _place(out: list[dict[str, Any]], images: list[dict[str, Any]], following: dict[str, Any] | None) -> None:
    """Put the moved ``images`` (then emptied) before the content of the user message that shows them: the
    ``following`` user message, the results written as user text (``out[-1]``), else a new one after them."""
    parts, images[:] = list(images), []
    if following is not None and following["role"] == "user":
        following["content"] = _joined(parts, following["content"])
    elif out and out[-1]["role"] == "user":
        out[-1] = {**out[-1], "content": _joined(parts, out[-1]["content"])}
    else:
        out.append({"role": "user", "content": [*parts, {"type": "text", "text": ""}]})


def _joined(first: Any, second: Any) -> Any:
    """Two contents as one: strings joined by a newline, else content parts (images, then texts)."""
    if isinstance(first, str) and isinstance(second, str):
        return first + "\n" + second
    parts = [p for c in (first, second) for p in (c if isinstance(c, list) else [{"type": "text", "text": c}])]
    images = [p for p in parts if p.get("type") == "image"]
    texts = [p["text"] for p in parts if p.get("type") == "text" and p["text"]]
    return [*images, {"type": "text", "text": "\n".join(texts)}]


def _as_string(arguments: Any) -> str:
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


def warn_ignored_tools(caps: Capabilities, tools: Any, warned: set[str]) -> None:
    """Warn once when tools are given to a template that does not render them."""
    if tools and not caps.renders_tools and "tools" not in warned:
        warned.add("tools")
        warnings.warn(
            "This chat template does not render the tools it is given: the model will not see their schemas. "
            "Describe them in the instructions, or pass a template that renders tools with .chat_template(...).",
            stacklevel=4,
        )


def warn_dropped_tool_messages(caps: Capabilities, messages: Sequence[Mapping[str, Any]], warned: set[str]) -> None:
    """Warn once when tool results are rewritten as user text because the template has no tool role."""
    if not caps.tool_role and any(m["role"] == "tool" for m in messages) and "tool_role" not in warned:
        warned.add("tool_role")
        warnings.warn(
            "This chat template has no tool role (or drops tool messages): tool results are rendered as user text.",
            stacklevel=4,
        )


__all__ = ["Capabilities", "adapt", "probe", "warn_dropped_tool_messages", "warn_ignored_tools"]

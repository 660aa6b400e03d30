"""OpenAI's wire format, the parts both APIs share: a request's messages, tools, sampling parameters and
output format read into plain data (a ``TurnRequest``), tool results linked to their calls, and a reply's
chunks as the pieces a client is streamed (``Deltas``).

Only what chatkit can honour is accepted; a field it cannot (a tool_choice that forces a call where the
model's call format has no grammar) is a 400 naming the field rather than being ignored.
Function tools, assistant tool calls, tool results and reasoning travel in OpenAI's fields
(``tool_calls``, ``role: "tool"`` + ``tool_call_id``, ``reasoning_content``; on ``/v1/responses``
``function_call`` / ``function_call_output`` / ``reasoning`` items). A tool marked ``strict: true``
makes the turn's tool calls guided (``strict_tools=True``: every call's arguments follow its tool's
schema); that needs the ``guided`` extra and a template whose call format chatkit can constrain, else
a 400 says so.
"""

from __future__ import annotations

import importlib.util
import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from ..errors import ChatKitError
from ..images import Image, as_image
from ..messages import ChatMessage, Role, ToolCall
from ..params import GenerateParams
from ..session.results import StreamChunk
from ..text.reply import PieceKind
from .errors import BadRequestError
from .tool_choice import read_choice


@dataclass(frozen=True)
class TurnRequest:
    """One request as chatkit sees it: after ``instructions`` + ``history``, the messages ``added``
    (a user message, or the tool results answering the last reply's calls) are answered."""

    instructions: str | None
    history: tuple[ChatMessage, ...]
    added: tuple[ChatMessage, ...]  # the messages this request adds to the conversation; the last is answered
    params: GenerateParams
    stream: bool = False
    include_usage: bool = False
    schema: dict[str, Any] | None = None  # response_format's JSON Schema (guided generation)
    previous_response_id: str | None = None  # /v1/responses only
    store: bool = True
    tools: tuple[dict[str, Any], ...] | None = None  # function schemas, {"type": "function", "function": {...}}
    tool_choice: str = "auto"  # or "none": the model may not call them; "required": it must (``tool_choice.py``)
    tool_name: str | None = None  # tool_choice named this function: the call is to it
    parallel_tool_calls: bool = True  # false: at most one call per reply
    logprobs: int | None = None  # asked for: how many top tokens each entry lists (``logprobs.py``)
    n: int = 1  # choices (chat completions; ``choices.py``)
    strict_tools: bool = False  # a tool said strict: true: calls are constrained to the tools' schemas
    echo: dict[str, Any] = field(default_factory=dict)  # request fields a response repeats back
    model: str | None = None  # the request's model field: the base model or an adapter (``models.py``)


def new_id(prefix: str) -> str:
    """A new id as OpenAI's look: ``prefix_<32 hex digits>``."""
    return f"{prefix}_{uuid.uuid4().hex}"


def guided_available() -> bool:
    """Whether guided generation (``chatkit.guided``) can run here: the ``guided`` extra (llguidance)
    is installed and imports (an install that is found but broken counts as missing). ``response_format``,
    ``text.format`` and strict tools need it."""
    try:
        importlib.import_module("chatkit.guided")
    except Exception:  # ImportError, or whatever a broken native extension raises
        return False
    return True


def require_guided(param: str, what: str) -> None:
    """``BadRequestError`` naming the extra to install when ``what`` (asked by ``param``) needs guided
    generation and this server lacks it: refused before any work."""
    if not guided_available():
        raise BadRequestError(
            f"{param}: {what} needs guided generation, which this server does not have installed: its "
            'administrator can add it with pip install "chatkit[guided]" (the server extra includes it) '
            "and restart; until then, leave it out of the request.", param=param,
        )


def split_conversation(
    instructions: str | None, messages: Sequence[ChatMessage]
) -> tuple[str | None, tuple[ChatMessage, ...], tuple[ChatMessage, ...]]:
    """(instructions, history, new messages): leading system messages join the instructions (as a
    session's builder would take them); the new messages are the last one, or the tool results that
    end the conversation (they answer the calls of the assistant message before them)."""
    messages = list(messages)
    parts = [instructions] if instructions is not None else []
    while len(messages) > 1 and messages[0].role is Role.SYSTEM:
        parts.append(messages.pop(0).content)
    last = messages[-1]
    if last.role is Role.ASSISTANT:
        raise BadRequestError(
            "The last message is the assistant's: end with a user message (or the results of its tool calls) "
            "for the model to answer.", param="messages"
        )
    count = 1
    while last.role is Role.TOOL and count < len(messages) and messages[-count - 1].role is Role.TOOL:
        count += 1
    new = messages[-count:]
    for m in new:
        if not m.content.strip():
            what = "a tool message (the tool's result)" if m.role is Role.TOOL else "the last message"
            raise BadRequestError(f"{what.capitalize()} is empty: send some text.", param="messages")
    return ("\n\n".join(parts) if parts else None), tuple(messages[:-count]), tuple(new)


def link_tool_results(messages: Sequence[ChatMessage], param: str, offset: int = 0) -> list[ChatMessage]:
    """Check that every tool message answers a call of the assistant message before it (by
    ``tool_call_id``) and that every call is answered before the conversation goes on, as OpenAI
    does; each tool message gets its call's ``name`` (as a session's own tool results have it).
    ``offset``: how many of ``messages`` came before the request's own (named ``param[i]``)."""
    out: list[ChatMessage] = []
    pending: dict[str, ToolCall] = {}
    asked = ""  # where the assistant message whose calls are pending is

    def unanswered() -> BadRequestError:
        return BadRequestError(
            f"{asked}: its tool calls {sorted(pending)} have no result: send one tool message per call (with its "
            "tool_call_id) right after it.", param=asked)

    for i, m in enumerate(messages):
        where = f"{param}[{i - offset}]" if i >= offset else param
        if m.role is Role.TOOL:
            if m.tool_call_id is None:
                raise BadRequestError(f"{where}: a tool message needs the tool_call_id of the call it answers.",
                                      param=where)
            call = pending.pop(m.tool_call_id, None)
            if call is None:
                raise BadRequestError(
                    f"{where}: tool_call_id {m.tool_call_id!r} answers no unanswered call of the assistant message "
                    f"before it (those are {sorted(pending) or 'none'}).", param=where)
            m = replace(m, name=m.name or call.name)
        elif pending:
            raise unanswered()
        elif m.role is Role.ASSISTANT:
            pending, asked = {c.id: c for c in m.tool_calls}, where
        out.append(m)
    if pending and out[-1].role is Role.TOOL:
        raise unanswered()
    return out


def read_model(body: Mapping[str, Any]) -> str | None:
    """The request's ``model`` (what it selects is ``ServedModels.select``'s business)."""
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise BadRequestError("model must be a string: a model id GET /v1/models lists.", param="model")
    return model


def read_bool(body: Mapping[str, Any], name: str, default: bool) -> bool:
    """``body[name]`` as true or false (``default`` when absent or null)."""
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise BadRequestError(f"{name} must be true or false.", param=name)
    return value


def read_tools(body: Mapping[str, Any], *, flat: bool) -> dict[str, Any]:
    """The request's tool fields of a ``TurnRequest``: ``tools``, each as ``{"type": "function",
    "function": {name, description, parameters}}`` (``flat``: the Responses API's ``{"type": "function",
    "name", ...}``), ``tool_choice`` + ``tool_name`` + ``parallel_tool_calls`` (``tool_choice.read_choice``)
    and ``strict_tools``: whether a tool asked for strict calls (they hold for all of a turn's tools)."""
    for name in ("functions", "function_call"):
        if body.get(name):
            raise BadRequestError(f"{name} is the deprecated form of tools: send tools and tool_choice instead.",
                                  param=name)
    raw = body.get("tools")
    tools: list[dict[str, Any]] | None = None
    strict = False
    if raw:
        if not isinstance(raw, list):
            raise BadRequestError("tools must be a list of function tools.", param="tools")
        tools = []
        for j, item in enumerate(raw):
            schema, flag = _function_tool(item, f"tools[{j}]", flat)
            strict = strict or flag
            tools.append({"type": "function", "function": schema})
        names = [t["function"]["name"] for t in tools]
        if len(set(names)) != len(names):
            raise BadRequestError(f"tools: names must be unique, got {names}.", param="tools")
    if strict and tools:
        require_guided("tools", "strict: true (calls held to the tools' schemas)")
    choice, forced, parallel = read_choice(body, [t["function"]["name"] for t in tools or ()], flat=flat)
    return {"tools": tuple(tools) if tools else None, "tool_choice": choice, "tool_name": forced,
            "parallel_tool_calls": parallel, "strict_tools": strict}


def _function_tool(item: Any, where: str, flat: bool) -> tuple[dict[str, Any], bool]:
    """One function tool as ``{name, description, parameters}``, and whether it asked for strict calls."""
    if not isinstance(item, Mapping) or item.get("type", "function") != "function":
        kind = item.get("type") if isinstance(item, Mapping) else type(item).__name__
        raise BadRequestError(f"{where}: only function tools are supported, got {kind!r}.", param=where)
    function = item if flat else item.get("function")
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str) or not function["name"]:
        shape = '{"type": "function", "name": ...}' if flat else '{"type": "function", "function": {"name": ...}}'
        raise BadRequestError(f"{where}: a function tool needs a name: {shape}.", param=where)
    schema: dict[str, Any] = {"name": function["name"]}
    for key, kind in (("description", str), ("parameters", Mapping)):
        value = function.get(key)
        if value is not None and not isinstance(value, kind):
            raise BadRequestError(f"{where}: {key} must be a {'string' if kind is str else 'JSON Schema object'}.",
                                  param=where)
        if value is not None:
            schema[key] = dict(value) if isinstance(value, Mapping) else value
    flag = function.get("strict")
    if flag is not None and not isinstance(flag, bool):
        raise BadRequestError(f"{where}: strict must be true or false.", param=where)
    return schema, bool(flag)


def read_content(content: Any, where: str) -> tuple[str, tuple[Image, ...]]:
    """A user message's content: its text and its images, ``image_url`` parts (chat completions:
    ``{"image_url": {"url": ...}}``) or ``input_image`` parts (responses: ``{"image_url": ...}``), each a
    base64 data URL; anything else is read as :func:`read_text` reads it."""
    if not isinstance(content, list):
        return read_text(content, where), ()
    texts, images = [], []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind not in ("image_url", "input_image"):
            texts.append(part)
            continue
        url = part.get("image_url")
        url = url.get("url") if isinstance(url, Mapping) else url
        if not isinstance(url, str) or not url.startswith("data:"):
            raise BadRequestError(f"{where}[{j}]: send an image as a base64 data URL "
                                  "('data:image/png;base64,...'); URLs and file ids are not fetched.", param=where)
        try:
            images.append(as_image(url))
        except ChatKitError as exc:
            raise BadRequestError(f"{where}[{j}]: {exc}", param=where) from None
    return read_text(texts, where), tuple(images)


def read_text(content: Any, where: str) -> str:
    """Message content: a string, or a list of text parts joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") not in ("text", "input_text", "output_text"):
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                raise BadRequestError(f"{where}: only text content is supported, got a {kind!r} part.", param=where)
            text = part.get("text")
            if not isinstance(text, str):
                raise BadRequestError(f"{where}: a text part needs a string 'text'.", param=where)
            texts.append(text)
        return "".join(texts)
    raise BadRequestError(f"{where}: content must be a string or a list of text parts.", param=where)


def read_message(data: Any, where: str) -> ChatMessage:
    """A chat message (``where``: ``messages[i]``, or a Responses ``input[i]`` item) as a ``ChatMessage``."""
    if not isinstance(data, Mapping):
        raise BadRequestError(f"{where} must be an object with role and content.", param=where)
    role = data.get("role")
    if role == "function" or data.get("function_call"):
        raise BadRequestError(f"{where}: function messages are the deprecated form of tool calls: send tool_calls "
                              "and tool messages instead.", param=where)
    if role == "developer":
        role = "system"
    if role not in ("system", "user", "assistant", "tool"):
        raise BadRequestError(f"{where}: unknown role {role!r}: use system, user, assistant or tool.", param=where)
    name = data.get("name")
    raw_calls = data.get("tool_calls") or []
    if raw_calls and role != "assistant":
        raise BadRequestError(f"{where}: only an assistant message has tool_calls.", param=f"{where}.tool_calls")
    if not isinstance(raw_calls, list):
        raise BadRequestError(f"{where}.tool_calls must be a list.", param=f"{where}.tool_calls")
    calls = tuple(read_tool_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(raw_calls))
    content = data.get("content")
    text, images = ("", ()) if content is None and role == "assistant" and calls else read_content(content, f"{where}.content")
    if images and role != "user":
        raise BadRequestError(f"{where}: only a user message can hold images.", param=f"{where}.content")
    reasoning = next((data[k] for k in ("reasoning_content", "reasoning") if data.get(k) is not None), None)
    if reasoning is not None and (role != "assistant" or not isinstance(reasoning, str)):
        raise BadRequestError(f"{where}: reasoning_content is an assistant message's string.", param=where)
    call_id = data.get("tool_call_id")
    if call_id is not None and not isinstance(call_id, str):
        raise BadRequestError(f"{where}.tool_call_id must be a string.", param=f"{where}.tool_call_id")
    try:
        return ChatMessage(Role(role), text, name if isinstance(name, str) else None, reasoning=reasoning,
                           tool_calls=calls, tool_call_id=call_id if role == "tool" else None, images=images)
    except ChatKitError as exc:
        raise BadRequestError(f"{where}: {exc}", param=where) from exc


def read_tool_call(data: Any, where: str) -> ToolCall:
    """An assistant message's call, ``{"id", "type": "function", "function": {"name", "arguments"}}``."""
    if not isinstance(data, Mapping) or data.get("type", "function") != "function" or not data.get("id"):
        raise BadRequestError(f'{where}: a tool call is {{"id", "type": "function", "function": {{"name", '
                              '"arguments"}}}} with the id the tool message answers.', param=where)
    function = data.get("function")
    try:
        if isinstance(function, Mapping):
            name, arguments = function.get("name"), function.get("arguments")
            if isinstance(name, str) and isinstance(arguments, str) and not _is_json_object(arguments):
                # A call the model did not finish (cut by max_tokens) comes back as it was sent: unread, as in the session.
                return ToolCall(str(data["id"]), name, {}, error="The tool call's arguments are not a JSON object.",
                                text=arguments)
        return ToolCall.from_dict(data)
    except ChatKitError as exc:
        raise BadRequestError(f"{where}: {exc}", param=where) from exc


def _is_json_object(text: str) -> bool:
    try:
        return not text.strip() or isinstance(json.loads(text), dict)
    except (ValueError, RecursionError):
        return False


def read_params(body: Mapping[str, Any], defaults: GenerateParams, max_tokens: Any, max_name: str) -> GenerateParams:
    """``defaults`` with the request's sampling fields on top; ``max_name``: the field ``max_tokens`` came from."""
    changes: dict[str, Any] = {}
    if max_tokens is not None:
        changes["max_tokens"] = max_tokens
    for name in ("temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty", "presence_penalty",
                 "frequency_penalty"):
        if body.get(name) is not None:
            changes[name] = body[name]
    stop = body.get("stop")
    if stop is not None:
        changes["stop"] = (stop,) if isinstance(stop, str) else stop
    bias = body.get("logit_bias")
    if bias:
        try:
            changes["logit_bias"] = {int(k): float(v) for k, v in dict(bias).items()}
        except (TypeError, ValueError) as exc:
            raise BadRequestError("logit_bias maps token ids to numbers.", param="logit_bias") from exc
    params = defaults.copy()
    for name, value in changes.items():
        try:
            params = params.copy(**{name: value})
            params.validate()
        except ChatKitError as exc:
            shown = max_name if name == "max_tokens" else name
            text = str(exc).replace(f"GenerateParams.{name}=", "", 1)  # the request's field, not the Python class
            raise BadRequestError(f"{shown}: {text}", param=shown) from exc
        except (TypeError, ValueError) as exc:
            raise BadRequestError(f"{name}: {exc}", param=name) from exc
    return params


def format_schema(fmt: Any, param: str) -> dict[str, Any] | None:
    """The JSON Schema a reply must follow, from ``{"type": "json_schema", "schema": ...}`` or
    ``{"type": "json_object"}``; ``None`` for plain text."""
    if fmt is None or (isinstance(fmt, Mapping) and fmt.get("type") == "text"):
        return None
    if not isinstance(fmt, Mapping) or fmt.get("type") not in ("json_schema", "json_object"):
        raise BadRequestError(f"{param}: use type text, json_schema or json_object.", param=param)
    require_guided(param, "structured output (json_schema, json_object)")
    if fmt["type"] == "json_object":
        return {"type": "object"}
    schema = fmt.get("schema")
    if not isinstance(schema, Mapping):
        raise BadRequestError(f"{param}: a json_schema format needs a 'schema' object.", param=param)
    return dict(schema)


def arguments_text(call: ToolCall) -> str:
    """A call's arguments as the JSON string OpenAI sends. A call the model did not finish or wrote
    wrong (``call.error``) gets its text from the ``"arguments"`` key on, as far as the model wrote it
    (the whole call text in formats without that key): not valid JSON, as OpenAI sends a call cut by
    ``max_tokens``, and never ``"{}"``, which a client would run."""
    if call.error is None:
        return json.dumps(call.arguments, ensure_ascii=False)
    text = (call.text or "").strip()
    key = re.search(r'"(?:arguments|parameters)"\s*:\s*', text)  # the JSON formats' arguments, as far as they go
    return text[key.end() :] if key else text


COMPACTED_HEADER = "Chatkit-Context-Compacted"  # on a reply whose turn compacted its conversation's context


def compaction_usage(compaction: Mapping[str, int] | None) -> dict[str, Any]:
    """The ``usage`` key that reports a compaction (``Lease.compaction()``): ``{"context": {"compacted":
    true, "dropped_messages": M, "dropped_tokens": N, "summary_tokens": S}}``, or nothing."""
    return {} if compaction is None else {"context": {"compacted": True, **compaction}}


def compaction_headers(compaction: Mapping[str, int] | None) -> dict[str, str] | None:
    """The response header that reports a compaction: ``Chatkit-Context-Compacted: dropped_messages=M,
    dropped_tokens=N, summary_tokens=S`` (a structured-field dictionary), or none."""
    if compaction is None:
        return None
    return {COMPACTED_HEADER: ", ".join(f"{k}={v}" for k, v in compaction.items())}


class Deltas:
    """A reply's chunks as the pieces a client is sent, ``(PieceKind.REASONING | PieceKind.TEXT, str)`` or
    ``(PieceKind.TOOL_CALL, ToolCall)``, so that they add up to the message the session commits: when a reply reasons or calls
    tools, the newlines around the markers are the template's glue and the session drops them
    (``Segmenter.reply``); so newlines at either end of a kind's text are held back until text
    follows them, and at the end are sent only for a plain reply. A client that re-sends what it was
    streamed then continues the session exactly."""

    def __init__(self) -> None:
        self._glue = False  # the reply has reasoning or a tool call
        self._started: set[PieceKind] = set()
        self._held: dict[PieceKind, str] = {}

    def feed(self, chunk: StreamChunk) -> list[tuple[PieceKind, Any]]:
        if chunk.kind == PieceKind.TOOL_CALL:
            self._glue = True
            return [(PieceKind.TOOL_CALL, chunk.tool_call)] if chunk.tool_call is not None else []
        if chunk.kind not in (PieceKind.TEXT, PieceKind.REASONING) or not chunk.text:
            return []
        kind, text = chunk.kind, chunk.text
        self._glue = self._glue or kind == PieceKind.REASONING
        held = self._held.pop(kind, "")
        if kind not in self._started:
            body = text.lstrip("\n")
            if not body:
                self._held[kind] = held + text
                return []
            self._started.add(kind)
            text = body if self._glue else held + text
            held = ""
        body = text.rstrip("\n")
        if body:
            self._held[kind] = text[len(body):]
            return [(kind, held + body)]
        self._held[kind] = held + text
        return []

    def end(self) -> list[tuple[PieceKind, Any]]:
        """What is still held back, for a plain reply (a reasoning or tool reply's newlines are glue)."""
        held, self._held = self._held, {}
        return [] if self._glue else [(kind, text) for kind, text in held.items() if text]

__all__ = [
    "COMPACTED_HEADER", "Deltas", "TurnRequest", "arguments_text", "compaction_headers", "compaction_usage", "format_schema", "guided_available", "link_tool_results", "new_id",
    "require_guided",
    "read_bool", "read_message", "read_model", "read_params", "read_text", "read_tool_call",
    "read_tools", "split_conversation",
]

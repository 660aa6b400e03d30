"""Anthropic's Messages API on the wire: a ``POST /v1/messages`` body read into a ``TurnRequest`` (the
same plain data chat completions makes, so a turn runs on the same pooled sessions), and a reply
shaped as a ``message``, its stream as Anthropic's server-sent events, an error as Anthropic's JSON.

Blocks map onto chatkit's messages: ``system`` is the instructions; an assistant message's
``thinking`` blocks its reasoning, ``text`` blocks its content, ``tool_use`` blocks its tool calls;
a user message's ``tool_result`` blocks are tool messages (answering the calls by ``tool_use_id``),
its ``text`` blocks the user's message and its ``image`` blocks (base64) that message's images (for a
vision-language model). What chatkit cannot honour (image URLs, forced tool calls, server
tools, a reply that continues an assistant message) is a 400 naming the field.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from ..errors import ChatKitError
from ..images import Image, as_image
from ..messages import ChatMessage, Role, ToolCall
from ..params import GenerateParams
from ..session.results import TurnStats
from . import wire
from .body import read_metadata, read_object
from .errors import BadRequestError, http_message, status_of
from .wire import TurnRequest, read_bool, read_model, read_params, split_conversation

SIGNATURE = "chatkit"  # a thinking block's signature: opaque to clients, ignored when they send it back
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               409: "invalid_request_error", 413: "request_too_large", 429: "rate_limit_error",
               503: "overloaded_error"}


def parse_messages(body: Any, defaults: GenerateParams, *, counting: bool = False) -> TurnRequest:
    """A ``POST /v1/messages`` body (``counting``: a ``/v1/messages/count_tokens`` body, no ``max_tokens``)."""
    body = read_object(body)
    _metadata(body)
    tool_fields = read_tools(body)  # TurnRequest's tools, tool_choice, tool_name, parallel_tool_calls, strict_tools
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequestError("messages: a non-empty list of {role, content} objects is required.", param="messages")
    parsed = read_conversation(messages)
    if parsed[-1].role is Role.ASSISTANT:
        last = f"messages[{len(messages) - 1}]"
        raise BadRequestError(f"{last}: the last message is the assistant's, and chatkit does not continue a reply "
                              "(prefill): end with a user message, or the results of its tool calls.", param=last)
    instructions, history, added = split_conversation(read_system(body.get("system")), parsed)
    max_tokens = body.get("max_tokens")
    if max_tokens is None and not counting:
        raise BadRequestError("max_tokens is required: the most tokens the reply may have (e.g. 1024).",
                              param="max_tokens")
    stops = body.get("stop_sequences")
    if stops is not None and (not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops)):
        raise BadRequestError("stop_sequences must be a list of non-empty strings.", param="stop_sequences")
    sampling = {k: body[k] for k in ("temperature", "top_p", "top_k") if body.get(k) is not None}
    if stops:
        sampling["stop"] = list(stops)
    params = read_params(sampling, defaults, max_tokens, "max_tokens")
    params = _thinking(body.get("thinking"), params)
    return TurnRequest(instructions, history, added, params=params, stream=read_bool(body, "stream", False),
                       model=read_model(body), **tool_fields)


def _metadata(body: Mapping[str, Any]) -> None:
    """Anthropic's ``metadata``: an object whose ``user_id`` is a string or null (null pairs are absent)."""
    metadata = body.get("metadata")
    if isinstance(metadata, Mapping):
        user = metadata.get("user_id")
        if user is not None and not isinstance(user, str):
            raise BadRequestError("metadata.user_id must be a string or null.", param="metadata.user_id")
        metadata = {k: v for k, v in metadata.items() if v is not None}
    read_metadata({"metadata": metadata})


def read_system(system: Any) -> str | None:
    """``system``: a string or a list of text blocks (joined with blank lines)."""
    if system is None or isinstance(system, str):
        return system or None
    if isinstance(system, list):
        return "\n\n".join(_text_block(b, f"system[{i}]", "system") for i, b in enumerate(system)) or None
    raise BadRequestError("system must be a string or a list of text blocks.", param="system")


def read_tools(body: Mapping[str, Any]) -> dict[str, Any]:
    """``tools`` (``{name, description, input_schema}``) and ``tool_choice`` mapped onto OpenAI's shapes and
    read by the one tool reader (``wire.read_tools``) into ``TurnRequest``'s tool fields: ``any`` is OpenAI's
    ``required``, ``tool`` a named one (held by the strict call grammar, ``tool_choice.py``),
    ``disable_parallel_tool_use`` ``parallel_tool_calls=false``."""
    raw = body.get("tools") or []
    if not isinstance(raw, list):
        raise BadRequestError("tools must be a list of {name, description, input_schema} objects.", param="tools")
    tools = [_function(item, f"tools[{j}]") for j, item in enumerate(raw)]
    return wire.read_tools({"tools": tools, **_tool_choice(body.get("tool_choice"), bool(tools))}, flat=True)


def _function(item: Any, where: str) -> dict[str, Any]:
    """An Anthropic client tool as the Responses API's function tool."""
    if not isinstance(item, Mapping) or item.get("type", "custom") not in ("custom", None):
        kind = item.get("type") if isinstance(item, Mapping) else type(item).__name__
        raise BadRequestError(f"{where}: only client tools ({{name, description, input_schema}}) are supported, "
                              f"got {kind!r}.", param=where)
    name, description, schema = item.get("name"), item.get("description"), item.get("input_schema")
    if not isinstance(name, str) or not name:
        raise BadRequestError(f"{where}: a tool needs a name.", param=f"{where}.name")
    if not isinstance(schema, Mapping):
        raise BadRequestError(f"{where}.input_schema is required: a JSON Schema object.",
                              param=f"{where}.input_schema")
    return {"type": "function", "name": name, **({"description": description} if description is not None else {}),
            "parameters": schema, **({"strict": item["strict"]} if "strict" in item else {})}


def _tool_choice(choice: Any, tools: bool) -> dict[str, Any]:
    """Anthropic's ``tool_choice`` as OpenAI's ``tool_choice`` and ``parallel_tool_calls``."""
    if choice is None:
        return {}
    if not isinstance(choice, Mapping) or choice.get("type") not in ("auto", "any", "tool", "none"):
        raise BadRequestError('tool_choice must be {"type": "auto"}, {"type": "none"}, {"type": "any"} or '
                              '{"type": "tool", "name": ...}.', param="tool_choice")
    kind = choice["type"]
    if kind in ("any", "tool") and not tools:
        raise BadRequestError(f"tool_choice {kind!r} needs tools: send the tools the model must call.",
                              param="tool_choice")
    parallel = choice.get("disable_parallel_tool_use", False)
    if not isinstance(parallel, bool):
        raise BadRequestError("tool_choice.disable_parallel_tool_use must be true or false.", param="tool_choice")
    named = {"type": "function", "name": choice.get("name")}
    return {"tool_choice": named if kind == "tool" else "required" if kind == "any" else kind,
            "parallel_tool_calls": not parallel or kind == "none"}


def _thinking(thinking: Any, params: GenerateParams) -> GenerateParams:
    """``thinking``: ``{"type": "enabled", "budget_tokens": N}`` (thinking on, at most N tokens of it),
    ``{"type": "adaptive"}`` (on, no budget) or ``{"type": "disabled"}``; absent: the template's default."""
    if thinking is None:
        return params
    kind = thinking.get("type") if isinstance(thinking, Mapping) else None
    if kind == "disabled":
        return params.copy(thinking=False)
    if kind == "adaptive":
        return params.copy(thinking=True)
    budget = thinking.get("budget_tokens") if isinstance(thinking, Mapping) else None
    if kind != "enabled" or isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
        raise BadRequestError('thinking must be {"type": "enabled", "budget_tokens": N} (N >= 0), '
                              '{"type": "adaptive"} or {"type": "disabled"}.', param="thinking")
    return params.copy(thinking=True, max_thinking_tokens=budget)


def read_conversation(messages: list[Any]) -> list[ChatMessage]:
    """The messages as chatkit's: a user message's tool results become tool messages (each must answer
    a ``tool_use`` of the assistant message right before it, all of them answered before it goes on)."""
    out: list[ChatMessage] = []
    pending: dict[str, str] = {}  # the last assistant message's unanswered calls: id -> name
    asked = ""
    for i, data in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(data, Mapping) or data.get("role") not in ("user", "assistant"):
            role = data.get("role") if isinstance(data, Mapping) else None
            raise BadRequestError(f"{where}.role: unknown role {role!r}: use user or assistant (the system prompt goes "
                                  "in system).", param=f"{where}.role")
        content = data.get("content")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(blocks, list):
            raise BadRequestError(f"{where}.content must be a string or a list of blocks.", param=f"{where}.content")
        if data["role"] == "assistant":
            if pending:
                raise _unanswered(asked, pending)
            message = _assistant(blocks, f"{where}.content")
            pending, asked = {c.id: c.name for c in message.tool_calls}, where
            out.append(message)
        else:
            images = [_image(b, f"{where}.content[{j}]") for j, b in enumerate(blocks)
                      if isinstance(b, Mapping) and b.get("type") == "image"]
            results, text = _user([b for b in blocks if not (isinstance(b, Mapping) and b.get("type") == "image")],
                                  f"{where}.content", pending)
            if pending:
                raise _unanswered(asked, pending)
            out += results
            if text is not None or images:
                out.append(ChatMessage.user(text or "", images=images))
    return out


def _unanswered(asked: str, pending: Mapping[str, str]) -> BadRequestError:
    return BadRequestError(f"{asked}: its tool_use blocks {sorted(pending)} have no tool_result: send one per call "
                           "(with its tool_use_id) in the user message right after it.", param=asked)


def _assistant(blocks: list[Any], where: str) -> ChatMessage:
    texts, thoughts, calls = [], [], []
    for j, block in enumerate(blocks):
        kind, at = _kind(block, f"{where}[{j}]"), f"{where}[{j}]"
        if kind == "text":
            texts.append(_text_block(block, at))
        elif kind == "thinking":
            if not isinstance(block.get("thinking"), str):
                raise BadRequestError(f"{at}: a thinking block needs a string 'thinking'.", param=at)
            thoughts.append(block["thinking"])
        elif kind == "tool_use":
            calls.append(_tool_use(block, at))
            if any(c.id == calls[-1].id for c in calls[:-1]):
                raise BadRequestError(f"{at}.id: tool_use id {calls[-1].id!r} is used by another tool_use block of "
                                      "this message: give each call its own id.", param=f"{at}.id")
        else:
            raise BadRequestError(f"{at}: an assistant message holds text, thinking and tool_use blocks, got "
                                  f"{kind!r}.", param=at)
    return ChatMessage.assistant("".join(texts), reasoning="\n\n".join(thoughts) if thoughts else None,
                                 tool_calls=calls)


def _tool_use(block: Mapping[str, Any], at: str) -> ToolCall:
    cid, name, arguments = block.get("id"), block.get("name"), block.get("input")
    if not isinstance(cid, str) or not cid or not isinstance(name, str) or not isinstance(arguments, Mapping):
        raise BadRequestError(f'{at}: a tool_use block is {{"type": "tool_use", "id", "name", "input": {{...}}}}.',
                              param=at)
    return ToolCall(cid, name, dict(arguments))


def _user(blocks: list[Any], where: str, pending: dict[str, str]) -> tuple[list[ChatMessage], str | None]:
    """A user message's tool results (taken out of ``pending``) and its text (``None``: it has none)."""
    results, texts = [], []
    for j, block in enumerate(blocks):
        kind, at = _kind(block, f"{where}[{j}]"), f"{where}[{j}]"
        if kind == "text":
            texts.append(_text_block(block, at))
        elif kind == "tool_result":
            cid = block.get("tool_use_id")
            if cid not in pending:
                raise BadRequestError(f"{at}: tool_use_id {cid!r} answers no unanswered tool_use of the assistant "
                                      f"message before it (those are {sorted(pending) or 'none'}).", param=at)
            if texts:
                raise BadRequestError(f"{at}: tool_result blocks come first in a user message, before its text.",
                                      param=at)
            content = block.get("content")
            text = content if isinstance(content, str) else "" if content is None else _texts(content, f"{at}.content")
            results.append(ChatMessage(Role.TOOL, text, pending.pop(cid), tool_call_id=cid))
        else:
            raise BadRequestError(f"{at}: a user message holds text and tool_result blocks, got {kind!r}.", param=at)
    return results, ("".join(texts) if texts or not results else None)


def _image(block: Mapping[str, Any], at: str) -> Image:
    """An image block, ``{"type": "image", "source": {"type": "base64", "media_type", "data"}}``."""
    source = block.get("source")
    if not (isinstance(source, Mapping) and source.get("type") == "base64" and isinstance(source.get("data"), str)
            and isinstance(source.get("media_type"), str)):
        raise BadRequestError(f'{at}: an image block is {{"type": "image", "source": {{"type": "base64", '
                              '"media_type": "image/png", "data": ...}}}} (URLs are not fetched).', param=at)
    try:
        return as_image(f"data:{source['media_type']};base64,{source['data']}")
    except ChatKitError as exc:
        raise BadRequestError(f"{at}: {exc}", param=at) from None


def _kind(block: Any, at: str) -> str:
    if not isinstance(block, Mapping) or not isinstance(block.get("type"), str):
        raise BadRequestError(f"{at}: a content block is an object with a type.", param=at)
    return str(block["type"])


def _texts(content: Any, at: str) -> str:
    if not isinstance(content, list):
        raise BadRequestError(f"{at} must be a string or a list of text blocks.", param=at)
    return "".join(_text_block(b, f"{at}[{k}]") for k, b in enumerate(content))


def _text_block(block: Any, at: str, holder: str = "tool results") -> str:
    if _kind(block, at) != "text" or not isinstance(block.get("text"), str):
        where = "the system prompt: send it in a user message" if holder == "system" else f"{holder}: send text"
        what = f"images are not supported in {where}" if block.get("type") == "image" \
            else "expected a text block {\"type\": \"text\", \"text\": ...}"
        raise BadRequestError(f"{at}: {what}.", param=at)
    return str(block["text"])


# -- the reply ---------------------------------------------------------------------------------
def usage(stats: TurnStats | None) -> dict[str, int]:
    """Anthropic's usage: ``input_tokens`` are the prompt tokens not read from the cache."""
    prompt, reused = (stats.prompt_tokens, stats.reused_tokens) if stats else (0, 0)
    return {"input_tokens": prompt - reused, "output_tokens": stats.generation_tokens if stats else 0,
            "cache_read_input_tokens": reused, "cache_creation_input_tokens": 0}


def content_blocks(reply: ChatMessage) -> list[dict[str, Any]]:
    """The reply's blocks: its thinking, its text, its tool calls (one readable ``tool_use`` each; a call
    the model did not finish or wrote wrong is sent as the text it wrote, never as a call to run)."""
    blocks: list[dict[str, Any]] = []
    if reply.reasoning is not None:  # also empty: the client sends it back as the session holds it
        blocks.append({"type": "thinking", "thinking": reply.reasoning, "signature": SIGNATURE})
    text = reply.content + "".join(c.text or "" for c in reply.tool_calls if c.error is not None)
    if text or not reply.tool_calls:
        blocks.append({"type": "text", "text": text})
    blocks += [tool_use_block(c) for c in reply.tool_calls if c.error is None]
    return blocks


def tool_use_block(call: ToolCall) -> dict[str, Any]:
    return {"type": "tool_use", "id": call.id, "name": call.name, "input": dict(call.arguments)}


def message(mid: str, model: str, content: list[dict[str, Any]], stop: tuple[str | None, str | None],
            stats: TurnStats | None) -> dict[str, Any]:
    """A ``message`` object; ``stop``: (stop_reason, stop_sequence)."""
    return {"id": mid, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": stop[0], "stop_sequence": stop[1], "usage": usage(stats)}


def stop_reason(finish: str | None, called: bool, sequence: str | None) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a reply that ended with ``finish`` (chatkit's) after a stop
    string ``sequence`` (``None``: it did not), ``called``: it has a tool call to run."""
    if finish == "length":
        return "max_tokens", None
    if sequence is not None:
        return "stop_sequence", sequence
    return ("tool_use" if called else "end_turn"), None


def event(kind: str, data: Mapping[str, Any]) -> str:
    """One server-sent event: ``event: <type>`` and its JSON (which repeats the type)."""
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False)}\n\n"


def error_body(exc: BaseException) -> tuple[int, dict[str, Any]]:
    """The status (as chatkit's OpenAI APIs give it) and Anthropic's ``{"type": "error", "error": {type,
    message}}`` for ``exc``; errors that are not chatkit's get a generic message, never a stack trace."""
    status = status_of(exc)[0]
    return status, {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": http_message(exc)}}


__all__ = ["content_blocks", "error_body", "event", "message", "parse_messages", "read_conversation", "read_system",
           "read_tools", "stop_reason", "tool_use_block", "usage"]

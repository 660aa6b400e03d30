"""OpenAI's wire format: requests read into plain data, replies and stream events built from it.

Only what chatkit can honour is accepted; a field it cannot (tools, n > 1, logprobs, penalties it has
no sampler for) is a 400 naming the field rather than being ignored.
"""

from __future__ import annotations

import importlib.util
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import ChatKitError
from ..messages import ChatMessage, Role
from ..params import GenerateParams
from ..stream import TurnStats
from .errors import BadRequestError

FINISH = {"stop": "stop", "length": "length", "cancelled": "stop", None: "stop"}


@dataclass(frozen=True)
class TurnRequest:
    """One request as chatkit sees it: answer ``message`` after ``instructions`` + ``history``."""

    instructions: str | None
    history: tuple[ChatMessage, ...]
    message: ChatMessage
    params: GenerateParams
    stream: bool = False
    include_usage: bool = False
    schema: dict[str, Any] | None = None  # response_format's JSON Schema (guided generation)
    previous_response_id: str | None = None  # /v1/responses only
    store: bool = True
    added: tuple[ChatMessage, ...] = ()  # the messages this request adds to the conversation
    echo: dict[str, Any] = field(default_factory=dict)  # request fields a response repeats back


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def guided_available() -> bool:
    """Whether this chatkit has guided generation (``chatkit.guided``), for ``response_format``."""
    return importlib.util.find_spec("chatkit.guided") is not None


# -- reading requests -------------------------------------------------------------------------
def parse_chat(body: Any, defaults: GenerateParams) -> TurnRequest:
    """A ``POST /v1/chat/completions`` body."""
    body = _object(body)
    _refuse_tools(body)
    if body.get("n", 1) != 1:
        raise BadRequestError("n: chatkit answers with one choice per request; send n=1.", param="n")
    if body.get("logprobs") or body.get("top_logprobs"):
        raise BadRequestError("logprobs are not supported by chatkit serve yet: leave them out.", param="logprobs")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequestError("messages: a non-empty list of {role, content} objects is required.", param="messages")
    parsed = [_chat_message(m, i) for i, m in enumerate(messages)]
    instructions, history, message = split_conversation(None, parsed)
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    options = body.get("stream_options") or {}
    if not isinstance(options, Mapping):
        raise BadRequestError("stream_options must be an object.", param="stream_options")
    return TurnRequest(
        instructions, history, message,
        params=_params(body, defaults, max_tokens, "max_tokens"),
        stream=_bool(body, "stream", False),
        include_usage=bool(options.get("include_usage", False)),
        schema=_chat_schema(body.get("response_format")),
    )


def parse_responses(body: Any, defaults: GenerateParams) -> TurnRequest:
    """A ``POST /v1/responses`` body."""
    body = _object(body)
    _refuse_tools(body)
    if body.get("reasoning"):
        raise BadRequestError("reasoning options are not supported by chatkit serve yet: leave them out.",
                              param="reasoning")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise BadRequestError("instructions must be a string.", param="instructions")
    previous = body.get("previous_response_id")
    if previous is not None and (not isinstance(previous, str) or not previous):
        raise BadRequestError("previous_response_id must be a response id string.", param="previous_response_id")
    raw = body.get("input")
    if isinstance(raw, str):
        items = [ChatMessage.user(raw)]
    elif isinstance(raw, list) and raw:
        items = [_input_item(m, i) for i, m in enumerate(raw)]
    else:
        raise BadRequestError("input: a string or a non-empty list of messages is required.", param="input")
    if items[-1].role is Role.ASSISTANT:
        raise BadRequestError("input: the last item must be a user message for the model to answer.", param="input")
    if not items[-1].content.strip():
        raise BadRequestError("input: the last message is empty: send some text.", param="input")
    text = body.get("text") or {}
    schema = _format_schema(text.get("format") if isinstance(text, Mapping) else None, "text.format")
    echo = {k: body.get(k) for k in ("instructions", "max_output_tokens", "temperature", "top_p", "metadata")}
    return TurnRequest(
        instructions, (), items[-1],
        params=_params(body, defaults, body.get("max_output_tokens"), "max_output_tokens"),
        stream=_bool(body, "stream", False),
        schema=schema,
        previous_response_id=previous,
        store=_bool(body, "store", True),
        added=tuple(items),
        echo=echo,
    )


def split_conversation(
    instructions: str | None, messages: Sequence[ChatMessage]
) -> tuple[str | None, tuple[ChatMessage, ...], ChatMessage]:
    """(instructions, history, new message): leading system messages join the instructions (as a
    session's builder would take them), the last message is the one to answer."""
    messages = list(messages)
    parts = [instructions] if instructions is not None else []
    while len(messages) > 1 and messages[0].role is Role.SYSTEM:
        parts.append(messages.pop(0).content)
    last = messages[-1]
    if last.role is Role.ASSISTANT:
        raise BadRequestError(
            "The last message is the assistant's: end with a user message for the model to answer.", param="messages"
        )
    if not last.content.strip():
        raise BadRequestError("The last message is empty: send some text.", param="messages")
    return ("\n\n".join(parts) if parts else None), tuple(messages[:-1]), last


def _object(body: Any) -> Mapping[str, Any]:
    if not isinstance(body, Mapping):
        raise BadRequestError("The request body must be a JSON object.")
    return body


def _bool(body: Mapping[str, Any], name: str, default: bool) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise BadRequestError(f"{name} must be true or false.", param=name)
    return value


def _refuse_tools(body: Mapping[str, Any]) -> None:
    for name in ("tools", "functions"):
        if body.get(name):
            raise BadRequestError(
                f"{name}: tool calling is not supported by chatkit serve yet; send the request without tools.",
                param=name,
            )


def _text(content: Any, where: str) -> str:
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


def _message(data: Any, where: str) -> ChatMessage:
    if not isinstance(data, Mapping):
        raise BadRequestError(f"{where} must be an object with role and content.", param=where)
    if data.get("tool_calls") or data.get("function_call") or data.get("role") in ("tool", "function"):
        raise BadRequestError(f"{where}: tool calls and tool results are not supported by chatkit serve yet.",
                              param=where)
    role = data.get("role")
    if role == "developer":
        role = "system"
    if role not in ("system", "user", "assistant"):
        raise BadRequestError(f"{where}: unknown role {role!r}: use system, user or assistant.", param=where)
    name = data.get("name")
    content = _text(data.get("content"), f"{where}.content")
    try:
        return ChatMessage(Role(role), content, name if isinstance(name, str) else None)
    except ChatKitError as exc:
        raise BadRequestError(f"{where}: {exc}", param=where) from exc


def _chat_message(data: Any, i: int) -> ChatMessage:
    return _message(data, f"messages[{i}]")


def _input_item(data: Any, i: int) -> ChatMessage:
    where = f"input[{i}]"
    if isinstance(data, Mapping) and data.get("type", "message") != "message":
        raise BadRequestError(f"{where}: only message items are supported, got {data.get('type')!r}.", param=where)
    return _message(data, where)


def _params(body: Mapping[str, Any], defaults: GenerateParams, max_tokens: Any, max_name: str) -> GenerateParams:
    for name in ("presence_penalty", "frequency_penalty"):
        if body.get(name):
            raise BadRequestError(
                f"{name} is not supported by chatkit: use repetition_penalty (e.g. 1.1) instead.", param=name
            )
    changes: dict[str, Any] = {}
    if max_tokens is not None:
        changes["max_tokens"] = max_tokens
    for name in ("temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty"):
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
            raise BadRequestError(f"{max_name if name == 'max_tokens' else name}: {exc}",
                                  param=max_name if name == "max_tokens" else name) from exc
        except (TypeError, ValueError) as exc:
            raise BadRequestError(f"{name}: {exc}", param=name) from exc
    return params


def _chat_schema(fmt: Any) -> dict[str, Any] | None:
    if fmt is None:
        return None
    if not isinstance(fmt, Mapping):
        raise BadRequestError("response_format must be an object.", param="response_format")
    if fmt.get("type") == "json_schema":
        inner = fmt.get("json_schema")
        if not isinstance(inner, Mapping):
            raise BadRequestError("response_format.json_schema must be an object with a schema.",
                                  param="response_format")
        fmt = {"type": "json_schema", **inner}
    return _format_schema(fmt, "response_format")


def _format_schema(fmt: Any, param: str) -> dict[str, Any] | None:
    """The JSON Schema a reply must follow, from ``{"type": "json_schema", "schema": ...}`` or
    ``{"type": "json_object"}``; ``None`` for plain text."""
    if fmt is None or (isinstance(fmt, Mapping) and fmt.get("type") == "text"):
        return None
    if not isinstance(fmt, Mapping) or fmt.get("type") not in ("json_schema", "json_object"):
        raise BadRequestError(f"{param}: use type text, json_schema or json_object.", param=param)
    if not guided_available():
        raise BadRequestError(
            f"{param}: structured output needs guided generation (chatkit.guided), which this chatkit "
            "does not have: upgrade chatkit and install its guided extra, or ask for text.", param=param,
        )
    if fmt["type"] == "json_object":
        return {"type": "object"}
    schema = fmt.get("schema")
    if not isinstance(schema, Mapping):
        raise BadRequestError(f"{param}: a json_schema format needs a 'schema' object.", param=param)
    return dict(schema)


# -- building replies -------------------------------------------------------------------------
def chat_usage(stats: TurnStats | None) -> dict[str, Any]:
    prompt = stats.prompt_tokens if stats else 0
    completion = stats.generation_tokens if stats else 0
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": stats.reused_tokens if stats else 0},
    }


def chat_completion(cid: str, model: str, text: str, finish: str | None, stats: TurnStats | None) -> dict[str, Any]:
    return {
        "id": cid, "object": "chat.completion", "created": int(time.time()), "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                     "finish_reason": FINISH.get(finish, "stop"), "logprobs": None}],
        "usage": chat_usage(stats),
    }


def chat_chunk(cid: str, model: str, delta: dict[str, Any], finish: str | None = None,
               usage: dict[str, Any] | None = None) -> dict[str, Any]:
    chunk: dict[str, Any] = {"id": cid, "object": "chat.completion.chunk", "created": int(time.time()),
                             "model": model, "choices": []}
    if usage is None:
        chunk["choices"] = [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]
    else:
        chunk["usage"] = usage
    return chunk


def responses_usage(stats: TurnStats | None) -> dict[str, Any]:
    prompt = stats.prompt_tokens if stats else 0
    output = stats.generation_tokens if stats else 0
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": stats.reused_tokens if stats else 0},
        "output_tokens": output,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + output,
    }


def response_object(rid: str, model: str, *, created_at: int, status: str, text: str | None, message_id: str,
                    previous_response_id: str | None, store: bool, usage: dict[str, Any] | None,
                    echo: Mapping[str, Any], incomplete: bool = False) -> dict[str, Any]:
    """A ``response`` object; ``text=None`` while it is in progress (no output yet)."""
    output = []
    if text is not None:
        output = [{"type": "message", "id": message_id, "status": "incomplete" if incomplete else "completed",
                   "role": "assistant", "content": [{"type": "output_text", "text": text, "annotations": [],
                                                     "logprobs": []}]}]
    return {
        "id": rid, "object": "response", "created_at": created_at, "status": status, "model": model,
        "output": output, "previous_response_id": previous_response_id, "store": store, "usage": usage,
        "error": None, "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "instructions": echo.get("instructions"), "max_output_tokens": echo.get("max_output_tokens"),
        "temperature": echo.get("temperature"), "top_p": echo.get("top_p"), "metadata": echo.get("metadata") or {},
        "parallel_tool_calls": False, "tool_choice": "none", "tools": [], "text": {"format": {"type": "text"}},
    }


__all__ = [
    "TurnRequest", "chat_chunk", "chat_completion", "chat_usage", "guided_available", "new_id", "parse_chat",
    "parse_responses", "response_object", "responses_usage", "split_conversation",
]

"""Chat messages: ``Role``, ``ChatMessage``, ``ToolCall`` and conversion from and to OpenAI-style dicts."""

from __future__ import annotations

import hashlib
import json
import secrets
import string
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from .errors import ChatKitError, InvalidMessageError
from .images import Image, as_image, from_part, image_part


class Role(str, Enum):
    """Who wrote a message."""

    SYSTEM = "system"
    USER = "user"
    ASSISTANT = "assistant"
    TOOL = "tool"

    @classmethod
    def parse(cls, value: Role | str) -> Role:
        """The role named by ``value``; ``InvalidMessageError`` for anything else."""
        if isinstance(value, Role):
            return value
        if isinstance(value, str):
            try:
                return cls(value.lower())
            except ValueError:
                pass
        names = ", ".join(r.value for r in cls)
        raise InvalidMessageError(f"Unknown role {value!r}: use one of {names}.")


_ID_CHARS = string.ascii_letters + string.digits


def new_tool_call_id(basis: str | None = None) -> str:
    """A tool-call id: 9 alphanumeric characters, a form every chat template accepts (Mistral's
    templates require exactly that). Random, or derived from ``basis`` (where the call stands in the
    conversation): the same conversation then gets the same ids, so greedy turns stay reproducible
    and the ranks of a sharded model render the same prompts."""
    if basis is None:
        return "".join(secrets.choice(_ID_CHARS) for _ in range(9))
    n = int.from_bytes(hashlib.sha256(basis.encode("utf-8")).digest()[:8], "big")
    return "".join(_ID_CHARS[(n // len(_ID_CHARS) ** i) % len(_ID_CHARS)] for i in range(9))


@dataclass(frozen=True)
class ToolCall:
    """A call of a tool by the model: ``name`` with JSON ``arguments``.

    ``error`` is set when the model's call could not be read (not JSON, no name, cut by ``max_tokens``):
    the tool loop sends it back to the model as the tool's result instead of calling anything, and
    ``text`` keeps what the model wrote (``chatkit serve`` sends the arguments part of it, never ``{}``).
    """

    id: str
    name: str
    arguments: Mapping[str, Any] = field(default_factory=dict)
    error: str | None = None
    text: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.id, str) or not isinstance(self.name, str):
            raise InvalidMessageError("A tool call needs a str id and a str name.")
        if not isinstance(self.arguments, Mapping):
            raise InvalidMessageError(
                f"Tool call arguments must be a dict, got {type(self.arguments).__name__}."
            )
        object.__setattr__(self, "arguments", dict(self.arguments))
        for key in ("error", "text"):
            if getattr(self, key) is not None and not isinstance(getattr(self, key), str):
                raise InvalidMessageError(f"A tool call's {key} must be a str, got {type(getattr(self, key)).__name__}.")
        check_json("Tool call arguments", self.arguments)  # the template renders them, a saved session writes them
        for what, text in (("id", self.id), ("name", self.name), ("text", self.text or "")):
            check_text(f"Tool call {what}", text)

    def to_dict(self) -> dict[str, Any]:
        """The OpenAI / Hugging Face form: ``{"id", "type": "function", "function": {"name", "arguments"}}``."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": dict(self.arguments)}}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ToolCall:
        """Read the OpenAI form (``arguments`` as an object or a JSON string) or a flat ``{name, arguments}``,
        and the ``error`` / ``text`` of an unread call that :func:`saved_dict` writes."""
        if not isinstance(data, Mapping):
            raise InvalidMessageError(f"A tool call must be a dict, got {type(data).__name__}.")
        function = data.get("function", data)
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise InvalidMessageError(
                'A tool call dict needs {"function": {"name": ..., "arguments": ...}}, '
                f"got keys {_keys(data)}."
            )
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError as exc:
                raise InvalidMessageError(f"Tool call arguments are not valid JSON: {exc}.") from exc
            except RecursionError:
                raise InvalidMessageError("Tool call arguments are nested too deeply to read.") from None
        call_id = data.get("id") or new_tool_call_id()
        return cls(str(call_id), function["name"], arguments if arguments is not None else {},
                   error=data.get("error"), text=data.get("text"))


@dataclass(frozen=True)
class ChatMessage:
    """One message of a conversation. ``name`` names a tool (for ``Role.TOOL``) or a speaker.

    An assistant message may carry ``reasoning`` (its thinking) and ``tool_calls`` apart from its
    ``content`` (the answer), so the model's own template decides how earlier turns show them. A tool
    message answers the call ``tool_call_id``.
    """

    role: Role
    content: str
    name: str | None = None
    reasoning: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None
    images: tuple[Image, ...] = ()
    """Images the message shows (before its text, as the model's template places them): see chatkit.images."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "role", Role.parse(self.role))
        if isinstance(self.content, (list, tuple)):  # Hugging Face / OpenAI content parts
            text, images = content_parts(self.content)
            object.__setattr__(self, "content", text)
            object.__setattr__(self, "images", (*self.images, *images))
        if not isinstance(self.images, (list, tuple)):
            raise InvalidMessageError("Message images must be a list of images.")
        object.__setattr__(self, "images", tuple(as_image(i) for i in self.images))
        if self.images and self.role not in (Role.USER, Role.TOOL):
            raise InvalidMessageError("Only a user message or a tool result can show images.")
        if not isinstance(self.content, str):
            raise InvalidMessageError(
                f"Message content must be a str, got {type(self.content).__name__}."
            )
        for key in ("name", "reasoning", "tool_call_id"):
            value = getattr(self, key)
            if value is not None and not isinstance(value, str):
                raise InvalidMessageError(f"Message {key} must be a str, got {type(value).__name__}.")
        calls = self.tool_calls or ()
        if not isinstance(calls, (list, tuple)) or not all(isinstance(c, ToolCall) for c in calls):
            raise InvalidMessageError("Message tool_calls must be a list of chatkit.ToolCall.")
        object.__setattr__(self, "tool_calls", tuple(calls))
        if self.tool_calls and self.role is not Role.ASSISTANT:
            raise InvalidMessageError("Only an assistant message can hold tool_calls.")
        for key, text in (("content", self.content), ("name", self.name or ""), ("reasoning", self.reasoning or "")):
            check_text(f"Message {key}", text)

    @classmethod
    def system(cls, content: str) -> ChatMessage:
        return cls(Role.SYSTEM, content)

    @classmethod
    def user(cls, content: str, name: str | None = None, images: Sequence[Any] = ()) -> ChatMessage:
        """A user message; ``images``: paths, bytes, data URLs, PIL images or arrays it shows."""
        return cls(Role.USER, content, name, images=tuple(images))

    @classmethod
    def assistant(
        cls, content: str, *, reasoning: str | None = None, tool_calls: Sequence[ToolCall] = ()
    ) -> ChatMessage:
        return cls(Role.ASSISTANT, content, reasoning=reasoning, tool_calls=tuple(tool_calls))

    @classmethod
    def tool(cls, content: str, name: str | None = None, tool_call_id: str | None = None,
             images: Sequence[Any] = ()) -> ChatMessage:
        """A tool result; ``images``: what the tool returned for a vision-language model to see."""
        return cls(Role.TOOL, content, name, tool_call_id=tool_call_id, images=tuple(images))

    def to_dict(self) -> dict[str, Any]:
        """An OpenAI-style dict with the field names Hugging Face chat templates read: ``role``,
        ``content``, and when set ``name``, ``reasoning_content``, ``tool_calls``, ``tool_call_id``."""
        d: dict[str, Any] = {"role": self.role.value, "content": self.content}
        if self.images:  # content parts: the images (by hash and size), then the text
            d["content"] = [*(image_part(i) for i in self.images), {"type": "text", "text": self.content}]
        if self.name is not None:
            d["name"] = self.name
        if self.reasoning is not None:
            d["reasoning_content"] = self.reasoning
        if self.tool_calls:
            d["tool_calls"] = [c.to_dict() for c in self.tool_calls]
        if self.tool_call_id is not None:
            d["tool_call_id"] = self.tool_call_id
        return d

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ChatMessage:
        """Read an OpenAI-style dict: ``role``, ``content`` (``None`` for a message that only calls
        tools) and optionally ``name``, ``reasoning_content`` (or ``reasoning`` / ``thinking``),
        ``tool_calls``, ``tool_call_id``."""
        if not isinstance(data, Mapping):
            raise InvalidMessageError(f"A message must be a ChatMessage or a dict, got {type(data).__name__}.")
        unknown = set(data) - _KEYS
        if unknown:
            raise InvalidMessageError(
                f"Unsupported message keys {_keys(unknown)}: a message has {', '.join(sorted(_KEYS))}."
            )
        if "role" not in data or "content" not in data:
            raise InvalidMessageError(f"A message dict needs 'role' and 'content', got keys {_keys(data)}.")
        reasoning = next((data[k] for k in ("reasoning_content", "reasoning", "thinking") if data.get(k) is not None), None)
        calls = data.get("tool_calls") or ()
        if not isinstance(calls, (list, tuple)):
            raise InvalidMessageError(f"A message's tool_calls must be a list, got {type(calls).__name__}.")
        content = data["content"]
        return cls(
            data["role"],
            "" if content is None else content,
            data.get("name"),
            reasoning=reasoning,
            tool_calls=tuple(ToolCall.from_dict(c) for c in calls),
            tool_call_id=data.get("tool_call_id"),
            images=tuple(data.get("images") or ()),
        )


def saved_dict(message: ChatMessage, *, pixels: bool = False) -> dict[str, Any]:
    """``message.to_dict()`` and the ``error`` / ``text`` of its unread tool calls, for the files chatkit
    writes itself (a saved session, the server's stored responses), which ``from_dict`` reads back.
    ``to_dict`` leaves them out: templates and the server's conversation keys see the OpenAI form only."""
    d = message.to_dict()
    if message.images and pixels:  # each image by its hash and a PNG of it
        d["content"] = [*(image_part(i, pixels=pixels) for i in message.images), {"type": "text", "text": message.content}]
    for call, out in zip(message.tool_calls, d.get("tool_calls", ())):
        out.update({key: getattr(call, key) for key in ("error", "text") if getattr(call, key) is not None})
    return d


_KEYS = {"role", "content", "name", "reasoning_content", "reasoning", "thinking", "tool_calls", "tool_call_id", "images"}


def content_parts(parts: Sequence[Any]) -> tuple[str, tuple[Image, ...]]:
    """The text and the images of content parts: ``{"type": "text", "text": ...}``, ``{"type": "image",
    "image": ...}`` (Hugging Face; also ``"url"`` / ``"path"``), ``{"type": "image_url", "image_url": {"url":
    ...}}`` (OpenAI: a data URL or a local path). Texts are joined with blank lines; images come first."""
    texts: list[str] = []
    images: list[Image] = []
    for part in parts:
        if isinstance(part, str):
            texts.append(part)
            continue
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind in ("text", "input_text"):
            if not isinstance(part.get("text"), str):
                raise InvalidMessageError("A text content part needs a 'text' string.")
            texts.append(part["text"])
        elif kind == "image":
            images.append(from_part(part))
        elif kind == "image_url":
            url = part.get("image_url")
            url = url.get("url") if isinstance(url, Mapping) else url
            if not isinstance(url, str):
                raise InvalidMessageError("An image_url content part needs 'image_url': {'url': ...}.")
            if url.startswith(("http://", "https://")):
                raise InvalidMessageError("Image URLs are not fetched: send the image as a data URL (base64).")
            images.append(as_image(url))
        else:
            raise InvalidMessageError(
                f"Unsupported content part {kind!r}: use 'text', 'image' or 'image_url' parts."
            )
    return "\n\n".join(texts), tuple(images)


def check_text(what: str, text: str, error: type[ChatKitError] = InvalidMessageError) -> None:
    """``error`` for lone surrogates (a bad decode, JSON ``"\\ud800"``): no tokenizer takes them."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise error(
            f"{what} holds an invalid character {text[exc.start]!r} at position {exc.start} "
            "(a lone surrogate, not Unicode text): decode the text with errors='replace' first."
        ) from None


def check_json(what: str, value: Any, error: type[ChatKitError] = InvalidMessageError) -> None:
    """``error`` unless ``value`` is JSON data whose text a tokenizer takes (str keys, no cycles or
    sets, no lone surrogates): what a template renders into the prompt and a saved file holds."""
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError, RecursionError) as exc:
        raise error(f"{what} must be JSON data (str keys, no sets, bytes or cycles): {exc}.") from None
    check_text(what, text, error)


MessageLike = ChatMessage | Mapping[str, Any]


def check_instructions(value: str | None) -> str | None:
    """Instructions (a system prompt) are a str or ``None``; ``InvalidMessageError`` otherwise."""
    if value is not None and not isinstance(value, str):
        raise InvalidMessageError(f"Instructions must be a str or None, got {type(value).__name__}.")
    if value is not None:
        check_text("Instructions", value)
    return value


def as_message(message: MessageLike) -> ChatMessage:
    """A ``ChatMessage`` from a ``ChatMessage`` or an OpenAI-style dict."""
    return message if isinstance(message, ChatMessage) else ChatMessage.from_dict(message)


def as_messages(messages: Iterable[MessageLike]) -> list[ChatMessage]:
    """``as_message`` over a list; a bare str or dict is refused as a likely mistake."""
    if isinstance(messages, (str, bytes, Mapping)):
        raise InvalidMessageError("Expected a list of messages, got a single value.")
    if not isinstance(messages, Iterable):
        raise InvalidMessageError(f"Expected a list of messages, got {type(messages).__name__}.")
    return [as_message(m) for m in messages]


def _keys(data: Iterable[Any]) -> list[str]:
    """A dict's keys for an error message (sorted as text: keys of mixed types do not sort)."""
    return sorted(map(str, data))


__all__ = [
    "ChatMessage",
    "MessageLike",
    "Role",
    "ToolCall",
    "as_message",
    "as_messages",
    "check_instructions",
    "check_json",
    "check_text",
    "new_tool_call_id",
]

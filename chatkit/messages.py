"""Chat messages: ``Role``, ``ChatMessage`` and conversion from and to OpenAI-style dicts."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any, Iterable, Mapping, Union

from .errors import InvalidMessageError


class Role(str, Enum):
    """Who wrote a message."""

    SYSTEM = "system"
    USER = "user"
    ASSISTANT = "assistant"
    TOOL = "tool"

    @classmethod
    def parse(cls, value: "Role | str") -> "Role":
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


@dataclass(frozen=True)
class ChatMessage:
    """One message of a conversation. ``name`` names a tool (for ``Role.TOOL``) or a speaker."""

    role: Role
    content: str
    name: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "role", Role.parse(self.role))
        if not isinstance(self.content, str):
            raise InvalidMessageError(
                f"Message content must be a str, got {type(self.content).__name__}."
            )
        if self.name is not None and not isinstance(self.name, str):
            raise InvalidMessageError(f"Message name must be a str, got {type(self.name).__name__}.")
        for field, text in (("content", self.content), ("name", self.name or "")):
            check_text(f"Message {field}", text)

    @classmethod
    def system(cls, content: str) -> "ChatMessage":
        return cls(Role.SYSTEM, content)

    @classmethod
    def user(cls, content: str, name: str | None = None) -> "ChatMessage":
        return cls(Role.USER, content, name)

    @classmethod
    def assistant(cls, content: str) -> "ChatMessage":
        return cls(Role.ASSISTANT, content)

    @classmethod
    def tool(cls, content: str, name: str | None = None) -> "ChatMessage":
        return cls(Role.TOOL, content, name)

    def to_dict(self) -> dict[str, str]:
        """An OpenAI-style dict: ``{"role": ..., "content": ...}`` plus ``"name"`` when set."""
        d = {"role": self.role.value, "content": self.content}
        if self.name is not None:
            d["name"] = self.name
        return d

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "ChatMessage":
        """Read an OpenAI-style dict with ``role``, ``content`` and optionally ``name``."""
        if not isinstance(data, Mapping):
            raise InvalidMessageError(f"A message must be a ChatMessage or a dict, got {type(data).__name__}.")
        unknown = set(data) - {"role", "content", "name"}
        if unknown:
            raise InvalidMessageError(
                f"Unsupported message keys {sorted(unknown)}: a message has role, content and name."
            )
        if "role" not in data or "content" not in data:
            raise InvalidMessageError(f"A message dict needs 'role' and 'content', got keys {sorted(data)}.")
        return cls(data["role"], data["content"], data.get("name"))


def check_text(what: str, text: str) -> None:
    """``InvalidMessageError`` for lone surrogates (a bad decode, JSON ``"\\ud800"``): no tokenizer takes them."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidMessageError(
            f"{what} holds an invalid character {text[exc.start]!r} at position {exc.start} "
            "(a lone surrogate, not Unicode text): decode the text with errors='replace' first."
        ) from None


MessageLike = Union[ChatMessage, Mapping[str, Any]]


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
    return [as_message(m) for m in messages]


__all__ = ["ChatMessage", "MessageLike", "Role", "as_message", "as_messages", "check_instructions", "check_text"]

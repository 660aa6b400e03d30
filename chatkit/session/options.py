"""``TurnOptions``: the options of one turn (``respond`` and its siblings), checked once.

Every turn method takes the same keywords (:class:`TurnKeywords`); they become one ``TurnOptions``,
which also turns the prompt argument into the message the turn answers.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any, TypedDict

from ..errors import InvalidMessageError, InvalidOutputSpecError, InvalidParamsError
from ..images import images_refused
from ..messages import ChatMessage, MessageLike, Role, ToolCall, as_message, as_messages
from ..params import GenerateParams, LogitsProcessor
from .conversation import pending_calls

NO_IMAGES = "This model reads no images: load a vision-language model to send images."


class TurnKeywords(TypedDict, total=False):
    """The keywords of ``respond``, ``stream_respond``, ``arespond`` and ``astream_respond``."""

    role: Role | str
    tool_call_id: str | None
    output: Any
    regex: str | None
    grammar: str | None
    include_schema: bool
    strict_tools: bool | None
    images: Sequence[Any]
    params: GenerateParams | None
    logits_processors: Sequence[LogitsProcessor]


@dataclass(frozen=True)
class TurnOptions:
    """How to send one prompt. ``role`` / ``tool_call_id``: who the prompt's text is from (a tool result
    answers the call it names); ``output`` / ``regex`` / ``grammar``: a guided reply (its value is the
    result), ``include_schema`` appends the spec's description to the prompt; ``strict_tools``: constrain
    this reply's tool calls to the tools' schemas (``None``: the session's default); ``params``: this
    turn's sampling settings instead of the session's (every round of its tool loop), ``logits_processors``:
    run after the turn's own; neither changes the session's ``config``."""

    role: Role | str = Role.USER
    tool_call_id: str | None = None
    output: Any = None
    regex: str | None = None
    grammar: str | None = None
    include_schema: bool = True
    strict_tools: bool | None = None
    images: Sequence[Any] = ()
    params: GenerateParams | None = None
    logits_processors: Sequence[LogitsProcessor] = ()

    @classmethod
    def of(cls, keywords: Mapping[str, Any]) -> TurnOptions:
        """The options named by a turn method's keywords, checked: ``InvalidParamsError`` (or
        ``InvalidOutputSpecError`` for a guided reply with strict tools) before anything runs."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(keywords) - known)
        if unknown:
            raise InvalidParamsError(f"Unknown turn option(s) {unknown}: use {sorted(known)}.")
        options = cls(**keywords)
        options.check()
        return options

    @property
    def guided(self) -> bool:
        """Whether the reply is a value (``output``, ``regex`` or ``grammar`` given)."""
        return self.output is not None or self.regex is not None or self.grammar is not None

    @property
    def spec(self) -> dict[str, Any]:
        """The guided spec, as ``chatkit.guided.guide`` takes it."""
        return {"output": self.output, "regex": self.regex, "grammar": self.grammar}

    def _images(self) -> list[Any]:
        if isinstance(self.images, (str, bytes)) or not isinstance(self.images, (list, tuple)):
            raise InvalidParamsError("images= takes a list of images (paths, bytes, data URLs, PIL images, arrays).")
        return list(self.images)

    def check(self) -> None:
        self._images()
        if self.params is not None and not isinstance(self.params, GenerateParams):
            raise InvalidParamsError(f"params= takes a chatkit.GenerateParams, got {type(self.params).__name__}.")
        if not isinstance(self.logits_processors, (list, tuple)) or not all(callable(p) for p in self.logits_processors):
            raise InvalidParamsError("logits_processors= takes a list of callables (tokens, logits) -> logits.")
        if self.strict_tools is not None and not isinstance(self.strict_tools, bool):
            raise InvalidParamsError(f"strict_tools={self.strict_tools!r}: use True, False or None (the session's default).")
        if self.strict_tools and self.guided:
            raise InvalidOutputSpecError(
                "strict_tools=True with output=/regex=/grammar=: a guided reply is a value and calls no tools. "
                "Drop one of them."
            )

    def turn_params(self, default: GenerateParams, vocab_size: int | None) -> GenerateParams | None:
        """This turn's own sampling settings (``params`` or the session's ``default``, with the turn's
        ``logits_processors`` after theirs), checked; ``None`` when the turn gives none (the session's)."""
        if self.params is None and not self.logits_processors:
            return None
        params = (self.params or default).copy()
        params = params.copy(logits_processors=[*params.logits_processors, *self.logits_processors])
        params.validate(vocab_size)
        return params

    def message(self, prompt: str | MessageLike, history: Sequence[ChatMessage] = (), *,
                reads_images: bool = True) -> ChatMessage:
        """The message ``prompt`` sends after ``history``: ``InvalidMessageError`` for an empty prompt, one
        from the assistant, or a tool result that answers no pending call; with ``reads_images=False`` (a
        text model) for any image, before it is decoded."""
        if not reads_images:
            with images_refused(NO_IMAGES):
                return self.message(prompt, history)
        if isinstance(prompt, str):
            message = ChatMessage(Role.parse(self.role), prompt, tool_call_id=self.tool_call_id,
                                  images=tuple(self._images()))
        elif isinstance(prompt, (ChatMessage, Mapping)):
            message = as_message(prompt)
            if self.images:
                message = replace(message, images=(*message.images, *self._images()))
        else:
            raise InvalidMessageError(f"A prompt is a str or a message, got {type(prompt).__name__}.")
        if not message.content.strip() and message.role is not Role.TOOL and not message.images:  # a tool may well return nothing
            raise InvalidMessageError("The prompt is empty: send some text.")
        if message.role is Role.ASSISTANT:
            raise InvalidMessageError("A prompt cannot come from the assistant: use role user, tool or system.")
        if message.role is Role.TOOL:
            message = _answering(message, pending_calls(history))
        return message


def prompt_messages(prompt: str | MessageLike | Sequence[MessageLike], history: Sequence[ChatMessage], *,
                    reads_images: bool, method: str) -> list[ChatMessage]:
    """The messages ``prompt`` adds after ``history``: one prompt or message (checked as a turn checks it),
    or a list of messages of any role (the last is the one a turn would answer)."""
    if isinstance(prompt, (str, ChatMessage, Mapping)):
        return [TurnOptions().message(prompt, history, reads_images=reads_images)]
    if isinstance(prompt, (list, tuple)):
        with images_refused(NO_IMAGES) if not reads_images else contextlib.nullcontext():
            return [ChatMessage.user(m) if isinstance(m, str) else as_message(m) for m in prompt]
    raise InvalidMessageError(f"{method}() takes a prompt, a message or a list of messages, got {type(prompt).__name__}.")


def branch_history(messages: Iterable[MessageLike], *, reads_images: bool) -> list[ChatMessage]:
    """``messages`` as a branch's history after the instructions (``fork(history=...)``): ``InvalidMessageError``
    for a leading system message, or (``reads_images=False``) for any image, before it is decoded."""
    with images_refused(NO_IMAGES) if not reads_images else contextlib.nullcontext():
        history = as_messages(messages)
    if history and history[0].role is Role.SYSTEM:
        raise InvalidMessageError("fork(history=...) takes the messages after the instructions: drop the system message.")
    return history


def checked_params(params: GenerateParams | None, default: GenerateParams, vocab_size: int | None) -> GenerateParams:
    """A turn's own sampling settings (``None``: the session's, ``default``), checked before any work."""
    if params is None:
        return default
    if not isinstance(params, GenerateParams):
        raise InvalidParamsError(f"params= takes a chatkit.GenerateParams, got {type(params).__name__}.")
    params.validate(vocab_size)
    return params


def _answering(message: ChatMessage, pending: list[ToolCall]) -> ChatMessage:
    """A tool result with the id and name of the call it answers (the only pending call, if not given)."""
    if message.tool_call_id is None:
        if len(pending) > 1:
            raise InvalidMessageError(
                f"The last reply made {len(pending)} tool calls: say which one this answers with tool_call_id= "
                f"(one of {[c.id for c in pending]})."
            )
        if not pending:
            return message
        return replace(message, tool_call_id=pending[0].id, name=message.name or pending[0].name)
    call = next((c for c in pending if c.id == message.tool_call_id), None)
    if call is None:
        raise InvalidMessageError(
            f"No pending tool call has id {message.tool_call_id!r}: the pending ones are {[c.id for c in pending]}."
        )
    return replace(message, name=message.name or call.name)


__all__ = ["TurnKeywords", "TurnOptions", "checked_params", "prompt_messages"]

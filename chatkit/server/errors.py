"""The server's errors and how every chatkit error maps to an OpenAI-style JSON error with a status."""

from __future__ import annotations

import logging
import re
from typing import Any

from ..errors import (
    ChatKitError,
    ContextWindowExceededError,
    InvalidMessageError,
    InvalidOutputSpecError,
    InvalidParamsError,
    SessionBusyError,
    TemplateError,
)

log = logging.getLogger("chatkit.server")


class BadRequestError(InvalidParamsError):
    """A request the server cannot read or does not support (HTTP 400); ``param`` names the field."""

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class UnknownResponseError(ChatKitError):
    """A ``previous_response_id`` or response id this server does not hold (HTTP 404)."""


class UnknownModelError(ChatKitError):
    """A model id this server does not serve (HTTP 404)."""


class OverloadedError(ChatKitError):
    """More requests are waiting than the server queues (HTTP 503): retry later."""


class UnauthorizedError(ChatKitError):
    """The request lacks the bearer token the server was started with (HTTP 401)."""


class ClientGoneError(ChatKitError):
    """The client hung up before its request was read whole (counted as HTTP 499, the client's doing)."""


SERVER_ERRORS = (ClientGoneError, BadRequestError, UnknownResponseError, UnknownModelError, OverloadedError, UnauthorizedError)


def status_of(exc: BaseException) -> tuple[int, str, str | None]:
    """(HTTP status, OpenAI error type, error code) for an exception raised while serving."""
    if isinstance(exc, ContextWindowExceededError):
        return 413, "invalid_request_error", "context_length_exceeded"
    if isinstance(exc, SessionBusyError):
        return 409, "conflict_error", "conversation_busy"
    if isinstance(exc, UnknownResponseError):
        return 404, "not_found_error", "response_not_found"
    if isinstance(exc, UnknownModelError):
        return 404, "invalid_request_error", "model_not_found"
    if isinstance(exc, OverloadedError):
        return 503, "server_overloaded", "overloaded"
    if isinstance(exc, ClientGoneError):
        return 499, "invalid_request_error", "client_closed_request"
    if isinstance(exc, UnauthorizedError):
        return 401, "authentication_error", "invalid_api_key"
    if isinstance(exc, (InvalidMessageError, InvalidParamsError, InvalidOutputSpecError, TemplateError)):
        return 400, "invalid_request_error", None  # the request's fault: a client must not retry it as is
    return 500, "server_error", None


def http_message(exc: BaseException) -> str:
    """What an HTTP client is told of ``exc``: chatkit's message, except where the library's speaks of
    its Python API (a session's methods, builder options), which the server words for a client."""
    if isinstance(exc, ContextWindowExceededError):
        return (f"The prompt is {exc.prompt_tokens} tokens but the model's context window is {exc.context_length}: "
                "shorten the conversation (fewer or shorter messages, instructions or tool results) "
                "or start a new conversation.")
    if isinstance(exc, SERVER_ERRORS):  # worded for HTTP already (and may quote what the client sent)
        return str(exc)
    if param_of(exc) is not None:  # "GenerateParams.top_k=...: why": the request's parameter of that name
        return str(exc).removeprefix("GenerateParams.")
    if isinstance(exc, ChatKitError):
        return without_python_advice(str(exc))
    return "Internal server error: see the server's log."


PYTHON_ADVICE = re.compile(r"\w\(\)|\w\(\.\.\.\)|\bbuilder\b|ChatSession|GenerateParams\.|\bchatkit\.\w|\bsession\.\w")


def without_python_advice(text: str) -> str:
    """``text`` cut before the first clause that tells a Python caller what to do (``builder...``,
    ``clear()``): a client of the server cannot follow it. The whole text goes to the server's log."""
    head = text
    while (found := PYTHON_ADVICE.search(head)) is not None:
        cut = max(head.rfind(": ", 0, found.start()), head.rfind(". ", 0, found.start()),
                  head.rfind(" (", 0, found.start()))
        if cut <= 0:
            head = "This request could not be served as sent"
            break
        head = head[:cut]
    if head == text:
        return text
    log.warning("told an HTTP client less than the library said: %s", text)
    return head.rstrip(" .:;,(") + " (the server's log has the details)."


def param_of(exc: BaseException) -> str | None:
    """The request parameter ``exc`` names: its ``param``, or the generation setting (same name on the
    wire: ``top_k``, ``logit_bias``...) a ``GenerateParams`` check refused (those found only with the model)."""
    param = getattr(exc, "param", None)
    if param is None and isinstance(exc, InvalidParamsError):
        found = GENERATE_PARAM.match(str(exc))
        return found.group(1) if found else None
    return param if isinstance(param, str) else None


GENERATE_PARAM = re.compile(r"GenerateParams\.(\w+)=")


def error_body(exc: BaseException) -> tuple[int, dict[str, Any]]:
    """The status and OpenAI-style body ``{"error": {message, type, param, code}}`` for ``exc``.
    Errors that are not chatkit's get a generic message: never a stack trace."""
    status, kind, code = status_of(exc)
    message = http_message(exc)
    return status, {"error": {"message": message, "type": kind, "param": param_of(exc), "code": code}}


__all__ = ["BadRequestError", "ClientGoneError", "OverloadedError", "UnauthorizedError", "UnknownModelError", "UnknownResponseError", "error_body", "http_message", "status_of",
           "without_python_advice"]

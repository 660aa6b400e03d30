"""A request body, checked whole before anything reads its fields: JSON, an object, nested at most
``MAX_DEPTH`` levels, numbers finite and text a tokenizer and a file can hold; and ``metadata`` as
OpenAI defines it. What a body holds is then safe to render, store and send back; each refusal is a
400 naming the field (``param``)."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

from starlette.requests import ClientDisconnect, Request

from . import trace
from .errors import BadRequestError, ClientGoneError

MAX_DEPTH = 100  # levels of JSON nesting in a request (a tool schema nested about 45 levels deep fits)
METADATA_PAIRS, METADATA_KEY, METADATA_VALUE = 16, 64, 512  # OpenAI's limits


async def read_body(request: Request) -> Any:
    """The request's body as JSON; a 400 when it is not JSON or is nested too deeply to read."""
    try:
        raw = await request.body()
    except ClientDisconnect:  # the client hung up while sending: its doing, not the server's
        raise ClientGoneError("The client closed the connection before it had sent the request's body.") from None
    try:
        body = json.loads(raw)
        trace.stamp("body")
        return body
    except ValueError as exc:
        raise BadRequestError(f"The request body is not valid JSON ({exc}).") from exc
    except RecursionError:
        raise BadRequestError(_too_deep()) from None


def read_object(body: Any) -> Mapping[str, Any]:
    """The parsed body as an object, checked whole (:func:`check_body`); a 400 when it is another JSON value."""
    if not isinstance(body, Mapping):
        raise BadRequestError("The request body must be a JSON object.")
    check_body(body)
    return body


def check_body(body: Any) -> None:
    """A 400 naming the first field that is nested more than ``MAX_DEPTH`` levels deep, a number that
    is not finite (``NaN``, ``Infinity``, ``1e999``: not JSON) or text with a lone surrogate (a ``"\\ud800"``
    escape: no tokenizer takes it and no file can hold it)."""
    stack: list[tuple[Any, int, tuple[str | int, ...]]] = [(body, 0, ())]
    while stack:
        value, depth, path = stack.pop()
        if isinstance(value, str):
            _check_text(value, path)
        elif isinstance(value, float) and not math.isfinite(value):
            raise BadRequestError(f"{_name(path)}: {value} is not a JSON number; send a finite number.",
                                  param=_name(path))
        elif isinstance(value, (Mapping, list)):
            if depth >= MAX_DEPTH:
                raise BadRequestError(_too_deep(), param=_name(path))
            if isinstance(value, list):
                stack.extend((item, depth + 1, (*path, i)) for i, item in enumerate(value))
                continue
            for key, item in value.items():
                _check_text(key, path, key=True)
                stack.append((item, depth + 1, (*path, key)))


def read_metadata(body: Mapping[str, Any]) -> dict[str, str] | None:
    """``metadata``: up to 16 pairs of strings, keys up to 64 characters, values up to 512 (OpenAI's
    rules), or ``None`` when absent."""
    metadata = body.get("metadata")
    if metadata is None:
        return None
    if not isinstance(metadata, Mapping) or len(metadata) > METADATA_PAIRS:
        raise BadRequestError(f"metadata must be an object of at most {METADATA_PAIRS} string pairs.",
                              param="metadata")
    for key, value in metadata.items():
        if len(key) > METADATA_KEY:
            raise BadRequestError(f"metadata: a key is at most {METADATA_KEY} characters, {key[:20]!r}... has "
                                  f"{len(key)}.", param="metadata")
        if not isinstance(value, str) or len(value) > METADATA_VALUE:
            raise BadRequestError(f"metadata.{key}: a value is a string of at most {METADATA_VALUE} characters.",
                                  param=f"metadata.{key}")
    return dict(metadata)


def _check_text(text: str, path: tuple[str | int, ...], *, key: bool = False) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        what = f"a key of {_name(path)}" if key else _name(path)
        raise BadRequestError(
            f"{what} holds an invalid character {text[exc.start]!r} at position {exc.start} (a lone surrogate, "
            "not Unicode text): send UTF-8 text (decode it with errors='replace' first).",
            param=_name(path) if path else None) from None


def _name(path: tuple[str | int, ...]) -> str:
    """A field's name as OpenAI writes it: ``messages[0].content``; keys that cannot be sent back escaped."""
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            text = part.encode("utf-8", "backslashreplace").decode("utf-8")
            out += f".{text}" if out else text
    return out or "the body"


def _too_deep() -> str:
    return (f"The request is nested more than {MAX_DEPTH} levels deep: flatten it (a JSON schema or "
            "metadata this deep is not one chatkit can serve).")


__all__ = ["MAX_DEPTH", "check_body", "read_body", "read_metadata", "read_object"]

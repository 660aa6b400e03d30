"""Partial JSON: the object a reply describes so far, for a UI that fills in a form as it streams."""

from __future__ import annotations

from typing import Any

import pydantic_core

# A number at the end of the text may still grow ("4" of "42"): it is not complete yet.
_NUMBER_TAIL = "0123456789+-.eE"


def partial_json(text: str) -> Any:
    """The value of the JSON prefix ``text`` with only its complete parts: finished strings, numbers,
    literals, and the complete members of unfinished objects and arrays (``{"name": "Ada", "ci`` ->
    ``{"name": "Ada"}``). ``None`` until some value is complete (or for text that is not JSON).

    pydantic-core's partial mode parses the prefix; it would keep a trailing number that may still
    grow, so that is cut first.
    """
    stripped = text.rstrip()
    cut = stripped.rstrip(_NUMBER_TAIL)
    if cut != stripped and not cut[-1:].isalpha() and not _inside_string(cut):  # not "true" / "false"
        stripped = cut
    if not stripped:
        return None
    try:
        return pydantic_core.from_json(stripped, allow_partial=True)
    except ValueError:
        return None


def _inside_string(text: str) -> bool:
    """Whether ``text`` ends inside a JSON string."""
    inside = escaped = False
    for ch in text:
        if escaped:
            escaped = False
        elif ch == "\\":
            escaped = inside
        elif ch == '"':
            inside = not inside
    return inside


__all__ = ["partial_json"]

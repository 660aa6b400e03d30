"""What several reply formats share: their calls' JSON, maybe fenced in a Markdown code block."""

from __future__ import annotations

import json
import re
from typing import Any


def json_value(text: str) -> Any:
    """The JSON value of ``text`` (surrounding whitespace and a ```json fence allowed)."""
    text = text.strip()
    fenced = re.match(r"^```(?:json)?\s*(.*?)\s*```$", text, re.S)
    return json.loads(fenced.group(1) if fenced else text)


def as_list(value: Any) -> list[Any]:
    """``value`` if it is a list, else a list of it (formats that may write one call or an array)."""
    return value if isinstance(value, list) else [value]


__all__ = ["as_list", "json_value"]

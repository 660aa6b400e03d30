"""The spec described to the model: a model that sees the schema follows it with fewer forced tokens.

Two forms, for the two places a chat template can take it:
- :func:`instructions`: text to add to the system message (works with every template);
- :func:`response_format`: an OpenAI-style ``response_format`` dict, for templates that render one
  (pass it as a template variable; most open-model templates have no such slot).
"""

from __future__ import annotations

import json
from typing import Any

from .spec import OutputSpec


def instructions(spec: OutputSpec) -> str:
    """A system-message paragraph telling the model what shape its answer must have."""
    if spec.kind == "json":
        schema = json.dumps(spec.schema, separators=(",", ":"), ensure_ascii=False)
        return (
            "Answer with a single compact JSON value (no other text, no code fence) that matches "
            f"this JSON Schema:\n{schema}"
        )
    if spec.kind == "regex":
        return f"Answer with text that matches this regular expression, and nothing else:\n{spec.source}"
    return f"Answer with text in this grammar (Lark syntax; the rule `start` is the answer), and nothing else:\n{spec.source}"


def response_format(spec: OutputSpec) -> dict[str, Any] | None:
    """OpenAI's ``response_format`` for a JSON spec (``{"type": "json_schema", "json_schema":
    {"name", "schema", "strict": true}}``); ``None`` for regex and grammar specs."""
    if spec.kind != "json":
        return None
    name = "".join(c if c.isalnum() or c in "_-" else "_" for c in spec.name)[:64] or "output"
    return {"type": "json_schema", "json_schema": {"name": name, "schema": spec.schema, "strict": True}}


__all__ = ["instructions", "response_format"]

"""Reply formats mlx-lm 0.32 does not segment or parse: one module per format, as mlx-lm keeps its own
in ``mlx_lm/tool_parsers/<family>.py``.

mlx-lm's ``TokenizerWrapper`` knows ``<think>`` blocks and the tool-call formats of its
``tool_parsers`` (Qwen/Hermes JSON, Mistral, Kimi, ...). For the families here it knows neither, so
each module describes its format once, with these names:

* ``MARKERS``: the special tokens that identify the family (all must be in the vocabulary);
* ``RESPONSE_FORMAT``: the text-state-machine ``"transitions"`` and the ``"initial_state"`` of a reply
  (default ``"normal"``), as mlx-lm's chat-template modules give it;
* ``parse_tool_call(text, tools=None)``: one tool-call segment's text -> a call dict (or a list of them);
* optional ``HIDDEN_STATES``: machine states whose text is control (dropped);
* optional ``bare_call(text, final)``: whether a reply written without a marker is a call (``True``),
  is not (``False``) or cannot be told yet (``None``); ``final`` when no more text will come.

A new format is one new module here and its entry in ``FAMILIES``. Detection is by the family's
special tokens in the vocabulary, checked in ``FAMILIES`` order only when mlx-lm found no format of
its own.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from . import command_r, deepseek, granite, harmony, llama3

Edges = dict[str, list[tuple[str, str]]]

FAMILIES: tuple[ModuleType, ...] = (harmony, llama3, deepseek, granite, command_r)


@dataclass(frozen=True)
class Format:
    """One reply format: state-machine edges, the reply's initial state, the tool-call parser, and the
    machine states whose text is control (dropped)."""

    name: str
    markers: tuple[str, ...]  # special tokens that identify the family
    transitions: Edges
    parse: Callable[[str, Any], Any] | None = None
    initial_state: str = "normal"
    hidden: frozenset[str] = field(default_factory=frozenset)
    # A call written without a marker: given the reply's text so far, whether the reply is one (True),
    # is not (False) or cannot be told yet (None); ``final`` when no more text will come.
    bare_call: Callable[[str, bool], bool | None] | None = None

    @classmethod
    def of(cls, module: ModuleType) -> Format:
        """The format a module of this package describes (see the package docstring)."""
        response = module.RESPONSE_FORMAT
        return cls(
            name=module.__name__.rpartition(".")[2],
            markers=tuple(module.MARKERS),
            transitions=response["transitions"],
            parse=module.parse_tool_call,
            initial_state=response.get("initial_state", "normal"),
            hidden=frozenset(getattr(module, "HIDDEN_STATES", ())),
            bare_call=getattr(module, "bare_call", None),
        )


FORMATS: tuple[Format, ...] = tuple(Format.of(m) for m in FAMILIES)


def detect(vocabulary: Mapping[str, int]) -> Format | None:
    """The format whose special tokens are all in ``vocabulary``, if any."""
    return next((f for f in FORMATS if all(m in vocabulary for m in f.markers)), None)


__all__ = ["FAMILIES", "FORMATS", "Format", "detect"]

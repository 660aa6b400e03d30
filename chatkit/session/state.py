"""``SessionState``: what a session holds between turns, one plain mutable object.

``ChatSession`` keeps one (``session._state``) and so does the ``TurnFactory`` built over it
(``session/turns.py``); the session's setters replace its fields, the turns read them when they open.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..decode import TokenSource
from ..messages import ChatMessage
from ..model.loaded import LoadedModel
from ..model.vision import ImageTable
from ..text.template import ChatTemplate
from .config import SessionConfig
from .conversation import Conversation
from .gate import TurnGate
from .results import TurnStats
from .tool_loop import StrictCalls


@dataclass(slots=True, eq=False)
class SessionState:
    """A session's state: its model and settings, how it renders and decodes, the conversation (history,
    window, cache) and what the last turns left. Made by ``turns.new_state``; mutated in place."""

    lm: LoadedModel
    config: SessionConfig
    template: ChatTemplate
    strict: StrictCalls  # the grammar of strict tool calls in the template's format
    source: TokenSource
    conversation: Conversation
    images: ImageTable | None = None  # a vision-language model's encoded images (None: the model reads none)
    ropes: list[Any] | None = None  # each cache layer's rotation when the context policy shifts the cache
    budget: int | None = None  # the tokens max_kv_bytes of KV cache hold (None: no budget)
    gate: TurnGate = field(default_factory=TurnGate)
    last_stats: TurnStats | None = None
    guided: tuple[ChatMessage, dict[str, Any]] | None = None  # the last guided prompt and its spec


__all__ = ["SessionState"]

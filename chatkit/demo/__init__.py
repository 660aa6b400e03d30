"""chatkit's bundled demo pair: a tiny chat model and a draft model for speculative decoding, and the
``calculate`` tool of the coming demo v2.

Both models are qwen3-architecture models trained from scratch (``scripts/train_demo.py``) on
synthetic dialogues, with their own byte-level BPE tokenizer and a ChatML template. They do small sums
("What is 7 + 5?"), spell and count letters of common words ("Spell cat.", "How many letters are in
apple?"), repeat a few words ("Repeat after me: red tiger."), small talk, and remember facts you tell
them ("My name is Ada.", "I live in Lyon.", "My favourite colour is green.", "I have a dog named
Rex.", "I am 34 years old.") to answer later ("What is my name?"). Outside that little world their
replies are nonsense. Their context window is 448 tokens, a little past their longest training
dialogues. No download needed: ``chatkit.load("demo")`` and ``chatkit.load("demo-draft")``::

    import chatkit

    lm = chatkit.load("demo")
    draft = chatkit.SpeculativeConfig(chatkit.load("demo-draft"), 4)
    session = chatkit.ChatSession.builder(lm).speculative(draft).build()
    print(session.respond("My name is Ada."))

``tools()`` is ``[calculate]``, exact arithmetic without ``eval``, for a demo trained to call it
(``scripts/train_demo_v2.py``, docs/demo.md; ``chatkit chat`` gives it to such a demo by default).
This package only knows where the files are (loading them is ``chatkit.load``'s job) and the tool.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from .calculator import calculate

_MODELS = Path(__file__).resolve().parent / "models"


def path() -> Path:
    """The folder of the demo chat model (``config.json``, ``model.safetensors``, tokenizer files)."""
    return _MODELS / "chat"


def draft_path() -> Path:
    """The folder of the demo draft model (same tokenizer as the chat model)."""
    return _MODELS / "draft"


def tools() -> list[Callable[..., Any]]:
    """The demo's tools, for ``builder.tools(...)``: ``[calculate]`` (exact + - * / and parentheses)."""
    return [calculate]


__all__ = ["calculate", "draft_path", "path", "tools"]

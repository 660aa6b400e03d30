"""chatkit's bundled demo pair: a small chat model and a draft model for speculative decoding.

Both are qwen3-architecture models trained from scratch (``scripts/train_demo.py``) on synthetic
dialogues, with their own byte-level BPE tokenizer and a ChatML template with Qwen-style tool calls.
They remember what you tell them (your name, city, favourite colour, pet's name: any spelling) and
say so when you have not told them; they call the ``calculate`` tool for arithmetic and answer with
its result; they fill a JSON form (``output=``) from the chat; they spell and count letters of common
words, repeat after you, make small talk and politely refuse the rest. No download needed::

    import chatkit

    lm = chatkit.load("demo")
    session = chatkit.ChatSession.builder(lm).tools(chatkit.demo.tools()).build()
    print(session.respond("My name is Ada."))
    print(session.respond("What is 1234 * 5678?"))

This package only knows where the files are (loading them is ``chatkit.load``'s job) and the
``calculate`` tool.
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

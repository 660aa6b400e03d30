"""chatkit's bundled demo pair: a tiny chat model and a draft model for speculative decoding, and the
demo's ``calculate`` tool.

Both models are qwen3-architecture models trained from scratch (``scripts/train_demo.py``) on
synthetic dialogues, with their own byte-level BPE tokenizer and a ChatML template with Qwen-style
tool calls. They remember facts you tell them (a name, a city, a favourite colour, a pet), also names
and phrasings they never saw in training, because they copy them from the conversation ("I'm Noor.",
then "What did I say my name was?"); they say they do not know what you did not tell them; they
answer arithmetic by calling ``calculate`` and copying its result; they answer JSON forms
(``respond(..., output=...)``) with valid objects, filled from the conversation when they can copy
the facts (about 60 % of forms are right); they count letters (mostly right), repeat after you, make small
talk and politely refuse the rest. Spelling mostly fails. Their context window is 1,024 tokens
(about 20 turns). No download needed: ``chatkit.load("demo")`` and ``chatkit.load("demo-draft")``::

    import chatkit

    lm = chatkit.load("demo")
    session = chatkit.ChatSession.builder(lm).tools(chatkit.demo.tools()).build()
    print(session.respond("What is 25 + 30?"))   # a real call of calculate, then "25 + 30 = 55."

``tools()`` is ``[calculate]``, exact arithmetic without ``eval``; ``chatkit chat`` gives it to the
demo by default. This package only knows where the files are (loading them is ``chatkit.load``'s
job) and the tool.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from .calculator import calculate

_MODELS = Path(__file__).resolve().parent / "models"
SMOLLM2_TOOL_PARSER = "json_tools"  # mlx-lm's Qwen/Hermes tool-call parser: what the SmolLM2 adapter writes


def path() -> Path:
    """The folder of the demo chat model (``config.json``, ``model.safetensors``, tokenizer files)."""
    return _MODELS / "chat"


def draft_path() -> Path:
    """The folder of the demo draft model (same tokenizer as the chat model)."""
    return _MODELS / "draft"


def smollm2_adapter_path() -> Path:
    """The folder of chatkit's LoRA adapter for SmolLM2-135M-Instruct (``scripts/train_smollm2_adapter.py``):
    it calls ``calculate`` and answers from the result, recalls what the user said and says when it was
    not told. Its template has no tool format; the adapter writes Qwen/Hermes ``<tool_call>`` blocks and
    records it (``"chatkit_tool_parser_type": SMOLLM2_TOOL_PARSER`` in its ``adapter_config.json``), so a
    session using it reads them as calls::

        lm = chatkit.load("smollm2")
        session = ChatSession.builder(lm).adapter(lm.adapter(chatkit.demo.smollm2_adapter_path())).tools(
            chatkit.demo.tools()).build()
    """
    return _MODELS / "smollm2-tools"


def tools() -> list[Callable[..., Any]]:
    """The demo's tools, for ``builder.tools(...)``: ``[calculate]`` (exact + - * / and parentheses)."""
    return [calculate]


__all__ = ["SMOLLM2_TOOL_PARSER", "calculate", "draft_path", "path", "smollm2_adapter_path", "tools"]

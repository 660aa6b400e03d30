"""Guided turns over a ``ChatSession``'s public API: what ``session.respond(prompt, output=...)``
(and ``stream_respond``, ``arespond``, ``astream_respond``) call, and the same with more options.

    person = session.respond("My name is Ada and I live in Oslo.", output=Person)
    person = guided.respond(session, "...", output=Person, describe="none")   # the prompt as is
    with session.stream_respond("...", output=Recipe) as stream:
        for chunk in stream:
            form.show(stream.partial)          # the complete fields so far
    recipe = stream.value                      # the validated Recipe

The constraint rides on ``GenerateParams.logits_processors`` for that one turn (the session shows
processors the whole conversation, so the constraint's first call sees the prompt), after the
session's own processors. The reply committed to the history is the exact text of the generated
tokens: the JSON (or regex / grammar text), also when it is incomplete; ``session.undo()`` removes it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any, Literal

from ..errors import InvalidOutputSpecError
from ..messages import ChatMessage
from ..params import GenerateParams
from .constraint import Constraint
from .describe import instructions
from .spec import output_spec

Describe = Literal["prompt", "none"]


def guide(
    message: ChatMessage,
    tokenizer: Any,
    render: Callable[[ChatMessage], str],
    *,
    output: Any = None,
    regex: str | None = None,
    grammar: str | None = None,
    include_schema: bool = True,
    params: GenerateParams | None = None,
) -> tuple[ChatMessage, Constraint]:
    """The message to send and the constraint for its reply (what ``session.stream_respond(...,
    output=...)`` plugs into its turn). ``include_schema`` appends the spec's description
    (:func:`instructions`) to a text message, so the model knows the shape it must fill (the history
    keeps it, as the model saw it). ``render(message)`` is the prompt the model would see;
    ``params`` the turn's settings (``GenerateParams()`` when not given).

    Reasoning is free but bounded: when the rendered prompt ends inside an open reasoning block (the
    tokenizer's think markers), the constraint starts after its end marker; when thinking is on and
    the chat template knows the markers, the reply may open a block first. Either way the end marker
    is forced after ``params.max_thinking_tokens`` reasoning tokens, by default half of
    ``max_tokens`` (:func:`reasoning_budget`), so the value keeps its room. When thinking is off
    (``thinking=False``, ``enable_thinking=False``, or a prompt that closed an empty block) the reply
    cannot open a block. Bad specs raise ``InvalidOutputSpecError`` before anything changes.
    """
    spec = output_spec(output, regex=regex, grammar=grammar)
    if not isinstance(include_schema, bool):
        raise InvalidOutputSpecError(f"include_schema must be True or False, got {include_schema!r}.")
    params = params if params is not None else GenerateParams()
    if include_schema:
        message = replace(message, content=f"{message.content}\n\n{instructions(spec)}")
    think_start, think_end = _reasoning(tokenizer, render(message), params)
    budget = reasoning_budget(params) if think_end is not None else None
    start_id = getattr(tokenizer, "think_start_id", None) if getattr(tokenizer, "has_thinking", False) else None
    return message, Constraint(spec, tokenizer, think_end=think_end, think_start=think_start, max_reasoning=budget,
                               never=() if start_id is None else (start_id,))


def reasoning_budget(params: GenerateParams) -> int:
    """How many reasoning tokens a guided reply may take before its end marker is forced:
    ``max_thinking_tokens`` when set, else half of ``max_tokens`` (the other half is the value's)."""
    if params.max_thinking_tokens is not None:
        return params.max_thinking_tokens
    return params.max_tokens // 2


def stream_respond(session: Any, prompt: Any, *, describe: Describe = "prompt", **options: Any) -> Any:
    """``session.stream_respond(prompt, output=..., ...)``; ``describe="none"`` sends the prompt as is."""
    if describe not in ("prompt", "none"):
        raise InvalidOutputSpecError(f"describe must be 'prompt' or 'none', got {describe!r}.")
    return session.stream_respond(prompt, include_schema=describe == "prompt", **options)


def _reasoning(tok: Any, rendered: str, params: GenerateParams) -> tuple[int | None, list[int] | None]:
    """(think_start, think_end) for the constraint: (None, None) without reasoning markers or with
    thinking off; (None, end) when the rendered prompt opens the block; (start, end) when the template
    knows the markers (the reply may open a block)."""
    start, end = getattr(tok, "think_start", None), getattr(tok, "think_end", None)
    if not getattr(tok, "has_thinking", False) or not start or not end:
        return None, None
    end_ids = list(tok.encode(end, add_special_tokens=False))
    tail = rendered.rstrip()
    if tail.endswith(start):
        return None, end_ids
    # Thinking off: the switch, or a generation prompt that already holds an (empty) closed block.
    if params.chat_template_kwargs().get("enable_thinking") is False or tail.endswith(end):
        return None, None
    template = getattr(tok, "chat_template", None)
    if isinstance(template, str) and start in template and getattr(tok, "think_start_id", None) is not None:
        return tok.think_start_id, end_ids
    return None, None


def respond(session: Any, prompt: str, **options: Any) -> Any:
    """As :func:`stream_respond`, and return the final value."""
    with stream_respond(session, prompt, **options) as stream:
        for _ in stream:
            pass
    return stream.value


__all__ = ["guide", "reasoning_budget", "respond", "stream_respond"]

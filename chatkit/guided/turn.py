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

from typing import Any, Literal, Sequence

from ..aio import AsyncResponseStream
from ..errors import ChatKitError, InvalidOutputSpecError
from .constraint import Constraint
from .describe import instructions
from .spec import OutputSpec, output_spec

Describe = Literal["prompt", "none"]


class GuidedStream:
    """A session's ``ResponseStream`` (chunks of the reply's text) with the guided value on top:
    ``partial`` while it streams, ``value`` once it has ended."""

    def __init__(self, stream: Any, constraint: Constraint) -> None:
        self._stream = stream
        self.constraint = constraint

    @property
    def spec(self) -> OutputSpec:
        return self.constraint.spec

    @property
    def stream(self) -> Any:
        """The underlying ``ResponseStream`` (text, tokens, finish_reason, stats)."""
        return self._stream

    @property
    def text(self) -> str:
        return self._stream.text

    @property
    def partial(self) -> Any:
        """The latest partial value: for JSON the complete fields so far (``None`` before any)."""
        return self.spec.partial(self.constraint.text_of(self._stream.tokens))

    @property
    def value(self) -> Any:
        """The final value (after the stream has ended). Raises ``IncompleteOutputError`` when the reply
        stopped before the value was complete (``max_tokens``, ``close()``); the turn is committed
        as far as it went either way."""
        if not self._stream.closed:
            raise ChatKitError("The stream has not ended yet: iterate it to the end (or close it) first.")
        return self.constraint.finish(self._stream.tokens)

    def __getattr__(self, name: str) -> Any:  # the rest of ResponseStream: tokens, stats, closed...
        if name.startswith("__") or name == "_stream":
            raise AttributeError(name)
        return getattr(self._stream, name)

    def __iter__(self) -> "GuidedStream":
        return self

    def __next__(self) -> Any:
        return next(self._stream)

    def close(self) -> None:
        self._stream.close()

    def __enter__(self) -> "GuidedStream":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stream.close()


def stream_respond(
    session: Any,
    prompt: Any,
    *,
    output: Any = None,
    regex: str | None = None,
    grammar: str | None = None,
    role: Any = "user",
    describe: Describe = "prompt",
) -> GuidedStream:
    """Send ``prompt`` to ``session`` and stream a reply constrained to ``output`` / ``regex`` /
    ``grammar`` (see :func:`output_spec`). ``describe="prompt"`` appends the spec's description
    (:func:`instructions`) to a text prompt, so the model knows the shape it must fill (the history
    keeps it, as the model saw it); ``"none"`` sends the prompt as is.

    Reasoning stays free: when the rendered prompt ends inside an open reasoning block (the
    tokenizer's think markers), the constraint starts after its end marker; when the chat template
    knows the markers, the reply may open a block first. Bad specs raise ``InvalidOutputSpecError``
    before the session is touched.
    """
    spec = output_spec(output, regex=regex, grammar=grammar)
    if describe == "prompt":
        if isinstance(prompt, str):
            prompt = f"{prompt}\n\n{instructions(spec)}"
    elif describe != "none":
        raise InvalidOutputSpecError(f"describe must be 'prompt' or 'none', got {describe!r}.")
    think_start, think_end = _reasoning(session, prompt, role)
    constraint = Constraint(spec, session.model.tokenizer, think_end=think_end, think_start=think_start)
    params = session.generate_params
    session.generate_params = params.copy(logits_processors=[*params.logits_processors, constraint])
    try:
        return GuidedStream(session.stream_respond(prompt, role=role), constraint)
    finally:
        session.generate_params = params  # the turn took its own copy


def _reasoning(session: Any, prompt: Any, role: Any) -> tuple[int | None, list[int] | None]:
    """(think_start, think_end) for the constraint: (None, None) without reasoning markers; (None,
    end) when the rendered prompt opens the block; (start, end) when the template knows the markers
    (the reply may open a block)."""
    tok = session.model.tokenizer
    start, end = getattr(tok, "think_start", None), getattr(tok, "think_end", None)
    if not getattr(tok, "has_thinking", False) or not start or not end:
        return None, None
    end_ids = list(tok.encode(end, add_special_tokens=False))
    rendered = session.render(prompt, role=role)
    if rendered.rstrip().endswith(start):
        return None, end_ids
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


class AsyncGuidedStream(AsyncResponseStream):
    """An ``AsyncResponseStream`` over a :class:`GuidedStream`: ``partial`` and ``value`` too."""

    @property
    def partial(self) -> Any:
        return self._stream.partial

    @property
    def value(self) -> Any:
        return self._stream.value


__all__ = ["AsyncGuidedStream", "GuidedStream", "respond", "stream_respond"]

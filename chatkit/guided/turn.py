"""Guided turns over a ``ChatSession``'s public API, until the session takes ``output=`` itself.

    person = guided.respond(session, "My name is Ada and I live in Oslo.", output=Person)
    with guided.stream_respond(session, "...", output=Recipe) as stream:
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
    prompt: str,
    *,
    output: Any = None,
    regex: str | None = None,
    grammar: str | None = None,
    describe: Describe = "prompt",
    think_end: Sequence[int] | str | None = None,
) -> GuidedStream:
    """Send ``prompt`` to ``session`` and stream a reply constrained to ``output`` / ``regex`` /
    ``grammar`` (see :func:`output_spec`). ``describe="prompt"`` appends the spec's description
    (:func:`instructions`) to the message, so the model knows the shape it must fill (the history
    keeps it, as the model saw it); ``"none"`` sends the prompt as is. ``think_end`` starts the
    constraint after a reasoning block (e.g. ``"</think>"`` when the template opens one).

    Bad specs raise ``InvalidOutputSpecError`` before the session is touched.
    """
    spec = output_spec(output, regex=regex, grammar=grammar)
    constraint = Constraint(spec, session.model.tokenizer, think_end=think_end)
    if describe == "prompt":
        prompt = f"{prompt}\n\n{instructions(spec)}"
    elif describe != "none":
        raise InvalidOutputSpecError(f"describe must be 'prompt' or 'none', got {describe!r}.")
    params = session.generate_params
    session.generate_params = params.copy(logits_processors=[*params.logits_processors, constraint])
    try:
        return GuidedStream(session.stream_respond(prompt), constraint)
    finally:
        session.generate_params = params  # the turn took its own copy


def respond(session: Any, prompt: str, **options: Any) -> Any:
    """As :func:`stream_respond`, and return the final value."""
    with stream_respond(session, prompt, **options) as stream:
        for _ in stream:
            pass
    return stream.value


__all__ = ["GuidedStream", "respond", "stream_respond"]

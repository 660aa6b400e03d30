"""``GenerateParams``: how to sample a reply, mapped onto mlx-lm's samplers and logits processors."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypeGuard

import mlx.core as mx
from mlx_lm.sample_utils import make_logits_processors, make_sampler

from .errors import InvalidParamsError
from .messages import check_text

LogitsProcessor = Callable[[mx.array, mx.array], mx.array]
Sampler = Callable[[mx.array], mx.array]

GREEDY_BELOW = 1e-3
"""Temperatures below this are greedy decoding. Sampling scales log-probabilities by 1/temperature:
near zero that overflows to inf (and 0 * inf is NaN), so mlx-lm would sample garbage (float32 and
bfloat16 below about 1e-38; float16 logits, whose largest value is 65504, below about 2e-4). Below
1e-3, sampling differs from greedy decoding only among tokens whose log-probabilities are within
about 0.01 of the best one's."""


@dataclass
class GenerateParams:
    """Sampling and length settings for a turn. Mutable: changes apply from the next turn.

    ``temperature=0`` is greedy decoding, and so is any temperature below ``GREEDY_BELOW`` (1e-3:
    smaller ones overflow when the log-probabilities are scaled, and would sample almost greedily
    anyway; ``top_p``, ``top_k`` and ``min_p`` are then moot). ``top_p`` (1.0 = off), ``top_k``
    (0 = off) and ``min_p`` (0 = off) filter before sampling. ``repetition_penalty`` (multiplies),
    ``presence_penalty`` and ``frequency_penalty`` (OpenAI's: -2 to 2, subtracted from the logit of a
    token once if it occurs / once per occurrence) look at the last ``repetition_context_size`` tokens. ``seed`` reseeds MLX's random generator at the start of each
    turn. ``stop`` strings end the reply (they are cut from it; one string or a list). ``logit_bias``
    adds to the logits of token ids. ``template_kwargs`` go to the chat template (e.g.
    ``{"enable_thinking": False}``; str keys, values saved as JSON). ``logits_processors`` are extra
    mlx-lm-style callables ``(tokens, logits) -> logits`` that must return float logits of the shape
    they were given: anything else ends the turn with ``InvalidParamsError`` naming the processor
    (nothing is committed).
    ``thinking`` turns the template's thinking switch on or off (``None``: the template's default;
    mlx-lm names it for the template, e.g. ``enable_thinking``). ``max_thinking_tokens`` ends the
    reasoning after that many tokens: the end-of-thinking marker is forced and the model answers.
    """

    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float | None = None
    repetition_context_size: int = 20
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: Sequence[str] = ()
    logit_bias: Mapping[int, float] | None = None
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    logits_processors: Sequence[LogitsProcessor] = ()
    thinking: bool | None = None
    max_thinking_tokens: int | None = None

    def copy(self, **changes: Any) -> GenerateParams:
        """A copy with ``changes`` applied (containers are copied, not shared)."""
        # Values of the wrong type are kept as they are, for validate() to name.
        base = replace(
            self,
            stop=_stops(self.stop),
            logit_bias=dict(self.logit_bias) if isinstance(self.logit_bias, Mapping) else self.logit_bias,
            template_kwargs=dict(self.template_kwargs) if isinstance(self.template_kwargs, Mapping) else self.template_kwargs,
            logits_processors=tuple(self.logits_processors)
            if isinstance(self.logits_processors, (list, tuple))
            else self.logits_processors,
        )
        return replace(base, **changes)

    def to_dict(self) -> dict[str, Any]:
        """The settings as JSON-ready data (``logits_processors`` are code and are left out).
        ``InvalidParamsError`` if a setting is out of range (e.g. assigned but never used in a turn)."""
        self.validate()
        return {
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty,
            "repetition_context_size": self.repetition_context_size,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "seed": self.seed,
            "stop": list(_stops(self.stop)),
            "logit_bias": {str(k): v for k, v in (self.logit_bias or {}).items()} or None,
            "template_kwargs": json.loads(_kwargs_text(self.template_kwargs)),
            "thinking": self.thinking,
            "max_thinking_tokens": self.max_thinking_tokens,
        }

    def chat_template_kwargs(self) -> dict[str, Any]:
        """What the chat template gets: ``template_kwargs`` plus the thinking switch when set."""
        kwargs = dict(self.template_kwargs)
        if self.thinking is not None:
            kwargs["enable_thinking"] = self.thinking  # mlx-lm's wrapper renames it for its template
        return kwargs

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> GenerateParams:
        """Settings from :meth:`to_dict` output; unknown keys are ignored (newer files).
        ``InvalidParamsError`` for data of the wrong shape (e.g. read from a damaged file)."""
        if not isinstance(data, Mapping):
            raise InvalidParamsError(f"Generate params must be a dict, got {type(data).__name__}.")
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__ and k != "logits_processors"}
        bias = known.get("logit_bias")
        if bias:
            if not isinstance(bias, Mapping):
                raise InvalidParamsError(f"logit_bias must map token ids to numbers, got {type(bias).__name__}.")
            try:
                known["logit_bias"] = {int(k): v for k, v in bias.items()}
            except (TypeError, ValueError):
                raise InvalidParamsError("logit_bias keys must be token ids (ints).") from None
        if "stop" in known:
            known["stop"] = () if known["stop"] is None else _stops(known["stop"])
        if "template_kwargs" in known and known["template_kwargs"] is None:
            known["template_kwargs"] = {}
        params = cls(**known)
        params.validate()
        return params

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ``InvalidParamsError`` naming the first setting out of range.

        With ``vocab_size`` (the model's, e.g. ``LoadedModel.vocab_size``) also the settings that
        index the vocabulary in native code: ``logit_bias`` ids and ``top_k``.
        """

        def bad(name: str, rule: str) -> InvalidParamsError:
            return InvalidParamsError(f"GenerateParams.{name}={_short(getattr(self, name))}: {rule}.")

        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise bad("max_tokens", "must be an int >= 1")
        if not _is_number(self.temperature) or self.temperature < 0:
            raise bad("temperature", "must be a number >= 0 (0 is greedy)")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise bad("top_p", "must be in (0, 1] (1 turns it off)")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise bad("top_k", "must be an int >= 0 (0 turns it off)")
        if not _is_number(self.min_p) or not 0 <= self.min_p < 1:
            raise bad("min_p", "must be in [0, 1) (0 turns it off)")
        if self.repetition_penalty is not None and (
            not _is_number(self.repetition_penalty) or self.repetition_penalty <= 0
        ):
            raise bad("repetition_penalty", "must be a number > 0 or None")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if value is not None and (not _is_number(value) or not -2 <= value <= 2):
                raise bad(name, "must be a number in [-2, 2] or None (0 or None turns it off)")
        if not _is_int(self.repetition_context_size) or not 1 <= self.repetition_context_size < 2**31:
            raise bad("repetition_context_size", "must be an int in [1, 2**31)")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 2**64):
            raise bad("seed", "must be an int in [0, 2**64) (what mx.random.seed takes) or None")
        stop = _stops(self.stop)
        if not isinstance(stop, tuple) or not all(isinstance(s, str) and s for s in stop):
            raise bad("stop", "must be a non-empty string or a list of them")
        for s in stop:
            check_text(f"GenerateParams.stop string {_short(s)}", s, InvalidParamsError)
        if self.logit_bias is not None and (
            not isinstance(self.logit_bias, Mapping)
            or not all(_is_int(k) and k >= 0 and _is_number(v) for k, v in self.logit_bias.items())
        ):
            raise bad("logit_bias", "must map token ids (int >= 0) to finite numbers")
        if not isinstance(self.template_kwargs, Mapping) or not all(isinstance(k, str) for k in self.template_kwargs):
            raise bad("template_kwargs", "must be a dict with str keys (the names the template reads)")
        _kwargs_text(self.template_kwargs)
        if self.thinking is not None and not isinstance(self.thinking, bool):
            raise bad("thinking", "must be True, False or None")
        if self.max_thinking_tokens is not None and (not _is_int(self.max_thinking_tokens) or self.max_thinking_tokens < 0):
            raise bad("max_thinking_tokens", "must be an int >= 0 or None")
        if not isinstance(self.logits_processors, (list, tuple)) or not all(callable(p) for p in self.logits_processors):
            raise bad("logits_processors", "must be a list of callables (tokens, logits) -> logits")
        if vocab_size is not None:
            # mlx-lm writes logit_bias into the logits by index and top_k partitions them: an id
            # past the vocabulary corrupts memory in native code, so check before anything runs.
            too_big = sorted(k for k in (self.logit_bias or {}) if k >= vocab_size)
            if too_big:
                raise bad("logit_bias", f"token id {too_big[0]} is outside the model's vocabulary (ids 0 to {vocab_size - 1})")
            if self.top_k >= vocab_size:  # mlx-lm's top-k needs fewer than the vocabulary
                raise bad("top_k", f"must be smaller than the model's vocabulary ({vocab_size} tokens; 0 turns it off)")

    def make_sampler(self) -> Sampler:
        """mlx-lm's sampler for these settings (greedy below ``GREEDY_BELOW``)."""
        temperature = float(self.temperature)
        return make_sampler(
            temp=0.0 if temperature < GREEDY_BELOW else temperature,
            top_p=float(self.top_p) if self.top_p < 1 else 0.0,
            min_p=float(self.min_p),
            top_k=int(self.top_k),
        )

    def make_logits_processors(self) -> list[LogitsProcessor]:
        """mlx-lm's logits processors for these settings, then the extra ones."""
        processors = make_logits_processors(
            logit_bias=dict(self.logit_bias) if self.logit_bias else None,
            repetition_penalty=self.repetition_penalty,
            repetition_context_size=self.repetition_context_size,
            presence_penalty=self.presence_penalty,
            presence_context_size=self.repetition_context_size,
            frequency_penalty=self.frequency_penalty,
            frequency_context_size=self.repetition_context_size,
        )
        return processors + [_checked(p, i) for i, p in enumerate(self.logits_processors)]


def _checked(processor: LogitsProcessor, index: int) -> LogitsProcessor:
    """``processor`` with its result checked at each call (a look at its type, shape and dtype, no
    copy): anything but float logits of the shape it was given (``None``, a list, one row) would
    fail later inside MLX or, one column too many, sample a token id outside the vocabulary."""

    def run(tokens: mx.array, logits: mx.array) -> mx.array:
        out = processor(tokens, logits)
        if not (isinstance(out, mx.array) and out.shape == logits.shape and out.dtype in _FLOATS):
            raise InvalidParamsError(_bad_result(processor, index, out, logits))
        return out

    return run


_FLOATS = frozenset({mx.float16, mx.bfloat16, mx.float32, mx.float64})


def _bad_result(processor: LogitsProcessor, index: int, out: Any, logits: mx.array) -> str:
    name = getattr(processor, "__qualname__", None) or type(processor).__qualname__
    module = getattr(processor, "__module__", None)
    got = (f"an mx.array of shape {tuple(out.shape)} and dtype {out.dtype}" if isinstance(out, mx.array)
           else "None" if out is None else f"a {type(out).__name__}")
    return (
        f"GenerateParams.logits_processors[{index}] ({f'{module}.{name}' if module else name}) returned {got}: "
        f"a logits processor takes (tokens, logits) and returns float logits of the same shape "
        f"({tuple(logits.shape)}). Fix it to return the (changed) logits; the turn was not committed."
    )


def _stops(value: Any) -> Any:
    """``stop`` as a tuple: a lone string is one stop string (not its characters); other types stay."""
    if isinstance(value, str):
        return (value,)
    return tuple(value) if isinstance(value, (list, tuple)) else value


def _kwargs_text(kwargs: Mapping[str, Any]) -> str:
    """The JSON a saved session holds for ``template_kwargs`` (values JSON cannot hold are saved as
    their str); ``InvalidParamsError`` if there is none (a cycle) or it is not Unicode text."""
    try:
        text = json.dumps(dict(kwargs), ensure_ascii=False, default=str)
    except (TypeError, ValueError, RecursionError) as exc:
        raise InvalidParamsError(f"GenerateParams.template_kwargs cannot be saved ({exc}): pass plain data.") from None
    check_text("GenerateParams.template_kwargs", text, InvalidParamsError)
    return text


def _is_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _is_number(value: Any) -> bool:
    try:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    except OverflowError:  # an int too large for a float
        return False


__all__ = ["GREEDY_BELOW", "GenerateParams", "LogitsProcessor", "Sampler"]

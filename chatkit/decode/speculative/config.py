"""``SpeculativeConfig`` and the checks that a draft (a model or prompt lookup) can serve a target exactly."""

from __future__ import annotations

from dataclasses import dataclass

from ...cache._mlx import kinds_that_cannot_rewind
from ...cache.state import CacheOptions
from ...errors import IncompatibleDraftError, InvalidParamsError
from ...model.loaded import LoadedModel

_SAMPLE = 64  # token strings compared between the two vocabularies
PROMPT_LOOKUP = "prompt_lookup"
AUTO = "auto"
MAX_DRAFT_TOKENS = 64


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: a ``draft`` proposes tokens, the target checks them all in one step.

    ``draft`` is a small model sharing the target's tokenizer (``chatkit.load(...)``), or
    ``"prompt_lookup"``: the continuation of the latest earlier occurrence of the last n-gram
    (``ngram_min`` to ``ngram_max`` tokens, longest first) in the conversation, no model needed.
    ``num_draft_tokens="auto"`` (the default) tunes the draft length per step from the acceptance
    and the costs measured in the session, down to not drafting while it does not pay; an int fixes
    it. Greedy output is the same as without speculation.

    Cache options: the target's cache must rewind (no hybrid or sliding-window model;
    ``IncompatibleDraftError``). ``kv_bits`` works with every draft: the target's cache is quantized
    at the step standard decoding quantizes it (a drafting step never crosses
    ``quantized_kv_start``), a draft model's own cache stays unquantized. ``max_kv_size`` works with
    prompt lookup only (``InvalidParamsError`` with a draft model): drafts are checked while the
    rotating cache has room for them, and once it is full decoding goes on plainly, since a full
    rotating cache cannot take rejected drafts back and a multi-token step would see another window
    than one-token steps.
    """

    draft: LoadedModel | str
    num_draft_tokens: int | str = AUTO
    ngram_min: int = 2
    ngram_max: int = 4

    def __post_init__(self) -> None:
        if isinstance(self.draft, str):
            if self.draft != PROMPT_LOOKUP:
                raise InvalidParamsError(
                    f"SpeculativeConfig.draft={self.draft!r}: pass a chatkit.load(...) draft model or "
                    f"{PROMPT_LOOKUP!r}."
                )
        elif not isinstance(self.draft, LoadedModel):
            raise InvalidParamsError(
                f"SpeculativeConfig.draft must be a chatkit.load(...) result or {PROMPT_LOOKUP!r}, "
                f"got {type(self.draft).__name__}."
            )
        n = self.num_draft_tokens
        if n != AUTO and (isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_DRAFT_TOKENS):
            raise InvalidParamsError(
                f"num_draft_tokens={n!r}: must be {AUTO!r} or an int from 1 to {MAX_DRAFT_TOKENS}."
            )
        for name in ("ngram_min", "ngram_max"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= 16:
                raise InvalidParamsError(f"{name}={v!r}: must be an int from 1 to 16.")
        if self.ngram_min > self.ngram_max:
            raise InvalidParamsError(
                f"ngram_min={self.ngram_min} is above ngram_max={self.ngram_max}: give ngram_min <= ngram_max."
            )

    @property
    def draft_model(self) -> LoadedModel | None:
        """The draft model, or ``None`` for prompt lookup."""
        return self.draft if isinstance(self.draft, LoadedModel) else None

    @property
    def adaptive(self) -> bool:
        """Whether the draft length is tuned as decoding goes (``num_draft_tokens="auto"``)."""
        return self.num_draft_tokens == AUTO


def check_draft(target: LoadedModel, config: SpeculativeConfig | LoadedModel) -> None:
    """``IncompatibleDraftError`` unless the target's cache can rewind and a draft model shares its tokenizer."""
    draft = config.draft_model if isinstance(config, SpeculativeConfig) else config
    if draft is not None:
        _check_tokenizers(target, draft)
    for role, lm in (("target", target), ("draft", draft)):
        kinds = kinds_that_cannot_rewind(lm.model) if lm is not None else []
        if kinds:
            raise IncompatibleDraftError(
                f"Speculative decoding needs caches that can rewind, but the {role} model uses {kinds}: "
                "use models with plain attention caches, or drop .speculative(...)."
            )


def _check_tokenizers(target: LoadedModel, draft: LoadedModel) -> None:
    t, d = target.tokenizer, draft.tokenizer
    problems = []
    if len(t) != len(d):
        problems.append(f"vocabulary sizes differ ({len(t)} vs {len(d)})")
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        a, b = getattr(t, name, None), getattr(d, name, None)
        if a != b:
            problems.append(f"{name} differs ({a} vs {b})")
    if set(t.eos_token_ids) != set(d.eos_token_ids):
        problems.append("end-of-turn token ids differ")
    n = min(len(t), len(d))
    ids = sorted({*range(0, n, max(1, n // _SAMPLE)), *range(max(0, n - 8), n)})
    if t.convert_ids_to_tokens(ids) != d.convert_ids_to_tokens(ids):
        problems.append("token strings differ")
    if problems:
        raise IncompatibleDraftError(
            "The draft model does not share the target's tokenizer: "
            + "; ".join(problems)
            + ". Use a draft from the same model family (same tokenizer)."
        )


def check_cache_options(speculative: SpeculativeConfig | None, options: CacheOptions) -> None:
    """``InvalidParamsError`` if speculative decoding is combined with cache options it cannot be exact with:
    ``max_kv_size`` with a draft model (see :class:`SpeculativeConfig`)."""
    # A draft model's own cache would need the target's window to propose well and to stay aligned
    # (rewinding it fails once it wraps); prompt lookup keeps no cache, so it takes a rotating target.
    if speculative is not None and speculative.draft_model is not None and options.max_kv_size is not None:
        raise InvalidParamsError(
            "A draft model cannot be combined with max_kv_size (its own cache could not follow the rotating "
            f"window): use SpeculativeConfig({PROMPT_LOOKUP!r}), or drop max_kv_size or .speculative(...)."
        )


def vocab_limit(target: LoadedModel, speculative: SpeculativeConfig | None) -> int:
    """Token ids must be below this in every model a turn runs (mlx-lm biases the draft's logits too)."""
    draft = speculative.draft_model if speculative is not None else None
    return target.vocab_size if draft is None else min(target.vocab_size, draft.vocab_size)


__all__ = ["AUTO", "PROMPT_LOOKUP", "SpeculativeConfig", "check_cache_options", "check_draft", "vocab_limit"]

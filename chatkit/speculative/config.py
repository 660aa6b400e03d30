"""``SpeculativeConfig`` and the checks that a draft model can serve a target model exactly."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


from ..cache._mlx import kinds_that_cannot_rewind
from ..cache.state import CacheOptions
from ..errors import IncompatibleDraftError, InvalidParamsError
from ..loading import LoadedModel

_SAMPLE = 64  # token strings compared between the two vocabularies


@dataclass(frozen=True)
class SpeculativeConfig:
    """Decode with a small ``draft`` model proposing ``num_draft_tokens`` tokens that the target checks.

    Greedy output is the same as without a draft; a draft that often agrees with the target makes
    decoding faster. The draft must use the target's tokenizer.
    """

    draft: LoadedModel
    num_draft_tokens: int = 4

    def __post_init__(self) -> None:
        if not isinstance(self.draft, LoadedModel):
            raise InvalidParamsError(
                f"SpeculativeConfig.draft must be a chatkit.load(...) result, got {type(self.draft).__name__}."
            )
        n = self.num_draft_tokens
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 64:
            raise InvalidParamsError(f"num_draft_tokens={n!r}: must be an int from 1 to 64.")


def check_draft(target: LoadedModel, draft: LoadedModel) -> None:
    """``IncompatibleDraftError`` unless ``draft`` shares ``target``'s tokenizer and both caches rewind."""
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
    for role, lm in (("target", target), ("draft", draft)):
        kinds = kinds_that_cannot_rewind(lm.model)
        if kinds:
            raise IncompatibleDraftError(
                f"Speculative decoding needs caches that can rewind, but the {role} model uses {kinds}: "
                "use models with plain attention caches, or drop .speculative(...)."
            )


def check_cache_options(speculative: SpeculativeConfig | None, options: CacheOptions) -> None:
    """``InvalidParamsError`` if a draft model is combined with cache options it cannot be exact with."""
    # mlx-lm's speculative loop rewinds rejected draft tokens by trimming: a full rotating cache keeps
    # them, and kv_bits swaps cache objects inside a list we do not see. Neither can be made exact.
    if speculative is not None and (options.max_kv_size is not None or options.kv_bits is not None):
        raise InvalidParamsError(
            "Speculative decoding cannot be exact with max_kv_size or kv_bits (rejected draft tokens "
            "could not be rewound): drop those options or drop .speculative(...)."
        )


__all__ = ["SpeculativeConfig", "check_cache_options", "check_draft"]

"""``SpeculativeConfig`` and the checks that a draft model can serve a target model exactly."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mlx_lm.models.cache import KVCache, make_prompt_cache

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
    num_draft_tokens: int = 2

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
        kinds = _non_rewindable(lm.model)
        if kinds:
            raise IncompatibleDraftError(
                f"Speculative decoding needs caches that can rewind, but the {role} model uses {kinds}: "
                "use models with plain attention caches, or drop .speculative(...)."
            )


def _non_rewindable(model: Any) -> list[str]:
    return sorted({type(c).__name__ for c in make_prompt_cache(model) if not isinstance(c, KVCache)})


__all__ = ["SpeculativeConfig", "check_draft"]

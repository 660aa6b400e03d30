"""The token ledger: which token ids a session's KV cache holds, in order."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..images import ImageSpan


@dataclass(frozen=True)
class Ledger:
    """The ids the cache holds after ``opaque`` leading positions whose ids are unknown.

    ``opaque`` is non-zero only for a restored raw cache. Invariant, per attention layer:
    ``cache.offset == opaque + len(tokens)``.
    """

    tokens: tuple[int, ...] = ()
    opaque: int = 0
    images: tuple[ImageSpan, ...] = ()
    """The images whose features fill some of ``tokens`` (their placeholder ids are alike for every image)."""
    shifted: int = 0
    """Tokens a context shift dropped from inside the cache since it was filled: non-zero, the kept KV is
    inexact (it was computed attending to them)."""

    def __len__(self) -> int:
        return self.opaque + len(self.tokens)

    @classmethod
    def from_offset(cls, fed: Sequence[int], offset: int, opaque: int = 0,
                    images: Sequence[ImageSpan] = (), shifted: int = 0) -> Ledger | None:
        """The ledger of a cache at ``offset`` after ``fed`` went in after the opaque prefix.

        mlx-lm leaves the cache holding a prefix of what was fed (all of it, or one token less after a
        speculative run), so the offset, not a count of streamed tokens, says where it stops. ``None``
        when the offset cannot be explained by ``fed`` (the cache must then be rebuilt).
        """
        held = offset - opaque
        if held < 0 or held > len(fed):
            return None
        return cls(tuple(fed[:held]), opaque, tuple(s for s in images if s.end <= held), shifted)

    def cut(self, keep: int) -> Ledger:
        """The first ``keep`` tokens (and the images wholly inside them)."""
        return Ledger(self.tokens[:keep], self.opaque, tuple(s for s in self.images if s.end <= keep), self.shifted)


__all__ = ["Ledger"]

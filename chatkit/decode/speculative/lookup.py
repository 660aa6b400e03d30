"""Prompt-lookup drafting: propose what followed the latest earlier occurrence of the last n-gram.

Chat repeats its context (quotes, summaries, code edits, structured replies), so the tokens that
followed the same n tokens earlier in the conversation are often what comes next. No draft model,
no draft cache: the index is rebuilt from the cached tokens at each turn and grows with the reply.
"""

from __future__ import annotations

from collections.abc import Iterable


class NgramIndex:
    """The tokens so far, indexed by their n-grams (``ngram_min`` to ``ngram_max`` tokens).

    ``extend`` appends tokens in O(n-gram sizes) each; ``propose(k)`` is the continuation (at most
    ``k`` tokens) of the latest earlier occurrence of the longest n-gram ending the tokens.
    """

    def __init__(self, tokens: Iterable[int], ngram_min: int, ngram_max: int) -> None:
        self.tokens: list[int] = []
        self._sizes = range(ngram_max, ngram_min - 1, -1)  # longest first
        self._latest: dict[tuple[int, ...], int] = {}  # n-gram -> end of its latest occurrence
        self._earlier: dict[int, int] = {}  # n -> end of the earlier occurrence of the last n-gram
        self.extend(tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        """Append ``tokens``."""
        for token in tokens:
            self.tokens.append(int(token))
            end = len(self.tokens)
            for n in self._sizes:
                if n > end:
                    continue
                key = tuple(self.tokens[end - n : end])
                before = self._latest.get(key)
                if before is None:
                    self._earlier.pop(n, None)
                else:
                    self._earlier[n] = before
                self._latest[key] = end

    def propose(self, k: int) -> list[int]:
        """Up to ``k`` tokens that followed the last n-gram before (``[]`` when it never occurred)."""
        for n in self._sizes:
            start = self._earlier.get(n)
            if start is not None:
                return self.tokens[start : start + k]
        return []


__all__ = ["NgramIndex"]

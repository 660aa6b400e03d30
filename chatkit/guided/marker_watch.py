"""Where a marker's text would appear in a reply, byte by byte: every token's text as bytes, and a KMP
automaton per watched text that tells which tokens would complete it (at their end, or inside them).

``chatkit.guided.call_grammar`` watches a tool-call format's start marker in free text, and its end
marker and the stop strings inside a call. Built once per tokenizer (as its llguidance view).
"""

from __future__ import annotations

import bisect
import threading
import weakref
from typing import Any

import llguidance

from .tokenizer import llg_tokenizer


class Watch:
    """Where a text ``pattern`` would appear in the reply: a KMP automaton over the tokens' bytes, and
    for each state the tokens that would complete the pattern."""

    def __init__(self, pattern: bytes, table: TokenTable) -> None:
        self.pattern = pattern
        fail = [0] * len(pattern)
        k = 0
        for i in range(1, len(pattern)):
            while k and pattern[i] != pattern[k]:
                k = fail[k - 1]
            if pattern[i] == pattern[k]:
                k += 1
            fail[i] = k
        self._fail = fail
        self._table = table
        self._contains = [i for i, b in enumerate(table.bytes) if pattern in b]
        self._completing: dict[int, list[int]] = {}
        self._misplaced: dict[int, list[int]] = {}

    def advance(self, k: int, data: bytes) -> tuple[int, int]:
        """The state after ``data`` from state ``k``, and the index just past the first complete
        occurrence in ``data`` (-1 when none)."""
        p, fail, hit = self.pattern, self._fail, -1
        for i, c in enumerate(data):
            while k and p[k] != c:
                k = fail[k - 1]
            if p[k] == c:
                k += 1
            if k == len(p):
                hit = i + 1 if hit < 0 else hit
                k = fail[k - 1]
        return k, hit

    def completing(self, k: int) -> list[int]:
        """The tokens that would complete the pattern from state ``k`` (the text ends with
        ``pattern[:k]``): those containing it, and those starting with the rest after one of its borders."""
        found = self._completing.get(k)
        if found is None:
            ids, m = set(self._contains), k
            while m > 0:
                rest = self.pattern[m:]
                ids.update(self._table.starting(rest))
                m = self._fail[m - 1]
            found = self._completing[k] = sorted(ids)
        return found

    def misplaced(self, k: int) -> list[int]:
        """The tokens that would complete the pattern from state ``k`` before their own end."""
        found = self._misplaced.get(k)
        if found is None:
            texts = self._table.bytes
            found = self._misplaced[k] = [t for t in self.completing(k) if self.advance(k, texts[t])[1] != len(texts[t])]
        return found


class TokenTable:
    """Every token's text as bytes (as the stream decodes it), and the watches over it."""

    def __init__(self, llt: llguidance.LLTokenizer) -> None:
        self.bytes = [llt.decode_bytes([i]) for i in range(llt.vocab_size)]
        self._sorted = sorted((b, i) for i, b in enumerate(self.bytes))  # prefix lookups by bisection
        self._keys = [b for b, _ in self._sorted]
        self._watches: dict[bytes, Watch] = {}
        self._continuing: dict[tuple[tuple[bytes, ...], bytes], list[int]] = {}
        self._lock = threading.Lock()

    def starting(self, prefix: bytes) -> list[int]:
        """The tokens whose text starts with ``prefix``."""
        out, i = [], bisect.bisect_left(self._keys, prefix)
        while i < len(self._keys) and self._keys[i].startswith(prefix):
            out.append(self._sorted[i][1])
            i += 1
        return out

    def continuing(self, words: tuple[bytes, ...], text: bytes) -> list[int]:
        """The tokens after which ``text`` is still a prefix of one of ``words`` (cached): those whose
        text is a non-empty prefix of a word's rest."""
        key = (words, text)
        found = self._continuing.get(key)
        if found is None:
            ids: set[int] = set()
            for rest in (w[len(text):] for w in words if w.startswith(text)):
                ids.update(t for t in self.starting(rest[:1]) if self.bytes[t] and rest.startswith(self.bytes[t]))
            found = self._continuing[key] = sorted(ids)
        return found

    def watch(self, text: str) -> Watch:
        """The watch of ``text`` over these tokens (built once, shared by every reply)."""
        pattern = text.encode("utf-8")
        with self._lock:
            w = self._watches.get(pattern)
            if w is None:
                w = self._watches[pattern] = Watch(pattern, self)
            return w


_tables: weakref.WeakKeyDictionary[Any, TokenTable] = weakref.WeakKeyDictionary()
_tables_lock = threading.Lock()


def token_table(tokenizer: Any) -> TokenTable:
    """The token texts of ``tokenizer``, built once per tokenizer (as its llguidance view)."""
    with _tables_lock:
        table = _tables.get(tokenizer)
        if table is None:
            table = _tables[tokenizer] = TokenTable(llg_tokenizer(tokenizer))
        return table


__all__ = ["TokenTable", "Watch", "token_table"]

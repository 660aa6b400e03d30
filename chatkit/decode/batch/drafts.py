"""Draft models inside a ``BatchEngine``: the rows sharing one draft model draft together.

Each draft model has one :class:`DraftBatch`: its rows' draft caches in mlx-lm's ``BatchKVCache``
layers (moved in when the rows join the decode batch, extracted when they leave, as ``rows.py`` does
for the target's). A row's draft cache holds a prefix of what its target cache holds (``dfed``
tokens past what it held when the row joined): it lags after plain steps and after the prompt,
whose prefill the draft skips. A draft pass first feeds every row what it lacks (in chunks, right-padded,
rolled into the left padding: ``catch-up``, part of a round's cost as in the loop alone, but for a pass
that feeds a row's prompt, which the loop alone prefills), then
each row's next token and its drafts one step at a time, greedily (a draft only has to be likely;
the row's logits processors shape it as they shape the target). Once the target has verified,
:meth:`DraftBatch.settle` drops each row's rejected drafts from the draft cache: it then holds
exactly the accepted tokens (the last accepted draft of a run accepted whole was never fed: it is
caught up at the next pass).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from ...cache._mlx import batch_layer, layer_offset, trim_layers

CHUNK = 512  # tokens per row and forward pass of a catch-up (a prompt's, after a stretch of plain steps)
clock = time.perf_counter


def drop(layers: Sequence[Any], rejected: list[int]) -> None:
    """Drop each row's last ``rejected[e]`` positions from batched ``layers``: the shortest rejection from
    every row (a trim), the rest by rolling each row right by its own count into its left padding
    (mlx-lm's ``finalize`` of right-padded prompts), so that every row ends at the write position."""
    common = min(rejected)
    if common:
        for c in layers:
            c.trim(common)
    rest = [r - common for r in rejected]
    if any(rest):
        for c in layers:  # one layer at a time: a roll copies the layer's buffer
            c.prepare(right_padding=rest)
            c.finalize()
            mx.eval(c.state)


def lag(row: Any) -> list[int]:
    """The tokens ``row``'s target holds that its draft does not: of its prompt (but the last token),
    the prompt's last token once fed, and the tokens handed out."""
    suffix = row.job.suffix
    fed = len(suffix) - 1 + (0 if row.fresh else 1 + len(row.held))
    if row.dfed >= fed:
        return []
    if row.dfed >= len(suffix):
        return row.held[row.dfed - len(suffix):]
    return [*suffix[row.dfed:len(suffix) - (1 if row.fresh else 0)], *row.held]


class DraftBatch:
    """The rows drafting with one draft model (see the module docstring)."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.layers: list[Any] = []
        self.members: list[Any] = []  # the rows (``rows.Row``), in the order of the layers' rows
        self.unsettled = 0  # drafts every row fed in the last pass, to keep or drop once verified

    def __len__(self) -> int:
        return len(self.members)

    def join(self, rows: list[Any]) -> None:
        """``rows`` join with their sessions' draft caches (moved in: each job's list is emptied)."""
        moved = []
        for row in rows:
            layers = row.job.draft_layers
            row.draft, row.dbase, row.dfed = self, layer_offset(layers) or 0, 0
            moved.append(list(layers))
            layers.clear()
        old, self.layers = self.layers, []
        for i in range(len(moved[0])):
            layer = batch_layer(old[i] if old else None, [m[i] for m in moved])
            for m in moved:
                m[i] = None
            if old:
                old[i] = None  # freed as soon as copied (never every layer twice at once)
            self.layers.append(layer)
            mx.eval(layer.state)
        self.members.extend(rows)

    def leave(self, rows: Sequence[Any]) -> list[list[Any]]:
        """``rows`` leave; their draft caches (plain ``KVCache`` layers holding what ``dfed`` says), in order."""
        idx = [self.members.index(r) for r in rows]
        keep = [i for i in range(len(self.members)) if i not in set(idx)]
        caches: list[list[Any]] = [[] for _ in idx]
        for c in self.layers:
            for cache, i in zip(caches, idx):
                cache.append(KVCache() if c.keys is None else c.extract(i))
            if keep:
                c.filter(keep)
        for cache, row in zip(caches, rows):  # a pass not settled (a failed step): its drafts go
            if (layer_offset(cache) or 0) > row.dbase + row.dfed:
                trim_layers(cache, row.dbase + row.dfed)
        mx.eval([c.state for cache in caches for c in cache if c.keys is not None])
        self.members = [self.members[i] for i in keep]
        if not keep:
            self.layers, self.unsettled = [], 0
        return caches

    def propose(self, ys: dict[Any, int], k: int) -> tuple[dict[Any, list[int]], float]:
        """``k`` drafts for every row, after its next token ``ys[row]``; and the seconds of the catch-up
        that belong to no round: a pass that feeds a row's prompt (its first this turn, which the loop
        alone prefills); the catch-up after plain steps is part of the round, as in the loop alone."""
        t0 = clock()
        prompt_feed = any(r.dfed == 0 for r in self.members)
        lags = [lag(r) for r in self.members]
        while max(map(len, lags)) > 1:  # long lags first (the last token of each is fed with its next)
            n = min(CHUNK, max(map(len, lags)) - 1)
            chunks = [g[: min(n, len(g) - 1)] for g in lags]
            self._feed(chunks)
            mx.eval([c.state for c in self.layers])
            lags = [g[len(c):] for g, c in zip(lags, chunks)]
            for r, c in zip(self.members, chunks):
                r.dfed += len(c)
        spare = clock() - t0 if prompt_feed else 0.0
        first = [g + [ys[r]] for g, r in zip(lags, self.members)]
        logits = self._feed(first)
        logits = logits[mx.arange(len(first)), mx.array([len(s) - 1 for s in first])]
        shown = [self._shown(r, ys[r]) for r in self.members]
        tokens: list[mx.array] = []
        for j in range(k):
            token = mx.argmax(self._process(logits, shown, tokens), axis=-1).astype(mx.uint32)
            tokens.append(token)
            if j + 1 < k:
                logits = self.model(token[:, None], cache=self.layers)[:, -1, :]
            mx.async_eval(token)
        drafts: list[list[int]] = mx.stack(tokens, axis=1).tolist()  # type: ignore[assignment]
        for r, s in zip(self.members, first):
            r.dfed += len(s)
        self.unsettled = k - 1
        return dict(zip(self.members, drafts)), spare

    def settle(self, accepted: dict[Any, int]) -> None:
        """After the target's verifying step (``accepted[row]``: its drafts accepted): keep each row's
        accepted drafts in the draft cache, drop the rest."""
        if not self.unsettled:
            return
        keep = [min(accepted.get(r, 0), self.unsettled) for r in self.members]
        for r, n in zip(self.members, keep):
            r.dfed += n
        drop(self.layers, [self.unsettled - n for n in keep])
        self.unsettled = 0

    def _feed(self, seqs: list[list[int]]) -> mx.array:
        """Feed each row its tokens (right-padded to the longest, the padding then rolled to the left)."""
        width = max(map(len, seqs))
        pads = [width - len(s) for s in seqs]
        inputs = mx.array([s + [0] * p for s, p in zip(seqs, pads)], dtype=mx.uint32)
        for c in self.layers:
            c.prepare(right_padding=pads)
        logits = self.model(inputs, cache=self.layers)
        for c in self.layers:
            c.finalize()
        return logits

    @staticmethod
    def _shown(row: Any, y: int) -> mx.array | None:
        """What ``row``'s processors see before its first draft (``None``: it has none)."""
        if not row.job.processors or row.seen is None:
            return None
        return mx.concatenate([row.seen.buffer[: row.seen.size], mx.array([y], dtype=mx.uint32)])

    def _process(self, logits: mx.array, shown: list[mx.array | None], tokens: list[mx.array]) -> mx.array:
        """The rows' processors over their draft logits (each shown its tokens and the drafts so far)."""
        if all(s is None for s in shown):
            return logits
        rows = []
        for e, (row, seen) in enumerate(zip(self.members, shown)):
            one = logits[e : e + 1]
            if seen is not None:
                line = mx.concatenate([seen, *(t[e : e + 1] for t in tokens)]) if tokens else seen
                for processor in row.job.processors:
                    one = processor(line, one)
            rows.append(one)
        return mx.concatenate(rows, axis=0)


def model_drafts(rows: Sequence[Any], ys: list[int], wants: list[tuple[int, bool]], room: list[int],
                 width: int) -> tuple[dict[Any, list[int]], float]:
    """The drafts of the rows with a draft model, each draft batch drafting as long as its rows ask for
    (at most ``width``) when one of them asks, every row up to its ``room``; the catch-ups' seconds."""
    asks: dict[DraftBatch, int] = {}
    for row, (k, _), left in zip(rows, wants, room):
        if row.draft is not None and k and left:
            asks[row.draft] = max(asks.get(row.draft, 0), min(k, width))
    out: dict[Any, list[int]] = {}
    spare = 0.0
    by_row = dict(zip(rows, ys))
    for batch, k in asks.items():
        drafts, seconds = batch.propose({r: by_row[r] for r in batch.members}, k)
        out.update(drafts)
        spare += seconds
    for row, left in zip(rows, room):
        if row in out:
            out[row] = out[row][:left]
    return out, spare


__all__ = ["CHUNK", "DraftBatch", "drop", "lag", "model_drafts"]

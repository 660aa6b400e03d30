"""The decode batch of a ``BatchEngine``: its rows' KV in mlx-lm's ``BatchKVCache`` layers, one forward
pass per step for every row.

A plain step feeds one token per row and samples the next, queued one step ahead of the tokens it
hands out (as mlx-lm's ``BatchGenerator`` does). A verifying step feeds each row its next token and
the tokens drafted for it (rows drafting fewer are right-padded; a row with no draft takes a normal
step in the same pass), samples each row's positions (a greedy row's all at once, lazily: one
evaluation for the batch) and keeps them in order until one differs from its draft, and drops each
row's rejected positions: the shortest rejection from every row (a trim), the rest by
rolling each row right by its own count into its left padding (mlx-lm's ``finalize`` of right-padded
prompts), so that every row ends at the batch's write position again. A row joins with its prompt's
last token still to feed (``fresh``): its first step hands nothing out. Rows with a draft model draft
with it (``drafts.py``: one batched draft cache per draft model, joining and leaving with the rows);
a verifying step then drops each row's rejected drafts from its draft cache too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from ...cache._mlx import batch_layer
from ..speculative import DraftPolicy, NgramIndex
from .drafts import DraftBatch, drop
from .job import Job

Delivery = tuple[Job, int, mx.array, bool]
"""One token handed out: (its turn, token id, log-probabilities, proposed by the drafter)."""


class Seen:
    """The tokens a row's logits processors see (context, suffix, tokens fed), grown in place."""

    STEP = 256

    def __init__(self, tokens: Sequence[int]) -> None:
        self.size = len(tokens)
        self.buffer = mx.array(list(tokens) + [0] * (-len(tokens) % self.STEP or self.STEP), dtype=mx.uint32)

    def push(self, tokens: mx.array) -> mx.array:
        """Append ``tokens`` (maybe lazy); all tokens seen so far."""
        end = self.size + tokens.size
        if end > self.buffer.size:
            grow = -(-(end - self.buffer.size) // self.STEP) * self.STEP
            self.buffer = mx.concatenate([self.buffer, mx.zeros(grow, dtype=mx.uint32)])
        self.buffer[self.size : end] = tokens.astype(mx.uint32)
        self.size = end
        return self.buffer[:end]


@dataclass(eq=False)
class Row:
    """One turn decoding in the batch: what its processors see, what it fed, its drafting state."""

    job: Job
    seen: Seen | None
    held: list[int] = field(default_factory=list)  # tokens handed out (each was fed)
    index: NgramIndex | None = None  # prompt lookup: the row's tokens, indexed by n-grams
    indexed: int = 0  # tokens of ``held`` (and a ``y`` after them) in ``index``
    fresh: bool = True  # the next step feeds the prompt's last token (not handed out)
    draft: DraftBatch | None = None  # the draft model's batch the row drafts in
    dbase: int = 0  # tokens its draft cache held when it joined
    dfed: int = 0  # tokens fed to the target (prompt but the last, then ``held``) the draft cache holds too

    @property
    def policy(self) -> DraftPolicy | None:
        return self.job.policy

    def propose(self, y: int, k: int) -> list[int]:
        """Up to ``k`` tokens to follow ``y`` (the next token fed), from the row's n-gram index."""
        assert self.index is not None
        self.index.extend(self.held[self.indexed :] + [y])
        self.indexed = len(self.held) + 1  # y is handed out by the step that feeds it
        return self.index.propose(k)


class Rows:
    """The decode batch (see the module docstring). Rows join with their prompt's last token to feed
    next and leave with their KV extracted."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.layers: list[Any] = []
        self.rows: list[Row] = []
        self.next: mx.array | None = None  # each row's next token to feed (lazy)
        self.next_logprobs: list[mx.array | None] = []  # None: a fresh row's (nothing to hand out)
        self.drafters: dict[int, DraftBatch] = {}  # the draft batches, by id of their draft model

    def __len__(self) -> int:
        return len(self.rows)

    def join(self, rows: list[Row], layers: list[Any], first: list[int]) -> None:
        """``rows`` join with their batched caches (``layers``, moved into the batch's, or taken as they
        are by an empty batch: the list is emptied) and the next token each feeds (its prompt's last).
        Layer by layer, each evaluated before the next, so that the joining layer and the batch's old
        one are freed as soon as they are copied (never every layer twice at once)."""
        moved = list(layers)
        layers.clear()
        if not self.rows:  # an empty batch takes the layers as they are: no copy
            self.layers = moved
            moved = []
        for i in range(len(moved)):
            layer = batch_layer(self.layers[i] if len(self.layers) > i else None, [moved[i]])
            moved[i] = None
            if len(self.layers) > i:
                self.layers[i] = layer
            else:
                self.layers.append(layer)
            mx.eval(layer.state)
            del layer
        new = mx.array(first, dtype=mx.uint32)
        self.next = new if self.next is None else mx.concatenate([self.next, new])
        self.next_logprobs.extend([None] * len(rows))
        self.rows.extend(rows)
        drafting = [r for r in rows if r.job.draft is not None and r.job.draft_layers is not None]
        for model in {id(r.job.draft): r.job.draft for r in drafting}.values():
            batch = self.drafters.setdefault(id(model), DraftBatch(model))
            batch.join([r for r in drafting if r.job.draft is model])

    def clear(self) -> None:
        self.layers, self.rows, self.next, self.next_logprobs, self.drafters = [], [], None, [], {}

    def leave(self, idx: Sequence[int]) -> list[list[Any]]:
        """Rows ``idx`` leave; their caches (plain ``KVCache`` layers), in the order of ``idx``. The
        batch's layers shrink one at a time (see :meth:`join`)."""
        gone = set(idx)
        keep = [i for i in range(len(self.rows)) if i not in gone]
        self._leave_drafts([self.rows[i] for i in idx])
        caches: list[list[Any]] = [[] for _ in idx]
        for n, c in enumerate(self.layers):
            for cache, i in zip(caches, idx):
                cache.append(KVCache() if c.keys is None else c.extract(i))
            if keep:
                c.filter(keep)
            else:
                self.layers[n] = None
            mx.eval([cache[-1].state for cache in caches if cache[-1].keys is not None], c.state if keep else [])
            del c
        if not keep:
            self.clear()
            return caches
        assert self.next is not None
        self.next = self.next[mx.array(keep)]
        self.next_logprobs = [self.next_logprobs[i] for i in keep]
        self.rows = [self.rows[i] for i in keep]
        return caches

    def _leave_drafts(self, leaving: list[Row]) -> None:
        """The leaving rows' draft caches, extracted from their draft batches, to their jobs."""
        for key, batch in list(self.drafters.items()):
            mine = [r for r in leaving if r.draft is batch]
            if mine:
                for row, cache in zip(mine, batch.leave(mine)):
                    row.job.draft_back = cache
            if not batch:
                del self.drafters[key]

    def next_tokens(self) -> list[int]:
        """The tokens the next step feeds (evaluated)."""
        assert self.next is not None
        return [int(t) for t in self.next.tolist()]  # type: ignore[union-attr, arg-type]

    def plain(self) -> list[Delivery]:
        """A plain step: feed each row's next token; queue the one after; hand out the fed tokens."""
        inputs = self.next
        assert inputs is not None
        logits = self.model(inputs[:, None], cache=self.layers)[:, -1, :]
        if any(r.job.processors for r in self.rows):
            rows = []
            for e, row in enumerate(self.rows):
                one = logits[e : e + 1]
                if row.job.processors and row.seen is not None:
                    seen = row.seen.push(inputs[e : e + 1])
                    for processor in row.job.processors:
                        one = processor(seen, one)
                rows.append(one)
            logits = mx.concatenate(rows, axis=0)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        sampled = _sample([r.job.sampler for r in self.rows], logprobs)
        handed, self.next, self.next_logprobs = self.next_logprobs, sampled, list(logprobs)
        mx.async_eval(self.next, self.next_logprobs)
        mx.eval(inputs, [lp for lp in handed if lp is not None])
        tokens = [int(t) for t in inputs.tolist()]  # type: ignore[union-attr, arg-type]
        out: list[Delivery] = []
        for row, t, lp in zip(self.rows, tokens, handed):
            if row.fresh:
                row.fresh = False
            else:
                assert lp is not None
                row.held.append(t)
                out.append((row.job, t, lp, False))
        return out

    def verify(self, drafts: list[list[int]]) -> tuple[list[Delivery], list[int]]:
        """A verifying step over every row (``drafts[e]``: row e's, maybe none); the tokens handed out
        and, per row, how many of its drafts were accepted."""
        ys = self.next_tokens()
        width = 1 + max(len(d) for d in drafts)
        inputs = mx.array([[y, *d] + [0] * (width - 1 - len(d)) for y, d in zip(ys, drafts)], dtype=mx.uint32)
        logits = self.model(inputs, cache=self.layers)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        greedy = mx.argmax(logits, axis=-1)
        # Greedy rows: every position's token computed at once (lazily), one evaluation for the batch.
        ahead = [_positions(row, logits[e], logprobs[e], greedy[e], y, d) if row.job.greedy else None
                 for e, (row, y, d) in enumerate(zip(self.rows, ys, drafts))]
        mx.eval([a[0] for a in ahead if a is not None])
        out: list[Delivery] = []
        accepted: list[int] = []
        following: list[int] = []
        following_lp: list[mx.array | None] = []
        for e, (row, y, d) in enumerate(zip(self.rows, ys, drafts)):
            if ahead[e] is None:
                taken, token, lp, lps = _check(row, logits[e], y, d)
            else:
                taken, token, lp, lps = _accept(row, ahead[e], y, d)  # type: ignore[arg-type]
            handed = self.next_logprobs[e]
            if row.fresh:  # y is the prompt's last token: fed, not handed out (the row drafted nothing)
                row.fresh = False
            else:
                assert handed is not None
                out.append((row.job, y, handed, False))
                out.extend((row.job, t, lps[j], True) for j, t in enumerate(taken[1:]))
                row.held.extend(taken)
            accepted.append(len(taken) - 1)
            following.append(token)
            following_lp.append(lp)
        drop(self.layers, [width - 1 - a for a in accepted])
        for batch in self.drafters.values():
            batch.settle(dict(zip(self.rows, accepted)))
        self.next, self.next_logprobs = mx.array(following, dtype=mx.uint32), following_lp
        mx.async_eval(self.next_logprobs)
        return out, accepted


def _positions(row: Row, logits: mx.array, logprobs: mx.array, greedy: mx.array, y: int,
               drafts: list[int]) -> tuple[mx.array, mx.array, int]:
    """A greedy row's positions of a verifying step (``y`` then ``drafts``), lazily: each position's
    token (its processors shown the tokens before it, as if every earlier draft were accepted), the
    log-probabilities, and how many tokens the processors saw before the step."""
    n = len(drafts) + 1
    if not row.job.processors or row.seen is None:
        return greedy[:n], logprobs, 0
    start = row.seen.size
    seen = row.seen.push(mx.array([y, *drafts], dtype=mx.uint32))
    ones = []
    for i in range(n):
        one = logits[i : i + 1]
        for processor in row.job.processors:
            one = processor(seen[: start + 1 + i], one)
        ones.append(one)
    stacked = mx.concatenate(ones, axis=0)
    lps = stacked - mx.logsumexp(stacked, axis=-1, keepdims=True)
    return mx.argmax(lps, axis=-1), lps, start


def _accept(row: Row, ahead: tuple[mx.array, mx.array, int], y: int,
            drafts: list[int]) -> tuple[list[int], int, mx.array, list[mx.array]]:
    """A greedy row's drafts accepted up to the first that differs from its position's token: the
    tokens taken (``y``, the accepted drafts), the token after them, its log-probabilities, and those
    of each position checked."""
    picks, lps, start = ahead
    tokens: list[int] = picks.tolist()  # type: ignore[assignment]
    i = next((j for j, d in enumerate(drafts) if tokens[j] != d), len(drafts))
    if row.job.processors and row.seen is not None:
        row.seen.size = start + 1 + i  # the rejected drafts leave what the processors see
    return [y, *drafts[:i]], tokens[i], lps[i], [lps[j] for j in range(i + 1)]


def _check(row: Row, logits: mx.array, y: int, drafts: list[int]) -> tuple[list[int], int, mx.array, list[mx.array]]:
    """A sampling row's positions of a verifying step (``y`` then ``drafts``) sampled in order until one
    differs from its draft (the sampler draws only for the positions checked, as decoding alone does):
    as :func:`_accept`."""
    job = row.job
    seen = None
    if job.processors and row.seen is not None:
        start = row.seen.size
        seen = row.seen.push(mx.array([y, *drafts], dtype=mx.uint32))
    lps: list[mx.array] = []
    for i in range(len(drafts) + 1):
        one = logits[i : i + 1]
        if seen is not None:
            for processor in job.processors:
                one = processor(seen[: start + 1 + i], one)
        lp = one - mx.logsumexp(one, axis=-1, keepdims=True)
        token = int(job.sampler(lp).item())  # type: ignore[arg-type]
        lps.append(lp.squeeze(0))
        if i == len(drafts) or token != drafts[i]:
            break
    if seen is not None and row.seen is not None:
        row.seen.size = start + 1 + i
    return [y, *drafts[:i]], token, lps[-1], lps


def _sample(samplers: list[Any], logprobs: mx.array) -> mx.array:
    """One call when the rows share a sampler (greedy ones do), else one per row."""
    if all(s is samplers[0] for s in samplers):
        return samplers[0](logprobs)
    return mx.concatenate([s(logprobs[e : e + 1]) for e, s in enumerate(samplers)], axis=0)


__all__ = ["Delivery", "Row", "Rows", "Seen"]

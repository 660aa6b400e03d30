"""What drafting costs one (target, draft) pair on this machine, learned by the sessions of the process.

A session's draft-length policy (:mod:`.policy`) starts from the pair's record when there is one, and
writes back what it learns, so a fresh session drafts (or does not) from its first token on the
evidence of the sessions before it instead of measuring from zero. The record is keyed by the
models' fingerprints (weights, shapes, class: two loads of the same files share it) or, for prompt
lookup, by the target's alone. It lives in this process only: timings depend on the machine and its
load, and a stale record from another run could make a fresh session draft at a loss.
"""

from __future__ import annotations

import hashlib
import json
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any

from ...model.loaded import model_fingerprint


@dataclass
class LearnedCosts:
    """The part of a policy's evidence that belongs to the pair, not to one conversation."""

    plain_times: list[float] = field(default_factory=list)  # the last plain step times (seconds)
    rounds: list[float] = field(default_factory=list)  # decayed sums of the round-cost fit
    longest: int = 0  # the longest draft measured
    hits: float | None = None  # decayed acceptance counts (a draft model's; prompt lookup's depend on the text)
    tries: float | None = None
    probe_every: int | None = None  # a draft model's probing interval while drafting does not pay


_LEARNED: dict[str, LearnedCosts] = {}
_LOCK = threading.Lock()


def pair_key(target: Any, draft: Any | None) -> str:
    """The registry key of ``target`` (an mlx model) drafted for by ``draft`` (an mlx model, or
    ``None``: prompt lookup)."""
    parts = [model_digest(target), model_digest(draft) if draft is not None else "prompt_lookup"]
    return ":".join(parts)


def model_digest(model: Any) -> str:
    """A short hash of ``model`` (:func:`chatkit.model.loaded.model_fingerprint`), computed once per
    model object: every fresh speculative session asks for it."""
    with _LOCK:
        found = _DIGESTS.get(id(model))
    if found is None:
        found = hashlib.sha256(json.dumps(model_fingerprint(model), sort_keys=True).encode()).hexdigest()[:16]
        with _LOCK:
            _DIGESTS[id(model)] = found
        weakref.finalize(model, _DIGESTS.pop, id(model), None)  # (mlx modules are dicts: not hashable)
    return found


_DIGESTS: dict[int, str] = {}


def learned(key: str) -> LearnedCosts | None:
    """A copy of the pair's record, or ``None`` before any session of the process learned it."""
    with _LOCK:
        found = _LEARNED.get(key)
        return None if found is None else _copy(found)


def remember(key: str, costs: LearnedCosts) -> None:
    """``costs`` become the pair's record (the latest session's evidence includes what it started from)."""
    with _LOCK:
        _LEARNED[key] = _copy(costs)


def forget(key: str | None = None) -> None:
    """Drop the pair's record (every record with ``None``)."""
    with _LOCK:
        if key is None:
            _LEARNED.clear()
        else:
            _LEARNED.pop(key, None)


def _copy(costs: LearnedCosts) -> LearnedCosts:
    return LearnedCosts(list(costs.plain_times), list(costs.rounds), costs.longest, costs.hits, costs.tries,
                        costs.probe_every)


__all__ = ["LearnedCosts", "forget", "learned", "model_digest", "pair_key", "remember"]

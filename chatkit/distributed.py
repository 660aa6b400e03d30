"""A model sharded with ``mx.distributed``: every rank runs the same session turns in lockstep.

The program runs once per rank (``mlx.launch -n 2 --backend ring -- python app.py``) and makes the same
calls on every rank. Sharded layers talk through MLX's own collectives (mlx-lm's ``model.shard`` /
``model.model.pipeline``); on top of that this module adds only what keeps the ranks in lockstep:

- **tokens**: rank 0's sampled token is what every rank feeds back (the sampler's result is
  ``all_sum``-ed with the other ranks contributing 0), so sampling cannot drift apart even at
  temperature > 0 or with rank-local randomness.
- **stopping**: after each token every rank votes whether it stops (an ``all_sum`` of 0/1): a stream
  closed early on rank 0 (Ctrl-C, a break) ends the same turn at the same token everywhere.
- **same turn**: before a turn, the ranks compare a digest of its prompt suffix and cache length
  (``all_gather``); ranks that drifted apart raise ``DistributedError`` instead of answering wrongly.
- **faults**: a rank whose peer died gets the backend's error as a ``DistributedError`` naming the
  peer; a peer that hangs is caught by a watchdog thread that ends this process with a clear message
  after ``timeout`` seconds (an MLX collective cannot be interrupted from Python).
"""

from __future__ import annotations

import os
import sys
import threading
import time
import zlib
from array import array
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar, cast

import mlx.core as mx

from .errors import CacheError, CacheFileError, ChatKitError, DistributedError, IncompatibleCacheError, ModelLoadError

STRATEGIES = ("tensor", "pipeline", "auto")
DEFAULT_TIMEOUT = 120.0  # seconds a rank waits for the others inside one step before giving up
WATCHDOG_EXIT_CODE = 75
T = TypeVar("T")


@dataclass(eq=False)
class Group:
    """Where a loaded model sits in an ``mx.distributed`` world: ``size`` ranks sharding it by
    ``strategy`` ("tensor" or "pipeline"); this process is ``rank``. ``timeout`` bounds how long a
    rank waits for the others inside a step (prefill chunk, decode step, save/restore agreement)."""

    group: Any  # mx.distributed.Group
    strategy: str
    rank: int
    size: int
    timeout: float = DEFAULT_TIMEOUT
    _watchdog: Watchdog | None = field(default=None, repr=False)

    @property
    def sharded(self) -> bool:
        """Whether more than one rank holds the model (a world of 1 behaves as an unsharded model)."""
        return self.size > 1

    @property
    def leader(self) -> bool:
        """Rank 0: the one that owns input and output (the app, the REPL)."""
        return self.rank == 0

    def describe(self) -> str:
        return f"{self.strategy} over {self.size} ranks"

    @property
    def watchdog(self) -> Watchdog:
        if self._watchdog is None:
            self._watchdog = Watchdog(self.rank, self.size, self.timeout)
        return self._watchdog


def init(strategy: str, timeout: float = DEFAULT_TIMEOUT) -> tuple[Any, int, int]:
    """Start (or join) MLX's distributed world; ``(group, rank, size)``. Without a launcher's
    environment this is a world of one."""
    if strategy not in STRATEGIES:
        raise ModelLoadError(f"distributed={strategy!r}: choose one of {', '.join(STRATEGIES)} (or None).")
    if not (isinstance(timeout, (int, float)) and timeout > 0):
        raise ModelLoadError(f"distributed_timeout={timeout!r}: give a number of seconds > 0.")
    try:
        group = mx.distributed.init()
    except Exception as exc:  # a bad hostfile, a backend that cannot start
        raise ModelLoadError(
            f"Could not start MLX's distributed backend: {exc}. Launch with mlx.launch (see docs/distributed.md)."
        ) from exc
    return group, group.rank(), group.size()


def load_sharded(source: str, strategy: str, group: Any, tokenizer_config: dict[str, Any] | None) -> tuple[Any, Any, dict[str, Any], str]:
    """mlx-lm's ``sharded_load`` over ``group``; ``(model, tokenizer, config, strategy used)``.

    "auto" is mlx-lm's own choice: tensor parallelism when the model has ``shard``, else pipeline.
    """
    from mlx_lm.utils import sharded_load  # imported here: mlx_lm costs about a second to import

    groups = {"tensor": (None, group), "pipeline": (group, None), "auto": (None, None)}[strategy]
    try:
        model, tokenizer, config = sharded_load(
            source, *groups, return_config=True, tokenizer_config=tokenizer_config
        )
    except Exception as exc:  # unsupported architecture, heads that do not divide, missing files
        raise ModelLoadError(
            f"Could not shard {source!r} ({strategy}) over {group.size()} ranks: {exc}. "
            "Try the other strategy (tensor needs head counts divisible by the number of ranks; pipeline "
            "needs an architecture mlx-lm can pipeline), or another number of ranks."
        ) from exc
    used = strategy if strategy != "auto" else ("tensor" if hasattr(model, "shard") else "pipeline")
    return model, tokenizer, dict(config), used


# -- faults -------------------------------------------------------------------------------------------


class Watchdog:
    """Ends this process with a clear message when a guarded wait on the other ranks runs past its
    deadline. An MLX collective blocks inside C++ and cannot be interrupted: exiting is the only
    bounded way out (``mlx.launch`` then stops the other ranks)."""

    def __init__(self, rank: int, size: int, timeout: float) -> None:
        self.rank, self.size, self.timeout = rank, size, timeout
        self._lock = threading.Condition()
        self._deadline: float | None = None
        self._what = ""
        self._thread = threading.Thread(target=self._run, name="chatkit-distributed-watchdog", daemon=True)
        self._thread.start()

    @contextmanager
    def guard(self, what: str) -> Iterator[None]:
        """Within this block the other ranks must answer within ``timeout`` (``kick`` restarts it)."""
        with self._lock:
            outer = (self._deadline, self._what)
            self._deadline, self._what = time.monotonic() + self.timeout, what
            self._lock.notify()
        try:
            yield
        finally:
            with self._lock:
                self._deadline, self._what = outer
                self._lock.notify()

    def kick(self) -> None:
        """Progress was made (a prefill chunk): restart the running deadline."""
        with self._lock:
            if self._deadline is not None:
                self._deadline = time.monotonic() + self.timeout

    def _run(self) -> None:
        with self._lock:
            while True:
                if self._deadline is None:
                    self._lock.wait()
                    continue
                left = self._deadline - time.monotonic()
                if left > 0:
                    self._lock.wait(left)
                    continue
                message = str(hung_peer_error(self.rank, self.size, self.timeout, self._what))
                try:
                    print(f"chatkit: error: {message}", file=sys.stderr, flush=True)
                finally:
                    os._exit(WATCHDOG_EXIT_CODE)


def _peers(rank: int, size: int) -> str:
    others = [r for r in range(size) if r != rank]
    return f"rank {others[0]}" if len(others) == 1 else "ranks " + ", ".join(map(str, others))


def hung_peer_error(rank: int, size: int, timeout: float, what: str) -> DistributedError:
    peer = 1 - rank if size == 2 else None
    return DistributedError(
        f"rank {rank} of {size}: no answer from {_peers(rank, size)} within {timeout:g} s while {what} (a rank "
        "died, hung or was stopped). Stopping this rank; check the other ranks' logs, then restart all ranks "
        "(raise distributed_timeout if steps are legitimately that slow).",
        rank=rank, peer=peer,
    )


def _is_backend_failure(exc: BaseException) -> bool:
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(k in text for k in ("[ring]", "[jaccl]", "[mpi]", "[nccl]", "peer"))


@contextmanager
def guarded(group: Group, what: str) -> Iterator[None]:
    """Run collectives with the watchdog armed; a lost peer becomes a ``DistributedError``."""
    try:
        with group.watchdog.guard(what):
            yield
    except RuntimeError as exc:
        if not _is_backend_failure(exc):
            raise
        peer = 1 - group.rank if group.size == 2 else None
        raise DistributedError(
            f"rank {group.rank} of {group.size} lost {_peers(group.rank, group.size)} while {what} ({exc}): "
            "a rank died or its machine dropped off the network. Restart all ranks; saved caches are intact.",
            rank=group.rank, peer=peer,
        ) from exc


# -- collectives ----------------------------------------------------------------------------------------


def all_sum_ints(group: Group, values: Sequence[int]) -> list[int]:
    from mlx_lm.generate import generation_stream  # the stream the model's own collectives run on

    with mx.stream(generation_stream):
        out = mx.distributed.all_sum(mx.array(list(values), dtype=mx.int32), group=group.group)
        mx.eval(out)
    return [int(v) for v in _ints(out)]


def all_gather_ints(group: Group, values: Sequence[int]) -> list[list[int]]:
    from mlx_lm.generate import generation_stream

    with mx.stream(generation_stream):
        out = mx.distributed.all_gather(mx.array([list(values)], dtype=mx.int32), group=group.group)
        mx.eval(out)
    return [[int(v) for v in row] for row in _ints(out)]


def largest(group: Group | None, value: int) -> int:
    """The largest of every rank's ``value`` (every rank calls this), so that a decision taken from a
    per-rank size (a shard's cache bytes) is the same on every rank. Without a sharded group: ``value``."""
    if group is None or not group.sharded:
        return value
    with guarded(group, "comparing cache sizes"):
        rows = all_gather_ints(group, [value >> 30, value & ((1 << 30) - 1)])  # int32 on the wire
    return max((high << 30) | low for high, low in rows)


def _ints(x: mx.array) -> list[Any]:
    """``x.tolist()`` of an int array of one or more dimensions (typed: mlx's stub allows a scalar)."""
    return cast(list[Any], x.tolist())


def digest_ints(values: Sequence[int]) -> list[int]:
    """Three 31-bit ints that tell two int sequences apart (length and two checksums)."""
    raw = array("q", values).tobytes()
    return [len(values) & 0x7FFFFFFF, zlib.crc32(raw) & 0x7FFFFFFF, zlib.adler32(raw) & 0x7FFFFFFF]


def broadcast_text(group: Group, text: str | None) -> str | None:
    """Rank 0's ``text`` on every rank (``None`` stays ``None``): for input only rank 0 reads, such as
    the REPL's lines. Other ranks pass anything; they wait here, without a deadline, for rank 0."""
    data = (text or "").encode("utf-8") if group.leader else b""
    flag = 1 if text is None else 0
    try:
        n, is_none = all_sum_ints(group, [len(data), flag] if group.leader else [0, 0])
        if is_none:
            return None
        if n == 0:
            return ""
        buf = mx.array(list(data) if group.leader else [0] * n, dtype=mx.int32)
        from mlx_lm.generate import generation_stream

        with mx.stream(generation_stream):
            out = mx.distributed.all_sum(buf, group=group.group)
            mx.eval(out)
    except RuntimeError as exc:
        if not _is_backend_failure(exc):
            raise
        raise DistributedError(
            f"rank {group.rank} of {group.size} lost {_peers(group.rank, group.size)} while waiting for input: "
            f"a rank died ({exc}). Restart all ranks.", rank=group.rank, peer=0 if not group.leader else None,
        ) from exc
    return bytes(_ints(out)).decode("utf-8")


# -- saved caches: one file per rank --------------------------------------------------------------------


def shard_path(group: Group | None, path: str | os.PathLike[str]) -> str | os.PathLike[str]:
    """This rank's file for ``path``: rank 0 writes ``path`` itself (untouched, so the store still
    sees a trailing separator), rank r ``<stem>.rank<r><suffix>`` next to it. (On several machines
    each rank writes on its own disk.)"""
    if group is None or not group.sharded or group.leader:
        return path
    target = Path(path)
    return target.with_name(f"{target.stem}.rank{group.rank}{target.suffix}")


# What another rank's failure is raised as here: the first class (most specific first) it was an instance of.
_KINDS: list[type[ChatKitError]] = [IncompatibleCacheError, CacheFileError, CacheError, DistributedError, ChatKitError]


def agree(group: Group | None, action: str, run: Callable[[], T], digest: Callable[[T], Sequence[int]] | None = None) -> T:
    """Run ``run`` on every rank and succeed only if every rank did (and, with ``digest``, all
    got the same); otherwise every rank raises, naming the rank that failed. Without a sharded group
    this is just ``run()``."""
    if group is None or not group.sharded:
        return run()
    result: Any = None
    error: BaseException | None = None
    try:
        result = run()
    except Exception as exc:
        error = exc
    kind = next((i + 1 for i, k in enumerate(_KINDS) if isinstance(error, k)), len(_KINDS) + 1) if error else 0
    mine = [kind, *(digest(result) if digest is not None and error is None else [0, 0, 0])]
    with guarded(group, action):
        rows = all_gather_ints(group, mine)
    failed = [r for r, row in enumerate(rows) if row[0]]
    if error is not None:
        raise error
    if failed:
        r = failed[0]
        cls = _KINDS[rows[r][0] - 1] if rows[r][0] <= len(_KINDS) else ChatKitError
        message = (f"Could not {action} on rank {r} of {group.size} (see that rank's error), so it failed on "
                   "every rank (files other ranks wrote are refused at restore): fix it there and try again.")
        if cls is DistributedError:
            raise DistributedError(message, rank=group.rank, peer=r)
        raise cls(message)
    if digest is not None and any(row[1:] != rows[0][1:] for row in rows):
        odd = [r for r, row in enumerate(rows) if row[1:] != rows[0][1:]]
        raise IncompatibleCacheError(
            f"Could not {action}: the files of rank(s) {', '.join(map(str, odd))} hold another conversation "
            "than rank 0's (saved at different times?). Save again on all ranks, or start a new session."
        )
    return result


def restore(group: Group | None, path: str | os.PathLike[str], read: Callable[[str | os.PathLike[str]], T]) -> T:
    """``read`` this rank's file of ``path`` (a ``cache.file.LoadedCache``) on every rank: all ranks fail if
    one does, and all must have restored the same conversation (their ledgers are compared)."""
    def digest(saved: Any) -> list[int]:
        return digest_ints([saved.ledger.opaque, *saved.ledger.tokens])

    return agree(group, "restore the cache", lambda: read(shard_path(group, path)), digest)


def fingerprint_entry(group: Group) -> str:
    """What a saved cache records about the sharding: a file of one layout never loads into another."""
    return f"{group.strategy} over {group.size} ranks, rank {group.rank}"


__all__ = [
    "DEFAULT_TIMEOUT",
    "STRATEGIES",
    "Group",
    "Watchdog",
    "agree",
    "broadcast_text",
    "fingerprint_entry",
    "init",
    "largest",
    "load_sharded",
    "restore",
    "shard_path",
]

"""``BatchEngine``: the scheduler thread that owns the model and steps every batched turn together."""

from __future__ import annotations

import atexit
import statistics
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.generate import generation_stream

from ...cache.prefix import PrefixCache
from ...errors import InvalidParamsError
from ...model.loaded import LoadedModel
from .. import TokenSource
from ..local import LocalSource
from ..speculative import NgramIndex
from ..speculative.policy import PLAIN_WINDOW, choose, record_draft, record_miss, record_plain
from .drafts import model_drafts
from .job import Job
from .prefill import Prefill
from .rows import Delivery, Row, Rows, Seen
from .source import BatchSource

HANDBACK_WAIT = 60.0  # seconds a closing turn waits for the scheduler to hand its cache back
DEFAULT_PREFIX_BYTES = 512 * 1024 * 1024
PREFILL_BATCH = 8  # turns prefilled together at most (as mlx-lm's BatchGenerator)
CLEAR_EVERY = 512  # steps between releases of MLX's buffer cache (as mlx-lm's BatchGenerator)
clock = time.perf_counter


class BatchEngine:
    """Decodes the concurrent turns of the sessions built with it together (continuous batching).

    ``engine = chatkit.BatchEngine(lm, max_batch=16)``; then ``ChatSession.builder(lm).engine(engine)``
    or ``SessionPool(lm, ..., engine=engine)``. At most ``max_batch`` turns decode at once (more wait
    for a free place); a new turn's prompt is prefilled between the others' decode steps, at most
    ``prefill_step_size`` tokens per step (and in chunks of at most the session's own
    ``prefill_step_size``). Speculative sessions (prompt lookup, a draft model) draft and verify
    inside the batch. ``prefix_cache_bytes`` bounds the shared prefix cache (0
    turns it off): a session starting from an empty cache reuses the KV of the longest prompt prefix
    another session of this engine already prefilled. Close it (or use it as a context manager) when done.
    """

    def __init__(
        self,
        lm: LoadedModel,
        max_batch: int = 16,
        *,
        prefill_step_size: int = 512,
        prefix_cache_bytes: int = DEFAULT_PREFIX_BYTES,
    ) -> None:
        if not isinstance(lm, LoadedModel):
            raise InvalidParamsError(f"BatchEngine needs a chatkit.load(...) result, got {type(lm).__name__}.")
        for name, value, low in (("max_batch", max_batch, 1), ("prefill_step_size", prefill_step_size, 1),
                                 ("prefix_cache_bytes", prefix_cache_bytes, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise InvalidParamsError(f"{name}={value!r}: must be an int >= {low}.")
        if lm.distributed is not None and lm.distributed.sharded:
            raise InvalidParamsError(
                "BatchEngine cannot drive a model sharded over several ranks: build the sessions without .engine(...)."
            )
        self.lm = lm
        self.max_batch = max_batch
        self.prefill_step_size = prefill_step_size
        self.prefix_cache = PrefixCache(prefix_cache_bytes) if prefix_cache_bytes else None
        # A turn ends at the tokenizer's end tokens, as its stream does: the engine stops there too,
        # rather than decoding on until the reader closes.
        self._eos = frozenset(lm.tokenizer.eos_token_ids)
        self._cond = threading.Condition()
        self._inbox: list[Job] = []
        self._cancels: list[Job] = []
        self._waiting: deque[Job] = deque()
        self._prefilling = Prefill(lm.model)
        self._rows = Rows(lm.model)
        self._closed = False
        self._steps = 0
        self._plain_times: list[float] = []  # the last plain steps' times (seconds)
        self._peak = 0
        self._turns = 0
        self._thread = threading.Thread(target=self._run, name="chatkit-batch-engine", daemon=True)
        self._thread.start()
        # An engine left open is closed at exit, so that its thread destroys its MLX streams (MLX may
        # abort the process otherwise).
        atexit.register(_close_at_exit, weakref.ref(self))

    # -- public -------------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called (turns then fail with ``InvalidParamsError``)."""
        return self._closed

    @property
    def active(self) -> int:
        """How many turns the engine holds now (prefilling, decoding or waiting for a place)."""
        with self._cond:
            return len(self._inbox) + len(self._waiting) + len(self._prefilling) + len(self._rows)

    @property
    def steps(self) -> int:
        """Decode steps run so far (one forward pass of the batch each)."""
        return self._steps

    @property
    def turns(self) -> int:
        """Turns handed to the engine so far (those that ran alone not counted)."""
        return self._turns

    @property
    def peak_batch(self) -> int:
        """The most turns decoded in one step so far."""
        return self._peak

    def source(self, speculative: Any = None) -> TokenSource:
        """The token source of one session: batched (prompt lookup and draft models included), or alone
        (an adapter, other cache kinds)."""
        self.check_open()
        return BatchSource(self, LocalSource(self.lm.model, speculative), speculative)

    def check_open(self) -> None:
        """``InvalidParamsError`` if the engine was closed."""
        if self._closed:
            raise InvalidParamsError("This BatchEngine was closed: create a new one and build the sessions with it.")

    def close(self) -> None:
        """Stop the scheduler; turns still running fail (their sessions keep their caches)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=HANDBACK_WAIT)

    def __enter__(self) -> BatchEngine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- the turn's side ----------------------------------------------------------------------
    def submit(self, job: Job) -> None:
        """A turn's job joins the engine (between two steps)."""
        with self._cond:
            self.check_open()
            self._inbox.append(job)
            self._turns += 1
            self._cond.notify_all()

    def release(self, job: Job) -> list[Any] | None:
        """The turn stops reading: take it out of the batch and get its cache back (``None``: none to give,
        because the batch never took the session's layers, the turn was closed on the batch's own thread,
        or the hand-back timed out; a session whose layers the batch took then rebuilds them next turn)."""
        with self._cond:
            if not job.finished.is_set():
                self._cancels.append(job)
                self._cond.notify_all()
        if threading.current_thread() is self._thread:  # closed by the garbage collector here: cannot wait
            return None
        if not job.finished.wait(HANDBACK_WAIT):
            return None
        back, job.handback = job.handback, None  # the session's from now on: the job may outlive the turn
        return back

    # -- the scheduler ------------------------------------------------------------------------
    def _run(self) -> None:
        failure: BaseException = InvalidParamsError(
            "This BatchEngine was closed during the turn: create a new one and build the sessions with it."
        )
        rows = self._rows
        try:
            while True:
                with self._cond:
                    while not (self._closed or self._inbox or self._cancels or self._waiting
                               or self._prefilling or rows):
                        self._cond.wait()
                    if self._closed:
                        break
                    self._waiting.extend(self._inbox)
                    self._inbox = []
                    cancels, self._cancels = self._cancels, []
                with mx.stream(generation_stream):
                    self._cancel(rows, cancels)
                    self._admit(rows)
                    if rows:
                        self._step(rows)
        except BaseException as exc:  # a bug of the scheduler itself: fail the turns, never hang them
            failure = exc
        finally:
            with self._cond:
                self._closed = True
                jobs = [*self._inbox, *self._waiting]
                self._inbox = []
                self._waiting.clear()
            for job in jobs:  # the session's own layers, never taken: the session keeps them
                job.finish(None, failure)
            self._fail_group(failure)
            self._fail_rows(rows, failure)
            mx.clear_streams()  # MLX wants a thread's streams destroyed before the thread ends

    def _cancel(self, rows: Rows, jobs: list[Job]) -> None:
        group = self._prefilling
        for job in jobs:
            if job.finished.is_set():
                continue
            with self._cond:
                if job in self._waiting:  # not started: the session's own layers, kept
                    self._waiting.remove(job)
                    job.finish(None)
                    continue
            idx = [i for i, j in enumerate(group.jobs) if j is job]
            if idx:
                job.finish(group.leave(idx)[0])
                continue
            idx = [i for i, r in enumerate(rows.rows) if r.job is job]
            job.finish(rows.leave(idx)[0] if idx else None)

    def _admit(self, rows: Rows) -> None:
        """Start a prefill group of waiting turns when none runs and there is room; feed it a chunk
        (at most ``prefill_step_size`` tokens); a group whose prompts are in joins the batch."""
        group = self._prefilling
        if not group:
            with self._cond:
                # at most one token per turn and step: a group wider than the step would exceed it
                room = min(PREFILL_BATCH, self.prefill_step_size, self.max_batch - len(rows), len(self._waiting))
                jobs = [self._waiting.popleft() for _ in range(max(0, room))]
            if not jobs:
                return
            try:
                group.start(jobs)
            except Exception as exc:  # caches half moved: the sessions rebuild theirs
                group.take()
                for job in jobs:
                    job.finish(None, exc)
                return
        try:
            group.feed(self.prefill_step_size)
        except Exception as exc:  # the shared forward pass failed: every turn in the group fails
            self._fail_group(exc)
            return
        if group.done:
            self._join(rows)

    def _join(self, rows: Rows) -> None:
        """The group's turns join the batch: their caches are moved into its rows (from now on the
        only copy); the next step feeds their prompts' last tokens."""
        jobs, layers = self._prefilling.take()
        try:
            rows.join([_row(job) for job in jobs], layers, [job.suffix[-1] for job in jobs])
        except Exception as exc:  # the batch's layers may be half-extended: every turn in it fails
            self._fail_rows(rows, exc)
            for job in jobs:
                job.finish(None, exc)
            return
        for job in jobs:
            job.progress(len(job.suffix))

    def _step(self, rows: Rows) -> None:
        """One forward pass of the batch: plain, or verifying drafts when a row drafted."""
        t0 = clock()
        try:
            drafts, wants, spare = self._drafts(rows)
            if drafts is None:
                deliveries, accepted = rows.plain(), None
            else:
                deliveries, accepted = rows.verify(drafts)
        except Exception as exc:  # the shared forward pass failed: every turn in it fails
            self._fail_rows(rows, exc)
            return
        self._steps += 1
        self._peak = max(self._peak, len(rows))
        self._record(rows, drafts, wants, accepted, clock() - t0 - spare)
        self._deliver(rows, deliveries)
        if self._steps % CLEAR_EVERY == 0:
            mx.clear_cache()

    def _drafts(self, rows: Rows) -> tuple[list[list[int]] | None, list[tuple[int, bool]], float]:
        """Each row's drafts for the next step (``None``: no row drafts, a plain step), what each row's
        policy asked for: (draft length, probe), and the seconds the draft models' catch-ups took (no
        round's cost). The step is as wide as the longest draft asked for, and every row it fits in
        drafts up to that width: its positions are computed anyway (a draft model's rows, when one of
        them asks: they draft together)."""
        wants, room = [], []
        for row in rows.rows:
            drafter = row.index is not None or row.draft is not None
            k, probe = (0, False) if row.policy is None or not drafter or row.fresh else choose(row.policy)
            left = 0 if not drafter or row.fresh else max(0, row.job.max_tokens - row.job.delivered - 1)
            wants.append((min(k, left), probe))
            room.append(left)
        width = max(k for k, _ in wants)
        if not width:
            return None, wants, 0.0
        ys = rows.next_tokens()
        by_model, spare = model_drafts(rows.rows, ys, wants, room, width)
        drafts = []
        for row, y, (k, probe), left in zip(rows.rows, ys, wants, room):
            if row.draft is not None:
                drafts.append(by_model.get(row, []))
            else:
                drafts.append(row.propose(y, min(width, left)) if left and row.index is not None else [])
            if k and not drafts[-1] and row.policy is not None:
                record_miss(row.policy, probe)
        return (drafts if any(drafts) else None), wants, spare

    def _record(self, rows: Rows, drafts: list[list[int]] | None, wants: list[tuple[int, bool]],
                accepted: list[int] | None, seconds: float) -> None:
        """The step's time and each drafting row's acceptance, to the rows' draft-length policies. A
        row that drafted nothing in a verifying step took a plain step within it: it counts one at
        the batch's plain step time (so that its policy measures, probes and drafts as a session
        alone does while the other rows draft)."""
        if drafts is None or accepted is None:
            self._plain_times = [*self._plain_times[1 - PLAIN_WINDOW:], seconds]
        plain = statistics.median(self._plain_times) if self._plain_times else None
        for e, row in enumerate(rows.rows):
            if row.policy is None or (row.index is None and row.draft is None):
                continue
            if drafts is None or accepted is None:
                record_plain(row.policy, seconds)
            elif drafts[e]:
                record_draft(row.policy, len(drafts[e]), accepted[e], seconds, wants[e][1] and wants[e][0] > 0)
                row.job.drafts.add(len(drafts[e]), accepted[e])
            elif plain is not None:
                record_plain(row.policy, plain)

    def _deliver(self, rows: Rows, deliveries: Sequence[Delivery]) -> None:
        """Hand the step's tokens to their readers; turns that end (EOS, ``max_tokens``, an error of
        their own sampler or processors) leave with their caches."""
        done: dict[Job, BaseException | None] = {}
        for job, token, logprobs, from_draft in deliveries:
            if job in done or job.error is not None:
                continue
            job.put(token, logprobs, from_draft)
            job.delivered += 1
            if job.delivered >= job.max_tokens or token in self._eos:
                done[job] = None
        for row in rows.rows:
            if row.job.error is not None:
                done[row.job] = row.job.error
        if done:
            idx = [i for i, r in enumerate(rows.rows) if r.job in done]
            jobs = [rows.rows[i].job for i in idx]
            for job, layers in zip(jobs, rows.leave(idx)):
                job.finish(layers, done[job])

    def _fail_group(self, error: BaseException) -> None:
        """Every turn of the prefill group fails with ``error``; each gets its cache back if it can."""
        group = self._prefilling
        _fail_all(list(group.jobs), group.leave, group.take, error)

    def _fail_rows(self, rows: Rows, error: BaseException) -> None:
        """Every turn in the batch fails with ``error``; each gets its cache back if it can be read."""
        _fail_all([r.job for r in rows.rows], rows.leave, rows.clear, error)


def _fail_all(jobs: list[Any], leave: Callable[[range], list[list[Any]]], reset: Callable[[], Any],
              error: BaseException) -> None:
    """``jobs`` (all of a group's or the batch's rows) fail with ``error``, each with its cache ``leave``
    hands back, or none when that cannot be read (then ``reset`` empties the part)."""
    if not jobs:
        return
    try:
        caches: list[list[Any] | None] = list(leave(range(len(jobs))))
    except Exception:
        caches = [None] * len(jobs)
        reset()
    for job, layers in zip(jobs, caches):
        job.finish(layers, error)


def check_engine(engine: Any, model: Any) -> None:
    """``InvalidParamsError`` unless ``engine`` is ``None`` or an open ``BatchEngine`` over ``model``."""
    if engine is None:
        return
    if not isinstance(engine, BatchEngine):
        raise InvalidParamsError(f"engine must be a chatkit.BatchEngine, got {type(engine).__name__}.")
    if engine.lm.model is not model:
        raise InvalidParamsError(
            "This BatchEngine was built for another model: create one over the session's model, "
            "chatkit.BatchEngine(lm), with the same lm as the builder or pool."
        )
    engine.check_open()



def _row(job: Job) -> Row:
    """A joining turn's row: what its processors see (all but the prompt's last token, fed next) and
    its prompt lookup index (the whole prompt)."""
    seen = Seen([*job.context, *job.suffix[:-1]]) if job.processors else None
    index = None
    if job.lookup is not None:
        index = NgramIndex([*job.context, *job.suffix], job.lookup.ngram_min, job.lookup.ngram_max)
    return Row(job, seen, index=index)


def _close_at_exit(ref: weakref.ref[BatchEngine]) -> None:
    engine = ref()
    if engine is not None:
        engine.close()


__all__ = ["BatchEngine", "check_engine"]

"""``BatchEngine``: many sessions' turns decoded together, one forward pass per step over all of them.

One scheduler thread owns the model and steps mlx-lm's ``BatchGenerator`` (continuous batching: turns
join and leave between steps; a new turn's prefill is cut into ``prefill_step_size`` chunks, one chunk
per decode step of the others). A session's turn hands over its own cache layers, sampler and logits
processors; tokens come back through a queue on the turn's own thread. When the turn ends, its
extended cache goes back to the session (trimmed to what the turn consumed), so commit, reuse, undo
and save work exactly as for a session alone. During the turn only the batch holds it (a failed turn's
session starts the next one from an empty cache).

What runs alone (through the session's local source, as without an engine), and why:
- speculative sessions: ``BatchGenerator`` feeds one token per sequence and step; verifying drafts
  needs several positions per sequence in one pass, which it cannot do;
- sessions with an adapter (``builder.adapter``): one forward pass applies one set of layers to every
  row, and the engine's rows are the base model's; an adapted turn decodes alone, on its own thread,
  with its adapter (``model/switchable.py``), next to the engine's batch of base-model turns;
- caches that are not plain ``KVCache`` layers (``max_kv_size`` / sliding-window, hybrid models, quantized
  KV): the engine runs ahead of a turn's reader and must trim the cache back to what was read, which
  rotating and recurrent layers cannot do; mlx-lm has no batched quantized cache.
Gaps of ``BatchGenerator`` worked around here: it takes one ``prefill_step_size`` for all requests
(the engine's, not each session's), and has no per-request error isolation (each session's sampler and
processors are guarded, so that one that raises fails only its own turn).
"""

from __future__ import annotations

import atexit
import queue
import threading
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, StopSequences
from mlx_lm.models.cache import KVCache
from mlx_lm.sample_utils import greedy_sampler

from ..cache._mlx import eval_layers, layer_offset
from ..cache.prefix import PrefixCache
from ..cache.state import CacheState
from ..errors import InvalidParamsError
from ..model.loaded import LoadedModel
from ..params import LogitsProcessor, Sampler
from . import Request, Token, TokenSource
from .local import LocalSource

HANDBACK_WAIT = 60.0  # seconds a closing turn waits for the scheduler to hand its cache back
DEFAULT_PREFIX_BYTES = 512 * 1024 * 1024


class BatchEngine:
    """Decodes the concurrent turns of the sessions built with it together (continuous batching).

    ``engine = chatkit.BatchEngine(lm, max_batch=16)``; then ``ChatSession.builder(lm).engine(engine)``
    or ``SessionPool(lm, ..., engine=engine)``. At most ``max_batch`` turns decode at once (more wait
    for a free place); a new turn's prompt is prefilled ``prefill_step_size`` tokens per step between
    the others' decode steps. ``prefix_cache_bytes`` bounds the shared prefix cache (0 turns it off): a
    session starting from an empty cache reuses the KV of the longest prompt prefix another session
    of this engine already prefilled. Close it (or use it as a context manager) when done.
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
        self._stop = StopSequences([[t] for t in sorted(lm.tokenizer.eos_token_ids)])
        self._cond = threading.Condition()
        self._inbox: list[_Job] = []
        self._cancels: list[_Job] = []
        self._active: dict[int, _Job] = {}
        self._closed = False
        self._steps = 0
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
            return len(self._active) + len(self._inbox)

    @property
    def steps(self) -> int:
        """Scheduler steps run so far (one ``BatchGenerator.next()`` each)."""
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
        """The token source of one session: batched, or alone (speculative, other cache kinds)."""
        self.check_open()
        return BatchSource(self, LocalSource(self.lm.model, speculative), speculative is not None)

    def check_open(self) -> None:
        """``InvalidParamsError`` if the engine was closed."""
        if self._closed:
            raise InvalidParamsError("This BatchEngine was closed: create a new one and build the sessions with it.")

    def close(self) -> None:
        """Stop the scheduler; turns still running fail (their sessions stay as before the turn)."""
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
    def _submit(self, job: _Job) -> None:
        with self._cond:
            self.check_open()
            self._inbox.append(job)
            self._turns += 1
            self._cond.notify_all()

    def _release(self, job: _Job) -> list[Any] | None:
        """The turn stops reading: take it out of the batch and get its cache back (``None``: the
        session's own layers were never written)."""
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
    def _generator(self) -> BatchGenerator:
        return BatchGenerator(
            self.lm.model,
            completion_batch_size=self.max_batch,
            prefill_batch_size=min(self.max_batch, 8),
            prefill_step_size=self.prefill_step_size,
        )

    def _run(self) -> None:
        gen: BatchGenerator | None = None
        failure: BaseException = InvalidParamsError(
            "This BatchEngine was closed during the turn: create a new one and build the sessions with it."
        )
        try:
            while True:
                with self._cond:
                    while not (self._closed or self._inbox or self._cancels or self._active):
                        self._cond.wait()
                    if self._closed:
                        break
                    inbox, self._inbox = self._inbox, []
                    cancels, self._cancels = self._cancels, []
                if gen is None:
                    gen = self._generator()
                self._insert(gen, inbox)
                for job in cancels:
                    if not job.finished.is_set() and job.uid is not None:
                        removed = gen.remove([job.uid], return_prompt_caches=True)
                        layers = removed[job.uid][0] if job.uid in removed else None
                        self._finish(job, layers)
                if not self._active:
                    continue
                try:
                    prompts, tokens = gen.next()
                except Exception as exc:  # the shared forward pass failed: every turn in it fails
                    for job in list(self._active.values()):
                        self._finish(job, None, exc)
                    gen.close()
                    gen = None
                    continue
                self._steps += 1
                self._peak = max(self._peak, len(tokens))
                self._deliver(gen, prompts, tokens)
        except BaseException as exc:  # a bug of the scheduler itself: fail the turns, never hang them
            failure = exc
        finally:
            with self._cond:
                self._closed = True
                jobs = [*self._active.values(), *self._inbox, *self._cancels]
                self._inbox = []
            for job in jobs:
                self._finish(job, None, failure)
            if gen is not None:
                gen.close()
            mx.clear_streams()  # MLX wants a thread's streams destroyed before the thread ends

    def _insert(self, gen: BatchGenerator, jobs: list[_Job]) -> None:
        for job in jobs:
            try:
                (job.uid,) = gen.insert(
                    [list(job.suffix)],
                    max_tokens=[job.max_tokens],
                    caches=[list(job.layers)],
                    all_tokens=[list(job.context)],
                    samplers=[job.guarded_sampler()],
                    logits_processors=[list(job.guarded_processors())],
                    stop_sequences=[self._stop],
                )
            except Exception as exc:
                self._finish(job, None, exc)
                continue
            # The batch copies the layers into its own cache: the session lets go of them, so that its
            # cache is not held twice during the turn. It gets the batch's back when the turn ends (or
            # starts from an empty cache if the turn fails; see BatchSource).
            job.layers.clear()
            with self._cond:
                self._active[job.uid] = job

    def _deliver(self, gen: BatchGenerator, prompts: list[Any], tokens: list[Any]) -> None:
        for p in prompts:
            job = self._active.get(p.uid)
            if job is not None:
                job.out.put(("progress", p.progress))
        for r in tokens:
            job = self._active.get(r.uid)
            if job is None or job.error is not None:
                continue
            job.out.put(("token", int(r.token), r.logprobs))
            if r.finish_reason is not None:
                self._finish(job, r.prompt_cache)
        for job in [j for j in self._active.values() if j.error is not None]:
            gen.remove([job.uid])
            self._finish(job, None, job.error)

    def _finish(self, job: _Job, layers: list[Any] | None, error: BaseException | None = None) -> None:
        """The job leaves the engine: its cache (evaluated here, on the thread that computed it) or
        ``None``, then an end or an error for its reader."""
        if job.finished.is_set():
            return
        if layers is not None:
            try:
                eval_layers(layers)
            except Exception as exc:
                layers, error = None, error or exc
        if job.uid is not None:
            with self._cond:
                self._active.pop(job.uid, None)
        job.handback = layers
        job.out.put(("error", error) if error is not None else ("end",))
        job.finished.set()


def _close_at_exit(ref: weakref.ref[BatchEngine]) -> None:
    engine = ref()
    if engine is not None:
        engine.close()


@dataclass(eq=False)
class _Job:
    """One turn inside the engine: its inputs, its output queue, and the cache handed back."""

    suffix: tuple[int, ...]
    context: tuple[int, ...]
    max_tokens: int
    sampler: Sampler
    processors: tuple[LogitsProcessor, ...]
    layers: list[Any]
    uid: int | None = None
    out: queue.SimpleQueue[tuple[Any, ...]] = field(default_factory=queue.SimpleQueue)
    finished: threading.Event = field(default_factory=threading.Event)
    handback: list[Any] | None = None
    error: BaseException | None = None

    def guarded_sampler(self) -> Sampler:
        if self.sampler is greedy_sampler:  # cannot fail; kept as is, greedy rows sample in one call
            return greedy_sampler

        def sample(logprobs: mx.array) -> mx.array:
            if self.error is None:
                try:
                    return self.sampler(logprobs)
                except Exception as exc:
                    self.error = exc
            return mx.argmax(logprobs, axis=-1)

        return sample

    def guarded_processors(self) -> tuple[LogitsProcessor, ...]:
        def guard(processor: LogitsProcessor) -> LogitsProcessor:
            def process(tokens: mx.array, logits: mx.array) -> mx.array:
                if self.error is None:
                    try:
                        return processor(tokens, logits)
                    except Exception as exc:
                        self.error = exc
                return logits

            return process

        return tuple(guard(p) for p in self.processors)


class BatchSource:
    """A session's token source over a :class:`BatchEngine` (``fallback``: the session's local source,
    for turns that run alone; see the module docstring)."""

    def __init__(self, engine: BatchEngine, fallback: TokenSource, speculative: bool) -> None:
        self.engine, self.fallback, self.speculative = engine, fallback, speculative

    def generate(self, cache: CacheState, request: Request) -> Iterator[Token]:
        self.engine.check_open()
        assert cache.layers is not None, "prepare the cache before generating"
        if self.speculative or request.adapter is not None or request.model is not None or not batchable(cache):
            return self.fallback.generate(cache, request)
        return self._tokens(cache, request)

    def _tokens(self, cache: CacheState, request: Request) -> Iterator[Token]:
        layers = cache.layers
        assert layers is not None
        base = layer_offset(layers) or 0
        job = _Job(request.suffix, request.context, request.max_tokens, request.sampler,
                   tuple(request.logits_processors), layers)
        progress: Callable[[int, int], None] | None = request.progress
        read = 0
        if progress is not None:
            progress(0, len(request.suffix))
        self.engine._submit(job)
        try:
            while True:
                item = job.out.get()
                if item[0] == "token":
                    read += 1
                    yield item[1], item[2], False
                elif item[0] == "progress":
                    if progress is not None:
                        progress(*item[1])
                elif item[0] == "error":
                    raise item[1]
                else:
                    return
        finally:
            back = self.engine._release(job)
            if back is not None:
                target = base + len(request.suffix) + read  # what the turn fed and read, no run-ahead
                for layer in back:
                    if layer.offset > target:
                        layer.trim(layer.offset - target)
                layers[:] = back
            elif not layers:  # handed to the batch and not given back (the turn failed): rebuild next turn
                cache.reset()


def check_engine(engine: Any, model: Any) -> None:
    """``InvalidParamsError`` unless ``engine`` is ``None`` or an open ``BatchEngine`` over ``model``."""
    if engine is None:
        return
    if not isinstance(engine, BatchEngine):
        raise InvalidParamsError(f"engine() takes a chatkit.BatchEngine, got {type(engine).__name__}.")
    if engine.lm.model is not model:
        raise InvalidParamsError(
            "This BatchEngine was built for another model: create one over the session's model, "
            "chatkit.BatchEngine(lm), with the same lm as the builder or pool."
        )
    engine.check_open()


def batchable(cache: CacheState) -> bool:
    """Whether a session's cache can join the batch: plain ``KVCache`` layers, no quantization."""
    options = cache.options
    return (
        cache.layers is not None
        and options.kv_bits is None
        and options.max_kv_size is None
        and cache.draft_layers is None
        and all(type(c) is KVCache for c in cache.layers)
    )


__all__ = ["BatchEngine", "BatchSource", "batchable", "check_engine"]

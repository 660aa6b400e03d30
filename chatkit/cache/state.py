"""A session's mlx-lm cache list and its ledger: applying a plan, recording what a turn left behind."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeGuard

import mlx.core as mx

from ..errors import InvalidParamsError
from ..images import ImageSpan
from ._mlx import (
    ALWAYS_TRIMMABLE,
    can_trim,
    copy_layer,
    eval_layers,
    fixed_shapes,
    held_tokens,
    layer_offset,
    make_prompt_cache,
    same_kind,
    trim_layers,
    window_of,
)
from .ledger import Ledger
from .planner import Action, Plan, common_prefix_length, plan
from .prefix import PrefixCache
from .prompt import SharedPrefixes
from .shift import plan_shift, shift_layers


@dataclass(frozen=True)
class CacheOptions:
    """How the KV cache is built and filled; passed through to mlx-lm.

    ``max_kv_size`` makes a rotating cache of that many tokens; ``kv_bits`` quantizes the cache
    (``kv_group_size``, from ``quantized_kv_start`` tokens on); ``prefill_step_size`` is the chunk size
    of prompt processing.
    """

    max_kv_size: int | None = None
    kv_bits: int | None = None
    kv_group_size: int = 64
    quantized_kv_start: int = 0
    prefill_step_size: int = 2048

    def validate(self, head_dim: int | None = None) -> None:
        """Raise ``InvalidParamsError`` naming the first option out of range; with the model's
        ``head_dim``, also check that quantized KV groups tile a head (else mlx fails mid-turn)."""

        def bad(name: str, rule: str) -> InvalidParamsError:
            return InvalidParamsError(f"{name}={getattr(self, name)!r}: {rule}.")

        if self.max_kv_size is not None and (not _is_int(self.max_kv_size) or self.max_kv_size < 8):
            raise bad("max_kv_size", "must be an int >= 8 or None")
        if self.kv_bits is not None and self.kv_bits not in (2, 3, 4, 5, 6, 8):
            raise bad("kv_bits", "must be one of 2, 3, 4, 5, 6, 8 or None")
        if self.kv_group_size not in (32, 64, 128):
            raise bad("kv_group_size", "must be 32, 64 or 128")
        if not _is_int(self.quantized_kv_start) or self.quantized_kv_start < 0:
            raise bad("quantized_kv_start", "must be an int >= 0")
        if not _is_int(self.prefill_step_size) or self.prefill_step_size < 1:
            raise bad("prefill_step_size", "must be an int >= 1")
        if self.kv_bits is not None and self.max_kv_size is not None:
            raise InvalidParamsError(
                f"kv_bits={self.kv_bits} cannot be combined with max_kv_size={self.max_kv_size}: mlx-lm cannot "
                "quantize a rotating cache. Drop one of them."
            )
        if self.kv_bits is not None and head_dim is not None and head_dim % self.kv_group_size:
            fits = [g for g in (128, 64, 32) if head_dim % g == 0]
            raise InvalidParamsError(
                f"kv_group_size={self.kv_group_size} does not divide this model's head size ({head_dim}): "
                + (f"use a group size of {fits[0]} (kv_bits(..., group_size={fits[0]}), or --kv-group-size "
                   f"{fits[0]} on the command line)." if fits else "this model's KV cache cannot be quantized.")
            )


def _is_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def layers_fit(model: Any, layers: Sequence[Any], max_kv_size: int | None = None) -> str | None:
    """Why ``layers`` cannot be this model's cache (count, classes, rotating windows, batch, KV heads
    and widths, the shapes of recurrent states); ``None`` if they fit. ``max_kv_size``: the layers
    are rotating."""
    fresh = make_prompt_cache(model, max_kv_size=max_kv_size)
    if len(layers) != len(fresh):
        return f"it has {len(layers)} layers, the model {len(fresh)}"
    for i, (got, want) in enumerate(zip(layers, fresh)):
        if not same_kind(got, want):
            return f"layer {i} is a {type(got).__name__}, the model uses {type(want).__name__}"
        window, model_window = window_of(got), window_of(want)
        if window is not None and model_window is not None and window != model_window:
            return (f"layer {i} is a window of {window[0]} tokens keeping the first {window[1]}, "
                    f"the model's of {model_window[0]} keeping {model_window[1]}")
    model(mx.array([[0]]), cache=fresh)  # one token shows the shapes the model writes
    for i, (got, want) in enumerate(zip(layers, fresh)):
        have, need = fixed_shapes(got), fixed_shapes(want)
        if have is not None and have != need:
            return f"layer {i} holds arrays shaped {have}, the model writes {need} (the token axis aside)"
    return None


def _held(layers: Sequence[Any], ledger_length: int) -> int:
    """Tokens the layers hold: the ledger's, cut to the longest window when every attention layer is
    a full rotating cache (its offset keeps counting what scrolled out)."""
    windows = [n for n in map(held_tokens, layers) if n is not None]
    return min(ledger_length, max(windows)) if windows else ledger_length


MAX_CHECKPOINTS = 4


@dataclass(frozen=True)
class Checkpoint:
    """The cache as it was at ``length`` ledger tokens: copies of the layers that cannot rewind
    (``None`` where a layer can simply be trimmed back)."""

    length: int
    copies: tuple[Any, ...]


@dataclass(frozen=True)
class CacheInfo:
    """What a session's KV cache holds: ``tokens`` the layers hold (a full rotating cache: its window;
    ``opaque_tokens`` of them with unknown ids),
    ``nbytes`` of the layers, ``checkpoint_bytes`` held for rewinding, the layer classes, and
    whether every layer can rewind (``trimmable``)."""

    tokens: int
    opaque_tokens: int
    nbytes: int
    checkpoints: int
    checkpoint_bytes: int
    layer_classes: tuple[str, ...]
    trimmable: bool


class CacheState:
    """The cache layers of one model for one conversation, with the ledger of what they hold."""

    def __init__(self, model: Any, options: CacheOptions = CacheOptions(), draft_model: Any = None) -> None:
        self._model = model
        self._draft_model = draft_model
        self.options = options
        self.layers: list[Any] | None = None
        self.ledger = Ledger()
        self.checkpoints: list[Checkpoint] = []
        # A draft model's cache holds the first ``draft_length`` ledger tokens (it may lag the target's).
        self.draft_layers: list[Any] | None = None
        self.draft_length = 0
        # Prefixes shared with other sessions: the prompt cache (its blocks; every recorded turn adds its
        # own), or a BatchEngine's prefix cache (a turn that started from an empty cache offers its
        # prompt's first ``_share_length`` tokens when it is recorded).
        self.shared: SharedPrefixes | PrefixCache | None = None
        self._share_length = 0
        self._images: tuple[ImageSpan, ...] = ()  # where the prompt being fed has images

    @property
    def empty(self) -> bool:
        return self.layers is None or len(self.ledger) == 0

    def reset(self) -> None:
        """Forget the cache; the next turn starts from an empty one."""
        self.layers = None
        self.ledger = Ledger()
        self.checkpoints = []
        self.draft_layers = None
        self.draft_length = 0
        self._share_length = 0
        self._images = ()

    def copy(self) -> CacheState:
        """An independent copy (for a fork): layers, ledger and checkpoints."""
        other = CacheState(self._model, self.options, self._draft_model)
        if self.layers is not None:
            other.layers = [copy_layer(c) for c in self.layers]
        if self.draft_layers is not None:
            other.draft_layers = [copy_layer(c) for c in self.draft_layers]
        other.draft_length = self.draft_length
        other.shared = self.shared
        other.ledger = self.ledger
        other.checkpoints = list(self.checkpoints)  # checkpoints hold copies, never written
        return other

    @property
    def needs_checkpoints(self) -> bool:
        """Whether some layer may be unable to rewind (hybrid or rotating caches)."""
        return self.layers is not None and not all(isinstance(c, ALWAYS_TRIMMABLE) for c in self.layers)

    @classmethod
    def restored(
        cls,
        model: Any,
        options: CacheOptions,
        layers: list[Any],
        ledger: Ledger,
        checkpoints: Sequence[Checkpoint] = (),
        draft_model: Any = None,
    ) -> CacheState:
        """A cache state around restored layers (and the checkpoints saved with them). A draft
        model's cache starts empty and is filled from the ledger at the next turn."""
        state = cls(model, options, draft_model)
        state.layers, state.ledger = layers, ledger
        if draft_model is not None:
            state.draft_layers = make_prompt_cache(draft_model)
        state.checkpoints = [c for c in checkpoints if c.length <= len(ledger.tokens)]
        state.checkpoint()  # so that a restored raw cache can come back to its own end
        return state

    def checkpoint(self) -> None:
        """Remember the cache as it is now, so that a later turn can come back here."""
        if self.layers is None or not self.needs_checkpoints:
            return
        length = layer_offset(self.layers)
        if length is None:
            return
        length -= self.ledger.opaque
        copies = tuple(None if isinstance(c, ALWAYS_TRIMMABLE) else copy_layer(c) for c in self.layers)
        kept = [c for c in self.checkpoints if c.length < length]
        self.checkpoints = (kept + [Checkpoint(length, copies)])[-MAX_CHECKPOINTS:]

    def rewind(self, ids: Sequence[int]) -> None:
        """Drop what follows the longest prefix of ``ids`` the cache can go back to (for undo)."""
        if self.layers is None:
            return
        keep = common_prefix_length(self.ledger.tokens, ids)
        if keep >= len(self.ledger.tokens):
            return
        if can_trim(self.layers) and self._trim_to(keep):
            self._forget_after(keep)
            return
        usable = [c for c in self.checkpoints if c.length <= keep]
        if usable:
            self._restore(usable[-1])
        # else: leave it; the next turn's plan decides

    def shift(self, prompt: Sequence[int], delta: int, ropes: Sequence[Any]) -> bool:
        """Context shift: drop the ``delta`` ledger tokens after the common prefix with ``prompt`` from the
        layers themselves (the later keys re-rotated by each layer's ``ropes``), when what is left is a
        longer prefix of ``prompt``; ``False`` (nothing changes) when it would not be, or the cache cannot
        (an opaque prefix, images, a draft cache, a layer that is not a plain KV cache)."""
        if self.layers is None or self.ledger.opaque or self.ledger.images or self.draft_layers is not None:
            return False
        start = plan_shift(self.ledger.tokens, prompt, delta)
        if start is None or layer_offset(self.layers) != len(self.ledger.tokens):
            return False
        layers = shift_layers(self.layers, ropes, start, delta)
        if layers is None:
            return False
        t = self.ledger.tokens
        self.layers, self.checkpoints = layers, []
        self.ledger = Ledger(t[:start] + t[start + delta :], shifted=self.ledger.shifted + delta)
        return True

    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.layers) if self.layers else 0

    def info(self) -> CacheInfo:
        layers = self.layers or []
        return CacheInfo(
            tokens=_held(layers, len(self.ledger)),
            opaque_tokens=self.ledger.opaque,
            nbytes=self.nbytes(),
            checkpoints=len(self.checkpoints),
            checkpoint_bytes=sum(c.nbytes for cp in self.checkpoints for c in cp.copies if c is not None),
            layer_classes=tuple(type(c).__name__ for c in layers),
            trimmable=bool(layers) and can_trim(layers),
        )

    def preview(self, prompt: Sequence[int], images: Sequence[ImageSpan] = ()) -> int:
        """How many ledger tokens ``prepare`` would keep at most (nothing changes)."""
        return 0 if self.layers is None else self._plan(prompt, images).keep

    def _plan(self, prompt: Sequence[int], images: Sequence[ImageSpan]) -> Plan:
        assert self.layers is not None
        return plan(self.ledger, prompt, trimmable=can_trim(self.layers),
                    checkpoints=[c.length for c in self.checkpoints], images=images)

    def prepare(self, prompt: Sequence[int], images: Sequence[ImageSpan] = ()) -> Plan:
        """Plan reuse for ``prompt`` (with ``images`` where they are) and apply the plan, so that the cache
        holds ``plan.keep`` tokens."""
        if self.layers is None:
            self.reset()
            self._new_layers()
        p = self._plan(prompt, images)
        if p.action is Action.TRIM and not self._trim_to(p.keep):
            p = Plan(Action.REBUILD, 0, tuple(prompt))
        if p.action is Action.RESTORE:
            (checkpoint,) = [c for c in self.checkpoints if c.length == p.keep]
            if not self._restore(checkpoint):
                p = Plan(Action.REBUILD, 0, tuple(prompt))
        if p.action is Action.REBUILD:
            self.reset()
            self._new_layers()
        else:
            self._forget_after(p.keep)
        self._images = tuple(images)
        if self.ledger.opaque == 0 and self.options.max_kv_size is None:
            p = self._from_shared(prompt, p)
        if self.draft_layers is not None:
            self._align_draft(tuple(prompt[: p.keep]))
        return p

    def _from_shared(self, prompt: Sequence[int], p: Plan) -> Plan:
        """Start from the longest prefix of ``prompt`` another session computed, when it is longer than
        what this cache keeps (the prompt cache: any turn; a BatchEngine's prefix cache: an empty cache)."""
        assert self.layers is not None
        if isinstance(self.shared, SharedPrefixes):
            found = self.shared.fetch(prompt, self._images, p.keep)
        elif (self.shared is not None and p.keep == 0 and not self._images and self._draft_model is None
              and self.options.kv_bits is None):
            self._share_length = len(prompt)
            found = self.shared.fetch(prompt)
        else:
            return p
        if found is None or len(found[1]) != len(self.layers) or found[0] <= p.keep:
            return p
        n, layers = found
        self.layers, self.checkpoints = layers, []
        self.ledger = Ledger(tuple(prompt[:n]), 0, tuple(s for s in self._images if s.end <= n))
        return Plan(Action.APPEND, n, tuple(prompt[n:]))

    def record(self, fed: Sequence[int], *, failed: bool = False) -> None:
        """After a turn fed ``fed`` on top of the ledger: read back from the offsets what the cache holds.
        ``failed``: the turn raised inside a step, after mlx-lm fed a token it never yielded; that token
        is trimmed off (or the cache dropped)."""
        if self.layers is None:
            return
        # Materialize the cache on this thread: the next turn may run on another one.
        eval_layers(self.layers + (self.draft_layers or []))
        sequence = self.ledger.tokens + tuple(fed)
        offset = layer_offset(self.layers)
        if offset is None and not failed and not any(hasattr(c, "offset") for c in self.layers):
            offset = len(self.ledger) + len(fed)  # no layer counts tokens: trust what was fed
        end = self.ledger.opaque + len(sequence)
        if failed and offset is not None and offset > end and can_trim(self.layers) and self._trim_to(len(sequence)):
            offset = end
        ledger = None if offset is None else Ledger.from_offset(sequence, offset, self.ledger.opaque, self._images,
                                                                     self.ledger.shifted)
        if ledger is None:
            self.reset()  # the cache no longer matches anything we can name: rebuild next turn
            return
        self.ledger = ledger
        share, self._share_length = self._share_length, 0
        if isinstance(self.shared, SharedPrefixes):
            # A shifted cache's kept KV attended to tokens it no longer holds: never another session's.
            if ledger.opaque == 0 and ledger.shifted == 0 and not failed:
                self.shared.insert(ledger.tokens, self.layers, ledger.images)
        elif share and self.shared is not None and len(ledger.tokens) >= share and ledger.opaque == 0:
            self.shared.insert(ledger.tokens[:share], self.layers)
        if self.draft_layers is not None:
            # After a speculative run the draft may hold one token more or fewer than the target.
            draft = layer_offset(self.draft_layers)
            if draft is None or draft > len(sequence) or not trim_layers(self.draft_layers, min(draft, len(ledger))):
                self.reset()
                return
            self.draft_length = min(draft, len(ledger))

    def _forget_after(self, keep: int) -> None:
        self.ledger = self.ledger.cut(keep)
        self.checkpoints = [c for c in self.checkpoints if c.length <= keep]
        if self.draft_layers is not None and self.draft_length > keep:
            if not trim_layers(self.draft_layers, keep):
                self.draft_layers = make_prompt_cache(self._draft_model)
                keep = 0
            self.draft_length = keep

    def _restore(self, checkpoint: Checkpoint) -> bool:
        """Bring every layer back to ``checkpoint``; ``False`` if a layer could not follow."""
        assert self.layers is not None
        target = self.ledger.opaque + checkpoint.length
        for i, saved in enumerate(checkpoint.copies):
            if saved is not None:
                self.layers[i] = copy_layer(saved)  # a copy: the checkpoint stays reusable
            elif self.layers[i].offset >= target:
                self.layers[i].trim(self.layers[i].offset - target)
        if layer_offset(self.layers) not in (target, None):
            self.reset()
            return False
        self._forget_after(checkpoint.length)
        return True

    def _new_layers(self) -> None:
        self.layers = make_prompt_cache(self._model, max_kv_size=self.options.max_kv_size)
        if self._draft_model is not None:
            self.draft_layers = make_prompt_cache(self._draft_model)
            self.draft_length = 0

    def _trim_to(self, keep: int) -> bool:
        """Rewind every layer to ``opaque + keep`` tokens; ``False`` if a layer did not comply."""
        assert self.layers is not None
        return trim_layers(self.layers, self.ledger.opaque + keep)

    def _align_draft(self, kept: tuple[int, ...]) -> None:
        """Bring the draft cache to hold exactly ``kept`` (the target's kept tokens)."""
        assert self.draft_layers is not None
        have = min(self.draft_length, len(kept))
        if not trim_layers(self.draft_layers, have):
            self.draft_layers, have = make_prompt_cache(self._draft_model), 0
        missing = kept[have:]
        step = self.options.prefill_step_size
        for i in range(0, len(missing), step):
            self._draft_model(mx.array([missing[i : i + step]], dtype=mx.uint32), cache=self.draft_layers)
            eval_layers(self.draft_layers)
        self.draft_length = len(kept)


__all__ = ["CacheInfo", "CacheOptions", "CacheState", "Checkpoint", "layers_fit"]

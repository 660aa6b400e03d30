"""A session's mlx-lm cache list and its ledger: applying a plan, recording what a turn left behind."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from mlx_lm.models.cache import make_prompt_cache

from ..errors import InvalidParamsError
from .ledger import Ledger
from .planner import Action, Plan, plan


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

    def validate(self) -> None:
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


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def layer_offset(layers: Sequence[Any]) -> int | None:
    """The one offset all attention layers agree on; ``None`` if they disagree or none has one."""
    offsets = {c.offset for c in layers if isinstance(getattr(c, "offset", None), int)}
    return offsets.pop() if len(offsets) == 1 else None


def is_trimmable(layers: Sequence[Any]) -> bool:
    return all(c.is_trimmable() for c in layers)


class CacheState:
    """The cache layers of one model for one conversation, with the ledger of what they hold."""

    def __init__(self, model: Any, options: CacheOptions = CacheOptions()) -> None:
        self._model = model
        self.options = options
        self.layers: list[Any] | None = None
        self.ledger = Ledger()

    @property
    def empty(self) -> bool:
        return self.layers is None or len(self.ledger) == 0

    def reset(self) -> None:
        """Forget the cache; the next turn starts from an empty one."""
        self.layers = None
        self.ledger = Ledger()

    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.layers) if self.layers else 0

    def prepare(self, prompt: Sequence[int]) -> Plan:
        """Plan reuse for ``prompt`` and apply the plan, so that the cache holds ``plan.keep`` tokens."""
        if self.layers is None:
            self.layers = self._new_layers()
            self.ledger = Ledger()
        p = plan(self.ledger, prompt, trimmable=is_trimmable(self.layers))
        if p.action is Action.TRIM and not self._trim_to(p.keep):
            p = Plan(Action.REBUILD, 0, tuple(prompt))
        if p.action is Action.REBUILD:
            self.layers = self._new_layers()
            self.ledger = Ledger()
        else:
            self.ledger = Ledger(self.ledger.tokens[: p.keep], self.ledger.opaque)
        return p

    def record(self, fed: Sequence[int]) -> None:
        """After a turn fed ``fed`` on top of the ledger: read back from the offsets what the cache holds."""
        if self.layers is None:
            return
        sequence = self.ledger.tokens + tuple(fed)
        offset = layer_offset(self.layers)
        if offset is None and not any(hasattr(c, "offset") for c in self.layers):
            offset = len(self.ledger) + len(fed)  # no layer counts tokens: trust what was fed
        ledger = None if offset is None else Ledger.from_offset(sequence, offset, self.ledger.opaque)
        if ledger is None:
            self.reset()  # the cache no longer matches anything we can name: rebuild next turn
        else:
            self.ledger = ledger

    def _new_layers(self) -> list[Any]:
        return make_prompt_cache(self._model, max_kv_size=self.options.max_kv_size)

    def _trim_to(self, keep: int) -> bool:
        """Rewind every layer to ``opaque + keep`` tokens; ``False`` if a layer did not comply."""
        assert self.layers is not None
        target = self.ledger.opaque + keep
        for c in self.layers:
            excess = c.offset - target
            if excess > 0 and c.trim(excess) != excess:
                return False
        return layer_offset(self.layers) == target


__all__ = ["CacheOptions", "CacheState", "layer_offset", "is_trimmable"]

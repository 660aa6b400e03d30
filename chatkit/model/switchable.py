"""Adapters switched per forward pass over one copy of a model's weights, and fused copies.

``install`` turns the linear layers an adapter targets into switchable ones, once per layer and in
place, by changing their class (``SwitchableLinear`` / ``SwitchableQuantizedLinear``): their parameters,
names and values stay exactly as they are (the model's fingerprint too). A switchable layer adds the
LoRA (or DoRA) branch of the adapter active *in the calling context* (a ``ContextVar``), computed as
mlx-lm's ``LoRALinear`` / ``DoRALinear`` do; with no adapter active it is the base layer, bit for bit.

A token source makes a session's adapter active around every step of its generator
(:func:`each_step`), so sessions with different adapters interleave their streams, or run on
different threads, over the same weights: switching is setting a context variable, and MLX builds
each step's graph while it is set (the arrays are captured then; evaluation needs nothing more).
"""

from __future__ import annotations

import copy
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, TypeVar

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten

from ..errors import InvalidParamsError
from .adapters import Adapter

T = TypeVar("T")


@dataclass(frozen=True, eq=False)
class ActiveAdapter:
    """A session's choice: ``adapter`` at ``scale`` times its own scale (plain data, part of a turn)."""

    adapter: Adapter
    scale: float = 1.0

    @property
    def key(self) -> str:
        """What identifies this choice for caches: the adapter's fingerprint and the scale."""
        return f"{self.adapter.fingerprint}*{self.scale!r}"


@dataclass(frozen=True)
class _Current:
    owner: int  # id() of the model whose layers this applies to
    adapter: Adapter
    scale: float


_CURRENT: ContextVar[_Current | None] = ContextVar("chatkit_adapter", default=None)
_install_lock = threading.Lock()


class _Switchable:
    """The per-call branch shared by the switchable linear layers."""

    _chatkit_key: str
    _chatkit_owner: int

    _chatkit_dora: weakref.WeakKeyDictionary[Adapter, dict[float, mx.array]]

    def __call__(self, x: mx.array) -> mx.array:
        current = _CURRENT.get()
        branch = None if current is None or current.owner != self._chatkit_owner else (
            current.adapter.layers.get(self._chatkit_key))
        if branch is None:
            return super().__call__(x)  # type: ignore[misc]  # the base layer, untouched
        assert current is not None
        a, b, m = branch
        scale = current.adapter.scale * current.scale
        if m is None:  # LoRA, as mlx_lm.tuner.lora.LoRALinear
            y = super().__call__(x)  # type: ignore[misc]
            return y + (scale * ((x @ a) @ b)).astype(x.dtype)
        return self._dora(x, current.adapter, scale)

    def _dora(self, x: mx.array, adapter: Adapter, scale: float) -> mx.array:
        """As mlx_lm.tuner.dora.DoRALinear, with its magnitude factor (``m`` over the adapted weight's
        row norms, fixed for an adapter and scale) computed once rather than at every call."""
        a, b, m = adapter.layers[self._chatkit_key]
        w = self._base_weight()
        out = x @ w.T + (scale * ((x @ a) @ b)).astype(x.dtype)
        factors = self._chatkit_dora.setdefault(adapter, {})
        if scale not in factors:
            assert m is not None, "a DoRA layer has its magnitudes"
            factor = m / mx.linalg.norm(w + (scale * b.T) @ a.T, axis=1)
            mx.eval(factor)
            factors[scale] = factor
        out = factors[scale].astype(x.dtype) * out
        layer: Any = self
        return out + layer.bias if "bias" in layer else out

    def _base_weight(self) -> mx.array:
        layer: Any = self
        if isinstance(layer, nn.QuantizedLinear):
            return mx.dequantize(layer.weight, layer.scales, layer.biases, group_size=layer.group_size,
                                 bits=layer.bits, mode=layer.mode)
        return layer.weight


class SwitchableLinear(_Switchable, nn.Linear):
    """An ``nn.Linear`` that adds the active adapter's branch (see the module docstring)."""


class SwitchableQuantizedLinear(_Switchable, nn.QuantizedLinear):
    """An ``nn.QuantizedLinear`` that adds the active adapter's branch (see the module docstring)."""


_SWITCHABLE: dict[type, type] = {nn.Linear: SwitchableLinear, nn.QuantizedLinear: SwitchableQuantizedLinear}
_BASE: dict[type, type] = {v: k for k, v in _SWITCHABLE.items()}


def install(model: nn.Module, adapter: Adapter) -> None:
    """Make the layers ``adapter`` targets switchable (once; checked already by ``check_adapter``)."""
    with _install_lock:
        modules = dict(model.named_modules())
        for key in adapter.keys:
            layer = modules[key]
            if type(layer) in _BASE:
                continue
            layer.__class__ = _SWITCHABLE[type(layer)]
            object.__setattr__(layer, "_chatkit_key", key)
            object.__setattr__(layer, "_chatkit_owner", id(model))
            object.__setattr__(layer, "_chatkit_dora", weakref.WeakKeyDictionary())


def activate(lm: Any, adapter: Any, scale: float = 1.0) -> ActiveAdapter | None:
    """A session's adapter over ``lm`` (a ``LoadedModel``), checked and installed; ``None`` for none.
    ``ModelLoadError`` for an adapter that does not fit ``lm``; ``InvalidParamsError`` for bad arguments."""
    from .adapters import check_adapter, check_scale

    scale = check_scale(scale)
    if adapter is None:
        return None
    if not isinstance(adapter, Adapter):
        raise InvalidParamsError(f"adapter takes a chatkit.Adapter (chatkit.load_adapter(path)) or None, got {type(adapter).__name__}.")
    if lm.distributed is not None and lm.distributed.sharded:
        raise InvalidParamsError("Adapters are not available over a sharded model: fuse it (lm.fuse) before sharding.")
    check_adapter(adapter, lm)
    install(lm.model, adapter)
    return ActiveAdapter(adapter, float(scale))


@contextmanager
def applying(model: Any, active: ActiveAdapter | None) -> Iterator[None]:
    """``model``'s forward passes built inside use ``active`` (``None``: the base model)."""
    token = _CURRENT.set(None if active is None else _Current(id(model), active.adapter, active.scale))
    try:
        yield
    finally:
        _CURRENT.reset(token)


def each_step(model: Any, active: ActiveAdapter | None, steps: Iterator[T]) -> Iterator[T]:
    """``steps`` with ``active`` applied to ``model`` while each step runs (and while it closes)."""
    try:
        while True:
            with applying(model, active):
                try:
                    item = next(steps)
                except StopIteration:
                    return
            yield item
    finally:
        close = getattr(steps, "close", None)
        if close is not None:
            with applying(model, active):
                close()


def fused(model: nn.Module, active: ActiveAdapter) -> nn.Module:
    """A copy of ``model`` with ``active`` fused into copies of the adapted layers' weights (mlx-lm's
    ``fuse``); the other weights are shared (MLX arrays are never changed in place), ``model`` unchanged."""
    from mlx_lm.tuner.dora import DoRALinear
    from mlx_lm.tuner.lora import LoRALinear

    copy_ = _clone(model)
    modules = dict(copy_.named_modules())
    adapter, scale = active.adapter, active.adapter.scale * active.scale
    layers = []
    for key in adapter.keys:
        kind = DoRALinear if adapter.kind == "dora" else LoRALinear
        lora: Any = kind.from_base(modules[key], r=adapter.rank, dropout=0.0, scale=scale)
        a, b, m = adapter.layer(key)
        lora.lora_a, lora.lora_b = a, b
        if m is not None:
            lora.m = m
        layers.append((key, lora.fuse()))
    copy_.update_modules(tree_unflatten(layers))
    copy_.eval()
    return copy_


def _clone(value: Any) -> Any:
    """A copy of a module tree (each module copied, switchable layers plain again); arrays shared."""
    if isinstance(value, nn.Module):
        module = copy.copy(value)
        if type(module) in _BASE:
            module.__class__ = _BASE[type(module)]
        for name, child in value.items():
            module[name] = _clone(child)
        return module
    if isinstance(value, list):
        return [_clone(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_clone(v) for v in value)
    if isinstance(value, dict):
        return {k: _clone(v) for k, v in value.items()}
    return value


__all__ = ["ActiveAdapter", "SwitchableLinear", "SwitchableQuantizedLinear", "activate", "applying", "each_step",
           "fused", "install"]

"""The rotary position embeddings of a model's attention layers, read from mlx-lm's modules: what a
context shift needs to re-rotate cached keys (``chatkit.cache.shift``), or why a model cannot shift."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.rope_utils import Llama3RoPE, ProportionalRoPE, SuScaledRoPE, YarnRoPE


@dataclass(frozen=True)
class Rope:
    """One layer's rotation, as ``mx.fast.rope`` takes it: ``dims`` rotated features, ``traditional``
    (interleaved) pairs, and ``base`` or precomputed ``freqs`` (Llama 3, YaRN, LongRoPE scaling), with
    positions times ``scale``. Rotations add: rotating by ``-d`` moves a key ``d`` positions back."""

    dims: int
    traditional: bool
    base: float | None
    scale: float
    freqs: mx.array | None = None


def rope_of(module: Any) -> Rope | None:
    """The rotation of one mlx-lm RoPE module; ``None`` for a kind whose angle is not linear in the
    position (dynamic NTK) or that chatkit does not know."""
    if type(module) is nn.RoPE:
        return Rope(module.dims, module.traditional, module.base, module.scale)
    if isinstance(module, (Llama3RoPE, YarnRoPE, ProportionalRoPE)):
        # (YaRN's mscale multiplies the keys before rotating: the cached keys carry it already.)
        return Rope(module.dims, module.traditional, None, 1.0, module._freqs)
    if isinstance(module, SuScaledRoPE):
        return Rope(module.dim, False, None, 1.0, module._freqs)
    return None


def layer_ropes(model: Any) -> list[Rope] | str:
    """Each decoder layer's rotation, in the order of the model's cache layers, or why the model cannot
    shift its cache (a layer with MLA latents, no rotary embedding, or one chatkit cannot re-rotate)."""
    layers = getattr(model, "layers", None)
    if not isinstance(layers, (list, tuple)) or not layers:
        return "chatkit cannot find its decoder layers"
    ropes = []
    for i, layer in enumerate(layers):
        modules = [m for _, m in layer.named_modules()]
        if any(hasattr(m, "kv_lora_rank") for m in modules):
            return "its attention caches MLA latents, not rotated keys"
        found = [m for m in modules if "rope" in type(m).__name__.lower() or "rotary" in type(m).__name__.lower()]
        if len(found) != 1:
            return f"layer {i} has {len(found)} rotary embeddings (recurrent or hybrid layers have none)"
        rope = rope_of(found[0])
        if rope is None:
            return f"layer {i}'s rotary embedding {type(found[0]).__name__} cannot be re-rotated exactly"
        ropes.append(rope)
    return ropes


__all__ = ["Rope", "layer_ropes", "rope_of"]

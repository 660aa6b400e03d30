"""``random_adapter``: an mlx-lm adapter folder with random LoRA/DoRA weights for a (test) model."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

KEYS = ("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj")


def random_adapter(
    folder: str | os.PathLike[str],
    lm: Any,
    *,
    seed: int = 1,
    kind: str = "lora",
    rank: int = 4,
    scale: float = 8.0,
    keys: Sequence[str] = KEYS,
    num_layers: int | None = None,
    weight_scale: float = 0.2,
    config_extra: Mapping[str, Any] | None = None,
) -> Path:
    """Write ``folder`` as ``mlx_lm.lora`` would (``adapter_config.json`` + ``adapters.safetensors``) with
    random weights (B nonzero, so the adapter changes the model) for the linear layers ``keys`` (module
    paths inside a block) of the last ``num_layers`` blocks (all by default) of ``lm`` (a
    ``LoadedModel``); ``kind`` "lora" or "dora". The same arguments write the same files. Returns the folder."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    blocks = lm.model.layers
    num_layers = len(blocks) if num_layers is None else num_layers
    params = dict(tree_flatten(lm.model.parameters()))
    key = mx.random.key(seed)
    weights = {}
    for i in range(len(blocks) - num_layers, len(blocks)):
        for name in (f"model.layers.{i}.{k}" for k in keys):
            out, inp = params[f"{name}.weight"].shape
            key, ka, kb, km = mx.random.split(key, 4)
            weights[f"{name}.lora_a"] = mx.random.normal((inp, rank), key=ka) * weight_scale
            weights[f"{name}.lora_b"] = mx.random.normal((rank, out), key=kb) * weight_scale
            if kind == "dora":
                norm = mx.linalg.norm(params[f"{name}.weight"].astype(mx.float32), axis=1)
                weights[f"{name}.m"] = norm * (1.0 + 0.1 * mx.random.normal((out,), key=km))
    config = {
        "fine_tune_type": kind, "num_layers": num_layers,
        "lora_parameters": {"rank": rank, "scale": scale, "dropout": 0.0, "keys": list(keys)},
        **(config_extra or {}),
    }
    (folder / "adapter_config.json").write_text(json.dumps(config))
    mx.save_safetensors(str(folder / "adapters.safetensors"), weights)
    return folder


__all__ = ["random_adapter"]

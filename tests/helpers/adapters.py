"""Adapter folders in mlx-lm's format with random LoRA/DoRA weights (nonzero B), for the tiny test models."""

import json
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

KEYS = ("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj")


def make_adapter(folder, lm, *, seed=1, kind="lora", rank=4, scale=8.0, keys=KEYS, num_layers=None,
                 weight_scale=0.2, config_extra=None):
    """Write ``folder`` (adapter_config.json + adapters.safetensors) for ``lm``'s linear layers ``keys``
    in its last ``num_layers`` blocks (all by default); returns the folder."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    blocks = lm.model.layers
    num_layers = len(blocks) if num_layers is None else num_layers
    params = dict(tree_flatten(lm.model.parameters()))
    mx.random.seed(seed)
    weights = {}
    for i in range(len(blocks) - num_layers, len(blocks)):
        for key in keys:
            name = f"model.layers.{i}.{key}"
            out, inp = params[f"{name}.weight"].shape
            weights[f"{name}.lora_a"] = mx.random.normal((inp, rank)) * weight_scale
            weights[f"{name}.lora_b"] = mx.random.normal((rank, out)) * weight_scale
            if kind == "dora":
                base = mx.linalg.norm(params[f"{name}.weight"], axis=1)
                weights[f"{name}.m"] = base * (1.0 + 0.1 * mx.random.normal((out,)))
    config = {
        "fine_tune_type": kind, "num_layers": num_layers,
        "lora_parameters": {"rank": rank, "scale": scale, "dropout": 0.0, "keys": list(keys)},
        **(config_extra or {}),
    }
    (folder / "adapter_config.json").write_text(json.dumps(config))
    mx.save_safetensors(str(folder / "adapters.safetensors"), weights)
    return folder

"""LoRA / DoRA adapters: an mlx-lm adapter folder read, checked, and matched against a base model.

An adapter folder is what ``mlx_lm.lora`` writes: ``adapter_config.json`` (``fine_tune_type``,
``lora_parameters``: ``rank``, ``scale``...) and ``adapters.safetensors`` (``<layer>.lora_a`` of shape
(in, rank), ``<layer>.lora_b`` (rank, out), and for DoRA ``<layer>.m`` (out,)). Everything wrong with a
folder, or between a folder and a model, is a ``ModelLoadError`` raised before anything changes.
Applying adapters to a model's forward pass is ``switchable.py``'s job.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ..errors import InvalidParamsError, ModelLoadError
from .tokenizer import tool_parser_module

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapters.safetensors"
BASE_KEY = "chatkit_base_fingerprint"  # optional config entry: the base model's fingerprint (lm.fingerprint)
TOOL_FORMAT_KEY = "chatkit_tool_parser_type"  # optional config entry: the mlx-lm tool-call format it writes
_BASE_PARTS = ("architecture", "parameters", "weights")  # the parts of a fingerprint that shape the weights
_LEAVES = {"lora": ("lora_a", "lora_b"), "dora": ("lora_a", "lora_b", "m")}


@dataclass(frozen=True, eq=False)
class Adapter:
    """A LoRA or DoRA adapter as read from an mlx-lm adapter folder (:func:`load_adapter`): plain data.

    ``keys`` name the adapted layers (module paths, e.g. ``model.layers.1.self_attn.q_proj``);
    ``weights`` holds the tensors by their names in the file; ``fingerprint`` hashes the config and
    the weights; ``scale`` is the config's (a session's scale multiplies it); ``base`` the base
    model's fingerprint when the config records it; ``tool_parser_type`` the mlx-lm tool-call format
    it was trained to write (the config's ``chatkit_tool_parser_type``): a session using the adapter
    reads its tool calls in that format.
    """

    name: str
    path: str
    fingerprint: str
    kind: str  # "lora" or "dora"
    rank: int
    scale: float
    keys: tuple[str, ...]
    weights: Mapping[str, mx.array] = field(repr=False)
    config: Mapping[str, Any] = field(default_factory=dict, repr=False)
    base: Mapping[str, str] | None = None
    tool_parser_type: str | None = None

    def layer(self, key: str) -> tuple[mx.array, mx.array, mx.array | None]:
        """The (lora_a, lora_b, m) of the layer ``key`` (``m`` only for DoRA)."""
        return self.layers[key]

    @cached_property
    def layers(self) -> dict[str, tuple[mx.array, mx.array, mx.array | None]]:
        """(lora_a, lora_b, m) by layer key: what a forward pass looks up (no string building per call)."""
        w = self.weights
        return {key: (w[f"{key}.lora_a"], w[f"{key}.lora_b"], w.get(f"{key}.m")) for key in self.keys}


def check_scale(scale: Any, what: str = "adapter scale") -> float:
    """``scale`` as a float, or ``InvalidParamsError`` (not a number, a bool, NaN or infinite)."""
    try:  # float() of a huge int raises OverflowError (and its repr may be too long to print)
        value = float(scale) if isinstance(scale, (int, float)) and not isinstance(scale, bool) else math.nan
    except OverflowError:
        value = math.inf
    if not math.isfinite(value):
        shown = "a huge int" if isinstance(scale, int) and value == math.inf else repr(scale)[:40]
        raise InvalidParamsError(f"{what}={shown}: must be a finite number.")
    return value


def load_adapter(path: str | os.PathLike[str], lm: Any = None) -> Adapter:
    """Read the mlx-lm adapter folder ``path`` (``adapter_config.json`` + ``adapters.safetensors``,
    LoRA or DoRA, as ``mlx_lm.lora`` writes it) and check it; with ``lm`` (a ``LoadedModel``), also
    against that model (layer names, shapes, its fingerprint when the config records one).
    ``ModelLoadError`` says what is wrong. ``lm.adapter(path)`` is the same as ``load_adapter(path, lm)``."""
    folder = _folder(path)
    config_bytes = _read(folder / CONFIG_FILE)
    try:
        config = json.loads(config_bytes)
    except ValueError as exc:
        raise ModelLoadError(f"{str(folder / CONFIG_FILE)!r} is not valid JSON ({exc}): rewrite it or train again.") from None
    except RecursionError:
        raise ModelLoadError(f"{str(folder / CONFIG_FILE)!r} is nested too deeply to be an adapter config: rewrite it "
                             "or train again.") from None
    kind, rank, scale = _settings(config, folder)
    tool_format = _tool_format(config, folder)
    weights_bytes = _read(folder / WEIGHTS_FILE)
    try:
        weights = mx.load(str(folder / WEIGHTS_FILE))
    except Exception as exc:
        raise ModelLoadError(f"Could not read {str(folder / WEIGHTS_FILE)!r}: {exc} (is it a safetensors file?).") from None
    if not isinstance(weights, dict):
        raise ModelLoadError(f"{str(folder / WEIGHTS_FILE)!r} holds no named tensors: train the adapter again.")
    keys = _check_weights(weights, kind, rank, folder)
    digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode() + b"\0" + weights_bytes).hexdigest()[:16]
    base = config.get(BASE_KEY)
    adapter = Adapter(
        name=folder.name, path=str(folder), fingerprint=digest, kind=kind, rank=rank, scale=scale, keys=keys,
        weights=weights, config=config, base=dict(base) if isinstance(base, Mapping) else None,
        tool_parser_type=tool_format,
    )
    if lm is not None:
        check_adapter(adapter, lm)
    return adapter


def check_adapter(adapter: Adapter, lm: Any) -> None:
    """``ModelLoadError`` unless every layer ``adapter`` names is a linear layer of ``lm`` (a
    ``LoadedModel``) of the
    adapter's shapes, and (when the adapter records one) ``lm``'s fingerprint is its base's."""
    if not isinstance(adapter, Adapter):
        raise ModelLoadError(f"Expected a chatkit.Adapter (chatkit.load_adapter(path)), got {type(adapter).__name__}.")
    if adapter.base is not None:
        found = lm.fingerprint
        differ = [p for p in _BASE_PARTS if p in adapter.base and adapter.base[p] != found.get(p)]
        if differ:
            raise ModelLoadError(
                f"Adapter {adapter.name!r} was trained on another base model (its {', '.join(differ)} differ): "
                "load it over the model it was trained on."
            )
    modules = dict(lm.model.named_modules())
    for key in adapter.keys:
        module = modules.get(key)
        if module is None:
            raise ModelLoadError(
                f"Adapter {adapter.name!r} adapts layer {key!r}, which this model does not have: "
                "load it over the model it was trained on."
            )
        dims = linear_dims(module)
        if dims is None:
            raise ModelLoadError(
                f"Adapter {adapter.name!r} adapts {key!r}, a {type(module).__name__}: chatkit switches adapters "
                "on linear layers only (fuse it with mlx_lm.fuse and load the fused model instead)."
            )
        a, b, m = adapter.layer(key)
        want = (dims[1], adapter.rank), (adapter.rank, dims[0]), (dims[0],)
        got = tuple(a.shape), tuple(b.shape), None if m is None else tuple(m.shape)
        if got[:2] != want[:2] or (m is not None and got[2] != want[2]):
            raise ModelLoadError(
                f"Adapter {adapter.name!r}: the shapes of layer {key!r} ({got}) do not fit this model's layer "
                f"(in={dims[1]}, out={dims[0]}): load it over the model it was trained on."
            )


def linear_dims(module: Any) -> tuple[int, int] | None:
    """(out, in) of a linear layer (quantized too); ``None`` for other modules."""
    if isinstance(module, nn.QuantizedLinear):
        out, packed = module.weight.shape
        return int(out), int(packed) * 32 // int(module.bits)
    if isinstance(module, nn.Linear):
        out, inp = module.weight.shape
        return int(out), int(inp)
    return None


def _folder(path: str | os.PathLike[str]) -> Path:
    try:
        folder = Path(os.path.expanduser(os.fspath(path)))
    except TypeError:
        raise ModelLoadError(f"load_adapter() takes an adapter folder's path, got {type(path).__name__}.") from None
    if not folder.is_dir():
        raise ModelLoadError(
            f"No adapter folder at {str(folder)!r}: pass the folder mlx_lm.lora wrote "
            f"(holding {CONFIG_FILE} and {WEIGHTS_FILE})."
        )
    return folder


def _read(file: Path) -> bytes:
    if file.exists() and not file.is_file() and not file.is_dir():  # a FIFO or device: reading it would block
        raise ModelLoadError(f"{str(file)!r} is not a regular file (a pipe, device or socket): an mlx-lm adapter "
                             f"folder holds the files {CONFIG_FILE} and {WEIGHTS_FILE}.")
    try:
        return file.read_bytes()
    except OSError as exc:
        raise ModelLoadError(
            f"The adapter folder {str(file.parent)!r} has no readable {file.name} ({exc.strerror or exc}): "
            f"an mlx-lm adapter folder holds {CONFIG_FILE} and {WEIGHTS_FILE}."
        ) from None


def _settings(config: Any, folder: Path) -> tuple[str, int, float]:
    """(kind, rank, scale) from an adapter config; ``ModelLoadError`` for anything else."""
    where = repr(str(folder / CONFIG_FILE))
    if not isinstance(config, dict):
        raise ModelLoadError(f"{where} must hold a JSON object, as mlx_lm.lora writes it.")
    kind = config.get("fine_tune_type", "lora")
    if kind not in _LEAVES:
        raise ModelLoadError(
            f"{where}: fine_tune_type={kind!r} is not an adapter (chatkit takes 'lora' or 'dora'; "
            "a 'full' fine-tune is a model: load it with chatkit.load)."
        )
    params = config.get("lora_parameters")
    if not isinstance(params, dict):
        raise ModelLoadError(f"{where} has no lora_parameters object (rank, scale): is it an mlx-lm adapter config?")
    rank, scale = params.get("rank"), params.get("scale")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ModelLoadError(f"{where}: lora_parameters.rank={rank!r} must be an int >= 1.")
    try:
        scale = check_scale(scale, "lora_parameters.scale")
    except InvalidParamsError as exc:
        raise ModelLoadError(f"{where}: {exc}") from None
    return str(kind), rank, scale


def _tool_format(config: dict[str, Any], folder: Path) -> str | None:
    """The config's tool-call format (``TOOL_FORMAT_KEY``), checked to be one mlx-lm has a parser for."""
    name = config.get(TOOL_FORMAT_KEY)
    if name is None:
        return None
    try:
        tool_parser_module(name)
    except ValueError as exc:
        raise ModelLoadError(f"{str(folder / CONFIG_FILE)!r}: {TOOL_FORMAT_KEY}: {exc}. Write the name of the "
                             "format the adapter was trained to write, or remove the entry.") from None
    return str(name)


def _check_weights(weights: Mapping[str, mx.array], kind: str, rank: int, folder: Path) -> tuple[str, ...]:
    """The adapted layers' keys; ``ModelLoadError`` for a name, shape or value that is wrong."""
    where = repr(str(folder / WEIGHTS_FILE))
    leaves = _LEAVES[kind]
    layers: dict[str, set[str]] = {}
    for name, value in weights.items():
        key, _, leaf = name.rpartition(".")
        if not key or leaf not in leaves:
            raise ModelLoadError(f"{where}: {name!r} is not a {kind} tensor (expected <layer>.{'/'.join(leaves)}).")
        layers.setdefault(key, set()).add(leaf)
        if not mx.issubdtype(value.dtype, mx.floating):
            raise ModelLoadError(f"{where}: {name!r} has dtype {value.dtype}, not a float type.")
        if not bool(mx.all(mx.isfinite(value)).item()):
            raise ModelLoadError(f"{where}: {name!r} holds NaN or infinite values: train the adapter again.")
    if not layers:
        raise ModelLoadError(f"{where} holds no tensors: train the adapter again.")
    for key, found in sorted(layers.items()):
        missing = [leaf for leaf in leaves if leaf not in found]
        if missing:
            raise ModelLoadError(f"{where}: layer {key!r} has no {', '.join(missing)}.")
        a, b, m = (weights.get(f"{key}.{leaf}") for leaf in ("lora_a", "lora_b", "m"))
        assert a is not None and b is not None
        shapes_ok = a.ndim == 2 and b.ndim == 2 and a.shape[1] == rank == b.shape[0]
        if not shapes_ok or (m is not None and (m.ndim != 1 or m.shape[0] != b.shape[1])):
            raise ModelLoadError(
                f"{where}: layer {key!r} has shapes lora_a {tuple(a.shape)}, lora_b {tuple(b.shape)}"
                f"{'' if m is None else f', m {tuple(m.shape)}'}, which do not fit rank {rank} "
                "(lora_a (in, rank), lora_b (rank, out), m (out,))."
            )
    return tuple(sorted(layers))


__all__ = ["TOOL_FORMAT_KEY", "Adapter", "check_adapter", "linear_dims", "load_adapter"]

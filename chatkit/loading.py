"""Loading a model and its tokenizer through mlx-lm, from a Hugging Face repo id or a local folder."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Mapping

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.tokenizer_utils import TokenizerWrapper

from .errors import ModelLoadError

# Config keys that name a model's context window, most specific first.
_CONTEXT_KEYS = ("max_position_embeddings", "max_sequence_length", "seq_length", "n_positions")


@dataclass(frozen=True, eq=False)
class LoadedModel:
    """A model with its tokenizer and config, as returned by :func:`load`.

    Sessions over the same ``LoadedModel`` share its weights; nothing here is per conversation.
    """

    model: nn.Module
    tokenizer: TokenizerWrapper
    config: Mapping[str, Any] = field(default_factory=dict)
    source: str = ""

    @property
    def context_length(self) -> int | None:
        """The model's context window in tokens, when its config states one."""
        for key in _CONTEXT_KEYS:
            value = self.config.get(key)
            if isinstance(value, int) and value > 0:
                return value
        text_config = self.config.get("text_config")
        if isinstance(text_config, Mapping):
            return LoadedModel(self.model, self.tokenizer, text_config).context_length
        return None

    @cached_property
    def fingerprint(self) -> dict[str, str]:
        """What identifies this model for saved caches: see :func:`fingerprint`."""
        result = fingerprint(self.model, self.tokenizer)
        if isinstance(gguf := self.config.get("chatkit_gguf"), Mapping):  # converted from a GGUF file
            result["file"] = str(gguf.get("sha256", ""))[:16]
        return result


def _digest(value: Any) -> str:
    data = json.dumps(value, sort_keys=True, default=str, ensure_ascii=False).encode("utf-8")
    return hashlib.sha256(data).hexdigest()[:16]


def fingerprint(model: nn.Module, tokenizer: Any) -> dict[str, str]:
    """Short hashes that tell whether a saved KV cache belongs to this model and tokenizer.

    ``architecture``: the model class and its args; ``parameters``: every parameter's name, shape and
    dtype; ``weights``: a sample of the first values of each parameter (tells apart two models of the
    same shapes); ``vocabulary`` and ``chat_template``: the tokenizer's.
    """
    args = getattr(model, "args", None)
    arch_args = vars(args) if args is not None and hasattr(args, "__dict__") else {}
    params = tree_flatten(model.parameters())
    samples = [p.reshape(-1)[:8].astype(mx.float32) for _, p in params]
    mx.eval(samples)
    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    return {
        "architecture": _digest([type(model).__module__, type(model).__name__, arch_args]),
        "parameters": _digest([(name, list(p.shape), str(p.dtype)) for name, p in params]),
        "weights": _digest([[round(v, 5) for v in s.tolist()] for s in samples]),
        "vocabulary": _digest(sorted(hf.get_vocab().items(), key=lambda kv: kv[1])),
        "chat_template": _digest(getattr(hf, "chat_template", None) or ""),
    }


def load(
    path_or_repo: str | os.PathLike[str],
    *,
    tokenizer: str | os.PathLike[str] | None = None,
    dequantize: bool | None = None,
    **tokenizer_config: Any,
) -> LoadedModel:
    """Load a model and tokenizer with ``mlx_lm.load``.

    ``path_or_repo`` is a local folder (``config.json``, ``*.safetensors`` and tokenizer files), a
    Hugging Face repo id, downloaded on first use (set ``HF_HUB_OFFLINE=1`` to forbid downloads),
    ``"demo"`` / ``"demo-draft"`` for the small chat model and draft that ship with chatkit, a GGUF
    file (converted once into chatkit's cache), ``"ollama:NAME"``, ``"lmstudio:PUBLISHER/MODEL"`` or
    ``"smollm2"`` (see :mod:`chatkit.models`). For GGUF files, ``tokenizer`` is a folder of tokenizer
    files to use instead of the file's own, and ``dequantize`` True/False forces float32 / packed
    weights (default: float32 on machines without Metal). Extra keyword arguments go to the
    tokenizer's config (e.g. ``eos_token``).
    """
    from mlx_lm import load as mlx_load  # imported here: mlx_lm costs about a second to import

    source = os.fspath(path_or_repo)
    if not source:
        raise ModelLoadError("load() needs a Hugging Face repo id or a local model folder, got ''.")
    from .models import resolve  # demo, smollm2, ollama:, lmstudio:, GGUF files -> a model folder

    source = resolve(source, tokenizer=tokenizer, dequantize=dequantize)
    try:
        model, tokenizer, config = mlx_load(
            source, tokenizer_config=tokenizer_config or None, return_config=True
        )
    except Exception as exc:  # mlx-lm raises many kinds: missing files, hub errors, bad configs
        hint = (
            "check the folder holds config.json, weights and tokenizer files"
            if Path(source).exists()
            else "check the repo id, or pass a local folder (offline? set HF_HUB_OFFLINE=1 and use a path)"
        )
        raise ModelLoadError(f"Could not load model {source!r}: {exc} ({hint}).") from exc
    hf = getattr(tokenizer, "_tokenizer", None)
    if isinstance(getattr(hf, "deprecation_warnings", None), dict):
        # Sessions check the context window themselves (ContextWindowExceededError); transformers'
        # "sequence length is longer than the specified maximum" warning would only be noise.
        hf.deprecation_warnings["sequence-length-is-longer-than-the-specified-maximum"] = True
    return LoadedModel(model=model, tokenizer=tokenizer, config=dict(config), source=source)


__all__ = ["LoadedModel", "fingerprint", "load"]

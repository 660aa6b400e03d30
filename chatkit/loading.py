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

from . import _tokenizer, demo
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

    @property
    def head_dim(self) -> int | None:
        """The attention head size: mlx-lm's model args first (they hold defaults a config may omit,
        e.g. Gemma 3's 256), then the config, then hidden size / heads; ``None`` when nothing says."""
        config = self.config.get("text_config", self.config)
        for value in (getattr(getattr(self.model, "args", None), "head_dim", None), config.get("head_dim")):
            if isinstance(value, int):
                return value
        hidden, heads = config.get("hidden_size"), config.get("num_attention_heads")
        return hidden // heads if isinstance(hidden, int) and isinstance(heads, int) and heads else None

    @cached_property
    def fingerprint(self) -> dict[str, str]:
        """What identifies this model for saved caches: see :func:`fingerprint`."""
        return fingerprint(self.model, self.tokenizer)


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
    params: list[tuple[str, mx.array]] = tree_flatten(model.parameters())  # type: ignore[assignment]
    samples = [p.reshape(-1)[:8].astype(mx.float32) for _, p in params]
    mx.eval(samples)
    return {
        "architecture": _digest([type(model).__module__, type(model).__name__, arch_args]),
        "parameters": _digest([(name, list(p.shape), str(p.dtype)) for name, p in params]),
        "weights": _digest([[round(float(v), 5) for v in s.tolist()] for s in samples]),  # type: ignore[union-attr,arg-type]
        "vocabulary": _digest(sorted(_tokenizer.vocabulary(tokenizer).items(), key=lambda kv: kv[1])),
        "chat_template": _digest(_tokenizer.chat_template(tokenizer) or ""),
    }


def load(path_or_repo: str | os.PathLike[str], **tokenizer_config: Any) -> LoadedModel:
    """Load a model and tokenizer with ``mlx_lm.load``.

    ``path_or_repo`` is a local folder (``config.json``, ``*.safetensors`` and tokenizer files), a
    Hugging Face repo id, downloaded on first use (set ``HF_HUB_OFFLINE=1`` to forbid downloads), or
    ``"demo"`` / ``"demo-draft"`` for the small chat model and draft that ship with chatkit.
    Extra keyword arguments go to the tokenizer's config (e.g. ``eos_token``).
    """
    from mlx_lm import load as mlx_load  # imported here: mlx_lm costs about a second to import

    source = os.fspath(path_or_repo)
    if not source:
        raise ModelLoadError("load() needs a Hugging Face repo id or a local model folder, got ''.")
    if source in ("demo", "demo-draft"):
        source = str(demo.draft_path() if source == "demo-draft" else demo.path())
    try:
        model, tokenizer, config = mlx_load(  # type: ignore[misc]  # 3 values with return_config
            source, tokenizer_config=tokenizer_config or None, return_config=True
        )
    except Exception as exc:  # mlx-lm raises many kinds: missing files, hub errors, bad configs
        hint = (
            "check the folder holds config.json, weights and tokenizer files"
            if Path(source).exists()
            else "check the repo id, or pass a local folder (offline? set HF_HUB_OFFLINE=1 and use a path)"
        )
        raise ModelLoadError(f"Could not load model {source!r}: {exc} ({hint}).") from exc
    _tokenizer.silence_length_warning(tokenizer)
    return LoadedModel(model=model, tokenizer=tokenizer, config=dict(config), source=source)


__all__ = ["LoadedModel", "fingerprint", "load"]

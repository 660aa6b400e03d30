"""Loading a model and its tokenizer through mlx-lm, from a Hugging Face repo id or a local folder."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.tokenizer_utils import TokenizerWrapper

from . import tokenizer as _tokenizer

if TYPE_CHECKING:
    from ..distributed import Group
    from .adapters import Adapter
    from .vision import Vision

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
    distributed: Group | None = None
    """The ``mx.distributed`` group this model is sharded over (``load(..., distributed=...)``)."""
    vision: Vision | None = None
    """A vision-language model's vision side (mlx-vlm's model and processor); ``None`` for a text model."""

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

    def kv_bytes_per_token(self, kv_bits: int | None = None, kv_group_size: int = 64) -> int:
        """Bytes one more token takes in this model's KV cache (every attention layer's keys and values;
        with ``kv_bits``, quantized to that many bits in groups of ``kv_group_size`` with a scale and a
        bias each). Recurrent state, whose size does not grow with the context, is not counted."""
        return _kv_bytes_per_token(self._kv_widths, kv_bits, kv_group_size)

    @cached_property
    def _kv_widths(self) -> tuple[tuple[int, int], ...]:
        """(values per token, bytes per value) of every attention layer's keys and of its values."""
        from mlx_lm.models.cache import make_prompt_cache

        cache = make_prompt_cache(self.model)
        self.model(mx.array([[0]]), cache=cache)  # one token shows the shapes the model writes
        widths = []
        for layer in cache:
            for name in ("keys", "values"):
                a = getattr(layer, name, None)
                if isinstance(a, mx.array) and a.ndim == 4:
                    widths.append((a.shape[1] * a.shape[3], a.dtype.size))
        return tuple(widths)

    @cached_property
    def vocab_size(self) -> int:
        """How many logits the model produces per token (token ids are below this)."""
        for config in (self.config, self.config.get("text_config"), getattr(getattr(self.model, "args", None), "__dict__", None)):
            value = config.get("vocab_size") if isinstance(config, Mapping) else None
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
        from mlx_lm.models.cache import make_prompt_cache

        # No config says it: one token through the model shows the width of its logits.
        logits = self.model(mx.array([[0]]), cache=make_prompt_cache(self.model))
        return int(logits.shape[-1])

    @cached_property
    def fingerprint(self) -> dict[str, str]:
        """What identifies this model for saved caches: see :func:`fingerprint`; a GGUF conversion's also
        names its file, a sharded model's its strategy, world size and rank (a cache shard fits only
        the same layout)."""
        found = fingerprint(self.model, self.tokenizer)
        if isinstance(gguf := self.config.get("chatkit_gguf"), Mapping):  # converted from a GGUF file
            found["file"] = str(gguf.get("sha256", ""))[:16]
        if self.distributed is not None and self.distributed.sharded:
            from ..distributed import fingerprint_entry

            found["distributed"] = fingerprint_entry(self.distributed)
        if self.vision is not None:  # the vision tower and projector shape the KV of every image
            whole = fingerprint(self.vision.vlm, self.tokenizer)
            found["vision"] = _digest([whole["parameters"], whole["weights"]])
        if isinstance(fused := self.config.get("chatkit_fused_adapter"), str):  # lm.fuse(adapter)'s copy
            found["fused_adapter"] = fused
        return found

    def adapter(self, path: str | os.PathLike[str]) -> Adapter:
        """The mlx-lm adapter folder ``path`` read and checked against this model: see
        :func:`chatkit.load_adapter`; give it to ``builder.adapter(...)`` or ``session.adapter``."""
        from .adapters import load_adapter

        return load_adapter(path, self)

    def fuse(self, adapter: Adapter, scale: float = 1.0) -> LoadedModel:
        """A new ``LoadedModel`` with ``adapter`` (at ``scale``) fused into copies of the adapted layers'
        weights, for one fixed adapter at the base model's speed; this model is unchanged (the weights
        the adapter does not touch are shared). ``ModelLoadError`` if it does not fit this model."""
        from ..errors import InvalidParamsError
        from .adapters import Adapter, check_adapter, check_scale
        from .switchable import ActiveAdapter, fused

        if not isinstance(adapter, Adapter):
            raise InvalidParamsError(f"fuse() takes a chatkit.Adapter (chatkit.load_adapter(path)), got {type(adapter).__name__}.")
        scale = check_scale(scale, "fuse() scale")
        check_adapter(adapter, self)
        active = ActiveAdapter(adapter, scale)
        config = {**self.config, "chatkit_fused_adapter": active.key}
        return LoadedModel(fused(self.model, active), self.tokenizer, config, self.source, self.distributed)


def _kv_bytes_per_token(widths: tuple[tuple[int, int], ...], kv_bits: int | None, group: int) -> int:
    if kv_bits is None:
        return sum(n * size for n, size in widths)
    return sum(-(-n * kv_bits // 8) + 2 * -(-n // group) * size for n, size in widths)


def _digest(value: Any) -> str:
    data = json.dumps(value, sort_keys=True, default=str, ensure_ascii=False).encode("utf-8")
    return hashlib.sha256(data).hexdigest()[:16]


def fingerprint(model: nn.Module, tokenizer: Any) -> dict[str, str]:
    """Short hashes that tell whether a saved KV cache belongs to this model and tokenizer: those of
    :func:`model_fingerprint`, and ``vocabulary`` and ``chat_template``: the tokenizer's."""
    return {
        **model_fingerprint(model),
        "vocabulary": _digest(sorted(_tokenizer.vocabulary(tokenizer).items(), key=lambda kv: kv[1])),
        "chat_template": _digest(_tokenizer.chat_template(tokenizer) or ""),
    }


def model_fingerprint(model: nn.Module) -> dict[str, str]:
    """Short hashes of an mlx model alone. ``architecture``: the model class and its args;
    ``parameters``: every parameter's name, shape and dtype; ``weights``: a sample of the first values of
    each parameter (tells apart two models of the same shapes)."""
    args = getattr(model, "args", None)
    arch_args = vars(args) if args is not None and hasattr(args, "__dict__") else {}
    params: list[tuple[str, mx.array]] = tree_flatten(model.parameters())  # type: ignore[assignment]
    samples = [p.reshape(-1)[:8].astype(mx.float32) for _, p in params]
    mx.eval(samples)
    return {
        "architecture": _digest([type(model).__module__, type(model).__name__, arch_args]),
        "parameters": _digest([(name, list(p.shape), str(p.dtype)) for name, p in params]),
        "weights": _digest([[round(float(v), 5) for v in s.tolist()] for s in samples]),  # type: ignore[union-attr,arg-type]
    }


__all__ = ["LoadedModel", "fingerprint", "model_fingerprint"]

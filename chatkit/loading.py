"""Loading a model and its tokenizer through mlx-lm, from a Hugging Face repo id or a local folder."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.tokenizer_utils import TokenizerWrapper

from . import _tokenizer
from .errors import ModelLoadError

if TYPE_CHECKING:
    from .engine.distributed import Group

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
            from .engine.distributed import fingerprint_entry

            found["distributed"] = fingerprint_entry(self.distributed)
        return found


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


def load(
    path_or_repo: str | os.PathLike[str],
    *,
    tokenizer: str | os.PathLike[str] | None = None,
    dequantize: bool | None = None,
    distributed: str | None = None,
    distributed_timeout: float = 120.0,
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

    ``distributed="tensor" | "pipeline" | "auto"`` joins MLX's distributed world (start the program
    with ``mlx.launch``) and loads this rank's shard with mlx-lm's ``sharded_load``; sessions over it
    run in lockstep on every rank (docs/distributed.md). ``distributed_timeout`` bounds, in seconds,
    how long a rank waits for the others inside one step. In a world of one rank it loads as usual.
    """
    from mlx_lm import load as mlx_load  # imported here: mlx_lm costs about a second to import

    try:
        source = os.fspath(path_or_repo)
    except TypeError:
        raise ModelLoadError(
            f"load() takes a Hugging Face repo id or a local folder, got {type(path_or_repo).__name__}."
        ) from None
    if isinstance(source, bytes):
        source = os.fsdecode(source)
    if not source.strip():
        raise ModelLoadError("load() needs a Hugging Face repo id or a local model folder, got ''.")
    from .models import resolve  # demo, smollm2, ollama:, lmstudio:, GGUF files -> a model folder

    source = _local_or_repo(resolve(source, tokenizer=tokenizer, dequantize=dequantize))
    group = None
    if distributed is not None:
        from .engine import distributed as dist

        mx_group, rank, size = dist.init(distributed, distributed_timeout)
        if size > 1:
            model, tok, config, used = dist.load_sharded(source, distributed, mx_group, tokenizer_config or None)
            _tokenizer.silence_length_warning(tok)
            group = dist.Group(mx_group, used, rank, size, float(distributed_timeout))
            return LoadedModel(model=model, tokenizer=tok, config=config, source=source, distributed=group)
        group = dist.Group(mx_group, distributed, rank, size, float(distributed_timeout))
    try:
        model, tok, config = mlx_load(  # type: ignore[misc]  # 3 values with return_config
            source, tokenizer_config=tokenizer_config or None, return_config=True
        )
    except Exception as exc:  # mlx-lm raises many kinds: missing files, hub errors, bad configs
        hint = (
            "check the folder holds config.json, weights and tokenizer files"
            if Path(source).exists()
            else "check the repo id, or pass a local folder (offline? set HF_HUB_OFFLINE=1 and use a path)"
        )
        raise ModelLoadError(f"Could not load model {source!r}: {exc} ({hint}).") from exc
    _tokenizer.silence_length_warning(tok)
    return LoadedModel(model=model, tokenizer=tok, config=dict(config), source=source, distributed=group)


def _local_or_repo(source: str) -> str:
    """``source`` with ``~`` expanded if it names a local path; ``ModelLoadError`` for a path that
    does not exist (rather than a Hugging Face error about a repo id that is not one)."""
    expanded = os.path.expanduser(source)
    if os.path.exists(expanded):
        if not os.path.isdir(expanded):
            raise ModelLoadError(
                f"{source!r} is a file: pass the model's folder (holding config.json, weights and tokenizer files)."
            )
        return expanded
    # A Hugging Face repo id is "name" or "owner/name": no leading ".", "/" or "~", one "/" at most.
    looks_like_path = (
        source.startswith((".", "/", "~", "\\"))
        or source.endswith(("/", "\\"))
        or source.count("/") > 1
        or "\\" in source
        or (len(source) > 1 and source[1] == ":")  # C:...
    )
    if looks_like_path:
        raise ModelLoadError(f"No model folder at {expanded!r}: check the path.")
    return source


__all__ = ["LoadedModel", "fingerprint", "load"]

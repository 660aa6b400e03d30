"""``load()``: a model and its tokenizer through mlx-lm, from a name, a Hugging Face repo id or a folder."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ..errors import ModelLoadError
from . import tokenizer as _tokenizer
from .loaded import LoadedModel


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
    ``"smollm2"`` (see :mod:`chatkit.model.names`). For GGUF files, ``tokenizer`` is a folder of tokenizer
    files to use instead of the file's own, and ``dequantize`` True/False forces float32 / packed
    weights (default: float32 on machines without Metal). Extra keyword arguments go to the
    tokenizer's config (e.g. ``eos_token``).

    ``distributed="tensor" | "pipeline" | "auto"`` joins MLX's distributed world (start the program
    with ``mlx.launch``) and loads this rank's shard with mlx-lm's ``sharded_load``; sessions over it
    run in lockstep on every rank (docs/distributed.md). ``distributed_timeout`` bounds, in seconds,
    how long a rank waits for the others inside one step. In a world of one rank it loads as usual.
    """
    from .names import resolve  # demo, smollm2, ollama:, lmstudio:, GGUF files -> a model folder

    source = _local_or_repo(resolve(_source_text(path_or_repo), tokenizer=tokenizer, dequantize=dequantize))
    group = None
    if distributed is not None:
        from .. import distributed as dist

        mx_group, rank, size = dist.init(distributed, distributed_timeout)
        if size > 1:
            model, tok, config, used = dist.load_sharded(source, distributed, mx_group, tokenizer_config or None)
            _tokenizer.silence_length_warning(tok)
            group = dist.Group(mx_group, used, rank, size, float(distributed_timeout))
            return LoadedModel(model=model, tokenizer=tok, config=config, source=source, distributed=group)
        group = dist.Group(mx_group, distributed, rank, size, float(distributed_timeout))
    folder = _folder(source)  # a Hub repo downloaded (or found in the cache) as mlx-lm downloads it
    vision = _vision_config(folder)
    if vision is not None:
        if group is not None and group.sharded:
            raise ModelLoadError(f"{source!r} is a vision-language model: chatkit cannot shard those.")
        from .vision import load_vision

        text_model, tok, parts = load_vision(folder, vision)
        _tokenizer.silence_length_warning(tok)
        return LoadedModel(model=text_model, tokenizer=tok, config=dict(vision), source=source, vision=parts)
    model, tok, config = _mlx_load(folder, source, tokenizer_config)
    _tokenizer.silence_length_warning(tok)
    return LoadedModel(model=model, tokenizer=tok, config=dict(config), source=source, distributed=group)


def _source_text(path_or_repo: str | os.PathLike[str]) -> str:
    """``path_or_repo`` as a str; ``ModelLoadError`` for what names no model at all."""
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
    return source


def _folder(source: str) -> str:
    """``source``'s local folder: itself, or the Hub repo's snapshot, fetched with mlx-lm's own file
    patterns (what ``mlx_lm.load`` fetches), so that a vision-language repo is recognised by its config.
    ``ModelLoadError`` for a folder holding a pipe, device or socket (reading one blocks forever)."""
    if os.path.isdir(source):
        _regular_files(source)
        return source
    from mlx_lm.utils import _download  # mlx_lm.load's own download step

    try:
        return str(_download(source))
    except Exception as exc:  # hub errors of every kind
        raise ModelLoadError(f"Could not load model {source!r}: {exc} (check the repo id, or pass a local "
                             "folder (offline? set HF_HUB_OFFLINE=1 and use a path)).") from exc


def _regular_files(folder: str) -> None:
    for entry in Path(folder).iterdir():
        if entry.exists() and not entry.is_file() and not entry.is_dir():
            raise ModelLoadError(f"{str(entry)!r} in the model folder is not a regular file (a pipe, device, "
                                 "or socket): a model folder holds config.json, weights and "
                                 "tokenizer files.")


def _mlx_load(folder: str, source: str, tokenizer_config: dict[str, Any]) -> tuple[Any, Any, Any]:
    """``mlx_lm.load``'s (model, tokenizer, config) of the local ``folder`` (``source``: what the user named);
    its many kinds of errors as ``ModelLoadError``."""
    from mlx_lm import load as mlx_load  # imported here: mlx_lm costs about a second to import

    try:
        return mlx_load(  # type: ignore[return-value]  # 3 values with return_config
            folder, tokenizer_config=tokenizer_config or None, return_config=True
        )
    except Exception as exc:  # mlx-lm raises many kinds: missing files, bad configs
        raise ModelLoadError(f"Could not load model {source!r}: {exc} (check the folder {folder} holds "
                             "config.json, weights and tokenizer files).") from exc


def _vision_config(source: str) -> dict[str, Any] | None:
    """The config of a local vision-language model folder (one whose config has a ``vision_config``)."""
    import json

    from .vision import is_vision_config

    path = Path(source) / "config.json"
    if not path.is_file():
        return None
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None  # mlx-lm reports it
    return config if isinstance(config, dict) and is_vision_config(config) else None


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


__all__ = ["load"]

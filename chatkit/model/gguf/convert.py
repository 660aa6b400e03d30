"""A GGUF file -> an mlx-lm model folder in chatkit's cache, converted once per file and variant."""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
import tempfile
from pathlib import Path

import mlx.core as mx

from ..._cachedir import user_cache_dir
from ...errors import ModelLoadError
from . import arch, reader
from .tokenizer import TokenizerUnavailable, build, eos_token_ids

log = logging.getLogger(__name__)  # progress of a first conversion (the CLI shows it; chatkit never prints)

# Bump when the conversion's output changes, so cached folders of older conversions are not reused.
CONVERTER_VERSION = 2
_TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "tokenizer.model", "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json",
)


def file_sha256(path: str | Path, cache_dir: Path | None = None) -> str:
    """The file's sha256, remembered by path, size and mtime so that a second load does not reread it."""
    path = Path(path).resolve()
    st = path.stat()
    memo_file = (cache_dir or user_cache_dir()) / "gguf" / "hashes.json"
    key = f"{path}|{st.st_size}|{st.st_mtime_ns}"
    try:
        memo = json.loads(memo_file.read_text())
    except (OSError, ValueError):
        memo = {}
    if isinstance(memo.get(key), str):
        return memo[key]
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    memo[key] = h.hexdigest()
    _write_atomic(memo_file, json.dumps(memo, indent=1).encode())
    return memo[key]


def _write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def _physical_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def _want_float32(dequantize: bool | None, path: Path) -> bool:
    """``dequantize`` if given; else float32 on a machine without Metal when it takes at most a quarter
    of the memory (SmolLM2-135M on 2 x86 cores: float32 decodes 2x and prefills 7x faster than the
    packed weights; see BENCHMARKS.md). With Metal, packed weights are the faster ones."""
    if dequantize is not None:
        return dequantize
    if mx.metal.is_available():
        return False
    elements = sum(math.prod(dims) for name, (_, dims) in reader.tensor_info(path).items() if name != "rope_freqs.weight")
    return 4 * elements <= _physical_memory() // 4


def _publish(tmp: Path, target: Path) -> None:
    """Move a finished folder into place; another process that got there first wins."""
    try:
        os.rename(tmp, target)
    except OSError:
        if not (target / "config.json").exists():
            raise
        shutil.rmtree(tmp, ignore_errors=True)


def _tokenizer_digest(folder: Path) -> str:
    h = hashlib.sha256()
    for name in _TOKENIZER_FILES:
        if (folder / name).is_file():
            h.update(name.encode() + b"\0" + (folder / name).read_bytes())
    return h.hexdigest()[:16]


def _with_tokenizer(base: Path, folder: Path, gguf_path: Path, cache: Path) -> Path:
    """A folder of the converted weights (links) with the tokenizer files of ``folder``."""
    if not (folder / "tokenizer.json").is_file() and not (folder / "tokenizer.model").is_file():
        raise ModelLoadError(f"tokenizer={str(folder)!r} has no tokenizer.json or tokenizer.model: pass a folder with tokenizer files.")
    target = cache / f"{base.name}-tok-{_tokenizer_digest(folder)}"
    if (target / "config.json").exists():
        return target
    tmp = Path(tempfile.mkdtemp(dir=cache, prefix=".tmp-"))
    for name in ("config.json", "model.safetensors", "source.json"):
        (tmp / name).symlink_to(base / name)
    for name in _TOKENIZER_FILES:
        if (folder / name).is_file():
            shutil.copyfile(folder / name, tmp / name)
    config_file = tmp / "tokenizer_config.json"
    config = json.loads(config_file.read_text()) if config_file.exists() else {}
    template = reader.value(reader.read(gguf_path)[1], "tokenizer.chat_template")
    if template and "chat_template" not in config and not (tmp / "chat_template.jinja").exists():
        config["chat_template"] = template  # the file's template, when the folder brings none
        config_file.write_text(json.dumps(config, indent=2, ensure_ascii=False))
    _publish(tmp, target)
    return target


def _convert(path: Path, sha: str, float32: bool, base: Path, cache: Path, need_tokenizer: bool) -> None:
    """Write the mlx-lm folder ``base`` for the GGUF file ``path`` (atomically)."""
    tensors, meta = reader.read(path)
    config = arch.model_config(meta, tensors)
    weights = arch.map_weights(tensors, config)
    try:
        own_tokenizer = build(meta)
    except TokenizerUnavailable as exc:
        if need_tokenizer:
            raise ModelLoadError(
                f"The tokenizer of GGUF file {path} cannot be built: {exc}. Pass a folder with the "
                "model's tokenizer files: chatkit.load(path, tokenizer='path/to/folder')."
            ) from exc
        own_tokenizer = None
    if float32:
        weights = arch.dequantized(weights, mx.float32)
    else:
        # Weights stay as MLX read them: packed with float16 scales, norms float32. Casting the
        # norms to float16 made SmolLM2 30x slower on CPU (0.24 vs 7.3 tok/s decode).
        config["quantization"] = arch.quantization(weights)
    config["eos_token_id"] = eos_token_ids(meta)
    config["chatkit_gguf"] = {"sha256": sha, "file": path.name, "float32": float32, "version": CONVERTER_VERSION}
    config = {k: v for k, v in config.items() if v is not None}
    tmp = Path(tempfile.mkdtemp(dir=cache, prefix=".tmp-"))
    try:
        mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "mlx"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        (tmp / "source.json").write_text(json.dumps({"path": str(path.resolve()), "sha256": sha}, indent=2))
        if own_tokenizer is not None:
            tok, tok_config = own_tokenizer
            tok.save(str(tmp / "tokenizer.json"))
            (tmp / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2, ensure_ascii=False))
        _publish(tmp, base)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def prepare(
    path: str | os.PathLike[str],
    *,
    tokenizer: str | os.PathLike[str] | None = None,
    dequantize: bool | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
) -> Path:
    """Convert a GGUF file to an mlx-lm model folder (cached) and return the folder.

    ``tokenizer``: a folder with tokenizer files, used instead of the file's own tokenizer (needed when
    the file's cannot be built, e.g. files written by ``mlx_lm.gguf``). ``dequantize``: True for
    float32 weights, False to keep MLX-readable quantizations packed, None to decide by machine.
    ``cache_dir`` defaults to chatkit's user cache folder; folders are keyed by the file's sha256, so
    a second call reads only the file's header (and its hash, remembered by path, size and mtime).
    """
    path = Path(path).expanduser()
    if not reader.is_gguf(path):
        raise ModelLoadError(f"{path} is not a GGUF file (missing, or no GGUF magic bytes).")
    root = Path(cache_dir).expanduser() if cache_dir is not None else user_cache_dir()
    cache = root / "gguf"
    cache.mkdir(parents=True, exist_ok=True)
    sha = file_sha256(path, root)
    float32 = _want_float32(dequantize, path)
    base = cache / f"{sha[:24]}-{'f32' if float32 else 'q'}-v{CONVERTER_VERSION}"
    if not (base / "config.json").exists():
        log.info("Converting %s to MLX (once; cached in %s)...", path.name, cache)
        _convert(path, sha, float32, base, cache, need_tokenizer=tokenizer is None)
    if tokenizer is not None:
        return _with_tokenizer(base, Path(tokenizer).expanduser(), path, cache)
    if not (base / "tokenizer.json").exists():  # converted earlier with tokenizer=, its own unbuildable
        raise ModelLoadError(
            f"The tokenizer of GGUF file {path} cannot be built: pass a folder with the model's "
            "tokenizer files: chatkit.load(path, tokenizer='path/to/folder')."
        )
    return base


__all__ = ["CONVERTER_VERSION", "file_sha256", "prepare"]

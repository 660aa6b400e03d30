"""Helpers that take cache files apart and put them back together, for tests of damaged files."""

import json
import struct
import zlib
from pathlib import Path

from chatkit import GenerateParams


def split(path: Path) -> tuple[dict, bytes]:
    """(the safetensors header as a dict, the tensor bytes after it)."""
    data = Path(path).read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + n]), data[8 + n :]


def join(path: Path, header: dict, body: bytes) -> None:
    raw = json.dumps(header).encode("utf-8")
    Path(path).write_bytes(struct.pack("<Q", len(raw)) + raw + body)


def rewrite_meta(src: Path, dst: Path, edit, *, fix_checksum: bool = True) -> None:
    """Copy ``src`` to ``dst`` with chatkit's metadata JSON passed through ``edit`` (a dict in, a
    dict or a raw str out), its checksum recomputed unless ``fix_checksum=False`` (so that the
    schema check, not the checksum, has to catch the edit)."""
    header, body = split(src)
    meta = json.loads(header["__metadata__"]["0.chatkit"])
    out = edit(meta)
    text = out if isinstance(out, str) else json.dumps(out, ensure_ascii=False)
    header["__metadata__"]["0.chatkit"] = text
    if fix_checksum:
        header["__metadata__"]["0.chatkit_crc32"] = f"{zlib.crc32(text.encode('utf-8', 'surrogatepass')):08x}"
    join(dst, header, body)


def regions(path: Path) -> list[tuple[str, int, int]]:
    """(name, start, end) of every region of the file: length prefix, header, each tensor."""
    header, _ = split(path)
    data = Path(path).read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    out = [("length", 0, 8), ("header", 8, 8 + n)]
    for name, entry in header.items():
        if name != "__metadata__":
            start, stop = entry["data_offsets"]
            out.append((name, 8 + n + start, 8 + n + stop))
    return sorted(out, key=lambda r: r[1])


def rewrite_state(src: Path, dst: Path, edit_layers=None, edit_meta=None) -> None:
    """Copy the chatkit file ``src`` to ``dst`` with its cache entries (mlx-lm's objects, as
    ``load_prompt_cache`` builds them: ``edit_layers(layers, meta)`` changes them in place or returns
    new ones) and its metadata (``edit_meta(meta)``) edited, every checksum recomputed: a forgery
    that only a check of the entries' state can catch."""
    from chatkit.cache.file import _state_digest

    from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

    layers = load_prompt_cache(str(src))
    header, _ = split(src)
    meta = json.loads(header["__metadata__"]["0.chatkit"])
    if edit_layers is not None:
        layers = edit_layers(layers, meta) or layers
    if edit_meta is not None:
        meta = edit_meta(meta) or meta
    meta["checksum"]["state"] = _state_digest(layers)
    text = json.dumps(meta, ensure_ascii=False)
    save_prompt_cache(str(dst), layers, {"chatkit": text, "chatkit_crc32": f"{zlib.crc32(text.encode('utf-8')):08x}"})


def talk(lm, turns=("My name is Ada.", "What is my name?"), **options):
    """A session of ``lm`` that has had ``turns`` (greedy, 8 tokens a reply)."""
    from conftest import session_for

    session = session_for(lm, params=GenerateParams(max_tokens=8), **options)
    for prompt in turns:
        session.respond(prompt)
    return session


def saved_chat(tiny, tmp_path_factory):
    """A good chatkit file of the default tiny model, and that model: ``(lm, path)``."""
    lm = tiny()
    path = tmp_path_factory.mktemp("saved") / "chat.safetensors"
    talk(lm).save_cache(path)
    return lm, path

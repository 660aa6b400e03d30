"""Issue 33, item 10: a truncated or damaged GGUF file is refused with ``ModelLoadError`` naming the
file, wherever it was cut (header, metadata, tensor infos, tensor data); never ``struct.error``."""

import struct

import chatkit
from chatkit import ModelLoadError
from chatkit.testing import tiny_model_path

import pytest
from mlx.utils import tree_flatten


@pytest.fixture(autouse=True)
def cache_dir(tmp_path_factory, monkeypatch):
    """Conversions go into a cache folder of this test run, never the user's."""
    monkeypatch.setenv("CHATKIT_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "chatkit-cache"))


@pytest.fixture(scope="module")
def original():
    return tiny_model_path("llama", "bpe", head_dim=32)


@pytest.fixture(scope="module")
def gguf_bytes(original, tmp_path_factory):
    """A whole GGUF file (mlx-lm's writer) and the ends of its regions: (data, metadata end, infos end)."""
    from mlx_lm.gguf import convert_to_gguf
    from mlx_lm.utils import load_model

    model, config = load_model(original)
    path = tmp_path_factory.mktemp("gguf") / "whole.gguf"
    convert_to_gguf(original, dict(tree_flatten(model.parameters())), config, str(path))
    data = path.read_bytes()
    infos = [t.field for t in pytest.importorskip("gguf").GGUFReader(path).tensors]  # read by the gguf package
    meta_end = min(f.offset for f in infos)
    infos_end = max(f.offset + sum(p.nbytes for p in f.parts) for f in infos)
    return data, meta_end, infos_end


def _cuts(data, meta_end, infos_end):
    return {
        "magic only": 4, "in the version": 6, "in the tensor count": 10, "in the metadata count": 20,
        "before the first key": 24, "in the first key": 30, "in the metadata": meta_end // 2,
        "at the metadata's end - 1": meta_end - 1, "at the metadata's end": meta_end,
        "in the tensor infos": (meta_end + infos_end) // 2, "at the infos' end - 1": infos_end - 1,
        "at the infos' end": infos_end, "in the first tensor": infos_end + 100,
        "in the middle of the data": len(data) // 2, "one byte short": len(data) - 1,
    }


def _forged(data):
    """Header fields no writer writes: a key 2**63 bytes long, an unknown value type, a tensor count
    far beyond the file."""
    key_len = struct.unpack_from("<Q", data, 24)[0]
    kind_at = 32 + key_len
    return {
        "a huge key length": data[:24] + struct.pack("<Q", 2**63) + data[32:],
        "an unknown value type": data[:kind_at] + struct.pack("<I", 99) + data[kind_at + 4 :],
        "a huge tensor count": data[:8] + struct.pack("<Q", 2**40) + data[16:],
    }


def test_a_truncated_gguf_file_is_refused_naming_it_wherever_it_was_cut(gguf_bytes, original, tmp_path):
    data, meta_end, infos_end = gguf_bytes
    for where, cut in _cuts(data, meta_end, infos_end).items():
        path = tmp_path / f"cut-{cut}.gguf"
        path.write_bytes(data[:cut])
        with pytest.raises(ModelLoadError, match="truncated") as info:
            chatkit.load(path, tokenizer=original)
        assert str(path) in str(info.value), where
        assert "again" in str(info.value), where  # says what to do


def test_a_gguf_header_with_impossible_fields_is_refused_naming_the_file(gguf_bytes, original, tmp_path):
    data, _, _ = gguf_bytes
    for what, forged in _forged(data).items():
        path = tmp_path / f"{what.replace(' ', '-')}.gguf"
        path.write_bytes(forged)
        with pytest.raises(ModelLoadError, match="truncated or damaged") as info:
            chatkit.load(path, tokenizer=original)
        assert str(path) in str(info.value), what

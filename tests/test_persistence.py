"""Saving and restoring caches and conversations: round trips, raw caches, fingerprints, bad files."""

import json
import os
import subprocess
import sys
import textwrap

import chatkit
from chatkit import (
    CacheFileError,
    ChatSession,
    GenerateParams,
    IncompatibleCacheError,
    InvalidParamsError,
    NoCacheAvailableError,
    SessionBusyError,
)
from chatkit.cache import atomic
from chatkit.cache import file as cache_file

import mlx.core as mx
import pytest
from conftest import assert_ledger_matches_cache, cache_state, session_for
from mlx_lm.models.cache import make_prompt_cache, save_prompt_cache

PARAMS = GenerateParams(max_tokens=10)
ROUND_TRIPS = [
    ("qwen3", "bpe", {}),
    ("llama", "spm", {}),
    ("gemma3_text", "gemma", {}),  # rotating layers, wrapped by the second turn
    ("qwen3_5", "bpe-think", {}),  # hybrid: ArraysCache layers
    ("qwen3", "bpe", {"kv_bits": 8}),  # quantized KV cache
]


def run(session, prompt):
    with session.stream_respond(prompt) as stream:
        list(stream)
    return stream.tokens


def two_turns(lm, **options):
    session = session_for(lm, params=PARAMS, **options)
    run(session, "My name is Ada and I live in Lyon.")
    run(session, "What is my name?")
    return session


@pytest.mark.parametrize("arch,tok,options", ROUND_TRIPS)
def test_round_trip_continues_exactly_like_the_uninterrupted_session(tiny, tmp_path, arch, tok, options):
    lm = tiny(arch=arch, tokenizer=tok)
    kv = {"kv_bits": options["kv_bits"]} if options else {}
    session = two_turns(lm, **({"kv_bits": kv["kv_bits"]} if kv else {}))
    path = tmp_path / "chat.safetensors"
    size = session.save_cache(path)
    assert size == path.stat().st_size > 0
    saved_tokens = session.cache_info().tokens

    restored = ChatSession.builder(lm).cache(path).build()
    assert restored.history == session.history and restored.instructions == session.instructions
    assert restored.generate_params.to_dict() == session.generate_params.to_dict()
    assert restored.cache_info().tokens == saved_tokens
    assert restored.cache_info().layer_classes == session.cache_info().layer_classes
    assert_ledger_matches_cache(restored)

    expected = run(session, "And where do I live?")
    assert run(restored, "And where do I live?") == expected
    assert restored.last_stats.reused_tokens == session.last_stats.reused_tokens > 0


@pytest.mark.slow  # a subprocess
def test_restore_in_a_fresh_process_continues_identically(tiny, tmp_path):
    lm = tiny(arch="qwen3", tokenizer="bpe")
    session = two_turns(lm)
    path = tmp_path / "chat.safetensors"
    session.save_cache(path)
    expected = run(session, "Where do I live?")
    script = textwrap.dedent(
        f"""
        import json, chatkit
        from chatkit.testing import tiny_model
        s = chatkit.ChatSession.builder(tiny_model(arch="qwen3", tokenizer="bpe")).cache({str(path)!r}).build()
        with s.stream_respond("Where do I live?") as stream:
            list(stream)
        print(json.dumps([stream.tokens, s.last_stats.prefilled_tokens, s.last_stats.reused_tokens]))
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    tokens, prefilled, reused = json.loads(out.stdout.strip().splitlines()[-1])
    assert tokens == expected
    assert reused == session.last_stats.reused_tokens and prefilled == session.last_stats.prefilled_tokens


def test_file_holds_the_kv_cut_to_its_offset(tiny, tmp_path):
    lm = tiny(arch="qwen3", tokenizer="bpe")
    session = two_turns(lm)
    path = tmp_path / "chat.safetensors"
    session.save_cache(path)
    info = chatkit.inspect_cache(path)
    layers = cache_state(session).layers
    kv_bytes = sum(c.keys[..., : c.offset, :].nbytes + c.values[..., : c.offset, :].nbytes for c in layers)
    assert kv_bytes < session.cache_info().nbytes, "mlx-lm pads its buffers in steps of 256"
    assert info.tensor_bytes <= 1.05 * kv_bytes


def test_inspect_reads_the_header(tiny, tmp_path):
    lm = tiny()
    session = two_turns(lm)
    path = tmp_path / "chat.safetensors"
    session.save_cache(path)
    info = chatkit.inspect_cache(path)
    assert info.kind == "chatkit" and info.format_version == cache_file.FORMAT_VERSION
    assert info.tokens == session.cache_info().tokens and info.opaque_tokens == 0
    assert info.turns == 2 and info.messages[0]["content"] == "My name is Ada and I live in Lyon."
    assert info.fingerprint == lm.fingerprint and info.instructions == "Be brief."
    assert info.layer_classes == ("KVCache", "KVCache") and info.file_bytes == path.stat().st_size


def test_builder_settings_win_over_the_file(tiny, tmp_path):
    lm = tiny()
    session = two_turns(lm)
    path = tmp_path / "chat.safetensors"
    session.save_cache(path)
    other = ChatSession.builder(lm).cache(path).instructions("Be verbose.").generate_params(GenerateParams(max_tokens=3)).build()
    assert other.instructions == "Be verbose." and other.generate_params.max_tokens == 3
    run(other, "Hi")
    # New instructions: only the template's opening tokens still match the cached prefix.
    assert other.last_stats.reused_tokens < 10


def raw_cache(lm, text="A raw prompt cache made with mlx-lm alone."):
    ids = lm.tokenizer.encode(text)
    cache = make_prompt_cache(lm.model)
    lm.model(mx.array([ids]), cache=cache)
    mx.eval([c.state for c in cache])
    return cache, len(ids)


@pytest.mark.parametrize("as_file", [True, False])
def test_raw_mlx_lm_cache_restores_as_an_opaque_prefix(tiny, tmp_path, as_file):
    lm = tiny(arch="qwen3", tokenizer="bpe")
    cache, n = raw_cache(lm)
    source = cache
    if as_file:
        source = tmp_path / "raw.safetensors"
        save_prompt_cache(str(source), cache)
        assert chatkit.inspect_cache(source).kind == "mlx-lm"
    session = ChatSession.builder(lm).generate_params(PARAMS).cache(source).build()
    info = session.cache_info()
    assert info.tokens == info.opaque_tokens == n
    session.respond("Continue.")
    rendered = lm.tokenizer.encode(session.render("x"), add_special_tokens=False)
    stats = session.last_stats
    assert stats.reused_tokens == n, "the opaque prefix is kept and only the new messages are fed"
    assert stats.prompt_tokens == n + stats.prefilled_tokens
    assert_ledger_matches_cache(session)
    session.respond("More.")
    assert session.last_stats.reused_tokens > n
    assert len(rendered) > 0
    # Saving an opaque session keeps the prefix as opaque.
    path = tmp_path / "opaque.safetensors"
    session.save_cache(path)
    again = ChatSession.builder(lm).cache(path).build()
    assert again.cache_info().opaque_tokens == n and again.history == session.history


def test_raw_cache_of_another_model_is_refused_unless_not_verified(tiny, tmp_path):
    cache, _ = raw_cache(tiny(arch="gemma3_text", tokenizer="bpe"))
    with pytest.raises(IncompatibleCacheError, match="layer"):
        ChatSession.builder(tiny(arch="qwen3", tokenizer="bpe")).cache(cache).build()
    same_shapes, n = raw_cache(tiny(arch="qwen3", tokenizer="bpe", seed=1))
    session = ChatSession.builder(tiny(arch="qwen3", tokenizer="bpe")).cache(same_shapes, verify=False).build()
    assert session.cache_info().opaque_tokens == n


def test_chatkit_file_of_another_model_names_what_differs(tiny, tmp_path):
    path = tmp_path / "chat.safetensors"
    two_turns(tiny(arch="qwen3", tokenizer="bpe", seed=0)).save_cache(path)
    with pytest.raises(IncompatibleCacheError, match="weights"):
        ChatSession.builder(tiny(arch="qwen3", tokenizer="bpe", seed=1)).cache(path).build()
    with pytest.raises(IncompatibleCacheError, match="architecture.*vocabulary"):
        ChatSession.builder(tiny(arch="llama", tokenizer="spm")).cache(path).build()
    # verify=False skips the tensor checksums and the layer check, never the fingerprint.
    with pytest.raises(IncompatibleCacheError, match="architecture"):
        ChatSession.builder(tiny(arch="llama", tokenizer="spm")).cache(path, verify=False).build()
    assert len(ChatSession.builder(tiny(arch="qwen3", tokenizer="bpe")).cache(path, verify=False).build().history) == 4


def _write_bad_files(tmp_path, good):
    data = good.read_bytes()
    files = {
        "corrupt": os.urandom(4096),
        "truncated": data[: len(data) // 2],
        "empty": b"",
        "text": b"hello, this is not a cache\n" * 10,
        "header-only": data[:8],
    }
    paths = {}
    for name, content in files.items():
        paths[name] = tmp_path / f"{name}.safetensors"
        paths[name].write_bytes(content)
    paths["foreign"] = tmp_path / "weights.safetensors"
    mx.save_safetensors(str(paths["foreign"]), {"w": mx.zeros((4, 4))}, {"format": "mlx"})
    paths["missing"] = tmp_path / "nope.safetensors"
    paths["folder"] = tmp_path
    return paths


def test_bad_files_raise_cache_file_error_and_build_nothing(tiny, tmp_path, monkeypatch):
    lm = tiny()
    good = tmp_path / "good.safetensors"
    two_turns(lm).save_cache(good)
    monkeypatch.setattr(cache_file, "FORMAT_VERSION", 99)
    newer = tmp_path / "newer.safetensors"
    two_turns(lm).save_cache(newer)
    monkeypatch.undo()
    paths = _write_bad_files(tmp_path, good)
    paths["newer"] = newer
    for name, path in paths.items():
        with pytest.raises(CacheFileError) as err:
            ChatSession.builder(lm).cache(path).build()
        assert str(path) in str(err.value) or name == "folder", name
        with pytest.raises(CacheFileError):
            chatkit.inspect_cache(path)
    with pytest.raises(CacheFileError, match="newer chatkit"):
        chatkit.inspect_cache(newer)


def test_save_before_the_first_turn_or_while_streaming(tiny, tmp_path):
    session = session_for(tiny(), params=PARAMS)
    with pytest.raises(NoCacheAvailableError):
        session.save_cache(tmp_path / "x.safetensors")
    with session.stream_respond("Hi") as stream:
        next(stream)
        with pytest.raises(SessionBusyError):
            session.save_cache(tmp_path / "x.safetensors")
    session.release_cache()
    with pytest.raises(NoCacheAvailableError):
        session.save_cache(tmp_path / "x.safetensors")
    with pytest.raises(CacheFileError, match="folder"):
        run(session, "Again")
        session.save_cache(tmp_path)


@pytest.mark.parametrize("fail_in", ["write", "rename"])
def test_a_failed_write_leaves_the_previous_file_intact(tiny, tmp_path, monkeypatch, fail_in):
    lm = tiny()
    session = two_turns(lm)
    path = tmp_path / "chat.safetensors"
    session.save_cache(path)
    before = path.read_bytes()
    run(session, "One more turn so the file would change.")

    if fail_in == "write":
        real = cache_file.save_prompt_cache

        def half_then_crash(file_name, cache, metadata=None):
            real(file_name, cache, metadata)
            with open(file_name, "r+b") as f:
                f.truncate(100)
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(cache_file, "save_prompt_cache", half_then_crash)
    else:

        def refuse(src, dst):
            raise PermissionError(13, "Permission denied")

        monkeypatch.setattr(atomic.os, "replace", refuse)
    with pytest.raises(CacheFileError, match="intact"):
        session.save_cache(path)
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chat.safetensors"], "no temporary file left"
    restored = ChatSession.builder(lm).cache(path).build()
    assert len(restored.history) == 4


def test_a_restore_cannot_change_the_caches_kind(tiny, tmp_path):
    """A saved unbounded cache restored with max_kv_size would silently stay unbounded: refused."""
    lm = tiny()
    path = tmp_path / "chat.safetensors"
    two_turns(lm).save_cache(path)
    with pytest.raises(InvalidParamsError, match="max_kv_size"):
        ChatSession.builder(lm).cache(path).max_kv_size(64).build()
    assert len(ChatSession.builder(lm).cache(path).build().history) == 4  # as saved: fine

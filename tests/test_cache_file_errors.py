"""Saving and restoring cache files when something is wrong: every bad path, failed write, damaged or
forged file is a ``CacheFileError`` / ``IncompatibleCacheError`` naming the file, and nothing is lost."""

import errno
import fcntl
import io
import json
import os
import shutil
import sys

import chatkit
from chatkit import (
    CacheFileError,
    ChatSession,
    GenerateParams,
    IncompatibleCacheError,
    SessionPool,
    cli,
)
from chatkit.cache import atomic
from chatkit.cache import file as cache_file

import pytest
from conftest import session_for
from helpers.cachefiles import join, rewrite_meta, saved_chat, split, talk

PARAMS = GenerateParams(max_tokens=8)


@pytest.fixture(scope="module")
def saved(tiny, tmp_path_factory):
    return saved_chat(tiny, tmp_path_factory)


# -- saving: every file error a CacheFileError naming the path ---------------------------------------
def test_save_into_a_missing_folder_names_the_folder(tiny, tmp_path):
    session = talk(tiny())
    target = tmp_path / "no" / "such" / "chat.safetensors"
    with pytest.raises(CacheFileError, match="does not exist") as err:
        session.save_cache(target)
    assert str(target) in str(err.value) and "mkdir" in str(err.value)


def test_save_under_a_file_where_a_folder_should_be(tiny, tmp_path):
    session = talk(tiny())
    (tmp_path / "notes.txt").write_text("a file")
    target = tmp_path / "notes.txt" / "chat.safetensors"
    with pytest.raises(CacheFileError, match="not a folder") as err:
        session.save_cache(target)
    assert str(target) in str(err.value)


@pytest.mark.parametrize(
    "code,words",
    [(errno.EROFS, "read-only"), (errno.EACCES, "permission"), (errno.ENOSPC, "disk is full"),
     (errno.ENOENT, "does not exist")],
)
def test_creating_the_temporary_file_fails_with_a_cache_file_error(tiny, tmp_path, monkeypatch, code, words):
    # mkstemp used to run outside the error handling: these were bare OSErrors.
    session = talk(tiny())
    target = tmp_path / "chat.safetensors"

    def refuse(*args, **kwargs):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(atomic.tempfile, "mkstemp", refuse)
    with pytest.raises(CacheFileError, match=words) as err:
        session.save_cache(target)
    assert str(target) in str(err.value)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_save_into_a_read_only_folder(tiny, tmp_path):
    session = talk(tiny())
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o500)
    try:
        with pytest.raises(CacheFileError, match="permission"):
            session.save_cache(folder / "chat.safetensors")
    finally:
        folder.chmod(0o700)


def test_file_names_too_long_and_long_but_valid(tiny, tmp_path):
    session = talk(tiny())
    with pytest.raises(CacheFileError, match="too long"):
        session.save_cache(tmp_path / ("x" * 300 + ".safetensors"))
    # 240 bytes is a valid name; the temporary file's name must not push it over the limit.
    long = tmp_path / ("y" * 228 + ".safetensors")
    session.save_cache(long)
    assert len(ChatSession.builder(session.model).cache(long).build().history) == 4
    assert [p.name for p in tmp_path.iterdir()] == [long.name]


def test_a_trailing_slash_is_refused_not_written_as_a_file(tiny, tmp_path):
    session = talk(tiny())
    with pytest.raises(CacheFileError, match="separator"):
        session.save_cache(str(tmp_path / "chat.safetensors") + os.sep)
    assert list(tmp_path.iterdir()) == []


def test_a_name_mlx_cannot_read_back_is_refused(tiny, tmp_path):
    # MLX picks the loader by extension: a file saved as "chat.bin" could never be restored.
    session = talk(tiny())
    with pytest.raises(CacheFileError, match=r"chat\.bin\.safetensors"):
        session.save_cache(tmp_path / "chat.bin")
    assert list(tmp_path.iterdir()) == []


def test_save_through_a_symlink_keeps_the_link(tiny, tmp_path):
    session = talk(tiny())
    real = tmp_path / "real.safetensors"
    real.write_bytes(b"old")
    link = tmp_path / "link.safetensors"
    link.symlink_to(real)
    session.save_cache(link)
    assert link.is_symlink() and os.readlink(link) == str(real)
    assert len(ChatSession.builder(session.model).cache(real).build().history) == 4
    blob = tmp_path / "store" / "blob"  # a link with the right name to a file without the suffix
    blob.parent.mkdir()
    (tmp_path / "named.safetensors").symlink_to(blob)
    session.save_cache(tmp_path / "named.safetensors")
    assert blob.is_file() and len(ChatSession.builder(session.model).cache(tmp_path / "named.safetensors").build().history) == 4


def test_a_pipe_or_device_is_never_replaced(tiny, tmp_path):
    session = talk(tiny())
    fifo = tmp_path / "pipe.safetensors"
    os.mkfifo(fifo)
    with pytest.raises(CacheFileError, match="not a regular file"):
        session.save_cache(fifo)
    assert fifo.exists() and not fifo.is_file()
    with pytest.raises(CacheFileError, match="not a regular file"):
        chatkit.inspect_cache(fifo)  # reading it would block forever


def test_temporary_files_of_killed_saves_are_removed_live_ones_kept(tiny, tmp_path):
    session = talk(tiny())
    target = tmp_path / "chat.safetensors"
    stale = tmp_path / ".chat.safetensors.k1ll3d.tmp.safetensors"
    stale.write_bytes(b"half a file")
    live = tmp_path / ".chat.safetensors.wr1t1n.tmp.safetensors"
    live.write_bytes(b"being written")
    other = tmp_path / "keep.me"
    other.write_bytes(b"not ours")
    with open(live, "rb") as held:
        fcntl.flock(held.fileno(), fcntl.LOCK_EX)  # as a save in progress holds it
        session.save_cache(target)
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted([target.name, live.name, other.name])
    assert atomic.remove_stale_temps(tmp_path) == [live.name]


def test_a_failed_save_cleans_up_its_own_temporary_file(tiny, tmp_path, monkeypatch):
    session = talk(tiny())

    def crash(file_name, cache, metadata=None):
        with open(file_name, "wb") as f:
            f.write(b"partial")
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(cache_file, "save_prompt_cache", crash)
    with pytest.raises(CacheFileError, match="Input/output error"):
        session.save_cache(tmp_path / "chat.safetensors")
    assert list(tmp_path.iterdir()) == []


def test_pool_keeps_working_when_its_folder_is_gone(tiny, tmp_path):
    lm = tiny()
    folder = tmp_path / "pool"
    pool = SessionPool(lm, folder=folder, max_cache_bytes=1,
                       configure=lambda b: b.generate_params(PARAMS).instructions("Be brief."))
    first = pool.session("a").respond("My name is Ada.")
    pool.session("b").respond("Hello")  # evicts a: saved to the folder
    assert pool.evicted("a")
    shutil.rmtree(folder)
    # The folder is made again for the next eviction (b's); a's file is gone.
    assert pool.session("c").respond("Hi there") == talk(lm, turns=()).respond("Hi there")
    assert pool.evicted("b") and not pool.evicted("c")
    shutil.rmtree(folder)
    folder.write_text("now a file: every save fails")
    # Evicting c cannot save: the pool releases its cache anyway and nobody sees an error.
    d = pool.session("d")
    assert d.respond("Hey") == talk(lm, turns=()).respond("Hey")
    assert not pool.evicted("c") and pool.cache_bytes() == d.cache_info().nbytes  # c's memory was freed
    # a and b lost their files: they come back from their transcripts and answer as fresh sessions.
    for key, said in (("a", ["My name is Ada.", first]), ("b", None)):
        session = pool.session(key)
        if said:
            assert [m.content for m in session.history] == said
        expected = session_for(lm, params=PARAMS, history=session.history).respond("What is my name?")
        assert session.respond("What is my name?") == expected


# -- metadata schema: always a CacheFileError naming the file ---------------------------------------
def _deep(meta):
    meta["messages"] = json.loads("[" * 50 + "]" * 50)
    return "[" * 100_000 + "]" * 100_000


VARIANTS = {
    "messages-int": lambda m: {**m, "messages": 5},
    "messages-str": lambda m: {**m, "messages": "hello"},
    "messages-of-ints": lambda m: {**m, "messages": [5]},
    "message-bad-role": lambda m: {**m, "messages": [{"role": "wizard", "content": "x"}]},
    "message-no-content": lambda m: {**m, "messages": [{"role": "user"}]},
    "message-int-content": lambda m: {**m, "messages": [{"role": "user", "content": 5}]},
    "message-surrogate": lambda m: {**m, "messages": [{"role": "user", "content": "\ud800"}]},
    "message-extra-key": lambda m: {**m, "messages": [{"role": "user", "content": "x", "evil": 1}]},
    "message-int-name": lambda m: {**m, "messages": [{"role": "tool", "content": "x", "name": 3}]},
    "fingerprint-str": lambda m: {**m, "fingerprint": "abc"},
    "fingerprint-empty": lambda m: {**m, "fingerprint": {}},
    "fingerprint-ints": lambda m: {**m, "fingerprint": {"weights": 1}},
    "fingerprint-list": lambda m: {**m, "fingerprint": ["weights"]},
    "ledger-none": lambda m: {**m, "ledger": None},
    "ledger-list": lambda m: {**m, "ledger": [1, 2]},
    "ledger-tokens-str": lambda m: {**m, "ledger": {"tokens": "abc", "opaque": 0}},
    "ledger-tokens-float": lambda m: {**m, "ledger": {"tokens": [1.5], "opaque": 0}},
    "ledger-tokens-negative": lambda m: {**m, "ledger": {"tokens": [-1], "opaque": 0}},
    "ledger-tokens-bool": lambda m: {**m, "ledger": {"tokens": [True], "opaque": 0}},
    "ledger-tokens-huge": lambda m: {**m, "ledger": {"tokens": [2**70], "opaque": 0}},
    "ledger-opaque-negative": lambda m: {**m, "ledger": {**m["ledger"], "opaque": -1}},
    "ledger-opaque-str": lambda m: {**m, "ledger": {**m["ledger"], "opaque": "3"}},
    "ledger-missing": lambda m: {k: v for k, v in m.items() if k != "ledger"},
    "params-list": lambda m: {**m, "generate_params": [1, 2]},
    "params-str": lambda m: {**m, "generate_params": "greedy"},
    "params-temp-str": lambda m: {**m, "generate_params": {"temperature": "hot"}},
    "params-stop-int": lambda m: {**m, "generate_params": {"stop": 5}},
    "params-bias-list": lambda m: {**m, "generate_params": {"logit_bias": [1]}},
    "params-bias-key": lambda m: {**m, "generate_params": {"logit_bias": {"a": 1}}},
    "params-max-tokens-0": lambda m: {**m, "generate_params": {"max_tokens": 0}},
    "params-seed-negative": lambda m: {**m, "generate_params": {"seed": -1}},
    "options-list": lambda m: {**m, "cache_options": [1]},
    "options-size-str": lambda m: {**m, "cache_options": {"max_kv_size": "big"}},
    "options-bits-7": lambda m: {**m, "cache_options": {"kv_bits": 7}},
    "instructions-int": lambda m: {**m, "instructions": 5},
    "instructions-list": lambda m: {**m, "instructions": ["be", "brief"]},
    "classes-none": lambda m: {**m, "layer_classes": None},
    "classes-empty": lambda m: {**m, "layer_classes": []},
    "classes-too-many": lambda m: {**m, "layer_classes": ["KVCache"] * 99},
    "classes-wrong": lambda m: {**m, "layer_classes": ["RotatingKVCache"] * len(m["layer_classes"])},
    "checkpoints-str": lambda m: {**m, "checkpoints": "none"},
    "checkpoints-ints": lambda m: {**m, "checkpoints": [5]},
    "checkpoint-negative": lambda m: {**m, "checkpoints": [{"length": -1, "layers": []}]},
    "checkpoint-layer-99": lambda m: {**m, "checkpoints": [{"length": 0, "layers": [99]}]},
    "checkpoint-missing-copy": lambda m: {**m, "checkpoints": [{"length": 0, "layers": [0]}]},
    "version-str": lambda m: {**m, "format_version": "2"},
    "version-none": lambda m: {**m, "format_version": None},
    "version-0": lambda m: {**m, "format_version": 0},
    "version-bool": lambda m: {**m, "format_version": True},
    "saved-at-int": lambda m: {**m, "saved_at": 5},
    "mcp-servers-str": lambda m: {**m, "mcp_servers": "python server.py"},
    "mcp-server-both": lambda m: {**m, "mcp_servers": [{"command": ["a"], "url": "http://x"}]},
    "mcp-server-env": lambda m: {**m, "mcp_servers": [{"command": ["a"], "env": {"K": "v"}}]},
    "mcp-server-command-str": lambda m: {**m, "mcp_servers": [{"command": "a b"}]},
    "settings-list": lambda m: {**m, "settings": ["manual"]},
    "settings-template-int": lambda m: {**m, "settings": {"chat_template": 5}},
    "settings-kv-bytes-str": lambda m: {**m, "settings": {"max_kv_bytes": "1GB"}},
    "settings-kv-bytes-0": lambda m: {**m, "settings": {"max_kv_bytes": 0}},
    "settings-special-str": lambda m: {**m, "settings": {"allow_special_in_content": "yes"}},
    "checksum-none": lambda m: {**m, "checksum": None},
    "checksum-md5": lambda m: {**m, "checksum": {"algorithm": "md5", "state": {}}},
    "meta-list": lambda m: [m],
    "meta-int": lambda m: 5,
    "meta-not-json": lambda m: "{not json",
    "meta-deeply-nested": _deep,
}


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_metadata_with_wrong_types_is_a_cache_file_error_naming_the_file(saved, tmp_path, name):
    lm, good = saved
    path = tmp_path / f"{name}.safetensors"
    rewrite_meta(good, path, VARIANTS[name])
    for attempt in (lambda: chatkit.inspect_cache(path), lambda: ChatSession.builder(lm).cache(path).build()):
        with pytest.raises(CacheFileError) as err:
            attempt()
        assert str(path) in str(err.value)
    errs = io.StringIO()
    sys_stderr, sys.stderr = sys.stderr, errs
    try:
        assert cli.main(["inspect", str(path)]) == 1  # a message, not a traceback
    finally:
        sys.stderr = sys_stderr
    assert str(path) in errs.getvalue() and "Traceback" not in errs.getvalue()


def test_edited_metadata_without_a_new_checksum_is_refused(saved, tmp_path):
    lm, good = saved
    path = tmp_path / "edited.safetensors"

    def rename(meta):
        meta["messages"][0]["content"] = meta["messages"][0]["content"].replace("Ada", "Eve")
        return meta

    rewrite_meta(good, path, rename, fix_checksum=False)
    with pytest.raises(CacheFileError, match="checksum"):
        ChatSession.builder(lm).cache(path).build()


def test_a_newer_format_asks_for_an_upgrade(saved, tmp_path):
    lm, good = saved
    path = tmp_path / "newer.safetensors"
    rewrite_meta(good, path, lambda m: {**m, "format_version": cache_file.FORMAT_VERSION + 1})
    with pytest.raises(CacheFileError, match="newer chatkit"):
        ChatSession.builder(lm).cache(path).build()


def test_a_format_1_file_without_checksums_still_loads(saved, tmp_path):
    lm, good = saved
    path = tmp_path / "v1.safetensors"
    rewrite_meta(good, path, lambda m: {k: v for k, v in {**m, "format_version": 1}.items() if k != "checksum"})
    assert ChatSession.builder(lm).cache(path).build().history == ChatSession.builder(lm).cache(good).build().history


def test_hostile_header_indices_are_refused_before_mlx_reads_them(saved, tmp_path):
    # mlx-lm rebuilds lists from dotted names: "1.999999999" would allocate a billion-entry list.
    lm, good = saved
    header, body = split(good)
    header["__metadata__"]["1.999999999"] = "KVCache"
    path = tmp_path / "huge-index.safetensors"
    join(path, header, body)
    with pytest.raises(CacheFileError, match="not a valid cache file"):
        ChatSession.builder(lm).cache(path).build()


# -- checksums of the tensors -------------------------------------------------------------------------
def test_a_flipped_byte_in_the_tensors_is_detected_unless_not_verified(saved, tmp_path):
    lm, good = saved
    data = bytearray(good.read_bytes())
    data[-100] ^= 0x40  # inside the last tensor's data: still a perfectly well-formed file
    path = tmp_path / "flipped.safetensors"
    path.write_bytes(bytes(data))
    with pytest.raises(CacheFileError, match="checksum") as err:
        ChatSession.builder(lm).cache(path).build()
    assert str(path) in str(err.value)
    assert len(ChatSession.builder(lm).cache(path, verify=False).build().history) == 4


# -- a fingerprint edited to match another model --------------------------------------------------
@pytest.mark.parametrize(
    "arch,tok,other",
    [
        ("qwen3", "bpe", {"num_key_value_heads": 1}),
        ("qwen3", "bpe", {"head_dim": 32}),
        ("qwen3", "bpe", {"num_hidden_layers": 3}),
        ("qwen3_5", "bpe-think", {"linear_conv_kernel_dim": 3}),  # ArraysCache state shapes
    ],
)
def test_a_forged_fingerprint_is_caught_by_the_layers(tiny, tmp_path, arch, tok, other):
    source, target = tiny(arch=arch, tokenizer=tok), tiny(arch=arch, tokenizer=tok, **other)
    good = tmp_path / "good.safetensors"
    talk(source).save_cache(good)
    forged = tmp_path / "forged.safetensors"
    rewrite_meta(good, forged, lambda m: {**m, "fingerprint": dict(target.fingerprint)})
    with pytest.raises(IncompatibleCacheError, match="does not fit this model") as err:
        ChatSession.builder(target).cache(forged).build()
    assert str(forged) in str(err.value)
    # A live session asked to restore it (as SessionPool does) refuses and keeps its own state.
    live = talk(target)
    history, info = live.history, live.cache_info()
    with pytest.raises(IncompatibleCacheError):
        live.restore_cache(forged)
    assert live.history == history and live.cache_info() == info
    assert live.respond("And now?") == session_for(target, params=PARAMS, history=history).respond("And now?")



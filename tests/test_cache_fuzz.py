"""Fuzzing cache files: whatever happens to a file, restoring it raises CacheFileError or
IncompatibleCacheError (or, for a change that alters nothing chatkit reads, restores the same
conversation), and a live session asked to restore it is left as it was."""

import random
import signal
import subprocess
import sys
import textwrap
import time

from chatkit import CacheFileError, ChatSession, GenerateParams, IncompatibleCacheError

import mlx.core as mx
import pytest
from conftest import cache_state, session_for
from helpers.cachefiles import regions, rewrite_meta
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx.utils import tree_flatten

PARAMS = GenerateParams(max_tokens=8)
REFUSED = (CacheFileError, IncompatibleCacheError)


def state_of(session):
    """Everything a restore could change, as plain data."""
    cache = cache_state(session)
    layers = [] if cache.layers is None else [
        [(k, v.tolist() if isinstance(v, mx.array) else v) for k, v in tree_flatten(c.state)] for c in cache.layers
    ]
    return session.history, session.instructions, cache.ledger, layers, len(cache.checkpoints)


@pytest.fixture(scope="module", params=[("qwen3", "bpe"), ("qwen3_5", "bpe-think")], ids=["kv", "hybrid"])
def setup(request, tiny, tmp_path_factory):
    """A good file (the hybrid one holds checkpoint copies), the model, the file's restored state,
    and a live session of the same model with a conversation of its own."""
    arch, tok = request.param
    lm = tiny(arch=arch, tokenizer=tok)
    folder = tmp_path_factory.mktemp("fuzz")
    good = folder / "good.safetensors"
    talker = session_for(lm, params=PARAMS)
    for prompt in ("My name is Ada.", "What is my name?"):
        talker.respond(prompt)
    talker.undo()  # the hybrid cache goes back to a checkpoint, which the file then holds
    talker.respond("Where do I live?")
    talker.save_cache(good)
    expected = state_of(ChatSession.builder(lm).cache(good).build())
    live = session_for(lm, params=PARAMS)
    live.respond("Hello there.")
    return lm, good, expected, live, folder


def check(setup, data: bytes, name: str = "bad.safetensors") -> None:
    """Restore ``data`` through the builder: refused, or exactly the good file's conversation. When
    refused, a live session asked to restore it (as SessionPool does) refuses too and is unchanged."""
    lm, good, expected, live, folder = setup
    path = folder / name
    path.write_bytes(data)
    try:
        restored = ChatSession.builder(lm).cache(path).build()
    except REFUSED as exc:
        assert str(path) in str(exc)
    else:
        assert state_of(restored) == expected, "a damaged file restored a different conversation"
        return
    before = state_of(live)
    with pytest.raises(REFUSED):
        live.restore_cache(path)
    assert state_of(live) == before, "a refused restore changed the live session"


def test_truncation_at_every_region_boundary(setup):
    lm, good, *_ = setup
    data = good.read_bytes()
    cuts = sorted({max(0, min(len(data) - 1, b + d)) for _, start, stop in regions(good)
                   for b in (start, stop) for d in (-1, 0, 1)})
    assert len(cuts) > 10
    for cut in cuts:
        with pytest.raises(CacheFileError):
            ChatSession.builder(lm).cache(_write(setup, data[:cut])).build()
        check(setup, data[:cut])


def _write(setup, data):
    path = setup[4] / "t.safetensors"
    path.write_bytes(data)
    return path


@pytest.mark.slow
def test_a_flipped_byte_in_every_region(setup):
    _, good, *_ = setup
    data = good.read_bytes()
    for _, start, stop in regions(good):
        if stop == start:
            continue  # an empty tensor (a None in a layer's state)
        for at in sorted({start, (start + stop) // 2, stop - 1}):
            for mask in (0x01, 0x80):
                flipped = bytearray(data)
                flipped[at] ^= mask
                check(setup, bytes(flipped))


@pytest.mark.slow
@settings(max_examples=150)
@given(data=st.data())
def test_flipped_bytes_anywhere(setup, data):
    _, good, *_ = setup
    raw = bytearray(good.read_bytes())
    n = int.from_bytes(raw[:8], "little")
    # Half of the flips in the header (small, where structure lives), half anywhere.
    where = data.draw(st.one_of(st.integers(0, 8 + n - 1), st.integers(0, len(raw) - 1)))
    for _ in range(data.draw(st.integers(1, 3))):
        raw[where] ^= data.draw(st.integers(1, 255))
        where = data.draw(st.integers(0, len(raw) - 1))
    check(setup, bytes(raw))


def test_foreign_model_foreign_template_edited_metadata_wrong_version(setup, tiny):
    lm, good, _, live, folder = setup
    before = state_of(live)
    arch = type(lm.model).__module__.rsplit(".", 1)[-1]
    other = tiny(arch=arch, tokenizer="bpe-think" if arch == "qwen3_5" else "bpe", seed=1)
    with pytest.raises(IncompatibleCacheError, match="weights"):
        ChatSession.builder(other).cache(good).build()
    cases = {
        "template.safetensors": (lambda m: {**m, "fingerprint": {**m["fingerprint"], "chat_template": "0" * 16}},
                                 True, IncompatibleCacheError, "chat_template"),
        "edited.safetensors": (lambda m: {**m, "instructions": "Obey the file."}, False, CacheFileError, "checksum"),
        "version.safetensors": (lambda m: {**m, "format_version": 99}, True, CacheFileError, "newer chatkit"),
        "old-version.safetensors": (lambda m: {**m, "format_version": 0}, True, CacheFileError, "format_version"),
    }
    for name, (edit, fix, error, words) in cases.items():
        rewrite_meta(good, folder / name, edit, fix_checksum=fix)
        with pytest.raises(error, match=words):
            ChatSession.builder(lm).cache(folder / name).build()
        with pytest.raises(error, match=words):
            live.restore_cache(folder / name)
        assert state_of(live) == before
    # Still the live session it was: it answers as a fresh session with its history.
    fresh = session_for(lm, params=PARAMS, history=live.history)
    assert live.respond("And now?") == fresh.respond("And now?")


KILLER = textwrap.dedent(
    """
    import sys
    from chatkit import ChatSession, GenerateParams
    from chatkit.testing import tiny_model
    lm = tiny_model("qwen3", "bpe", 0, num_hidden_layers=8)  # 8 layers: saves of ~3 MB
    path = sys.argv[1]
    sessions = []
    for name in ("Ada", "Bob"):
        history = [{"role": "user", "content": f"My name is {name}. " * 40}, {"role": "assistant", "content": "Hi."}]
        s = ChatSession.builder(lm).history(history).generate_params(GenerateParams(max_tokens=2)).build()
        s.respond("What is my name?")
        sessions.append(s)
    sys.stdin.readline()  # loaded: wait for the previous child to be killed
    sessions[0].save_cache(path)
    print("ready", flush=True)
    i = 0
    while True:  # nothing but saves: a kill lands inside one
        sessions[i % 2].save_cache(path)
        i += 1
    """
)


@pytest.mark.slow
def test_kill_9_during_repeated_saves_never_loses_the_previous_file(tmp_path):
    from chatkit.testing import tiny_model

    lm = tiny_model("qwen3", "bpe", 0, num_hidden_layers=8)
    path = tmp_path / "chat.safetensors"
    rng = random.Random(19)
    names, stale = set(), 0

    def spawn():
        return subprocess.Popen([sys.executable, "-c", KILLER, str(path)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True)

    def temps():
        return sorted(p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp.safetensors"))

    following = spawn()
    for round in range(20):
        child, following = following, None
        left = temps()
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "ready"
        assert not set(left) & set(temps()), "the next save removes what killed saves left"
        if round < 19:
            following = spawn()  # loads while this one saves
        time.sleep(rng.uniform(0.0, 0.3))
        child.send_signal(signal.SIGKILL)
        child.wait()
        child.stdout.close()
        child.stdin.close()
        stale += len(temps())
        session = ChatSession.builder(lm).cache(path).build()  # the previous file always loads
        names.add(session.history[0].content)
        assert len(session.history) == 4
    assert names <= {"My name is Ada. " * 40, "My name is Bob. " * 40}
    session.save_cache(path)
    assert [p.name for p in tmp_path.iterdir()] == ["chat.safetensors"]
    print(f"\n20 kills: {stale} left a temporary file (removed by the next save); every time the file loaded")

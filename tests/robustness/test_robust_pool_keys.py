"""SessionPool keys and files (issue 33, item 1 and the temporary files of killed saves): any str key
names a safe file, and one key never breaks the pool for the others."""

import hashlib
import os

from chatkit import GenerateParams, InvalidParamsError, SessionPool
from chatkit.cache import atomic

import pytest
from conftest import session_for

PARAMS = GenerateParams(max_tokens=6)
KEYS = ["x\udcff", "\ud800", "../../etc/passwd", "a/b", "nul\x00here", "ü" * 300, " ", "." ]


def pool_of(lm, folder, budget=1):
    return SessionPool(lm, folder=folder, max_cache_bytes=budget,
                       configure=lambda b: b.generate_params(PARAMS).instructions("Be brief."))


def test_keys_that_cannot_name_a_file_never_poison_the_pool(tiny, tmp_path):
    lm = tiny()
    folder = tmp_path / "pool"
    pool = pool_of(lm, folder)
    said = {}
    for key in KEYS:
        said[key] = pool.session(key).respond("My name is Ada.")  # evicts the key before it
    pool.session("y").respond("Hello")  # evicts the last bad key: its cache is saved like any other
    assert pool.cache_bytes() == pool.session("y").cache_info().nbytes  # the budget still holds
    names = sorted(os.listdir(folder))
    assert len(names) == len(KEYS) and all(n.endswith(".safetensors") and n.isascii() for n in names)
    for key in KEYS:
        path = pool.path(key)
        assert path.parent == folder and path.name in names
        assert pool.evicted(key)
        session = pool.session(key)  # its cache comes back from its file
        assert not pool.evicted(key) and session.cache_info().tokens > 0
        assert [m.content for m in session.history] == ["My name is Ada.", said[key]]
        expected = session_for(lm, params=PARAMS, history=session.history).respond("And now?")
        assert session.respond("And now?") == expected
    for key in KEYS:
        pool.remove(key)
        assert key not in pool and not pool.path(key).exists()
    assert sorted(os.listdir(folder)) == [pool.path("y").name]


def test_key_files_keep_their_names_for_files_saved_before(tiny, tmp_path):
    # The server's keys are hex digests: their files, saved by earlier versions, must still be found.
    pool = pool_of(tiny(), tmp_path)
    for key in ("abc", "0" * 64, "ü"):
        assert pool.path(key) == tmp_path / f"{hashlib.sha256(key.encode('utf-8')).hexdigest()[:32]}.safetensors"
    assert pool.path("\ud800") != pool.path("\udcff") != pool.path("?")


@pytest.mark.parametrize("key", ["", 5, None, b"bytes", ("a",)])
def test_keys_that_are_not_strings_are_refused_everywhere(tiny, tmp_path, key):
    pool = pool_of(tiny(), tmp_path)
    pool.session("ok")
    for call in (pool.session, pool.path, pool.remove, lambda k: pool.add(k, pool.get("ok"))):
        with pytest.raises(InvalidParamsError, match="session key"):
            call(key)
    assert list(pool) == ["ok"] and pool.session("ok").respond("Hi")


def test_stale_temporary_files_are_removed_at_pool_start_and_at_the_next_save(tiny, tmp_path):
    lm = tiny()
    folder = tmp_path / "pool"
    pool = pool_of(lm, folder, budget=10**12)
    pool.session("a").respond("Hi")
    target = pool.path("a")
    # What a save killed mid-write leaves: a temporary file next to the target, unlocked.
    stale = folder / f".{target.name}.killed{atomic.TEMP_SUFFIX}"
    stale.write_bytes(b"half a file")
    other = folder / f".{pool.path('b').name}.killed{atomic.TEMP_SUFFIX}"
    other.write_bytes(b"half another")
    pool.session("a").save_cache(target)  # the next save to the same path removes its leftovers
    assert not stale.exists() and other.exists() and target.exists()
    pool_of(lm, folder)  # a pool starting over the folder removes every leftover
    assert not other.exists() and target.exists()


def test_a_session_whose_settings_cannot_be_saved_is_still_evicted(tiny, tmp_path):
    # GenerateParams are mutable: a setting made invalid after the last turn makes its save fail;
    # the pool must still free that cache (the transcript rebuilds it), or the budget stops holding.
    lm = tiny()
    pool = pool_of(lm, tmp_path)
    pool.session("a").respond("Hi")
    pool.session("a").generate_params.temperature = -1.0
    pool.session("b").respond("Hello")
    assert pool.cache_bytes() == pool.session("b").cache_info().nbytes
    assert not pool.evicted("a") and pool.session("a").cache_info().tokens == 0

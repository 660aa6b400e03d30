"""Cache files forged with valid checksums (issue 33, item 4): a layer's state that disagrees with its
tensors (an offset past the buffers, a rotating window's fields out of range, quantization MLX does not
take), checkpoints that cannot be what they claim, an absurd ledger: each is a ``CacheFileError`` naming
the file and the problem when the file is read (also with ``verify=False``), never a failure mid-turn,
and nothing changes; a window of another size than the model's is an ``IncompatibleCacheError``. Every
genuine file (plain, quantized, rotating and wrapped, sliding-window, hybrid with checkpoint copies,
raw mlx-lm caches with unused buffer space) still loads and answers."""

import hashlib

import chatkit
from chatkit import CacheFileError, ChatSession, GenerateParams, IncompatibleCacheError
from chatkit.cache import file as cache_file
from chatkit.cache._mlx import cut_to_offset, state_problem

import mlx.core as mx
import pytest
from conftest import cache_state
from helpers.cachefiles import rewrite_meta, rewrite_state
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx.utils import tree_flatten
from mlx_lm.models.cache import (
    ChunkedKVCache,
    ConcatenateKVCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    make_prompt_cache,
    save_prompt_cache,
)

PARAMS = GenerateParams(max_tokens=6)
REFUSED = (CacheFileError, IncompatibleCacheError)

# name: (arch, tokenizer, cache options); every session talks twice, so rotating caches wrap.
GENUINE = {
    "kv": ("qwen3", "bpe", {}),
    "quantized": ("qwen3", "bpe", {"kv_bits": (4, 64)}),
    "quantized-8-32": ("qwen3", "bpe", {"kv_bits": (8, 32)}),
    "rotating": ("qwen3", "bpe", {"max_kv_size": 16}),
    "sliding": ("gemma3_text", "bpe", {}),
    "hybrid": ("qwen3_5", "bpe-think", {}),
}


def build(lm, options, **more):
    builder = ChatSession.builder(lm).generate_params(PARAMS).instructions("Be brief.")
    if "kv_bits" in options:
        bits, group = options["kv_bits"]
        builder = builder.kv_bits(bits, group_size=group)
    if "max_kv_size" in options:
        builder = builder.max_kv_size(options["max_kv_size"])
    for name, value in more.items():
        builder = getattr(builder, name)(value)
    return builder.build()


@pytest.fixture(scope="module")
def genuine(tiny, tmp_path_factory):
    """name -> (model, options, a good file of a two-turn conversation), built on first use."""
    folder, made = tmp_path_factory.mktemp("genuine"), {}

    def get(name):
        if name not in made:
            arch, tok, options = GENUINE[name]
            lm = tiny(arch=arch, tokenizer=tok)
            session = build(lm, options)
            for prompt in ("My name is Ada.", "What is my name?"):
                session.respond(prompt)
            path = folder / f"{name}.safetensors"
            session.save_cache(path)
            made[name] = lm, options, path
        return made[name]

    return get


def state_of(session):
    """Everything a restore could change, as plain data."""
    cache = cache_state(session)
    layers = [] if cache.layers is None else [
        [(k, v.tolist() if isinstance(v, mx.array) else v) for k, v in tree_flatten(c.state)] for c in cache.layers
    ]
    return session.history, cache.ledger, layers, len(cache.checkpoints)


def assert_refused(lm, options, path, error, words):
    """Refused by the builder (with and without verification where the error is the file's) and by
    a live session, which keeps its state and goes on; the file is not touched."""
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    for verify in (True, False) if error is CacheFileError else (True,):
        with pytest.raises(error, match=words) as err:
            ChatSession.builder(lm).cache(path, verify=verify).build()
        assert str(path) in str(err.value)
    live = build(lm, options)
    live.respond("Hello there.")
    before = state_of(live)
    with pytest.raises(error, match=words):
        live.restore_cache(path)
    assert state_of(live) == before
    live.respond("And now?")  # still usable (the state above is what a turn starts from)
    assert hashlib.sha256(path.read_bytes()).hexdigest() == digest


def layers_of(kind):
    """An edit of every main cache entry of class ``kind`` (checkpoint copies left alone)."""
    def edit(change):
        def run(layers, meta):
            for c in layers[: len(meta["layer_classes"])]:
                if isinstance(c, kind):
                    change(c)
        return run
    return edit


def moved(by):
    """Every main entry's offset and the ledger moved by ``by`` tokens, consistently: only the
    entries' own buffers say that it cannot be."""
    def run(layers, meta):
        for c in layers[: len(meta["layer_classes"])]:
            c.offset += by
        meta["ledger"]["opaque"] += by
    return run


def _reshape_keys(c):
    c.keys = c.keys.reshape(2, 1, *c.keys.shape[2:])


def _swap_copy_class(layers, meta):
    # The hybrid file's first copy stands for ArraysCache layer 0: put a KVCache (layer 1's) there.
    n = len(meta["layer_classes"])
    layers[n] = KVCache.from_state(layers[1].state)


KV, QUANTIZED, ROTATING = layers_of(KVCache), layers_of(QuantizedKVCache), layers_of(RotatingKVCache)

# name: (genuine file, edit of the entries or None, edit of the metadata or None, error, words)
FORGED = {
    "kv-offset-past-buffers": ("kv", moved(100), None, CacheFileError, r"counts (\d+) tokens in buffers of (?!\1)\d+\b"),
    "kv-offset-negative": ("kv", KV(lambda c: setattr(c, "offset", -1)), None, CacheFileError, "counts -1 tokens"),
    "kv-offset-float": ("kv", KV(lambda c: setattr(c, "offset", 59.0)), None, CacheFileError, "offset 59.0, not an int"),
    "kv-int-keys": ("kv", KV(lambda c: setattr(c, "keys", c.keys.astype(mx.int32))), None, CacheFileError,
                    "not floats"),
    "kv-batch-of-two": ("kv", KV(_reshape_keys), None, CacheFileError, "not one sequence's buffers"),
    "kv-no-values": ("kv", KV(lambda c: setattr(c, "values", None)), None, CacheFileError, "not arrays"),
    "quantized-bits-7": ("quantized", QUANTIZED(lambda c: setattr(c, "bits", 7)), None, CacheFileError,
                         "bits=7, group_size=64, which MLX does not take"),
    "quantized-group-48": ("quantized", QUANTIZED(lambda c: setattr(c, "group_size", 48)), None, CacheFileError,
                           "which MLX does not take"),
    "quantized-bits-8-on-4-bit-buffers": ("quantized", QUANTIZED(lambda c: setattr(c, "bits", 8)), None,
                                          CacheFileError, "do not fit bits=8 and group_size=64"),
    "quantized-group-32-on-64": ("quantized", QUANTIZED(lambda c: setattr(c, "group_size", 32)), None,
                                 CacheFileError, "do not fit bits=4 and group_size=32"),
    "quantized-no-biases": ("quantized", QUANTIZED(lambda c: setattr(c, "keys", c.keys[:2])), None, CacheFileError,
                            r"not \(packed, scales, biases\)"),
    "quantized-offset-past-buffers": ("quantized", moved(100), None, CacheFileError, r"counts \d+ tokens in buffers of \d+"),
    "rotating-keep-all": ("rotating", ROTATING(lambda c: setattr(c, "keep", 16)), None, CacheFileError,
                          "keeps 16 tokens of a window of 16"),
    "rotating-keep-negative": ("rotating", ROTATING(lambda c: setattr(c, "keep", -1)), None, CacheFileError,
                               "keeps -1 tokens"),
    "rotating-write-past-window": ("rotating", ROTATING(lambda c: setattr(c, "_idx", 40)), None, CacheFileError,
                                   "write position 40"),
    "rotating-write-negative": ("rotating", ROTATING(lambda c: setattr(c, "_idx", -3)), None, CacheFileError,
                                "write position -3"),
    "rotating-window-smaller-than-buffers": ("rotating", ROTATING(lambda c: setattr(c, "max_size", 8)), None,
                                             CacheFileError, "a window of 8 keeping 4 cannot hold"),
    "rotating-window-larger-than-buffers": ("rotating", ROTATING(lambda c: setattr(c, "max_size", 1000)), None,
                                            CacheFileError, "a window of 1000"),
    "sliding-offset-in-window": ("sliding", ROTATING(lambda c: setattr(c, "offset", 20)), None, CacheFileError,
                                 r"has offset 20, write position \d+ and a buffer of 32 tokens"),
    "sliding-idx-str": ("sliding", ROTATING(lambda c: setattr(c, "_idx", "9")), None, CacheFileError,
                        "has _idx '9', not an int"),
    "hybrid-state-of-a-batch": ("hybrid", lambda layers, meta: setattr(layers[0], "lengths", mx.array([3])), None,
                                CacheFileError, "a batch's padding"),
    "hybrid-state-not-arrays": ("hybrid", lambda layers, meta: setattr(layers[0], "cache", [1.5, None]), None,
                                CacheFileError, "not one sequence's"),
    "copy-of-another-class": ("hybrid", _swap_copy_class, None, CacheFileError,
                              r"checkpoint metadata \(a KVCache stands for layer 0, which is of class ArraysCache\)"),
}

# name: (genuine file, edit of the metadata, error, words): the metadata alone, its checksum recomputed.
FORGED_META = {
    "checkpoint-at-the-wrong-offset": (
        "sliding", lambda m: {**m, "checkpoints": [{**m["checkpoints"][0], "length": 24}, *m["checkpoints"][1:]]},
        CacheFileError, "the copy of layer 0 holds 25 tokens, its checkpoint 24"),
    "checkpoint-lengths-falling": (
        "hybrid", lambda m: {**m, "checkpoints": m["checkpoints"][::-1]}, CacheFileError, "lengths rise"),
    "checkpoint-lengths-equal": (
        "hybrid", lambda m: {**m, "checkpoints": [{**cp, "length": 25} for cp in m["checkpoints"]]},
        CacheFileError, "lengths rise"),
    "ledger-of-2-31-tokens": (
        "kv", lambda m: {**m, "ledger": {**m["ledger"], "opaque": 2**31 - len(m["ledger"]["tokens"])}},
        CacheFileError, "ledger of 2147483648 tokens, more than any cache holds"),
}


@pytest.mark.parametrize("name", sorted(FORGED))
def test_a_forged_state_is_refused_when_the_file_is_read(genuine, tmp_path, name):
    source, edit_layers, edit_meta, error, words = FORGED[name]
    lm, options, good = genuine(source)
    path = tmp_path / f"{name}.safetensors"
    rewrite_state(good, path, edit_layers, edit_meta)
    assert_refused(lm, options, path, error, words)


@pytest.mark.parametrize("name", sorted(FORGED_META))
def test_forged_checkpoints_and_ledgers_are_refused(genuine, tmp_path, name):
    source, edit, error, words = FORGED_META[name]
    lm, options, good = genuine(source)
    path = tmp_path / f"{name}.safetensors"
    rewrite_meta(good, path, edit)
    assert_refused(lm, options, path, error, words)
    if name.startswith("ledger"):
        with pytest.raises(CacheFileError, match=words):
            chatkit.inspect_cache(path)  # the header alone shows it


def _not_full(tiny, tmp_path, arch, options):
    """A file whose rotating layers have not wrapped (one short turn)."""
    lm = tiny(arch=arch, tokenizer="bpe")
    session = build(lm, options, generate_params=GenerateParams(max_tokens=2))
    session.respond("Hi")
    path = tmp_path / "short.safetensors"
    session.save_cache(path)
    return lm, path


@pytest.mark.parametrize(
    "arch,options,field,value,words",
    [
        ("gemma3_text", {}, "max_size", 64, r"of 64 tokens keeping the first 0, the model's of 32 keeping 0"),
        ("gemma3_text", {}, "keep", 4, r"of 32 tokens keeping the first 4, the model's of 32 keeping 0"),
        ("qwen3", {"max_kv_size": 64}, "max_size", 32, r"of 32 tokens keeping the first 4, the model's of 64 keeping 4"),
    ],
)
def test_a_window_of_another_size_than_the_models_is_incompatible(tiny, tmp_path, arch, options, field, value, words):
    lm, good = _not_full(tiny, tmp_path, arch, options)
    path = tmp_path / "window.safetensors"
    rewrite_state(good, path, layers_of(RotatingKVCache)(lambda c: setattr(c, field, value)))
    assert_refused(lm, options, path, IncompatibleCacheError, "does not fit this model: layer 0 is a window " + words)


@pytest.mark.parametrize("name", sorted(GENUINE))
def test_every_genuine_file_loads_and_answers(genuine, name):
    lm, options, path = genuine(name)
    expected = build(lm, options, cache=path).respond("Where do I live?")
    for verify in (True, False):
        restored = ChatSession.builder(lm).cache(path, verify=verify).build()
        assert restored.respond("Where do I live?") == expected
    live = build(lm, options, history=restored.history[:4])  # the conversation the file was saved from
    live.restore_cache(path)
    live.undo()  # back to a checkpoint, where the file has them
    live.respond("Where do I live?")


def test_a_rotating_cache_just_after_a_prompt_longer_than_its_window_loads(tiny, tmp_path):
    # A multi-token step leaves more than the window in the buffer (mlx-lm trims it at the next token).
    lm = tiny()
    layers = make_prompt_cache(lm.model, max_kv_size=16)
    lm.model(mx.array([list(range(5, 45))]), cache=layers)
    assert layers[0].keys.shape[2] == layers[0]._idx == layers[0].offset == 40
    session = ChatSession.builder(lm).max_kv_size(16).cache(layers, verify=False).build()
    path = tmp_path / "step.safetensors"
    session.save_cache(path)
    restored = ChatSession.builder(lm).cache(path).build()
    assert restored.cache_info().tokens == 16 and cache_state(restored).layers[0].keys.shape[2] == 40
    restored.respond("Where do I live?")


@pytest.mark.parametrize("max_kv_size", [None, 16])
def test_raw_mlx_lm_caches_with_unused_buffer_space_load(tiny, tmp_path, max_kv_size):
    # (A raw file has no cache options: a rotating one is taken only unverified.)
    lm = tiny()
    cache = make_prompt_cache(lm.model, max_kv_size=max_kv_size)
    lm.model(mx.array([list(range(5, 45))]), cache=cache)
    for _ in range(3):
        lm.model(mx.array([[7]]), cache=cache)
    mx.eval([c.state for c in cache])
    assert cache[0].keys.shape[2] == (256 if max_kv_size is None else 16)  # not cut to the offset
    path = tmp_path / "raw.safetensors"
    save_prompt_cache(str(path), cache)
    session = ChatSession.builder(lm).cache(path, verify=max_kv_size is None).build()
    assert session.cache_info().opaque_tokens == 43
    session.respond("Hello")


def _offsets(layers, meta, offset, idx, keep):
    """Every main rotating entry at ``offset`` / ``idx`` / ``keep``, the ledger as long as the offset."""
    n = len(meta["layer_classes"])
    del layers[n:]
    meta["checkpoints"] = []
    for c in layers:
        c.offset, c._idx, c.keep = offset, idx, keep
    tokens = meta["ledger"]["tokens"]
    meta["ledger"] = {"tokens": tokens[:offset], "opaque": max(0, offset - len(tokens))}


@pytest.mark.slow
@settings(max_examples=60)
@given(offset=st.integers(0, 90), idx=st.integers(-2, 20), keep=st.integers(-1, 17))
def test_any_forged_rotating_offsets_are_refused_or_answer(genuine, tmp_path, offset, idx, keep):
    # Whatever the fields say, a file that loads runs its next turns: nothing fails inside MLX. Unverified
    # (no check against the model): the state checks alone must hold.
    lm, options, good = genuine("rotating")
    path = tmp_path / "random.safetensors"
    rewrite_state(good, path, lambda layers, meta: _offsets(layers, meta, offset, idx, keep))
    try:
        session = ChatSession.builder(lm).cache(path, verify=False).build()
    except CacheFileError as exc:
        assert str(path) in str(exc)
        return
    session.respond("And now?")
    session.respond("Once more?")


@settings(max_examples=25)
@given(delta=st.integers(-80, 300))
def test_any_forged_kv_offset_is_refused_or_answers(genuine, tmp_path, delta):
    lm, options, good = genuine("kv")
    path = tmp_path / "random.safetensors"

    def edit(layers, meta):
        for c in layers:
            c.offset += delta
        tokens = meta["ledger"]["tokens"]
        n = len(tokens) + delta
        meta["ledger"] = {"tokens": tokens[: max(n, 0)], "opaque": max(0, n - len(tokens))}

    rewrite_state(good, path, edit)
    try:
        session = ChatSession.builder(lm).cache(path).build()
    except REFUSED as exc:
        assert str(path) in str(exc)
        assert delta < -59 or delta > 0  # only offsets the buffers cannot hold
        return
    session.respond("And now?")


def test_a_class_without_a_state_check_is_refused(genuine):
    assert state_problem(object()) == "is of a class chatkit does not restore"
    lm, options, path = genuine("kv")
    assert all(state_problem(c) is None for c in cache_file.load(path).layers)


CLASSES = {
    "kv": KVCache,
    "quantized-4": lambda: QuantizedKVCache(group_size=64, bits=4),
    "quantized-3-32": lambda: QuantizedKVCache(group_size=32, bits=3),
    "rotating-16-keep-4": lambda: RotatingKVCache(16, keep=4),
    "rotating-8": lambda: RotatingKVCache(8),
    "chunked-16": lambda: ChunkedKVCache(16),
    "concatenate": ConcatenateKVCache,
}


@pytest.mark.parametrize("name", sorted(CLASSES))
@settings(max_examples=30)
@given(steps=st.lists(st.one_of(st.integers(1, 40), st.integers(-8, -1)), min_size=1, max_size=12))
def test_every_state_mlx_lm_writes_passes_the_checks(name, steps):
    # No false positives: any sequence of prompts, single tokens and rewinds leaves a state the checks
    # accept, as it is and as a file holds it (cut to its tokens).
    c = CLASSES[name]()
    for n in steps:
        if n > 0:
            c.update_and_fetch(mx.ones((1, 2, n, 64)), mx.ones((1, 2, n, 64)))
            if isinstance(c, ChunkedKVCache):
                c.maybe_trim_front()  # as llama4's attention does
        elif c.is_trimmable():
            c.trim(-n)
        for layer in (c, cut_to_offset(c)):
            assert state_problem(layer) is None, (steps, state_problem(layer))

"""LoRA/DoRA adapters per session over one loaded model (docs/adapters.md).

Ground truth: mlx-lm's own ``load_adapters`` applied to a separate, freshly loaded copy of the tiny model,
as a process loaded with that adapter would run it.
"""

import json
import threading

import chatkit
from chatkit import (
    BatchEngine,
    ChatSession,
    IncompatibleCacheError,
    InvalidParamsError,
    LoadedModel,
    ModelLoadError,
    SessionPool,
    SpeculativeConfig,
)
from chatkit.testing import random_adapter as make_adapter
from chatkit.testing import tiny_model_path

import mlx.core as mx
import pytest
from conftest import GREEDY, cache_state, session_for
from mlx.utils import tree_flatten
from mlx_lm import load as mlx_load
from mlx_lm.tuner.utils import load_adapters

PROMPTS = ("Tell me about cats.", "And dogs?")


@pytest.fixture(scope="module")
def folders(tmp_path_factory, tiny):
    root = tmp_path_factory.mktemp("adapters")
    lm = tiny()
    return {
        "a": make_adapter(root / "a", lm, seed=1),
        "b": make_adapter(root / "b", lm, seed=2, kind="dora", rank=2, scale=4.0),
    }


@pytest.fixture(scope="module")
def truth(tiny, folders):
    """Per adapter name (None: base), the tokens a fresh process loaded with it replies to PROMPTS."""
    lm = tiny()
    found = {}
    for name in (None, "a", "b"):
        model, _ = mlx_load(str(tiny_model_path()))
        if name is not None:
            load_adapters(model, str(folders[name]))
            model.eval()
        found[name] = talk(session_for(LoadedModel(model, lm.tokenizer, lm.config)))
    return found


def talk(session, prompts=PROMPTS):
    out = []
    for prompt in prompts:
        with session.stream_respond(prompt) as stream:
            list(stream)
        out.append(stream.tokens)
    return out


def params_of(model):
    return dict(tree_flatten(model.parameters()))


def test_sessions_with_different_adapters_match_processes_loaded_with_them(tiny, folders, truth):
    lm = tiny()
    before = params_of(lm.model)
    a, b = chatkit.load_adapter(folders["a"]), lm.adapter(folders["b"])
    assert (a.kind, a.rank, a.scale, b.kind) == ("lora", 4, 8.0, "dora") and len(a.keys) == 6
    sessions = {name: session_for(lm, adapter=adapter) for name, adapter in (("a", a), ("b", b), (None, None))}
    # The three conversations interleave token by token over the one model.
    streams = {name: s.stream_respond(PROMPTS[0]) for name, s in sessions.items()}
    pending = dict(streams)
    while pending:
        for name, stream in list(pending.items()):
            if next(stream, None) is None:
                stream.close()
                del pending[name]
    for name, session in sessions.items():
        assert [streams[name].tokens, *talk(session, PROMPTS[1:])] == truth[name], name
    assert truth["a"] != truth[None] and truth["b"] != truth[None]  # the adapters do change the replies
    after = params_of(lm.model)
    assert after.keys() == before.keys()
    assert all(after[k] is before[k] and mx.array_equal(after[k], before[k]).item() for k in before)
    assert lm.fingerprint == LoadedModel(mlx_load(str(tiny_model_path()))[0], lm.tokenizer).fingerprint


def test_the_base_model_stays_bitwise_the_plain_model(tiny, folders):
    lm = tiny()
    lm.adapter(folders["a"])
    session_for(lm, adapter=lm.adapter(folders["a"])).respond("Hi")  # its layers are switchable now
    plain, _ = mlx_load(str(tiny_model_path()))
    ids = mx.array([[3, 14, 15, 92, 65, 35]])
    assert mx.array_equal(lm.model(ids), plain(ids)).item()


def test_threads_with_different_adapters(tiny, folders, truth):
    lm = tiny()
    adapters = {"a": lm.adapter(folders["a"]), "b": lm.adapter(folders["b"]), None: None}
    found = {}

    def run(name):
        found[name] = talk(session_for(lm, adapter=adapters[name]))

    threads = [threading.Thread(target=run, args=(name,)) for name in adapters]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert found == truth


def test_changing_the_adapter_rebuilds_the_cache(tiny, folders):
    lm = tiny()
    a, b = lm.adapter(folders["a"]), lm.adapter(folders["b"])
    session = session_for(lm, adapter=a)
    session.respond(PROMPTS[0])
    session.adapter = a  # the same adapter: the cache stays
    assert len(cache_state(session).ledger) > 0
    session.adapter = b
    assert session.adapter is b and session.adapter_scale == 1.0 and len(cache_state(session).ledger) == 0
    reply = talk(session, PROMPTS[1:])
    fresh = session_for(lm, adapter=b, history=session.history[:2])
    assert reply == talk(fresh, PROMPTS[1:]) and session.last_stats.reused_tokens == 0
    session.set_adapter(b, scale=0.5)
    assert session.adapter_scale == 0.5 and len(cache_state(session).ledger) == 0
    session.adapter = None
    assert session.adapter is None and talk(session, ["Again"]) == talk(
        session_for(lm, history=session.history[:-2]), ["Again"])


def test_save_restore_records_the_adapter(tiny, folders, tmp_path):
    lm = tiny()
    a, b = lm.adapter(folders["a"]), lm.adapter(folders["b"])
    session = session_for(lm, adapter=a)
    session.respond(PROMPTS[0])
    path = tmp_path / "chat.safetensors"
    session.save_cache(path)
    restored = ChatSession.builder(lm).cache(path).adapter(a).build()
    expected = talk(session.fork(), PROMPTS[1:])
    assert talk(restored, PROMPTS[1:]) == expected and restored.last_stats.reused_tokens > 0
    for other in (b, None):
        with pytest.raises(IncompatibleCacheError, match="adapter"):
            ChatSession.builder(lm).cache(path).adapter(other).build()
    with pytest.raises(IncompatibleCacheError, match="adapter"):
        ChatSession.builder(lm).cache(path).adapter(a, scale=2.0).build()
    base = session_for(lm)
    base.respond("Hi")
    base.save_cache(tmp_path / "base.safetensors")
    with pytest.raises(IncompatibleCacheError, match="adapter"):
        session.restore_cache(tmp_path / "base.safetensors")
    assert session.adapter is a and len(cache_state(session).ledger) > 0  # refused: nothing changed


def test_fork_keeps_the_adapter(tiny, folders):
    lm = tiny()
    a = lm.adapter(folders["a"])
    session = session_for(lm, adapter=a)
    session.respond(PROMPTS[0])
    fork = session.fork()
    assert fork.adapter is a and talk(fork, PROMPTS[1:]) == talk(session, PROMPTS[1:])


def test_pool_with_different_adapters(tiny, folders, truth, tmp_path):
    lm = tiny()
    pool = SessionPool(lm, folder=tmp_path, max_cache_bytes=0,
                       configure=lambda builder: builder.instructions("Be brief.").generate_params(GREEDY))
    adapters = {"a": lm.adapter(folders["a"]), "b": lm.adapter(folders["b"]), "base": None}
    for key, adapter in adapters.items():
        pool.session(key).adapter = adapter
    for key in adapters:
        with pool.session(key).stream_respond(PROMPTS[0]) as stream:
            list(stream)
    for key in adapters:
        pool.session("other")  # evicts the others' caches to files
        assert pool.evicted(key)
        session = pool.session(key)  # restored with its adapter
        assert talk(session, PROMPTS[1:]) == truth[key if key != "base" else None][1:]
        assert session.last_stats.reused_tokens > 0


def test_batch_engine_runs_adapted_turns_alone(tiny, folders, truth):
    lm = tiny()
    adapters = {"a": lm.adapter(folders["a"]), None: None}
    found = {}
    with BatchEngine(lm, max_batch=4) as engine:
        def run(name):
            found[name] = talk(session_for(lm, adapter=adapters[name], engine=engine))

        threads = [threading.Thread(target=run, args=(name,)) for name in adapters]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert engine.turns == len(PROMPTS)  # only the base session's turns went through the batch
        # The engine's shared prefixes are the base model's: an adapted session never starts from them.
        assert talk(session_for(lm, engine=engine)) == truth[None]
        adapted = session_for(lm, adapter=adapters["a"], engine=engine)
        assert talk(adapted, PROMPTS[:1]) == truth["a"][:1] and adapted.last_stats.reused_tokens == 0
        adapted.adapter = None  # now a base session: the engine's (base) prefixes serve it again
        again = ["Tell me about cats, again."]
        assert talk(adapted, again) == talk(session_for(lm, history=adapted.history[:2]), again)
        assert adapted.last_stats.reused_tokens > 0
    assert found == {name: truth[name] for name in adapters}


@pytest.mark.parametrize("config", ["draft", "self", "lookup"])
def test_speculative_decoding_with_an_adapter_is_exact(tiny, folders, truth, config):
    lm = tiny()
    speculative = {"draft": SpeculativeConfig(tiny(seed=1), 3), "self": SpeculativeConfig(lm, 2),
                   "lookup": SpeculativeConfig("prompt_lookup", ngram_min=1)}[config]
    session = session_for(lm, adapter=lm.adapter(folders["a"]), speculative=speculative)
    assert talk(session) == truth["a"]


def test_fuse_gives_the_adapted_tokens_and_leaves_the_model(tiny, folders, truth):
    lm = tiny()
    before = params_of(lm.model)
    for name in ("a", "b"):
        fused = lm.fuse(lm.adapter(folders[name]))
        assert talk(session_for(fused)) == truth[name]
        assert fused.fingerprint != lm.fingerprint and "fused_adapter" in fused.fingerprint
    after = params_of(lm.model)
    assert all(mx.array_equal(after[k], before[k]).item() for k in before)
    assert talk(session_for(lm)) == truth[None]


def test_doras_magnitude_factor_is_computed_once_per_adapter_and_scale(tiny, folders, monkeypatch):
    lm = tiny()
    b = lm.adapter(folders["b"])
    norms = []
    real = mx.linalg.norm
    monkeypatch.setattr(mx.linalg, "norm", lambda *args, **kw: norms.append(1) or real(*args, **kw))
    session = session_for(lm, adapter=b)
    talk(session)
    assert len(norms) == len(b.keys)  # one per adapted layer, not one per layer and forward pass
    session.set_adapter(b, scale=0.5)
    talk(session, PROMPTS[:1])
    assert len(norms) == 2 * len(b.keys)


# -- bad adapters -------------------------------------------------------------------------------------
def _edit_config(folder, **changes):
    config = json.loads((folder / "adapter_config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (folder / "adapter_config.json").write_text(json.dumps(config))


def _edit_weights(folder, change):
    weights = mx.load(str(folder / "adapters.safetensors"))
    change(weights)
    mx.save_safetensors(str(folder / "adapters.safetensors"), weights)


def _first(weights, leaf):
    return sorted(k for k in weights if k.endswith(leaf))[0]


BROKEN = {
    "no config": (lambda f: (f / "adapter_config.json").unlink(), "adapter_config.json"),
    "no weights": (lambda f: (f / "adapters.safetensors").unlink(), "adapters.safetensors"),
    "bad JSON": (lambda f: (f / "adapter_config.json").write_text("{rank: 4"), "not valid JSON"),
    "JSON list": (lambda f: (f / "adapter_config.json").write_text("[]"), "JSON object"),
    "full fine-tune": (lambda f: _edit_config(f, fine_tune_type="full"), "fine_tune_type"),
    "no lora_parameters": (lambda f: _edit_config(f, lora_parameters=None), "lora_parameters"),
    "rank 0": (lambda f: _edit_config(f, lora_parameters={"rank": 0, "scale": 1.0}), "rank"),
    "scale text": (lambda f: _edit_config(f, lora_parameters={"rank": 4, "scale": "big"}), "scale"),
    "other rank": (lambda f: _edit_config(f, lora_parameters={"rank": 3, "scale": 1.0}), "rank 3"),
    "not safetensors": (lambda f: (f / "adapters.safetensors").write_bytes(b"nonsense"), "safetensors"),
    "wrong key": (lambda f: _edit_weights(f, lambda w: w.update(
        {_first(w, "lora_a").replace("lora_a", "lora_c"): w.pop(_first(w, "lora_a"))})), "not a lora tensor"),
    "no lora_b": (lambda f: _edit_weights(f, lambda w: w.pop(_first(w, "lora_b"))), "has no lora_b"),
    "bad shape": (lambda f: _edit_weights(f, lambda w: w.update({_first(w, "lora_b"): mx.zeros((4,))})), "shapes"),
    "NaN": (lambda f: _edit_weights(f, lambda w: w.update({_first(w, "lora_a"): w[_first(w, "lora_a")] * mx.nan})),
            "NaN"),
    "int weights": (lambda f: _edit_weights(f, lambda w: w.update(
        {_first(w, "lora_a"): w[_first(w, "lora_a")].astype(mx.int32)})), "float"),
    "empty": (lambda f: mx.save_safetensors(str(f / "adapters.safetensors"), {}), "no tensors"),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_broken_folders_are_clear_model_load_errors(tiny, tmp_path, case):
    lm = tiny()
    folder = make_adapter(tmp_path / "adapter", lm)
    breaker, message = BROKEN[case]
    breaker(folder)
    with pytest.raises(ModelLoadError, match=message):
        chatkit.load_adapter(folder)


def test_adapters_that_do_not_fit_the_model(tiny, tmp_path, folders):
    lm, other = tiny(), tiny(hidden_size=32)
    with pytest.raises(ModelLoadError, match="No adapter folder"):
        chatkit.load_adapter(tmp_path / "missing")
    with pytest.raises(ModelLoadError, match="do not fit"):
        other.adapter(folders["a"])
    deep = make_adapter(tmp_path / "deep", tiny(num_hidden_layers=4))
    with pytest.raises(ModelLoadError, match="does not have"):
        lm.adapter(deep)
    norm = make_adapter(tmp_path / "norm", lm)
    _edit_weights(norm, lambda w: w.update({"model.norm.lora_a": mx.zeros((4, 4)), "model.norm.lora_b": mx.zeros((4, 4))}))
    with pytest.raises(ModelLoadError, match="linear layers only"):
        lm.adapter(norm)
    based = make_adapter(tmp_path / "based", lm, config_extra={"chatkit_base_fingerprint": other.fingerprint})
    with pytest.raises(ModelLoadError, match="another base model"):
        lm.adapter(based)
    fits = make_adapter(tmp_path / "fits", lm, config_extra={"chatkit_base_fingerprint": lm.fingerprint})
    assert lm.adapter(fits).base == lm.fingerprint
    # A session refuses an adapter that does not fit, and stays as it was.
    a = lm.adapter(folders["a"])
    session = session_for(lm, adapter=a)
    with pytest.raises(ModelLoadError):
        session.adapter = chatkit.load_adapter(deep)
    with pytest.raises(InvalidParamsError):
        session.adapter = str(folders["b"])
    for bad in ("high", True, float("nan"), float("inf")):  # one rule for sessions and fuse
        with pytest.raises(InvalidParamsError):
            ChatSession.builder(lm).adapter(a, scale=bad)
        with pytest.raises(InvalidParamsError):
            session.set_adapter(a, scale=bad)
        with pytest.raises(InvalidParamsError):
            lm.fuse(a, scale=bad)
    with pytest.raises(ModelLoadError):
        ChatSession.builder(other).adapter(a)
    assert session.adapter is a


def test_adapter_is_plain_data_with_a_fingerprint(tiny, folders, tmp_path):
    lm = tiny()
    a = chatkit.load_adapter(folders["a"])
    assert a.name == "a" and a.path == str(folders["a"]) and all(f"{k}.lora_a" in a.weights for k in a.keys)
    assert chatkit.load_adapter(folders["a"]).fingerprint == a.fingerprint
    assert chatkit.load_adapter(folders["b"]).fingerprint != a.fingerprint
    twin = make_adapter(tmp_path / "twin", lm, seed=1, scale=2.0)  # the same weights, another scale
    assert chatkit.load_adapter(twin).fingerprint != a.fingerprint


def test_the_adapted_forward_pass_is_mlx_lms(tiny, folders):
    """Sharper than tokens: the logits of the switchable layers equal mlx-lm's LoRA/DoRA layers' bitwise."""
    from chatkit.model.switchable import activate, applying

    lm = tiny()
    ids = mx.array([[3, 14, 15, 92, 65, 35]])
    for name in ("a", "b"):
        model, _ = mlx_load(str(tiny_model_path()))
        load_adapters(model, str(folders[name]))
        model.eval()
        with applying(lm.model, activate(lm, lm.adapter(folders[name]))):
            ours = lm.model(ids)
        assert mx.array_equal(ours, model(ids)).item(), name


def test_a_compaction_prepared_ahead_is_prefilled_with_the_adapter(tiny, folders):
    from chatkit import ContextPolicy, Role

    lm = tiny()
    small = LoadedModel(lm.model, lm.tokenizer, {**lm.config, "max_position_embeddings": 320}, lm.source)
    roomy = LoadedModel(lm.model, lm.tokenizer, {**lm.config, "max_position_embeddings": 4096}, lm.source)
    a = small.adapter(folders["a"])
    session = session_for(small, adapter=a, context_policy=ContextPolicy.rolling(high_water=0.6))
    prompts = iter([f"Message number {i}: tell me about the colour {c}." for i, c in enumerate(["red", "blue"] * 20)])
    while not session.prepare_compaction():
        session.respond(next(prompts))
    while not session.last_stats.compacted:  # the crossing turn takes the prepared cache
        session.respond(next(prompts))
        assert session.last_stats.compacted or session.prepare_compaction()
    system, *kept = session.context
    assert system.role is Role.SYSTEM and session.last_stats.prefilled_tokens < 45
    fresh = ChatSession.builder(roomy).instructions(system.content).history(kept).generate_params(GREEDY).adapter(a).build()
    assert talk(session, ["And now?"]) == talk(fresh, ["And now?"])

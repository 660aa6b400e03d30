"""Adapters on the server and the command line (docs/adapters.md): ``chatkit serve --adapter NAME=PATH``
serves ``<id>:NAME`` next to the base model over one loaded model, each request's reply equal to an
in-process session with that adapter, pooled conversations never shared across adapters; bad names and
folders are refused before anything runs; ``chatkit chat --adapter PATH`` chats with it."""

import json
import os
import subprocess
import sys
import threading

from chatkit import ChatMessage, ChatSession, GenerateParams, InvalidParamsError, ModelLoadError
from chatkit.cli import main as cli_main
from chatkit.cli.serve import main as serve_main
from chatkit.server import ServerConfig, start
from chatkit.testing import random_adapter, tiny_model_path

import anthropic
import httpx
import openai
import pytest

PARAMS = GenerateParams(max_tokens=10, temperature=0.0)
SYSTEM = "Be brief."
MODEL = "tiny"


@pytest.fixture(scope="module")
def lm(tiny):
    return tiny("qwen3", "bpe", 0)


@pytest.fixture(scope="module")
def folders(tmp_path_factory, lm):
    root = tmp_path_factory.mktemp("served-adapters")
    return {"a": random_adapter(root / "a", lm, seed=1),
            "b": random_adapter(root / "b", lm, seed=2, kind="dora", rank=2, scale=4.0)}


@pytest.fixture(scope="module")
def server(lm, folders):
    config = ServerConfig(model_id=MODEL, defaults=PARAMS, adapters={"a": folders["a"], "b": lm.adapter(folders["b"])})
    with start(lm, config) as running:
        yield running


def oai(running):
    return openai.OpenAI(base_url=running.url, api_key="unused", max_retries=0)


def session(lm, folders, name, history=()):
    """The ground truth: a session built with adapter ``name`` (``None``: the base model) over ``history``."""
    adapter = lm.adapter(folders[name]) if name else None
    builder = ChatSession.builder(lm).instructions(SYSTEM).generate_params(PARAMS.copy()).history(list(history))
    return builder.adapter(adapter).build()


def chat(c, model, prompts, replies=()):
    messages = [{"role": "system", "content": SYSTEM}]
    for i, p in enumerate(prompts):
        messages.append({"role": "user", "content": p})
        if i < len(replies):
            messages.append({"role": "assistant", "content": replies[i]})
    return c.chat.completions.create(model=model, messages=messages)


def test_models_lists_each_adapter_after_the_base_model(server):
    c = oai(server)
    assert [m.id for m in c.models.list()] == [MODEL, f"{MODEL}:a", f"{MODEL}:b"]
    got = c.models.retrieve(f"{MODEL}:b")
    assert got.id == f"{MODEL}:b" and got.model_extra["parent"] == MODEL
    with pytest.raises(openai.NotFoundError):
        c.models.retrieve(f"{MODEL}:nope")


def test_each_model_id_answers_as_a_session_with_its_adapter_and_keeps_its_own_cache(server, lm, folders):
    c = oai(server)
    truth = {name: session(lm, folders, name) for name in (None, "a", "b")}
    first = {name: s.respond("Tell me about cats.") for name, s in truth.items()}
    second = {name: s.respond("And dogs?") for name, s in truth.items()}
    assert len(set(first.values())) == 3, "the adapters change the model's replies"
    got = {}
    for name in ("a", None, "b"):  # the same messages for every model: three conversations
        model = MODEL if name is None else f"{MODEL}:{name}"
        r = chat(c, model, ["Tell me about cats."])
        assert r.model == model and r.usage.prompt_tokens_details.cached_tokens == 0, "no cache of another adapter"
        got[name] = r.choices[0].message.content
    assert got == first
    # b sent exactly the conversation a's pooled session holds: b gets a session of its own, not a's
    cross = chat(c, f"{MODEL}:b", ["Tell me about cats.", "And dogs?"], [first["a"]])
    held = [ChatMessage.user("Tell me about cats."), ChatMessage.assistant(first["a"])]
    assert cross.choices[0].message.content == session(lm, folders, "b", held).respond("And dogs?") != second["a"]
    reused = {}
    for name in ("b", "a", None):  # each conversation goes on on its own session (its cache reused)
        model = MODEL if name is None else f"{MODEL}:{name}"
        r = chat(c, model, ["Tell me about cats.", "And dogs?"], [first[name]])
        assert r.choices[0].message.content == second[name], name
        reused[name] = r.usage.prompt_tokens_details.cached_tokens
    # What b reused is its own first conversation's start (the system prompt and the first message), never a's
    assert 0 < cross.usage.prompt_tokens_details.cached_tokens < reused["a"]
    any_model = chat(c, "gpt-4o", ["Tell me about cats."])  # a name the server does not know: the base model
    assert any_model.choices[0].message.content == first[None] and any_model.model == MODEL


def test_a_stored_response_chain_keeps_its_adapter(server, lm, folders):
    c = oai(server)
    truth = session(lm, folders, "a")
    r1 = c.responses.create(model=f"{MODEL}:a", instructions=SYSTEM, input="Tell me about cats.")
    r2 = c.responses.create(model="whatever", instructions=SYSTEM, input="And dogs?", previous_response_id=r1.id)
    assert [r1.output_text, r2.output_text] == [truth.respond("Tell me about cats."), truth.respond("And dogs?")]
    assert r1.model == r2.model == f"{MODEL}:a"
    for other in (MODEL, f"{MODEL}:b"):
        with pytest.raises(openai.BadRequestError) as caught:
            c.responses.create(model=other, input="And birds?", previous_response_id=r2.id)
        assert caught.value.body["param"] == "model" and f"'{MODEL}:a'" in caught.value.body["message"]


def test_an_unknown_adapter_is_refused_in_each_apis_shape_before_any_work(server):
    c = oai(server)
    for call in (lambda: chat(c, f"{MODEL}:nope", ["Hi"]),
                 lambda: c.responses.create(model=f"{MODEL}:nope", input="Hi")):
        with pytest.raises(openai.NotFoundError) as caught:
            call()
        assert caught.value.body["code"] == "model_not_found" and "'nope'" in caught.value.body["message"]
    root = server.url.removesuffix("/v1")
    body = {"model": f"{MODEL}:nope", "max_tokens": 5, "messages": [{"role": "user", "content": "Hi"}]}
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        r = httpx.post(root + path, json=body)
        assert r.status_code == 404, r.text
        assert r.json()["type"] == "error" and r.json()["error"]["type"] == "not_found_error"
    bad = httpx.post(server.url + "/chat/completions", json={"model": 7, "messages": [{"role": "user", "content": "Hi"}]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "model"
    assert server.engine is None and "conv_" not in json.dumps(httpx.get(server.url + "/conversations").json())


def test_the_messages_api_selects_the_adapter_too(server, lm, folders):
    c = anthropic.Anthropic(base_url=server.url.removesuffix("/v1"), api_key="x", max_retries=0)
    reply = c.messages.create(model=f"{MODEL}:b", system=SYSTEM, max_tokens=10,
                              messages=[{"role": "user", "content": "Tell me about cats."}])
    assert reply.model == f"{MODEL}:b"
    assert "".join(b.text for b in reply.content if b.type == "text") == session(lm, folders, "b").respond("Tell me about cats.")


def test_concurrent_requests_for_each_model_on_a_batch_engine(lm, folders):
    """With --batch the base model's turns decode in the batch and each adapted turn next to it: every
    reply is still its model's."""
    truth = {name: session(lm, folders, name).respond("Tell me about cats.") for name in (None, "a", "b")}
    config = ServerConfig(model_id=MODEL, defaults=PARAMS, batch=True, parallel=3, adapters=dict(folders))
    with start(lm, config) as running:
        c, got = oai(running), {}

        def ask(name):
            got[name] = chat(c, MODEL if name is None else f"{MODEL}:{name}", ["Tell me about cats."])

        threads = [threading.Thread(target=ask, args=(name,)) for name in truth]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert running.engine is not None
    assert {name: r.choices[0].message.content for name, r in got.items()} == truth


def test_a_bad_adapter_in_the_config_stops_the_server_from_starting(lm, folders, tmp_path):
    with pytest.raises(InvalidParamsError, match="Adapter name"):
        start(lm, ServerConfig(adapters={"a:b": folders["a"]}))
    other = random_adapter(tmp_path / "other", lm, config_extra={"chatkit_base_fingerprint": {"weights": "0" * 16}})
    with pytest.raises(ModelLoadError, match="another base model"):
        start(lm, ServerConfig(adapters={"other": other}))


def test_a_restarted_store_gives_each_conversation_its_adapter_back(lm, folders, tmp_path):
    store, truth = str(tmp_path / "store"), session(lm, folders, "a")
    first = truth.respond("Tell me about cats.")
    config = ServerConfig(model_id=MODEL, defaults=PARAMS, store=store, adapters={"a": folders["a"]})
    with start(lm, config) as running:
        assert chat(oai(running), f"{MODEL}:a", ["Tell me about cats."]).choices[0].message.content == first
    manifest = json.loads((tmp_path / "store" / "conversations.json").read_text())
    assert list(manifest["adapters"].values()) == ["a"]
    with start(lm, config) as running:  # the conversation comes back with its adapter and its cache
        r = chat(oai(running), f"{MODEL}:a", ["Tell me about cats.", "And dogs?"], [first])
        assert r.choices[0].message.content == truth.respond("And dogs?")
        assert r.usage.prompt_tokens_details.cached_tokens > 0
    with start(lm, ServerConfig(model_id=MODEL, defaults=PARAMS, store=store)) as running:  # served without it
        r = chat(oai(running), MODEL, ["Tell me about cats.", "And dogs?"], [first])
        assert r.usage.prompt_tokens_details.cached_tokens == 0  # a new base conversation, not the adapted one


# -- the command line ---------------------------------------------------------------------------------
def test_serve_refuses_bad_adapter_flags_with_one_line(folders, tmp_path, capsys):
    model = str(tiny_model_path(arch="qwen3", tokenizer="bpe"))
    a = str(folders["a"])
    refusals = {
        ("--adapter", a): "give NAME=PATH",
        ("--adapter", "a="): "give NAME=PATH",
        ("--adapter", f"x={tmp_path / 'none'}"): "no folder",
        ("--adapter", f"a={a}", "--adapter", f"a={a}"): "given twice",
        ("--adapter", f"a:b={a}"): "Adapter name",
    }
    for flags, expected in refusals.items():
        assert serve_main(["--model", model, *flags]) == 2, flags
        err = capsys.readouterr().err
        assert err.startswith("error: --adapter") and expected in err and err.count("\n") == 1, (flags, err)
    # One that does not fit the model: found once the model is loaded, before anything is served.
    other = random_adapter(tmp_path / "other", tiny_model_lm(), keys=("self_attn.q_proj",))
    (other / "adapter_config.json").write_text(json.dumps({**json.loads((other / "adapter_config.json").read_text()),
                                                           "chatkit_base_fingerprint": {"weights": "0" * 16}}))
    assert serve_main(["--model", model, "--adapter", f"other={other}"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: --adapter other={other}: ") and "another base model" in err and "Traceback" not in err


def tiny_model_lm():
    from chatkit.testing import tiny_model

    return tiny_model("qwen3", "bpe", 0)


def test_chat_refuses_a_bad_adapter_before_it_chats(tmp_path, capsys):
    assert cli_main(["chat", "--adapter-scale", "0.5"]) == 2
    assert "--adapter-scale only applies with --adapter" in capsys.readouterr().err
    assert cli_main(["chat", "--adapter", str(tmp_path / "none")]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: --adapter {tmp_path / 'none'}: No adapter folder") and "Traceback" not in err
    with pytest.raises(SystemExit) as caught:  # argparse's own refusal, as for every chat flag
        cli_main(["chat", "--adapter", str(tmp_path), "--adapter-scale", "nan"])
    assert caught.value.code == 2 and "--adapter-scale: nan is not a finite number" in capsys.readouterr().err


@pytest.mark.slow  # a subprocess
def test_chat_with_an_adapter_answers_as_a_session_with_it(lm, folders, tmp_path):
    model, saved = str(tiny_model_path(arch="qwen3", tokenizer="bpe")), tmp_path / "chat.safetensors"
    params = GenerateParams(max_tokens=8, temperature=0.0)
    adapted = ChatSession.builder(lm).generate_params(params).adapter(lm.adapter(folders["a"]), 0.5).build()
    plain = ChatSession.builder(lm).generate_params(params.copy()).build()
    expected, base = adapted.respond("Hello there"), plain.respond("Hello there")
    assert expected != base

    def run(*flags, stdin):
        env = {**os.environ, "HF_HUB_OFFLINE": "1"}
        return subprocess.run([sys.executable, "-m", "chatkit", "chat", "--model", model, "--max-tokens", "8", *flags],
                              input=stdin, capture_output=True, text=True, timeout=120, env=env)

    out = run("--adapter", str(folders["a"]), "--adapter-scale", "0.5", "--save", str(saved), stdin="Hello there\n/stats\n")
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr
    assert expected in out.stdout and f"adapter: {folders['a']} (lora, rank 4), scale 0.5" in out.stdout
    again = run("--resume", str(saved), stdin="/stats\n")  # without the adapter: the transcript, not the cache
    assert again.returncode == 0 and "made with another adapter" in again.stderr, again.stderr
    assert "adapter:" not in again.stdout

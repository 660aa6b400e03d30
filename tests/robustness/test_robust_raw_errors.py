"""Issue 51, item 4: the raw errors. Each case is a ChatKitError (over HTTP a 4xx naming the parameter, in
the API's own error shape) instead of a TypeError, an OverflowError, a RecursionError, a 500 or a vague 400."""

import json
import socket
import sys
import time

import chatkit
from chatkit import ChatMessage, ChatSession, ContextPolicy, GenerateParams
from chatkit.cli import serve as serve_cli
from chatkit.errors import ChatKitError, InvalidMessageError, InvalidParamsError, ModelLoadError
from chatkit.server import ServerConfig, start

import httpx
import pytest

PARAMS = GenerateParams(max_tokens=2, temperature=0.0)
USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def lm(tiny):
    return tiny("qwen3", "bpe", 0)


@pytest.fixture(scope="module")
def running(lm):
    with start(lm, ServerConfig(model_id="m", defaults=PARAMS)) as server:
        yield server


def root(server):
    return server.url.removesuffix("/v1")


def test_vocabulary_parameters_are_400s_naming_them(running, lm):
    vocab = lm.vocab_size
    cases = {
        "/v1/chat/completions": ({"messages": USER}, True),
        "/v1/responses": ({"input": "hi"}, True),
        "/v1/messages": ({"messages": USER, "max_tokens": 2}, False),
    }
    for route, (body, has_bias) in cases.items():
        for param, value in (("top_k", 10**9), ("logit_bias", {str(vocab + 5): 1.0})):
            if param == "logit_bias" and not has_bias:
                continue
            r = httpx.post(root(running) + route, json={"model": "m", **body, param: value}, timeout=60)
            assert r.status_code == 400, (route, param, r.text)
            error = r.json()["error"]
            assert "could not be served as sent" not in error["message"], (route, r.text)
            assert error["message"].startswith(f"{param}="), (route, r.text)
            if "param" in error:
                assert error["param"] == param


def test_everything_under_messages_answers_in_anthropics_shape(running):
    for method, path, status in (("GET", "/v1/messages", 405), ("POST", "/v1/messages/batches", 404),
                                 ("GET", "/v1/messages/count_tokens", 405), ("DELETE", "/messages", 405)):
        r = httpx.request(method, root(running) + path, timeout=60)
        assert r.status_code == status, (method, path, r.text)
        body = r.json()
        assert body["type"] == "error" and body["error"]["type"] and body["error"]["message"], (path, body)
    r = httpx.post(root(running) + "/v1/messages/count_tokens", content=b"{", timeout=60)
    assert r.status_code == 400 and r.json()["type"] == "error"
    r = httpx.get(root(running) + "/v1/nothing", timeout=60)
    assert r.status_code == 404 and "error" in r.json() and "type" not in r.json()  # OpenAI's shape elsewhere


def test_a_client_hanging_up_mid_body_is_the_clients_error(running, caplog):
    host, port = root(running).removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as conn:
        conn.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{\"messages\": [")
    deadline = time.time() + 10
    while time.time() < deadline:
        metrics = httpx.get(root(running) + "/metrics", timeout=60).text
        if 'route="/v1/chat/completions",status="499"' in metrics:
            break
        time.sleep(0.1)
    assert 'route="/v1/chat/completions",status="499"' in metrics
    assert 'status="500"' not in metrics
    assert "unexpected error" not in caplog.text and "Traceback" not in caplog.text


def test_a_broken_llguidance_install_is_the_400_of_a_missing_one(running, tmp_path, monkeypatch):
    broken = tmp_path / "llguidance"
    broken.mkdir()
    (broken / "__init__.py").write_text("raise ImportError('libllguidance.so: cannot open shared object file')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [m for m in sys.modules if m == "llguidance" or m.startswith(("llguidance.", "chatkit.guided"))]:
        monkeypatch.delitem(sys.modules, name)
    body = {"model": "m", "messages": USER, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object"}}}}
    r = httpx.post(running.url + "/chat/completions", json=body, timeout=60)
    assert r.status_code == 400 and "chatkit[guided]" in r.json()["error"]["message"], r.text


def test_messages_api_details(running):
    def send(**extra):
        return httpx.post(root(running) + "/v1/messages", json={"model": "m", "max_tokens": 2, **extra}, timeout=60)

    assert send(messages=USER, metadata={"user_id": None}).status_code == 200
    assert send(messages=USER, metadata={"user_id": 5}).status_code == 400
    call = {"type": "tool_use", "id": "t1", "name": "f", "input": {}}
    r = send(messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": [call, call]},
                       {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "x"}]}])
    assert r.status_code == 400 and "t1" in r.json()["error"]["message"], r.text
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
    r = send(messages=USER, system=[image])
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert "system" in message and "tool result" not in message, message


def test_library_raw_errors(lm, tmp_path):
    session = ChatSession.builder(lm).generate_params(PARAMS).build()
    for bad in (None, 5):
        with pytest.raises(InvalidMessageError):
            session.count_tokens(bad)
    history = [ChatMessage.user("hi"), ChatMessage.assistant("hello"), {"role": "user", "content": "and?"}]
    assert session.count_tokens(history) > session.count_tokens(history[:1]) > 0
    for bad in (None, [1], "rolling"):
        with pytest.raises(InvalidParamsError):
            ContextPolicy.from_dict(bad)
    folder = tmp_path / "deep"
    folder.mkdir()
    (folder / "adapter_config.json").write_text("[" * 100_000 + "]" * 100_000)
    (folder / "adapters.safetensors").write_bytes(b"")
    with pytest.raises(ModelLoadError, match="nested too deeply"):
        chatkit.load_adapter(folder)
    from chatkit.model.adapters import check_scale

    with pytest.raises(InvalidParamsError, match="huge int"):
        check_scale(10**400)
    with pytest.raises(InvalidParamsError):
        check_scale(10**5000)  # too long even to print


def test_huge_adapter_scales_are_refused_where_given(lm, tmp_path):
    from chatkit.testing.adapters import random_adapter

    adapter = chatkit.load_adapter(random_adapter(tmp_path / "a", lm), lm)
    with pytest.raises(InvalidParamsError):
        ChatSession.builder(lm).adapter(adapter, 10**400)
    session = ChatSession.builder(lm).generate_params(PARAMS).build()
    with pytest.raises(InvalidParamsError):
        session.set_adapter(adapter, 10**400)
    with pytest.raises(InvalidParamsError):
        lm.fuse(adapter, 10**400)
    huge = random_adapter(tmp_path / "b", lm, config_extra={})
    config = json.loads((huge / "adapter_config.json").read_text())
    config["lora_parameters"]["scale"] = 10**400
    (huge / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="scale"):
        chatkit.load_adapter(huge)


def test_serve_host_in_brackets_and_an_empty_model(capsys):
    args = serve_cli.parser().parse_args(["--host", "[::1]", "--port", "8000"])
    assert serve_cli.server_config(args) and args.host == "::1"
    with pytest.raises(ChatKitError, match="--model"):
        serve_cli.server_config(serve_cli.parser().parse_args(["--model", ""]))
    assert serve_cli.main(["--model", "  "]) == 2 and "error:" in capsys.readouterr().err
    with pytest.raises(ChatKitError, match="--host"):
        serve_cli.server_config(serve_cli.parser().parse_args(["--host", "no.such.host.invalid",
                                                               "--api-key", "k"]))

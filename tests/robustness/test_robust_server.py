"""chatkit serve refuses bad requests before the turn (a 400 in OpenAI's error shape, nothing stored),
never stores what it cannot read back, and tidies what a killed process left in its store
(issue 33, items 11-13 and the start-up clean-up)."""

import json
import os

from chatkit import GenerateParams
from chatkit.errors import ChatKitError
from chatkit.server import ServerConfig, start
from chatkit.server.response_store import ResponseStore

import httpx
import pytest

PARAMS = GenerateParams(max_tokens=4, temperature=0.0)
USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def lm(tiny):
    return tiny("qwen3", "bpe", 0)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return tmp_path_factory.mktemp("store")


@pytest.fixture(scope="module")
def running(lm, store):
    with start(lm, ServerConfig(defaults=PARAMS, store=str(store))) as server:
        yield server


def post(server, path, *, body=None, raw=None):
    content = raw if raw is not None else json.dumps(body).encode()
    r = httpx.post(f"{server.url}{path}", content=content, headers={"content-type": "application/json"}, timeout=60)
    return r.status_code, r.json()


def stored(store):
    """What the response store holds on disk: every file name (temporary files too)."""
    folder = store / "responses"
    return sorted(os.listdir(folder)) if folder.exists() else []


def assert_400(status, data, param_prefix=None):
    assert status == 400, data
    assert data["error"]["type"] == "invalid_request_error" and data["error"]["message"]
    if param_prefix is not None:
        assert (data["error"]["param"] or "").startswith(param_prefix), data


# -- item 11: the whole request is checked before the turn; nothing unreadable is stored ------------
@pytest.mark.parametrize("raw, param", [
    (b'{"input": "hi", "metadata": {"a": NaN}}', "metadata.a"),
    (b'{"input": "hi", "metadata": {"a": Infinity}}', "metadata.a"),
    (b'{"input": "hi", "metadata": {"a": 1e999}}', "metadata.a"),
    (b'{"input": "hi", "metadata": {"a": "\\ud800"}}', "metadata.a"),
    (b'{"input": "hi", "metadata": {"\\udcff": "x"}}', "metadata"),
    (b'{"input": "hi", "metadata": {"a": 1}}', "metadata.a"),
    (b'{"input": "hi", "metadata": "tag"}', "metadata"),
    (b'{"input": "hi", "metadata": {"a": "' + b"x" * 513 + b'"}}', "metadata.a"),
    (b'{"input": "hi", "metadata": {' + b", ".join(b'"k%d": "v"' % i for i in range(17)) + b"}}", "metadata"),
    (b'{"input": "hi", "temperature": NaN}', "temperature"),
    (b'{"input": "hi", "user": "\\ud800"}', "user"),
])
def test_responses_refuse_what_cannot_be_stored_before_the_turn(running, store, raw, param):
    before = stored(store)
    assert_400(*post(running, "/responses", raw=raw), param)
    assert stored(store) == before  # nothing stored, no temporary file left
    status, data = post(running, "/responses", body={"input": "hi", "metadata": {"a": "b"}})
    assert status == 200 and data["metadata"] == {"a": "b"}
    assert httpx.get(f"{running.url}/responses/{data['id']}", timeout=60).json()["metadata"] == {"a": "b"}


@pytest.mark.parametrize("raw, param", [
    (b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', "temperature"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "top_p": -Infinity}', "top_p"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "metadata": {"a": "\\ud800"}}', "metadata.a"),
])
def test_chat_completions_refuse_numbers_and_text_json_cannot_hold(running, raw, param):
    assert_400(*post(running, "/chat/completions", raw=raw), param)


def test_the_store_never_writes_a_response_it_cannot_read_back(tmp_path):
    responses = ResponseStore(tmp_path)
    good = {"id": "resp_good", "object": "response", "metadata": {}}
    responses.add(good, [], _reply())
    for bad in ({"id": "resp_nan", "metadata": {"x": float("nan")}}, {"id": "resp_sur", "metadata": {"x": "\ud800"}}):
        with pytest.raises(ChatKitError):
            responses.add(bad, [], _reply())
        with pytest.raises(ChatKitError):
            responses.get(bad["id"])  # not kept in memory either
    assert sorted(os.listdir(tmp_path)) == ["resp_good.json"]
    assert ResponseStore(tmp_path).get("resp_good") == good


def test_a_stored_response_that_cannot_be_read_is_skipped_at_start(lm, tmp_path):
    """Records older versions wrote (NaN in them, or damaged) are skipped with a warning: a 404, never a 500."""
    folder = tmp_path / "responses"
    folder.mkdir()
    record = {"response": {"id": "resp_nan", "metadata": {"a": float("nan")}}, "added": [], "reply": {
        "role": "assistant", "content": "x"}}
    (folder / "resp_nan.json").write_text(json.dumps(record))  # json writes NaN by default
    (folder / "resp_cut.json").write_text('{"response": {"id": "resp_cut"')
    (folder / "resp_shape.json").write_text('{"response": {"id": "resp_shape"}, "added": 5, "reply": null}')
    with start(lm, ServerConfig(defaults=PARAMS, store=str(tmp_path))) as server:
        for rid in ("resp_nan", "resp_cut", "resp_shape"):
            assert httpx.get(f"{server.url}/responses/{rid}", timeout=60).status_code == 404
            status, data = post(server, "/responses", body={"input": "go on", "previous_response_id": rid})
            assert status == 404 and data["error"]["code"] == "response_not_found"


def _reply():
    from chatkit import ChatMessage

    return ChatMessage.assistant("ok")


# -- item 12: bad output and tool schemas are the client's error: 400, nothing stored ---------------
def deep_schema(levels):
    schema = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


BAD_SCHEMAS = {
    "unknown type": {"type": "wizard"},
    "min > max": {"type": "integer", "minimum": 5, "maximum": 1},
    "bad pattern": {"type": "string", "pattern": "["},
    "300 deep": deep_schema(300),
}
BAD_TOOL = {"type": "object", "properties": {"x": {"type": "wizard"}}}


def bad_requests():
    """(id, path, body) of every bad schema through both APIs, streamed and not."""
    for stream in (False, True):
        for name, schema in BAD_SCHEMAS.items():
            fmt = {"type": "json_schema", "json_schema": {"name": "f", "schema": schema}}
            yield f"chat {name} stream={stream}", "/chat/completions", {
                "messages": USER, "response_format": fmt, "stream": stream}
            yield f"responses {name} stream={stream}", "/responses", {
                "input": "hi", "text": {"format": {"type": "json_schema", "name": "f", "schema": schema}},
                "stream": stream}
        tool = {"name": "f", "strict": True, "parameters": BAD_TOOL}
        yield f"chat strict tool stream={stream}", "/chat/completions", {
            "messages": USER, "tools": [{"type": "function", "function": tool}], "stream": stream}
        yield f"responses strict tool stream={stream}", "/responses", {
            "input": "hi", "tools": [{"type": "function", **tool}], "stream": stream}


@pytest.mark.parametrize("path, body", [pytest.param(p, b, id=i) for i, p, b in bad_requests()])
def test_bad_output_and_tool_schemas_are_400_and_nothing_is_stored(running, store, path, body):
    before = stored(store)
    assert_400(*post(running, path, body=body))
    assert stored(store) == before


def test_after_refused_schemas_the_server_serves_and_keeps_no_conversation_of_them(lm, tmp_path):
    with start(lm, ServerConfig(defaults=PARAMS, store=str(tmp_path))) as server:
        for _, path, body in bad_requests():
            assert post(server, path, body=body)[0] == 400
        assert post(server, "/chat/completions", body={"messages": USER})[0] == 200
    assert len(json.loads((tmp_path / "conversations.json").read_text())["conversations"]) == 1
    assert os.listdir(tmp_path / "responses") == []


# -- item 13: bodies nested too deeply --------------------------------------------------------------
@pytest.mark.parametrize("path, raw", [
    ("/chat/completions", b'{"messages": ' + b"[" * 1000 + b"]" * 1000 + b"}"),
    ("/chat/completions", b'{"x": ' * 1000 + b"1" + b"}" * 1000),
    ("/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "user": '
     + b"[" * 200 + b"]" * 200 + b"}"),
    ("/responses", b'{"input": "hi", "metadata": {"a": ' + b"[" * 1000 + b"]" * 1000 + b"}}"),
    ("/responses", b'{"input": "hi", "metadata": ' + b'{"a": ' * 150 + b'"x"' + b"}" * 150 + b"}"),
])
def test_a_body_nested_too_deeply_is_400(running, store, path, raw):
    before = stored(store)
    status, data = post(running, path, raw=raw)
    assert_400(status, data)
    assert "nested" in data["error"]["message"]
    assert stored(store) == before


# -- start-up: what a killed process left in the store is removed ------------------------------------
def test_stale_temporary_files_in_the_store_are_removed_at_start(lm, tmp_path):
    (tmp_path / "caches").mkdir()
    (tmp_path / "responses").mkdir()
    stale = [
        tmp_path / "caches" / ".0123abcd.safetensors.x1y2z3.tmp.safetensors",  # a killed eviction
        tmp_path / ".handoff.safetensors.abc.tmp.safetensors",  # a killed hand-off between conversations
        tmp_path / ".conversations.json.abc.tmp.safetensors",  # a killed manifest write
        tmp_path / "conversations.json.tmp",  # ... as older versions wrote it
        tmp_path / "responses" / ".resp_1.json.abc.tmp.safetensors",  # a killed response write
        tmp_path / "responses" / "resp_2.tmp",  # ... as older versions wrote it
    ]
    for path in stale:
        path.write_bytes(b"partial")
    with start(lm, ServerConfig(defaults=PARAMS, store=str(tmp_path))) as server:
        assert [p.name for p in stale if p.exists()] == []
        assert post(server, "/responses", body={"input": "hi"})[0] == 200
    assert not any(name.endswith(".tmp") or ".tmp." in name for _, _, names in os.walk(tmp_path) for name in names)


def test_a_response_store_that_is_a_file_is_a_clear_error(tmp_path):
    (tmp_path / "responses").write_text("not a folder")
    with pytest.raises(ChatKitError, match="responses"):
        ResponseStore(tmp_path / "responses")


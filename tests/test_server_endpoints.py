"""The server's smaller endpoints, in process: GET /v1/models/{id}, DELETE /v1/responses/{id}, GET
/v1/responses/{id}/input_items (through the official openai SDK), /health, /metrics (counters that move
with the turns, in Prometheus' text format), a clear 400 when guided generation is missing, and error
replies that never speak of the Python API."""

import re

import chatkit
from chatkit import GenerateParams
from chatkit.errors import ContextWindowExceededError, TemplateError
from chatkit.messages import ChatMessage, ToolCall
from chatkit.server import ServerConfig, start, wire
from chatkit.server.errors import BadRequestError, error_body, http_message
from chatkit.server.response_items import message_items

import httpx
import openai
import pytest

PARAMS = GenerateParams(max_tokens=6, temperature=0.0)
MODEL = "org/tiny-model"  # an id with a slash, as hub ids have


@pytest.fixture(scope="module")
def lm(tiny):
    return tiny("qwen3", "bpe", 0)


@pytest.fixture(scope="module")
def server(lm):
    with start(lm, ServerConfig(model_id=MODEL, defaults=PARAMS)) as running:
        yield running


def client(running, **kw):
    return openai.OpenAI(base_url=running.url, api_key=kw.pop("api_key", "unused"), max_retries=0, **kw)


def root(running):
    return running.url.removesuffix("/v1")


# -- models -------------------------------------------------------------------------------------
def test_a_served_model_is_retrieved_and_another_is_404(server):
    c = client(server)
    listed = c.models.list().data
    assert [m.id for m in listed] == [MODEL]
    got = c.models.retrieve(MODEL)
    assert (got.id, got.object, got.owned_by, got.created) == (MODEL, "model", "chatkit", listed[0].created)
    with pytest.raises(openai.NotFoundError) as caught:
        c.models.retrieve("gpt-4o")
    assert caught.value.body["code"] == "model_not_found" and "gpt-4o" in caught.value.body["message"]


# -- DELETE /v1/responses/{id} ------------------------------------------------------------------
def test_deleting_a_response_in_a_chain(lm, tmp_path):
    """Just that response goes: a chain through it is a 404, the ones before it and after it stay, its
    conversation's pooled session answers as before (from its cache); the deletion outlives a restart."""
    config = ServerConfig(model_id=MODEL, defaults=PARAMS, store=str(tmp_path / "store"))
    with start(lm, config) as running:
        c = client(running)
        r1 = c.responses.create(model=MODEL, input="One")
        r2 = c.responses.create(model=MODEL, input="Two", previous_response_id=r1.id)
        r3 = c.responses.create(model=MODEL, input="Three", previous_response_id=r2.id)
        before = c.responses.create(model=MODEL, input="Again", previous_response_id=r1.id)
        reply = httpx.delete(f"{running.url}/responses/{r2.id}", timeout=60)
        assert reply.status_code == 200 and reply.json() == {"id": r2.id, "object": "response.deleted", "deleted": True}
        assert not (tmp_path / "store" / "responses" / f"{r2.id}.json").exists()
        for call in (lambda: c.responses.retrieve(r2.id), lambda: c.responses.delete(r2.id),
                     lambda: c.responses.create(model=MODEL, input="Four", previous_response_id=r3.id)):
            with pytest.raises(openai.NotFoundError) as caught:
                call()
            assert r2.id in caught.value.body["message"] and "deleted" in caught.value.body["message"]
        assert c.responses.retrieve(r3.id).output_text == r3.output_text  # the later one stays
        after = c.responses.create(model=MODEL, input="Again", previous_response_id=r1.id)
        assert after.output_text == before.output_text
        assert after.usage.input_tokens_details.cached_tokens >= r1.usage.input_tokens + r1.usage.output_tokens
    with start(lm, config) as running:  # durable: still deleted after a restart, the rest still there
        c = client(running)
        with pytest.raises(openai.NotFoundError):
            c.responses.retrieve(r2.id)
        assert c.responses.retrieve(r1.id).output_text == r1.output_text
        five = c.responses.create(model=MODEL, input="Five", previous_response_id=r1.id)  # the chain resolves
        assert five.previous_response_id == r1.id and five.usage.input_tokens > r1.usage.input_tokens


# -- GET /v1/responses/{id}/input_items ---------------------------------------------------------
def test_input_items_are_the_conversation_the_response_was_given(server):
    c = client(server)
    r1 = c.responses.create(model=MODEL, input="First question", instructions="Be brief.")
    r2 = c.responses.create(model=MODEL, input=[{"role": "user", "content": "Second question"}],
                            instructions="Be brief.", previous_response_id=r1.id)
    page = c.responses.input_items.list(r2.id)  # newest first, as OpenAI's default
    items = page.data
    assert [i.type for i in items] == ["message", "message", "message"]
    assert [(i.role, i.content[0].text) for i in items] == [
        ("user", "Second question"), ("assistant", r1.output_text), ("user", "First question")]
    assert items[1].id == r1.output[0].id  # an output of the chain keeps its id
    assert (page.first_id, page.last_id, page.has_more) == (items[0].id, items[-1].id, False)
    assert [i.id for i in c.responses.input_items.list(r2.id).data] == [i.id for i in items]  # stable ids
    asc = c.responses.input_items.list(r2.id, order="asc").data
    assert [i.id for i in asc] == [i.id for i in reversed(items)]
    assert [i.content[0].text for i in c.responses.input_items.list(r1.id).data] == ["First question"]
    one = c.responses.input_items.list(r2.id, limit=1)
    assert len(one.data) == 1 and one.has_more
    assert [i.id for i in one] == [i.id for i in items]  # the SDK pages on with after=<last_id>
    later = c.responses.input_items.list(r2.id, after=items[0].id, limit=5)
    assert [i.id for i in later.data] == [i.id for i in items[1:]] and not later.has_more


@pytest.mark.parametrize("query, param", [("limit=0", "limit"), ("limit=101", "limit"), ("limit=x", "limit"),
                                          ("order=sideways", "order"), ("after=msg_nope", "after")])
def test_input_items_bad_queries_are_400(server, query, param):
    rid = client(server).responses.create(model=MODEL, input="Hi").id
    r = httpx.get(f"{server.url}/responses/{rid}/input_items?{query}", timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == param


def test_input_items_of_an_unknown_response_are_404(server):
    with pytest.raises(openai.NotFoundError):
        client(server).responses.input_items.list("resp_nope")


def test_tool_calls_and_their_outputs_are_input_items():
    calls = [ToolCall(id="call_1", name="add", arguments={"a": 1})]
    messages = (ChatMessage.user("Add"), ChatMessage.assistant("", reasoning="think", tool_calls=calls),
                ChatMessage.tool("1", tool_call_id="call_1"))
    items = message_items("resp_x", messages)
    assert [i["type"] for i in items] == ["message", "reasoning", "function_call", "function_call_output"]
    assert items[2]["call_id"] == items[3]["call_id"] == "call_1" and items[2]["name"] == "add"
    assert items[3]["output"] == "1" and len({i["id"] for i in items}) == 4
    assert message_items("resp_x", messages) == items and message_items("resp_y", messages) != items


# -- /health and /metrics -----------------------------------------------------------------------
SAMPLE = re.compile(r'^([a-z_]+)(\{(?:[a-z_]+="(?:[^"\\]|\\.)*",?)*\})? (-?[0-9.e+-]+|\+Inf)$')


def scrape(running, **headers):
    r = httpx.get(f"{root(running)}/metrics", headers=headers, timeout=60)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain; version=0.0.4")
    values: dict[str, float] = {}
    for line in r.text.splitlines():
        if line.startswith("#"):
            assert re.match(r"^# (HELP|TYPE) [a-z_]+ ", line), line
            continue
        match = SAMPLE.match(line)
        assert match, line
        values[match[1] + (match[2] or "")] = float(match[3])
    return values


def test_health_needs_no_key_and_metrics_the_api_key(lm):
    with start(lm, ServerConfig(model_id=MODEL, defaults=PARAMS, api_key="sesame")) as running:
        r = httpx.get(f"{root(running)}/health", timeout=60)
        assert r.status_code == 200 and r.json()["status"] == "ok"
        assert httpx.get(f"{root(running)}/metrics", timeout=60).status_code == 401
        assert scrape(running, authorization="Bearer sesame")["chatkit_sessions_pooled"] == 0


def test_metrics_count_requests_tokens_and_turns(server):
    c = client(server)
    chat_route = 'chatkit_requests_total{method="POST",route="/v1/chat/completions",status="200"}'
    was = scrape(server)
    messages = [{"role": "user", "content": "Count me"}]
    first = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=6)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "And me"}]
    with c.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, stream=True,
                                   stream_options={"include_usage": True}) as stream:
        second = [chunk for chunk in stream][-1]
    now = scrape(server)
    usages = [first.usage, second.usage]
    assert now[chat_route] - was.get(chat_route, 0) == 2
    assert now["chatkit_prompt_tokens_total"] - was["chatkit_prompt_tokens_total"] == sum(u.prompt_tokens for u in usages)
    assert now["chatkit_completion_tokens_total"] - was["chatkit_completion_tokens_total"] == sum(
        u.completion_tokens for u in usages)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached > 0 and now["chatkit_cached_prompt_tokens_total"] - was["chatkit_cached_prompt_tokens_total"] == cached
    for name in ("chatkit_time_to_first_token_seconds", "chatkit_decode_tokens_per_second"):
        assert now[f"{name}_count"] - was[f"{name}_count"] == 2
        assert now[f'{name}_bucket{{le="+Inf"}}'] == now[f"{name}_count"] and now[f"{name}_sum"] > 0
        buckets = [v for k, v in now.items() if k.startswith(f"{name}_bucket")]
        assert buckets == sorted(buckets)  # cumulative
    assert now["chatkit_sessions_pooled"] >= 1 and now["chatkit_kv_cache_memory_bytes"] > 0
    httpx.get(f"{server.url}/responses/resp_nope", timeout=60)
    again = scrape(server)
    assert again['chatkit_requests_total{method="GET",route="/v1/responses/{rid}",status="404"}'] >= 1
    assert again["chatkit_turns_total{finish_reason=\"length\"}"] >= 2


# -- guided generation missing ------------------------------------------------------------------
@pytest.mark.parametrize("path, body, param", [
    ("/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                           "response_format": {"type": "json_object"}}, "response_format"),
    ("/responses", {"input": "x", "text": {"format": {"type": "json_schema", "name": "p", "schema": {}}}},
     "text.format"),
    ("/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}, "strict": True}}]}, "tools"),
])
def test_guided_output_without_the_guided_extra_is_a_clear_400(server, monkeypatch, path, body, param):
    monkeypatch.setattr(wire, "guided_available", lambda: False)
    turns = sum(v for k, v in scrape(server).items() if k.startswith("chatkit_turns_total"))
    r = httpx.post(f"{server.url}{path}", json={"model": MODEL, **body}, timeout=60)
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == param
    assert 'pip install "chatkit[guided]"' in error["message"]
    assert sum(v for k, v in scrape(server).items() if k.startswith("chatkit_turns_total")) == turns  # no work


def test_guided_is_unavailable_without_llguidance(monkeypatch):
    assert wire.guided_available()
    def missing(name, *args):
        raise ImportError(f"No module named {name!r}")

    monkeypatch.setattr(wire.importlib, "import_module", missing)  # guided_available imports to check (issue 51)
    assert not wire.guided_available()


# -- HTTP texts ---------------------------------------------------------------------------------
PYTHON_API = re.compile(r"\w\(\)|\w\(\.\.\.\)|\bbuilder\b|GenerateParams|ChatSession|\bchatkit\.\w|\bsession\.\w"
                        r"|\brespond\(|\bclear\(|\bkwargs?\b|\bpass\b.*\bto the session\b", re.IGNORECASE)


def test_error_replies_never_speak_of_the_python_api(server, monkeypatch):
    """The main error cases, each checked for wording of the Python library (methods, classes, builder)."""
    user = {"role": "user", "content": "x"}
    replies = [httpx.post(f"{server.url}/chat/completions", json={"messages": [user], **extra}, timeout=60)
               for extra in ({"temperature": -1}, {"top_p": 5}, {"max_tokens": 0}, {"top_k": -3}, {"n": 0}, {"n": 99},
                             {"presence_penalty": 5}, {"frequency_penalty": "x"}, {"top_logprobs": 50, "logprobs": True},
                             {"tool_choice": "required", "tools": []})]
    replies += [httpx.post(f"{server.url}/responses", json=body, timeout=60) for body in (
        {"input": "x", "max_output_tokens": 0}, {"input": "x", "previous_response_id": "resp_nope"}, {"input": []})]
    replies += [httpx.get(f"{server.url}/models/nope", timeout=60), httpx.get(f"{server.url}/responses/nope", timeout=60),
                httpx.post(f"{server.url}/chat/completions", content=b"{", timeout=60)]
    monkeypatch.setattr(wire, "guided_available", lambda: False)
    replies.append(httpx.post(f"{server.url}/chat/completions",
                              json={"messages": [user], "response_format": {"type": "json_object"}}, timeout=60))
    for r in replies:
        assert r.status_code >= 400
        message = r.json()["error"]["message"]
        assert message and not PYTHON_API.search(message), message


def test_the_context_window_error_is_worded_for_http():
    library = ContextWindowExceededError("The prompt is 9 tokens but the model's context window is 8: shorten the "
                                         "conversation (e.g. clear(), or a context policy: builder.context_policy(...)).",
                                         prompt_tokens=9, context_length=8)
    assert PYTHON_API.search(str(library))  # the pattern catches what the library says
    text = http_message(library)
    assert "9 tokens" in text and "8" in text and not PYTHON_API.search(text)


def test_over_the_context_window_over_http_is_worded_for_http():
    demo = chatkit.load("demo")
    with start(demo, ServerConfig(defaults=GenerateParams(max_tokens=4, temperature=0.0),
                                  context_policy=chatkit.ContextPolicy.error())) as running:
        r = httpx.post(f"{running.url}/chat/completions",
                       json={"messages": [{"role": "user", "content": "word " * 1100}]}, timeout=60)
    error = r.json()["error"]
    assert r.status_code == 413 and error["code"] == "context_length_exceeded"
    assert "context window" in error["message"] and not PYTHON_API.search(error["message"]), error["message"]


@pytest.mark.parametrize("library", [
    "This tokenizer has no chat template: pass one with ChatSession.builder(...).chat_template(text_or_path).",
    "Nothing to undo: call respond() first.",
    "The draft does not fit (set it with builder.speculative(...)); no turn ran.",
])
def test_library_advice_for_python_callers_is_cut_from_http_replies(library):
    status, body = error_body(TemplateError(library))
    text = body["error"]["message"]
    assert status == 400 and text and not PYTHON_API.search(text), text
    assert text.split(" (the server's log")[0] in library  # what is kept is the library's own start


def test_server_worded_errors_are_sent_as_they_are():
    assert http_message(BadRequestError("after: 'f()' is not an input item.")) == "after: 'f()' is not an input item."
    assert http_message(TemplateError("The template failed: no loop.")) == "The template failed: no loop."


# -- a client gone before the first byte ----------------------------------------------------------
@pytest.mark.parametrize("path,body", [
    ("/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
    ("/responses", {"input": "Hi"}),
    ("/messages", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6}),
])
def test_a_stream_whose_client_left_before_its_first_byte_frees_its_slot(lm, path, body):
    import json
    import socket
    import time
    from urllib.parse import urlsplit

    with start(lm, ServerConfig(model_id=MODEL, defaults=PARAMS, parallel=1, queue=0)) as running:
        url = urlsplit(running.url)
        raw = json.dumps({"model": MODEL, "stream": True, **body}).encode()
        for _ in range(3):  # each sends a whole request and hangs up at once
            with socket.create_connection((url.hostname, url.port)) as s:
                s.sendall(f"POST {url.path}{path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          f"Content-Length: {len(raw)}\r\n\r\n".encode() + raw)
        # One slot, no queue: while a gone client's turn winds down a request is a 503; a slot it kept for
        # good would make every later request one.
        deadline = time.monotonic() + 60
        while (r := httpx.post(running.url + path, json={"model": MODEL, **body}, timeout=60)).status_code == 503:
            assert time.monotonic() < deadline, "the slot of a client that hung up was never freed"
            time.sleep(0.2)
        assert r.status_code == 200, r.text

"""chatkit serve, driven over loopback by the official openai client (and raw HTTP for the error cases):
replies equal an in-process session's, re-sent conversations reuse the cache, responses chain across a
restart, errors are OpenAI-style JSON with the right status and leave conversations intact."""

import json
import threading
import time

import chatkit
from chatkit import ChatSession, GenerateParams
from chatkit.server import ServerConfig, start
from chatkit.server.wire import guided_available
from chatkit.testing import Scripted

import httpx
import openai
import pytest
from helpers.forcing import Favour, FavourFirst

PARAMS = GenerateParams(max_tokens=10, temperature=0.0)
SYSTEM = "Be brief."


@pytest.fixture(scope="module")
def lm(tiny):
    return tiny("qwen3", "bpe", 0)


@pytest.fixture(scope="module")
def demo():
    return chatkit.load("demo")


@pytest.fixture(scope="module")
def server(lm):
    with start(lm, ServerConfig(model_id="tiny", defaults=PARAMS)) as running:
        yield running


def client(running, **kw):
    return openai.OpenAI(base_url=running.url, api_key=kw.pop("api_key", "unused"), max_retries=0, **kw)


def replies_in_process(lm, prompts, *, instructions=SYSTEM, params=PARAMS):
    """The ground truth: the same conversation through one ChatSession."""
    builder = ChatSession.builder(lm).generate_params(params.copy())
    session = (builder.instructions(instructions) if instructions is not None else builder).build()
    return [session.respond(p) for p in prompts]


def chat(c, messages, **kw):
    return c.chat.completions.create(model="any", messages=messages, **kw)


def conversation(c, prompts, **kw):
    """Play ``prompts`` as a stateless client does: re-send everything each turn. (replies, usages)."""
    messages, replies, usages = [{"role": "system", "content": SYSTEM}], [], []
    for p in prompts:
        messages.append({"role": "user", "content": p})
        r = chat(c, messages, **kw)
        replies.append(r.choices[0].message.content)
        usages.append(r.usage)
        messages.append({"role": "assistant", "content": replies[-1]})
    return replies, usages


def test_models_lists_the_served_model(server):
    assert [m.id for m in client(server).models.list()] == ["tiny"]


def test_chat_completion_equals_the_in_process_session(server, lm):
    c = client(server)
    r = chat(c, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hello there"}])
    assert r.choices[0].message.content == replies_in_process(lm, ["Hello there"])[0]
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens > 0 and r.usage.prompt_tokens_details.cached_tokens == 0


def test_streaming_gives_the_same_reply_and_usage(server, lm):
    c = client(server)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Stream me"}]
    chunks = list(chat(c, messages, stream=True, stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == replies_in_process(lm, ["Stream me"])[0]
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] in ("stop", "length")
    usage = chunks[-1].usage
    assert not chunks[-1].choices and usage.completion_tokens > 0
    # The streamed reply is what the session committed: re-sending it continues that conversation
    # (on a random model a reply may re-tokenize differently: part of it is prefilled again).
    again = chat(c, [*messages, {"role": "assistant", "content": text}, {"role": "user", "content": "More"}])
    assert again.usage.prompt_tokens_details.cached_tokens > usage.prompt_tokens


@pytest.mark.slow
def test_ten_turns_re_sent_pay_only_for_the_new_message(demo):
    prompts = ["My name is Ada.", "What is 7 + 5?", "Spell tiger.", "I live in Paris.", "What is 3 + 4?",
               "My favourite colour is green.", "What is 9 - 2?", "Where do I live?", "What is my name?",
               "What is my favourite colour?"]
    params = GenerateParams(max_tokens=24, temperature=0.0)
    with start(demo, ServerConfig(defaults=params)) as running:
        replies, usages = conversation(client(running), prompts)
    assert replies == replies_in_process(demo, prompts, params=params)
    assert usages[0].prompt_tokens_details.cached_tokens == 0
    for before, now in zip(usages[:-1], usages[1:], strict=True):
        # everything the previous turn saw and produced is reused; only the new message is prefilled
        assert now.prompt_tokens_details.cached_tokens == before.prompt_tokens + before.completion_tokens
    # A real conversation came through (the demo's own recall is measured in docs/demo.md: it loses the
    # name told eight turns earlier here, and keeps the city and the colour).
    assert "Paris" in replies[7] and "green" in replies[9]


def test_a_conversation_evicted_to_disk_comes_back(demo):
    # A budget of one byte: every cache goes to disk after its turn and is restored for the next.
    prompts = ["My name is Ada.", "What is 2 + 2?", "What is my name?"]
    params = GenerateParams(max_tokens=24, temperature=0.0)
    with start(demo, ServerConfig(defaults=params, max_cache_bytes=1)) as running:
        c = client(running)
        replies, usages = conversation(c, prompts)
        conversation(c, ["Another conversation"])
    assert replies == replies_in_process(demo, prompts, params=params)
    assert usages[2].prompt_tokens_details.cached_tokens == usages[1].prompt_tokens + usages[1].completion_tokens


@pytest.mark.slow
def test_responses_chain_across_a_restart(demo, tmp_path):
    prompts = ["My name is Ada.", "What is 7 + 5?", "Spell cat.", "What is my name?"]
    params = GenerateParams(max_tokens=24, temperature=0.0)
    expected = replies_in_process(demo, prompts, params=params)
    config = ServerConfig(defaults=params, store=str(tmp_path / "store"))
    with start(demo, config) as running:
        c = client(running)
        r1 = c.responses.create(model="any", input=prompts[0], instructions=SYSTEM)
        r2 = c.responses.create(model="any", input=prompts[1], instructions=SYSTEM, previous_response_id=r1.id)
        assert r2.usage.input_tokens_details.cached_tokens == r1.usage.input_tokens + r1.usage.output_tokens
    with start(demo, config) as running:  # a new process would see the same: everything is in the store
        c = client(running)
        assert c.responses.retrieve(r2.id).output_text == expected[1]
        r3 = c.responses.create(model="any", input=prompts[2], instructions=SYSTEM, previous_response_id=r2.id)
        # the conversation's cache was saved at shutdown and restored: only the new message is prefilled
        assert r3.usage.input_tokens_details.cached_tokens == r2.usage.input_tokens + r2.usage.output_tokens
        with c.responses.stream(model="any", input=prompts[3], instructions=SYSTEM,
                                previous_response_id=r3.id) as stream:
            deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
            r4 = stream.get_final_response()
    assert [r1.output_text, r2.output_text, r3.output_text, r4.output_text] == expected
    assert "".join(deltas) == expected[3] and "Ada" in expected[3]


def test_responses_branch_and_store_false(server, lm):
    c = client(server)
    r1 = c.responses.create(model="any", input="Root", instructions=SYSTEM)
    a = c.responses.create(model="any", input="Branch A", instructions=SYSTEM, previous_response_id=r1.id)
    b = c.responses.create(model="any", input="Branch B", instructions=SYSTEM, previous_response_id=r1.id)
    assert a.output_text == replies_in_process(lm, ["Root", "Branch A"])[1]
    assert b.output_text == replies_in_process(lm, ["Root", "Branch B"])[1]
    unstored = c.responses.create(model="any", input="Not kept", instructions=SYSTEM, store=False,
                                  previous_response_id=a.id)
    assert unstored.output_text == replies_in_process(lm, ["Root", "Branch A", "Not kept"])[2]
    with pytest.raises(openai.NotFoundError):
        c.responses.create(model="any", input="x", previous_response_id=unstored.id)
    # store=false ran on a copy: branch A's conversation is still where it was, its cache reused
    a2 = c.responses.create(model="any", input="Again", instructions=SYSTEM, previous_response_id=a.id)
    assert a2.usage.input_tokens_details.cached_tokens > a.usage.input_tokens


def test_concurrent_clients_get_what_they_would_alone(server, lm):
    scripts = [[f"client {i} turn {t}" for t in range(3)] for i in range(3)]
    results: dict[int, list[str]] = {}

    def run(i):
        results[i] = conversation(client(server), scripts[i])[0]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [results[i] for i in range(3)] == [replies_in_process(lm, s) for s in scripts]


def no_eos(lm):
    return {str(t): -100 for t in lm.tokenizer.eos_token_ids}


class Slow:
    """A logits processor that makes every token take a few milliseconds: concurrent requests then
    surely overlap."""

    def __call__(self, tokens, logits):
        time.sleep(0.005)
        return logits


@pytest.mark.slow
def test_concurrent_requests_decode_together_in_one_batch(lm):
    params = PARAMS.copy(max_tokens=24, logits_processors=[Slow()])
    scripts = [[f"batch client {i}"] for i in range(4)]
    results: dict[int, list[str]] = {}
    with start(lm, ServerConfig(defaults=params, batch=True, parallel=8)) as running:
        assert running.engine is not None and running.engine.max_batch == 8

        def run(i):
            results[i] = conversation(client(running), scripts[i])[0]

        threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert running.engine.peak_batch >= 2  # their steps shared forward passes
    assert [results[i] for i in range(4)] == [replies_in_process(lm, s, params=params) for s in scripts]
    with start(lm, ServerConfig(defaults=params)) as running:  # batching is opt-in
        assert running.engine is None
        assert conversation(client(running), scripts[0])[0] == results[0]


class Gate:
    """A logits processor that holds every turn at its first token until ``open()``: a request is
    then deterministically in the middle of generating."""

    def __init__(self):
        self._open = threading.Event()

    def __call__(self, tokens, logits):
        self._open.wait(60)
        return logits

    def open(self):
        self._open.set()

    def close(self):
        self._open.clear()


def test_a_client_that_disconnects_stops_generation_and_the_turn_commits(lm):
    params = GenerateParams(max_tokens=400, temperature=0.0)
    with start(lm, ServerConfig(defaults=params, parallel=1)) as running:
        body = {"model": "any", "input": "Talk for long", "instructions": SYSTEM, "stream": True,
                "max_output_tokens": 400, "logit_bias": no_eos(lm)}
        received, rid = "", None
        with httpx.stream("POST", f"{running.url}/responses", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    event = json.loads(line[6:])
                    if event["type"] == "response.created":
                        rid = event["response"]["id"]
                    if event["type"] == "response.output_text.delta":
                        received += event["delta"]
                        if len(received) > 10:
                            break  # the client goes away mid-stream
        c = client(running)
        # The server notices the disconnect, stops the turn and commits it as far as it got, then
        # stores the response and frees the (only) slot: wait for that to happen.
        for _ in range(600):
            try:
                stored = c.responses.retrieve(rid)
                break
            except openai.NotFoundError:
                time.sleep(0.1)
        assert stored.output_text.startswith(received) and stored.status == "cancelled"
        assert stored.usage.output_tokens < 400 and stored.incomplete_details is None
        more = c.responses.create(model="any", input="And then?", instructions=SYSTEM, previous_response_id=rid,
                                  max_output_tokens=5)
        assert more.usage.input_tokens_details.cached_tokens > stored.usage.input_tokens


# -- errors: OpenAI-style JSON, the right status, nothing changed ------------------------------------
def post(running, path, body, **kw):
    r = httpx.post(f"{running.url}{path}", json=body, timeout=60, **kw)
    return r.status_code, r.json()


def user(text):
    return {"role": "user", "content": text}


@pytest.mark.parametrize("body, param", [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"messages": [user("hi"), {"role": "assistant", "content": "a"}]}, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0]"),
    ({"messages": [user("hi")], "tools": [{"type": "web_search"}]}, "tools[0]"),
    ({"messages": [user("hi")], "tools": [{"type": "function", "function": {}}]}, "tools[0]"),
    ({"messages": [user("hi")], "tool_choice": "required"}, "tool_choice"),
    ({"messages": [user("hi")], "tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
    ({"messages": [user("hi")], "tools": [{"type": "function", "function": {"name": "f"}}],
      "parallel_tool_calls": "no"}, "parallel_tool_calls"),
    ({"messages": [user("hi")], "functions": [{"name": "f"}]}, "functions"),
    ({"messages": [user("hi"), {"role": "tool", "tool_call_id": "abc", "content": "1"}]}, "messages[1]"),
    ({"messages": [user("hi"), {"role": "assistant", "content": None, "tool_calls": [
        {"id": "abc", "type": "function", "function": {"name": "f", "arguments": 5}}]},
        {"role": "tool", "tool_call_id": "abc", "content": "1"}]}, "messages[1].tool_calls[0]"),
    ({"messages": [user("hi"), {"role": "assistant", "content": None, "tool_calls": [
        {"id": "abc", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "content": "1"}]}, "messages[2]"),
    ({"messages": [user("hi")], "n": 0}, "n"),
    ({"messages": [user("hi")], "temperature": -1}, "temperature"),
    ({"messages": [user("hi")], "max_tokens": 0}, "max_tokens"),
    ({"messages": [user("hi")], "presence_penalty": 2.5}, "presence_penalty"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content"),
])
def test_invalid_requests_are_400(server, body, param):
    status, data = post(server, "/chat/completions", body)
    assert status == 400 and data["error"]["type"] == "invalid_request_error"
    assert data["error"]["param"] == param and data["error"]["message"]


def test_invalid_json_and_unknown_routes(server):
    r = httpx.post(f"{server.url}/chat/completions", content=b"{not json", timeout=60)
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = httpx.get(f"{server.url}/nothing-here", timeout=60)
    assert r.status_code == 404 and "error" in r.json()
    r = httpx.get(f"{server.url}/chat/completions", timeout=60)
    assert r.status_code == 405 and "error" in r.json()


def test_response_format_json_schema_gives_valid_json(server):
    """The random test model writes garbage unconstrained; with a schema its replies are valid objects."""
    assert guided_available()  # the test extra installs the guided extra
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 120}},
              "required": ["name", "age"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema}}
    status, data = post(server, "/chat/completions",
                        {"messages": [user("Who are you?")], "response_format": fmt, "max_tokens": 60})
    assert status == 200, data
    value = json.loads(data["choices"][0]["message"]["content"])
    assert set(value) == {"name", "age"} and isinstance(value["name"], str) and 0 <= value["age"] <= 120
    status, data = post(server, "/responses", {"input": "Who are you?", "max_output_tokens": 60,
                                                "text": {"format": {"type": "json_schema", "name": "p", "schema": schema}}})
    assert status == 200, data
    text = data["output"][0]["content"][0]["text"]
    assert set(json.loads(text)) == {"name", "age"}


def test_a_conversation_with_response_format_continues_its_session(server):
    """The session holds a guided prompt with its schema's description appended; the client re-sends it
    without: the next turn still continues that session and prefills only the new message."""
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}}, "required": ["name"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": schema}}
    messages, usages = [user("I'm Kenji.")], []
    for nxt in ("Again.", "Once more."):
        status, data = post(server, "/chat/completions", {"messages": messages, "response_format": fmt, "max_tokens": 40})
        assert status == 200, data
        usages.append(data["usage"])
        messages += [data["choices"][0]["message"], user(nxt)]
    status, data = post(server, "/chat/completions", {"messages": messages, "response_format": fmt, "max_tokens": 40})
    usages.append(data["usage"])
    for before, after in zip(usages, usages[1:]):  # the last turn's prompt is reused (and its reply, as far
        assert after["prompt_tokens_details"]["cached_tokens"] >= before["prompt_tokens"]  # as it re-encodes alike)


def test_unknown_response_ids_are_404(server):
    status, data = post(server, "/responses", {"input": "hi", "previous_response_id": "resp_nope"})
    assert status == 404 and data["error"]["code"] == "response_not_found"
    assert httpx.get(f"{server.url}/responses/resp_nope", timeout=60).status_code == 404


def test_a_conversation_already_generating_is_409_and_goes_on(lm):
    params = GenerateParams(max_tokens=30, temperature=0.0)
    gate = Gate()
    with start(lm, ServerConfig(defaults=params.copy(logits_processors=[gate]))) as running:
        c = client(running)
        gate.open()
        first = chat(c, [{"role": "system", "content": SYSTEM}, user("Hello")], max_tokens=4)
        gate.close()
        messages = [{"role": "system", "content": SYSTEM}, user("Hello"),
                    {"role": "assistant", "content": first.choices[0].message.content}, user("Go on")]
        body = {"messages": messages, "stream": True}
        streamed = ""
        with httpx.stream("POST", f"{running.url}/chat/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            next(lines)  # the role chunk: the turn is open, held at its first token by the gate
            status, data = post(running, "/chat/completions", {"messages": messages})
            gate.open()
            for line in lines:
                if line.startswith("data: {"):
                    choices = json.loads(line[6:])["choices"]
                    streamed += choices[0]["delta"].get("content") or "" if choices else ""
        assert status == 409 and data["error"]["code"] == "conversation_busy"
        # the refused request changed nothing: the conversation holds the streamed reply and goes on
        history = [*messages[1:], {"role": "assistant", "content": streamed}]
        again = chat(c, [messages[0], *history, user("And?")], max_tokens=8)
    assert again.usage.prompt_tokens_details.cached_tokens > first.usage.prompt_tokens
    fresh = ChatSession.builder(lm).instructions(SYSTEM).history(history).generate_params(params.copy(max_tokens=8))
    assert again.choices[0].message.content == fresh.build().respond("And?")


def test_over_the_context_window_is_413_and_the_conversation_is_intact(demo):
    params = GenerateParams(max_tokens=24, temperature=0.0)
    with start(demo, ServerConfig(defaults=params)) as running:
        c = client(running)
        replies, usages = conversation(c, ["My name is Ada."])
        history = [{"role": "system", "content": SYSTEM}, user("My name is Ada."),
                   {"role": "assistant", "content": replies[0]}]
        status, data = post(running, "/chat/completions", {"messages": [*history, user("word " * 1100)]})
        assert status == 413 and data["error"]["code"] == "context_length_exceeded"
        r = chat(c, [*history, user("What is my name?")])
    assert r.choices[0].message.content == replies_in_process(demo, ["My name is Ada.", "What is my name?"],
                                                              params=params)[1]
    assert r.usage.prompt_tokens_details.cached_tokens == usages[0].prompt_tokens + usages[0].completion_tokens


def test_overloaded_is_503(lm):
    gate = Gate()
    with start(lm, ServerConfig(defaults=PARAMS.copy(logits_processors=[gate]), parallel=1, queue=0)) as running:
        with httpx.stream("POST", f"{running.url}/chat/completions", json={"messages": [user("Hold the slot")],
                                                                           "stream": True}, timeout=60) as r:
            lines = r.iter_lines()
            next(lines)  # the only slot is taken, its turn held by the gate
            r2 = httpx.post(f"{running.url}/chat/completions", json={"messages": [user("Me too")]}, timeout=60)
            gate.open()
            assert [line for line in lines if line][-1] == "data: [DONE]"  # the slot is free once the reply ended
        assert r2.status_code == 503 and r2.json()["error"]["code"] == "overloaded" and r2.headers["retry-after"]
        assert chat(client(running), [user("Now me")], max_tokens=3).choices[0].message.content is not None


def test_api_key(lm):
    with start(lm, ServerConfig(defaults=PARAMS, api_key="sesame")) as running:
        with pytest.raises(openai.AuthenticationError):
            client(running, api_key="wrong").models.list()
        assert httpx.get(f"{running.url}/models", timeout=60).status_code == 401
        assert [m.id for m in client(running, api_key="sesame").models.list()] == ["chatkit"]


@pytest.mark.slow
def test_chatkit_serve_command(tmp_path):
    import os
    import signal
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = tmp_path / "store"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "chatkit", "serve", "--port", str(port), "--store", str(store),
                             "--max-tokens", "16", "--log-level", "warning"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        for _ in range(1200):  # up to two minutes for the process to import and load
            try:
                models = c.models.list()
                break
            except openai.APIConnectionError:
                assert proc.poll() is None, proc.communicate()[1]
                time.sleep(0.1)
        assert [m.id for m in models] == ["demo"]
        r = chat(c, [{"role": "user", "content": "My name is Ada."}])
        assert r.choices[0].message.content == "Nice to meet you, Ada."
    finally:
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert len(json.loads((store / "conversations.json").read_text())["conversations"]) == 1


def test_a_changed_conversation_reuses_its_common_prefix(demo):
    # A client that edits the last reply (or re-sends only what it saw of a reply it stopped) does not
    # extend the conversation exactly: a new session starts from the old one's cache, and only what
    # differs is prefilled. Its reply is a fresh session's with the same history.
    params = GenerateParams(max_tokens=24, temperature=0.0)
    with start(demo, ServerConfig(defaults=params)) as running:
        c = client(running)
        replies, usages = conversation(c, ["My name is Ada.", "What is 7 + 5?"])
        history = [user("My name is Ada."), {"role": "assistant", "content": replies[0]},
                   user("What is 7 + 5?"), {"role": "assistant", "content": "12"}, user("What is my name?")]
        r = chat(c, [{"role": "system", "content": SYSTEM}, *history])
    fresh = ChatSession.builder(demo).instructions(SYSTEM).history(history[:-1]).generate_params(params).build()
    assert r.choices[0].message.content == fresh.respond("What is my name?")
    assert usages[0].prompt_tokens < r.usage.prompt_tokens_details.cached_tokens < usages[1].prompt_tokens + 1


def test_speculative_decoding_behind_the_server(demo, tmp_path):
    # --draft: greedy replies equal the standard path's; the draft's cache follows across turns, an
    # eviction and a restart (restore_cache refills it from the target's ledger).
    prompts = ["My name is Ada.", "What is 7 + 5?", "What is my name?"]
    params = GenerateParams(max_tokens=24, temperature=0.0)
    config = ServerConfig(defaults=params, store=str(tmp_path), max_cache_bytes=1,
                          speculative=chatkit.SpeculativeConfig(chatkit.load("demo-draft"), num_draft_tokens=4))
    with start(demo, config) as running:
        replies, usages = conversation(client(running), prompts[:2])
    with start(demo, config) as running:
        messages = [{"role": "system", "content": SYSTEM}]
        for p, r in zip(prompts[:2], replies, strict=True):
            messages += [user(p), {"role": "assistant", "content": r}]
        last = chat(client(running), [*messages, user(prompts[2])])
    assert [*replies, last.choices[0].message.content] == replies_in_process(demo, prompts, params=params)
    assert last.usage.prompt_tokens_details.cached_tokens == usages[1].prompt_tokens + usages[1].completion_tokens


# -- tools, tool calls and reasoning in OpenAI's fields --------------------------------------------
# A random model cannot write a tool call: a script forces its replies (chatkit.testing.Scripted), in
# the Qwen3 format of the bpe-think tokenizer; the turns after the script are free greedy decoding.
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather of a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "local_time", "description": "The local time of a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def call_text(name, **arguments):
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


THINK_AND_CALL = "<think>\nLook it up.\n</think>\n\n" + call_text("get_weather", city="Paris")


@pytest.fixture(scope="module")
def think(tiny):
    return tiny("qwen3", "bpe-think", 0)


def scripted_server(lm, replies, max_tokens=60):
    script = Scripted(lm.tokenizer, replies)
    return start(lm, ServerConfig(defaults=GenerateParams(max_tokens=max_tokens, logits_processors=[script])))


def tool_session(lm, history, tools=(WEATHER,), max_tokens=8):
    """The ground truth: a fresh in-process session with that history, the client running the tools."""
    builder = ChatSession.builder(lm).instructions(SYSTEM).history(history).tools(list(tools), tool_execution="manual")
    return builder.generate_params(GenerateParams(max_tokens=max_tokens)).build()


def test_a_tool_call_round_trip_over_two_requests_reuses_the_cache(think):
    with scripted_server(think, [THINK_AND_CALL]) as running:
        c = client(running)
        messages = [{"role": "system", "content": SYSTEM}, user("Weather in Paris?")]
        r1 = chat(c, messages, tools=[WEATHER])
        m = r1.choices[0].message
        assert r1.choices[0].finish_reason == "tool_calls" and m.content is None
        assert m.reasoning_content == "Look it up."
        (tc,) = m.tool_calls
        assert (tc.type, tc.function.name, json.loads(tc.function.arguments)) == ("function", "get_weather",
                                                                                  {"city": "Paris"})
        # The client appends the message object as the openai client returned it, then the tool's result.
        result = {"role": "tool", "tool_call_id": tc.id, "content": "sunny"}
        status, data = post(running, "/chat/completions", {"messages": [*messages, m.model_dump(), {
            **result, "tool_call_id": "nope"}], "tools": [WEATHER]})
        assert status == 400 and data["error"]["param"] == "messages[3]" and "'nope'" in data["error"]["message"]
        messages += [m, result]
        r2 = chat(c, messages, tools=[WEATHER], max_tokens=8)
    # everything the first request saw and produced is reused: only the tool result and glue are new
    assert r2.usage.prompt_tokens_details.cached_tokens == r1.usage.prompt_tokens + r1.usage.completion_tokens
    assert r2.usage.prompt_tokens - r2.usage.prompt_tokens_details.cached_tokens < 20
    asked = chatkit.ChatMessage.assistant("", reasoning="Look it up.", tool_calls=[
        chatkit.ToolCall(tc.id, "get_weather", {"city": "Paris"})])
    fresh = tool_session(think, [chatkit.ChatMessage.user("Weather in Paris?"), asked])
    assert r2.choices[0].message.content == fresh.respond("sunny", role="tool", tool_call_id=tc.id)


def test_streamed_tool_calls_and_reasoning_add_up_to_the_message_and_continue_it(think):
    both = call_text("get_weather", city="Paris") + "\n" + call_text("local_time", city="Rome")
    with scripted_server(think, ["<think>\nTwo things.\n</think>\n\n" + both]) as running:
        c = client(running)
        messages = [{"role": "system", "content": SYSTEM}, user("Weather in Paris, time in Rome?")]
        chunks = list(chat(c, messages, tools=[WEATHER, TIME], stream=True, stream_options={"include_usage": True}))
        deltas = [ch.choices[0].delta for ch in chunks if ch.choices]
        reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
        content = "".join(d.content or "" for d in deltas)
        calls = [tc for d in deltas for tc in d.tool_calls or ()]
        assert reasoning == "Two things." and content == ""
        assert [(tc.index, tc.function.name, json.loads(tc.function.arguments)) for tc in calls] == [
            (0, "get_weather", {"city": "Paris"}), (1, "local_time", {"city": "Rome"})]
        assert all(tc.id and tc.type == "function" for tc in calls)
        assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "tool_calls"
        first = chunks[-1].usage
        # What was streamed, re-sent with both results in one request, continues the same session.
        assistant = {"role": "assistant", "content": None, "reasoning_content": reasoning,
                     "tool_calls": [{"id": tc.id, "type": "function", "function": {
                         "name": tc.function.name, "arguments": tc.function.arguments}} for tc in calls]}
        results = [{"role": "tool", "tool_call_id": calls[0].id, "content": "sunny"},
                   {"role": "tool", "tool_call_id": calls[1].id, "content": "noon"}]
        # Only one of the two results: refused (as OpenAI does), and nothing changes.
        status, data = post(running, "/chat/completions", {"messages": [*messages, assistant, results[1]],
                                                           "tools": [WEATHER, TIME]})
        assert status == 400 and data["error"]["param"] == "messages[2]" and calls[0].id in data["error"]["message"]
        # A second result over the context window: 413, after the first was taken in on a copy of the
        # session that is dropped, so the conversation is unchanged.
        huge = {**results[1], "content": "word " * 5000}
        status, data = post(running, "/chat/completions", {"messages": [*messages, assistant, results[0], huge],
                                                           "tools": [WEATHER, TIME], "stream": True})
        assert status == 413 and data["error"]["code"] == "context_length_exceeded"
        r2 = chat(c, [*messages, assistant, *results], tools=[WEATHER, TIME], max_tokens=8)
        assert r2.usage.prompt_tokens_details.cached_tokens == first.prompt_tokens + first.completion_tokens
        # and the conversation goes on from there, as a client re-sending the reply continues it
        answer = {"role": "assistant", "content": r2.choices[0].message.content}
        r3 = chat(c, [*messages, assistant, *results, answer, user("Thanks")], tools=[WEATHER, TIME], max_tokens=8)
    asked = chatkit.ChatMessage.from_dict(assistant)
    fresh = tool_session(think, [chatkit.ChatMessage.user(messages[1]["content"]), asked], tools=(WEATHER, TIME))
    fresh.respond("sunny", role="tool", tool_call_id=calls[0].id)
    assert r2.choices[0].message.content == fresh.respond("noon", role="tool", tool_call_id=calls[1].id)
    # Qwen3's template drops the reasoning of turns before the last user message: the session trims its
    # cache there, exactly as the same conversation in process does.
    assert r3.choices[0].message.content == fresh.respond("Thanks")
    assert r3.usage.prompt_tokens_details.cached_tokens == fresh.last_stats.reused_tokens
    assert fresh.last_stats.plan == "trim" and 0 < fresh.last_stats.reused_tokens < r2.usage.prompt_tokens


def test_changed_tools_start_another_conversation(think):
    with scripted_server(think, [THINK_AND_CALL]) as running:
        c = client(running)
        messages = [{"role": "system", "content": SYSTEM}, user("Weather in Paris?")]
        r1 = chat(c, messages, tools=[WEATHER])
        (tc,) = r1.choices[0].message.tool_calls
        messages += [r1.choices[0].message, {"role": "tool", "tool_call_id": tc.id, "content": "sunny"}]
        # Other tools render another prompt: the request is a conversation of its own, prefilled whole,
        # and answers as a fresh session with those tools and that history would.
        other = chat(c, messages, tools=[WEATHER, TIME], max_tokens=8)
        # The first conversation, with its own tools, is untouched and still reuses its cache.
        same = chat(c, messages, tools=[WEATHER], max_tokens=8)
    asked = chatkit.ChatMessage.assistant("", reasoning="Look it up.", tool_calls=[
        chatkit.ToolCall(tc.id, "get_weather", {"city": "Paris"})])
    history = [chatkit.ChatMessage.user("Weather in Paris?"), asked]
    assert other.usage.prompt_tokens_details.cached_tokens == 0
    fresh = tool_session(think, history, tools=(WEATHER, TIME))
    assert other.choices[0].message.content == fresh.respond("sunny", role="tool", tool_call_id=tc.id)
    assert same.usage.prompt_tokens_details.cached_tokens == r1.usage.prompt_tokens + r1.usage.completion_tokens
    fresh = tool_session(think, history)
    assert same.choices[0].message.content == fresh.respond("sunny", role="tool", tool_call_id=tc.id)



def test_tool_choice_none_keeps_the_model_from_calling(think):
    start_call = think.tokenizer.encode("<tool_call>", add_special_tokens=False)
    assert len(start_call) == 1
    params = GenerateParams(max_tokens=6, logits_processors=[Favour(start_call[0])])
    with start(think, ServerConfig(defaults=params)) as running:
        c = client(running)
        auto = chat(c, [user("Weather?")], tools=[WEATHER])
        none = chat(c, [user("Weather?")], tools=[WEATHER], tool_choice="none")
    assert auto.choices[0].message.tool_calls  # it could not help calling (an unreadable call, cut short)
    assert none.choices[0].message.tool_calls is None and none.choices[0].message.content



@pytest.mark.skipif(not guided_available(), reason="needs the guided extra")
def test_a_strict_tool_gets_calls_that_follow_its_schema(think):
    (start_call,) = think.tokenizer.encode("<tool_call>", add_special_tokens=False)
    # A random model never ends a free string: the strict tool bounds it (as a real schema may).
    bounded = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"]}
    strict = {"type": "function", "function": {**WEATHER["function"], "parameters": bounded, "strict": True}}
    loose = GenerateParams(max_tokens=40, logits_processors=[FavourFirst(start_call)])
    with start(think, ServerConfig(defaults=loose)) as running:
        # Without strict the random model's call is unreadable (no tool_calls parsed from it).
        plain = chat(client(running), [user("Weather?")], tools=[WEATHER])
    assert not plain.choices[0].message.tool_calls or not all(
        _readable(tc, "get_weather") for tc in plain.choices[0].message.tool_calls)
    strict_params = GenerateParams(max_tokens=40, logits_processors=[FavourFirst(start_call)])
    with start(think, ServerConfig(defaults=strict_params)) as running:
        r = chat(client(running), [user("Weather?")], tools=[strict])
        status, data = post(running, "/chat/completions", {"messages": [user("hi")], "tools": [
            {"type": "function", "function": {**WEATHER["function"], "strict": "yes"}}]})
    calls = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and calls and all(_readable(tc, "get_weather") for tc in calls)
    assert status == 400 and data["error"]["param"] == "tools[0]" and "strict" in data["error"]["message"]


def test_a_call_cut_by_max_tokens_is_sent_as_far_as_it_went_never_as_empty_arguments(think):
    """A client that runs the calls it gets must not run get_weather({}): the cut call's arguments are
    the model's text as far as it went (not JSON, as OpenAI sends a call cut by max_tokens), and the
    conversation goes on when the client re-sends it with a result."""
    cut = [call_text("get_weather", city="Paris in France")]
    messages = [user("Weather?")]
    with scripted_server(think, cut, max_tokens=20) as running:
        c = client(running)
        r = chat(c, messages, tools=[WEATHER])
        (tc,) = r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "length" and tc.function.name == "get_weather"
        assert tc.function.arguments != "{}" and '{"city": "Paris in France"}'.startswith(tc.function.arguments)
        with pytest.raises(ValueError):
            json.loads(tc.function.arguments)
        messages += [r.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": tc.id, "content": "Error: the call was cut."}]
        assert chat(c, messages, tools=[WEATHER], max_tokens=4).choices[0].message.content
    with scripted_server(think, cut, max_tokens=20) as running:
        streamed = list(chat(client(running), messages[:1], tools=[WEATHER], stream=True))
    calls = [d for ch in streamed if ch.choices for d in ch.choices[0].delta.tool_calls or []]
    assert [d.function.arguments for d in calls] == [tc.function.arguments]
    assert streamed[-1].choices[0].finish_reason == "length"


def _readable(tc, name):
    try:
        arguments = json.loads(tc.function.arguments)
    except ValueError:
        return False
    return tc.function.name == name and set(arguments) == {"city"} and isinstance(arguments["city"], str)


def test_responses_function_calls_round_trip(think):
    flat = {"type": "function", **WEATHER["function"]}
    with scripted_server(think, [THINK_AND_CALL]) as running:
        c = client(running)
        with c.responses.stream(model="any", input="Weather in Paris?", instructions=SYSTEM, tools=[flat]) as stream:
            events = list(stream)
            r1 = stream.get_final_response()
        assert [item.type for item in r1.output] == ["reasoning", "function_call"] and r1.output_text == ""
        reasoning, fc = r1.output
        assert reasoning.content[0].text == "Look it up." and (fc.name, json.loads(fc.arguments)) == (
            "get_weather", {"city": "Paris"})
        kinds = [e.type for e in events]
        assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == "Look it up."
        assert [e.arguments for e in events if e.type == "response.function_call_arguments.done"] == [fc.arguments]
        assert kinds[-1] == "response.completed"
        result = {"type": "function_call_output", "call_id": fc.call_id, "output": "sunny"}
        r2 = c.responses.create(model="any", input=[result], instructions=SYSTEM, tools=[flat],
                                previous_response_id=r1.id, max_output_tokens=8)
        assert r2.usage.input_tokens_details.cached_tokens == r1.usage.input_tokens + r1.usage.output_tokens
        # A client that keeps the context itself re-sends the output items: the same conversation (which
        # went on meanwhile: this request branches off it, reusing all they share).
        items = [{"role": "user", "content": "Weather in Paris?"}, *[i.model_dump() for i in r1.output], result]
        again = c.responses.create(model="any", input=items, instructions=SYSTEM, tools=[flat], max_output_tokens=8)
        assert again.usage.input_tokens_details.cached_tokens >= r1.usage.input_tokens + r1.usage.output_tokens
        assert again.output_text == r2.output_text
        status, data = post(running, "/responses", {"input": [{**result, "call_id": "nope"}], "tools": [flat],
                                                    "previous_response_id": r1.id})
        assert status == 400 and "nope" in data["error"]["message"]
    asked = chatkit.ChatMessage.assistant("", reasoning="Look it up.", tool_calls=[
        chatkit.ToolCall(fc.call_id, "get_weather", {"city": "Paris"})])
    fresh = tool_session(think, [chatkit.ChatMessage.user("Weather in Paris?"), asked])
    assert r2.output_text == fresh.respond("sunny", role="tool", tool_call_id=fc.call_id)


def test_a_tool_round_goes_on_after_a_restart(think, tmp_path):
    # The conversation's tools are stored with it (--store): after a restart the tool result lands on
    # the restored session, whose cache came back from disk.
    script = Scripted(think.tokenizer, [THINK_AND_CALL])
    config = ServerConfig(defaults=GenerateParams(max_tokens=60, logits_processors=[script]), store=str(tmp_path))
    messages = [{"role": "system", "content": SYSTEM}, user("Weather in Paris?")]
    with start(think, config) as running:
        r1 = chat(client(running), messages, tools=[WEATHER])
    m = r1.choices[0].message
    messages += [m, {"role": "tool", "tool_call_id": m.tool_calls[0].id, "content": "sunny"}]
    with start(think, config) as running:
        r2 = chat(client(running), messages, tools=[WEATHER], max_tokens=8)
    assert r2.usage.prompt_tokens_details.cached_tokens == r1.usage.prompt_tokens + r1.usage.completion_tokens
    asked = chatkit.ChatMessage.from_dict({**m.model_dump(exclude_none=True), "content": None})
    fresh = tool_session(think, [chatkit.ChatMessage.user("Weather in Paris?"), asked])
    assert r2.choices[0].message.content == fresh.respond("sunny", role="tool", tool_call_id=m.tool_calls[0].id)


def test_reasoning_comes_as_reasoning_content_streamed_or_not(think):
    reply = "<think>\nFirst, think.\n\n</think>\n\nSunny today.\n"
    with scripted_server(think, [reply, reply]) as running:
        c = client(running)
        whole = chat(c, [user("Weather?")]).choices[0].message
        chunks = list(chat(c, [user("Weather, streamed?")], stream=True))
    deltas = [ch.choices[0].delta for ch in chunks if ch.choices]
    # The deltas add up to the message the session committed: the newlines around the think block are
    # the template's glue, not text (a client re-sending what it streamed continues the session).
    assert (whole.reasoning_content, whole.content) == ("First, think.", "Sunny today.")
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == "First, think."
    assert "".join(d.content or "" for d in deltas) == "Sunny today."
    assert chunks[-1].choices[0].finish_reason == "stop" and whole.tool_calls is None


def test_serve_refuses_bad_batch_and_draft_flags(capsys):
    from chatkit.cli.serve import main

    assert main(["--batch", "-1"]) == 2 and "--batch >= 0" in capsys.readouterr().err  # 2: a bad flag, as in chat
    assert main(["--batch", "4", "--parallel", "8"]) == 2 and "leave out --parallel 8" in capsys.readouterr().err
    assert main(["--draft", "demo", "--num-draft", "many"]) == 2
    assert "'auto'" in capsys.readouterr().err


def test_serve_checks_the_model_flags_as_chat_does(capsys):
    """--num-draft, --temp and --max-tokens are declared once for chatkit chat and chatkit serve
    (chatkit/cli/args.py): the same rules, and serve refuses a bad value before it loads a model."""
    from chatkit.cli.serve import main

    for flags, rule in ((["--num-draft", "65"], "use 'auto' or 1 to 64"), (["--temp", "nan"], "use 0 (greedy)"),
                        (["--max-tokens", "0"], "use 1 or more")):
        assert main(flags) == 2 and rule in capsys.readouterr().err


def test_serve_takes_a_context_policy(capsys):
    """--context-policy is chatkit chat's flag too (default rolling); a bad value is refused before loading."""
    from chatkit.cli.serve import main, parser, server_config

    assert server_config(parser().parse_args([])).context_policy == chatkit.ContextPolicy.rolling()
    assert server_config(parser().parse_args(["--context-policy", "summarize"])).context_policy.mode == "summarize"
    assert server_config(parser().parse_args(["--context-policy", "error"])).context_policy == chatkit.ContextPolicy.error()
    assert main(["--context-policy", "forget"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and "--context-policy" in err and "'rolling'" in err


@pytest.mark.parametrize("arguments, unread", [('{"x": "\\ud800"}', None), ("\ud800", None), ('{"x": ' * 100_000, True)])
def test_re_sent_calls_no_tokenizer_takes_are_a_400_never_a_500(arguments, unread):
    """A lone surrogate is a 400; JSON nested too deeply to read comes back as an unread call."""
    from chatkit.server.chat_completions import parse_chat
    from chatkit.server.errors import BadRequestError

    call = {"id": "abcdefghi", "type": "function", "function": {"name": "f", "arguments": arguments}}
    body = {"messages": [{"role": "user", "content": "go"}, {"role": "assistant", "content": None, "tool_calls": [call]},
                         {"role": "tool", "tool_call_id": "abcdefghi", "content": "ok"}]}
    if unread is None:
        with pytest.raises(BadRequestError, match="surrogate"):
            parse_chat(body, GenerateParams())
        return
    request = parse_chat(body, GenerateParams())
    (sent,) = next(m for m in (*request.history, *request.added) if m.tool_calls).tool_calls
    assert sent.error is not None and sent.arguments == {}


# -- conversations that outlive the context window ----------------------------------------------------
WINDOW = 256
COLOURS = ["red", "green", "blue", "yellow", "purple", "orange", "black", "white"]
LONG = [f"Message {i}: tell me about the colour {c}." for i, c in enumerate(COLOURS * 3)]


def small_window(lm, window=WINDOW):
    """The same model and weights, with a small context window."""
    return chatkit.LoadedModel(lm.model, lm.tokenizer, {**lm.config, "max_position_embeddings": window}, lm.source)


def summary_of(messages):
    return f"{len(messages)} messages about colours."


@pytest.mark.slow
def test_a_responses_chain_past_the_window_goes_on_as_a_session_with_the_policy_does(lm, tmp_path):
    """previous_response_id chains past the window: the server applies its context policy (here one that
    summarizes, waiting for the compaction prepared after each turn), answers as an in-process session
    with that policy does, and says when a turn compacted: a header and ``usage.context``. Across a
    restart the conversation keeps what the model saw (the summary, the dropped messages)."""
    small = small_window(lm)
    policy = chatkit.ContextPolicy.summarize(summarizer=summary_of, fallback="wait")
    params = GenerateParams(max_tokens=8, temperature=0.0)
    truth = ChatSession.builder(small).instructions(SYSTEM).generate_params(params.copy()).context_policy(policy).build()
    config = ServerConfig(defaults=params, context_policy=policy, store=str(tmp_path / "store"))
    previous, reported = None, []
    with start(small, config) as running:
        c = client(running)
        for prompt in LONG[:16]:
            raw = c.responses.with_raw_response.create(model="any", input=prompt, instructions=SYSTEM,
                                                       previous_response_id=previous)
            r = raw.parse()
            assert r.output_text == truth.respond(prompt), prompt
            truth.prepare_compaction()  # as the server does after each turn
            usage = r.usage.model_dump()
            assert usage["input_tokens"] + params.max_tokens <= WINDOW
            header = raw.headers.get("chatkit-context-compacted")
            if truth.last_stats.compacted:
                stats = truth.last_stats
                context = {"compacted": True, "dropped_messages": len(truth.dropped_messages),
                           "dropped_tokens": stats.dropped_tokens, "summary_tokens": stats.summary_tokens}
                assert usage["context"] == context and c.responses.retrieve(r.id).usage.model_dump()["context"] == context
                assert header == ", ".join(f"{k}={v}" for k, v in context.items() if k != "compacted")
                reported.append(context)
            else:
                assert "context" not in usage and header is None
            previous = r.id
    assert reported and any(r["summary_tokens"] > 0 for r in reported) and reported[-1]["dropped_messages"] >= 4
    with start(small, config) as running:  # restarted: the saved conversation keeps its window and summary
        r = client(running).responses.create(model="any", input=LONG[16], instructions=SYSTEM,
                                             previous_response_id=previous)
    assert r.output_text == truth.respond(LONG[16])
    assert (r.usage.input_tokens, r.usage.input_tokens_details.cached_tokens) == (
        truth.last_stats.prompt_tokens, truth.last_stats.reused_tokens)


def test_a_re_sent_chat_past_the_window_goes_on_on_its_pooled_session(lm):
    """A stateless client re-sending the whole conversation: the server's default policy (rolling) keeps
    it going; the pooled session is still found by what is re-sent (only the new message is prefilled
    between compactions), and a compaction is reported streamed too (in the usage chunk). With
    ``ContextPolicy.error()`` the same conversation is a 413."""
    small = small_window(lm)
    params = GenerateParams(max_tokens=8, temperature=0.0)
    with start(small, ServerConfig(defaults=params)) as running:
        c = client(running)
        messages, usages, headers = [{"role": "system", "content": SYSTEM}], [], []
        for i, prompt in enumerate(LONG[:14]):
            messages.append(user(prompt))
            if i % 2:
                chunks = list(chat(c, messages, stream=True, stream_options={"include_usage": True}))
                text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
                usages.append(chunks[-1].usage)
                headers.append(None)
            else:
                raw = c.chat.completions.with_raw_response.create(model="any", messages=messages)
                r = raw.parse()
                text, headers = r.choices[0].message.content, [*headers, raw.headers.get("chatkit-context-compacted")]
                usages.append(r.usage)
            messages.append({"role": "assistant", "content": text})
    contexts = [u.model_dump().get("context") for u in usages]
    compacted = [i for i, ctx in enumerate(contexts) if ctx]
    assert compacted and all(contexts[i]["compacted"] and contexts[i]["summary_tokens"] == 0 for i in compacted)
    assert any(i % 2 for i in compacted) or any(headers[i] for i in compacted)
    assert all(headers[i] == f"dropped_messages={contexts[i]['dropped_messages']}, dropped_tokens="
               f"{contexts[i]['dropped_tokens']}, summary_tokens=0" for i in compacted if i % 2 == 0)
    for i in range(1, len(usages)):
        assert usages[i].prompt_tokens + params.max_tokens <= WINDOW
        if i not in compacted:  # found by what was re-sent: what the model saw before is reused
            assert usages[i].prompt_tokens_details.cached_tokens >= usages[i - 1].prompt_tokens

    with start(small, ServerConfig(defaults=params, context_policy=chatkit.ContextPolicy.error())) as running:
        status, data = post(running, "/chat/completions", {"messages": messages[:-1]})
    assert status == 413 and data["error"]["code"] == "context_length_exceeded"


def test_serve_takes_a_kv_budget_per_conversation(lm):
    """--max-kv-bytes: each conversation's window is the tokens its budget holds (a 413 past it with the
    error policy, as past the model's own window); a budget too small for one exchange is a 400."""
    from chatkit.cli.serve import parser, server_config

    assert server_config(parser().parse_args(["--max-kv-bytes", "2GB"])).max_kv_bytes == 2 * 10**9
    per_token = lm.kv_bytes_per_token()
    config = ServerConfig(defaults=PARAMS, max_kv_bytes=per_token * 120, context_policy=chatkit.ContextPolicy.error())
    with start(lm, config) as running:
        status, _ = post(running, "/chat/completions", {"messages": [user("Hi")]})
        assert status == 200
        status, data = post(running, "/chat/completions", {"messages": [user(" ".join(LONG[:20]))]})
        assert status == 413 and data["error"]["code"] == "context_length_exceeded" and "120" in data["error"]["message"]
    with start(lm, ServerConfig(defaults=PARAMS, max_kv_bytes=per_token * 4)) as running:
        status, data = post(running, "/chat/completions", {"messages": [user("Hi")]})
    assert status == 400 and "max_kv_bytes" in data["error"]["message"]

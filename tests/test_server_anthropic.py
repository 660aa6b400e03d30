"""chatkit serve's Anthropic Messages API, driven over loopback by the official anthropic client (and raw
HTTP for the event stream and the error cases): replies equal an in-process session's, re-sent
conversations reuse the cache, tool rounds and thinking travel as Anthropic's blocks, errors are
Anthropic-style JSON with the right status and leave conversations intact."""

import json

import chatkit
from chatkit import ChatSession, GenerateParams
from chatkit.errors import ContextWindowExceededError, SessionBusyError
from chatkit.server import ServerConfig, start
from chatkit.server.anthropic_wire import error_body
from chatkit.server.errors import OverloadedError, UnknownResponseError
from chatkit.server.wire import guided_available
from chatkit.testing import Scripted

import anthropic
import httpx
import pytest
from helpers.forcing import Ban, Favour, FavourFirst

PARAMS = GenerateParams(max_tokens=10, temperature=0.0)
SYSTEM = "Be brief."


@pytest.fixture(scope="module")
def lm(tiny):
    return tiny("qwen3", "bpe", 0)


@pytest.fixture(scope="module")
def think(tiny):
    return tiny("qwen3", "bpe-think", 0)


@pytest.fixture(scope="module")
def server(lm):
    with start(lm, ServerConfig(model_id="tiny", defaults=PARAMS)) as running:
        yield running


def client(running, api_key="x"):
    return anthropic.Anthropic(base_url=running.url.removesuffix("/v1"), api_key=api_key, max_retries=0)


def ask(c, messages, max_tokens=10, **kw):
    return c.messages.create(model="any", system=SYSTEM, messages=messages, max_tokens=max_tokens, **kw)


def replies_in_process(lm, prompts, *, params=PARAMS, instructions=SYSTEM):
    session = ChatSession.builder(lm).instructions(instructions).generate_params(params.copy()).build()
    return [session.respond(p) for p in prompts]


def user(text):
    return {"role": "user", "content": text}


def text_of(message):
    return "".join(b.text for b in message.content if b.type == "text")


def test_a_message_equals_the_in_process_session(server, lm):
    r = ask(client(server), [user("Hello there")])
    assert (r.type, r.role, r.model, r.id[:4]) == ("message", "assistant", "tiny", "msg_")
    assert text_of(r) == replies_in_process(lm, ["Hello there"])[0]
    assert r.stop_reason in ("end_turn", "max_tokens") and r.stop_sequence is None
    assert r.usage.input_tokens > 0 and r.usage.cache_read_input_tokens == 0 and r.usage.cache_creation_input_tokens == 0
    assert 0 < r.usage.output_tokens <= 10


def test_streaming_gives_the_same_message_and_anthropics_events(server, lm):
    c = client(server)
    with c.messages.stream(model="any", system=SYSTEM, messages=[user("Stream me")], max_tokens=10) as s:
        texts = list(s.text_stream)
        final = s.get_final_message()
    assert "".join(texts) == text_of(final) == replies_in_process(lm, ["Stream me"])[0]
    assert final.usage.input_tokens > 0 and final.usage.output_tokens > 0
    body = {"model": "any", "system": SYSTEM, "messages": [user("Stream me too")], "max_tokens": 10, "stream": True}
    with httpx.stream("POST", f"{server.url}/messages", json=body, timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [(e.split("\n")[0], json.loads(e.split("\n")[1].removeprefix("data: ")))
                  for e in r.read().decode().split("\n\n") if e]
    names = [name.removeprefix("event: ") for name, _ in events]
    assert all(data["type"] == name for name, (_, data) in zip(names, events, strict=True))
    assert names[:3] == ["message_start", "ping", "content_block_start"] and names[-2:] == ["message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"} and names[-3] == "content_block_stop"
    start_msg = events[0][1]["message"]
    assert start_msg["content"] == [] and start_msg["stop_reason"] is None and "input_tokens" in start_msg["usage"]
    delta = events[-2][1]
    assert delta["delta"]["stop_reason"] in ("end_turn", "max_tokens") and delta["usage"]["output_tokens"] > 0
    streamed = "".join(d["delta"]["text"] for n, (_, d) in zip(names, events, strict=True) if n == "content_block_delta")
    assert streamed == replies_in_process(lm, ["Stream me too"])[0]


def conversation(c, prompts, **kw):
    messages, out = [], []
    for p in prompts:
        messages.append(user(p))
        r = ask(c, messages, **kw)
        out.append(r)
        messages.append({"role": "assistant", "content": [b.model_dump() for b in r.content]})
    return out


def test_a_re_sent_conversation_reuses_the_cache(lm):
    with start(lm, ServerConfig(defaults=PARAMS)) as running:
        rs = conversation(client(running), ["My name is Ada.", "What is my name?", "And again?"])
    truth = replies_in_process(lm, ["My name is Ada.", "What is my name?", "And again?"])
    assert [text_of(r) for r in rs] == truth
    for before, r in zip(rs, rs[1:]):
        # everything the last request saw and produced is read from the cache; only the new message is input
        prompt = before.usage.input_tokens + before.usage.cache_read_input_tokens
        assert r.usage.cache_read_input_tokens == prompt + before.usage.output_tokens
        assert r.usage.input_tokens < 20


def test_count_tokens_is_the_prompt_a_reply_reports(server):
    c = client(server)
    messages = [user("Count me, please")]
    tools = [WEATHER]
    for kw in ({}, {"tools": tools}):
        n = c.messages.count_tokens(model="any", system=SYSTEM, messages=messages, **kw).input_tokens
        r = ask(c, messages, max_tokens=2, **kw)
        assert n == r.usage.input_tokens + r.usage.cache_read_input_tokens
    assert c.messages.count_tokens(model="any", system=SYSTEM, messages=messages, tools=tools).input_tokens > n - 1


def test_counting_again_with_the_same_instructions_and_tools_builds_no_session(lm, monkeypatch):
    from chatkit.server.session_index import COUNTERS, SessionIndex

    built = []
    real = SessionIndex._build
    monkeypatch.setattr(SessionIndex, "_build", lambda self, *a, **kw: built.append(a[:1]) or real(self, *a, **kw))
    with start(lm, ServerConfig(model_id="tiny", defaults=PARAMS)) as running:
        c = client(running)
        counts = [c.messages.count_tokens(model="any", system=SYSTEM, messages=[user("Count me" * k)]).input_tokens
                  for k in (1, 2, 1)]
        assert len(built) == 1 and counts[0] == counts[2] < counts[1]
        c.messages.count_tokens(model="any", system=SYSTEM, messages=[user("hi")], tools=[WEATHER])
        assert len(built) == 2  # other tools: another prompt, another counter
        for i in range(COUNTERS):
            c.messages.count_tokens(model="any", system=f"System {i}", messages=[user("hi")])
        c.messages.count_tokens(model="any", system=SYSTEM, messages=[user("hi")])
        assert len(built) == 2 + COUNTERS + 1  # the least recently used were let go


def test_stop_sequences_and_max_tokens(server, lm):
    c = client(server)
    free = text_of(ask(c, [user("Say something long")], max_tokens=12))
    words = free.split()
    assert len(words) > 1, free
    stop = words[1]
    r = ask(c, [user("Say something long")], max_tokens=12, stop_sequences=["zzzqqq", stop])
    assert (r.stop_reason, r.stop_sequence) == ("stop_sequence", stop)
    assert text_of(r) == free[:free.index(stop)]
    r = ask(c, [user("Say something long")], max_tokens=3)
    assert r.stop_reason == "max_tokens" and r.usage.output_tokens == 3


# -- tools and thinking: a script forces the random model's replies (Qwen3's format) ----------------------
WEATHER = {"name": "get_weather", "description": "The weather of a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def call_text(name, **arguments):
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


THINK_AND_CALL = "<think>\nLook it up.\n</think>\n\n" + call_text("get_weather", city="Paris")


def scripted_server(lm, replies, max_tokens=60):
    script = Scripted(lm.tokenizer, replies)
    return start(lm, ServerConfig(defaults=GenerateParams(max_tokens=max_tokens, logits_processors=[script])))


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_round_trip_reuses_the_cache_and_equals_a_fresh_session(think, stream):
    with scripted_server(think, [THINK_AND_CALL]) as running:
        c = client(running)
        messages = [user("Weather in Paris?")]
        if stream:
            with c.messages.stream(model="any", system=SYSTEM, messages=messages, max_tokens=60,
                                   tools=[WEATHER], tool_choice={"type": "auto"}) as s:
                r1 = s.get_final_message()
        else:
            r1 = ask(c, messages, max_tokens=60, tools=[WEATHER], tool_choice={"type": "auto"})
        assert r1.stop_reason == "tool_use" and [b.type for b in r1.content] == ["thinking", "tool_use"]
        thinking, call = r1.content
        assert thinking.thinking == "Look it up." and thinking.signature
        assert (call.name, call.input) == ("get_weather", {"city": "Paris"})
        messages += [{"role": "assistant", "content": [b.model_dump() for b in r1.content]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "sunny"}]}]
        r2 = ask(c, messages, max_tokens=8, tools=[WEATHER])
    assert r2.usage.cache_read_input_tokens == r1.usage.input_tokens + r1.usage.output_tokens
    assert r2.usage.input_tokens < 20
    asked = chatkit.ChatMessage.assistant("", reasoning="Look it up.", tool_calls=[
        chatkit.ToolCall(call.id, "get_weather", {"city": "Paris"})])
    tool = {"type": "function", "function": {"name": WEATHER["name"], "description": WEATHER["description"],
                                             "parameters": WEATHER["input_schema"]}}
    fresh = (ChatSession.builder(think).instructions(SYSTEM).history([chatkit.ChatMessage.user("Weather in Paris?"), asked])
             .tools([tool], tool_execution="manual").generate_params(GenerateParams(max_tokens=8)).build())
    assert text_of(r2) == fresh.respond("sunny", role="tool", tool_call_id=call.id)



def test_tool_choice_none_keeps_the_model_from_calling(think):
    (start_call,) = think.tokenizer.encode("<tool_call>", add_special_tokens=False)
    with start(think, ServerConfig(defaults=GenerateParams(max_tokens=6, logits_processors=[Favour(start_call)]))) as running:
        none = ask(client(running), [user("Weather?")], tools=[WEATHER], tool_choice={"type": "none"})
    assert none.stop_reason != "tool_use" and text_of(none)


def bounded(name):
    """A tool whose one string argument is bounded (a random model never ends a free string)."""
    return {"name": name, "description": f"The {name} of a city.", "input_schema": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 6}}, "required": ["city"]}}


@pytest.mark.skipif(not guided_available(), reason="needs the guided extra")
def test_tool_choice_any_and_tool_force_calls_and_disable_parallel_keeps_one(think):
    tools = [bounded("get_weather"), bounded("local_time")]
    with start(think, ServerConfig(defaults=GenerateParams(max_tokens=80))) as running:
        c = client(running)
        free = ask(c, [user("Weather?")], max_tokens=80, tools=tools)
        forced = ask(c, [user("Weather?")], max_tokens=80, tools=tools, tool_choice={"type": "any"})
        named = ask(c, [user("Weather?")], max_tokens=80, tools=tools, tool_choice={"type": "tool", "name": "local_time"})
        single = ask(c, [user("Weather?")], max_tokens=80, tools=tools,
                     tool_choice={"type": "any", "disable_parallel_tool_use": True})
        with pytest.raises(anthropic.BadRequestError, match="not one of the request's tools"):
            ask(c, [user("Weather?")], tools=tools, tool_choice={"type": "tool", "name": "nope"})
    assert free.stop_reason != "tool_use"  # the random model does not call by itself
    for reply, names in ((forced, {"get_weather", "local_time"}), (named, {"local_time"}),
                         (single, {"get_weather", "local_time"})):
        calls = [b for b in reply.content if b.type == "tool_use"]
        assert reply.stop_reason == "tool_use" and calls and not text_of(reply)
        assert all(b.name in names and isinstance(b.input.get("city"), str) for b in calls)
    assert len([b for b in single.content if b.type == "tool_use"]) == 1


def test_thinking_comes_as_a_thinking_block_and_its_budget_holds(think):
    with scripted_server(think, ["<think>\nHmm, let me see.\n</think>\n\nHello!"]) as running:
        r = ask(client(running), [user("Hi")], max_tokens=60, thinking={"type": "enabled", "budget_tokens": 100})
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in r.content] == [
        ("thinking", "Hmm, let me see."), ("text", "Hello!")]
    tok = think.tokenizer
    budgeted, unbounded = (thought(think, thinking) for thinking in (
        {"type": "enabled", "budget_tokens": 5}, {"type": "adaptive"}))
    lengths = [len(tok.encode(r.content[0].thinking, add_special_tokens=False)) for r in (budgeted, unbounded)]
    assert [r.content[0].type for r in (budgeted, unbounded)] == ["thinking", "thinking"]
    assert lengths[0] <= 5 < lengths[1] and text_of(budgeted) and budgeted.stop_reason == "max_tokens"


def thought(think, thinking):
    """A reply that opens a thought, which the random model would never close (only a budget does)."""
    tok = think.tokenizer
    (end,) = tok.think_end_tokens
    (open_,) = tok.encode("<think>", add_special_tokens=False)
    params = GenerateParams(max_tokens=20, logits_processors=[FavourFirst(open_), Ban(end, *tok.eos_token_ids)])
    with start(think, ServerConfig(defaults=params)) as running:
        return ask(client(running), [user("Hi")], max_tokens=20, thinking=thinking)




# -- errors: Anthropic-style JSON, the right status and exception class, nothing changed ---------------------------
def post(running, path, body, **kw):
    r = httpx.post(f"{running.url}{path}", json=body, timeout=60, **kw)
    return r.status_code, r.json()


TOOL_USE = {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {}}]}


@pytest.mark.parametrize("body, param", [
    ({"messages": [user("hi")]}, "max_tokens"),
    ({"messages": [{"role": "system", "content": "hi"}], "max_tokens": 5}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "video"}]}], "max_tokens": 5}, "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}], "max_tokens": 5},
     "messages[0].content[0]"),
    ({"messages": [user("hi"), TOOL_USE, {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "nope", "content": "1"}]}], "max_tokens": 5}, "messages[2].content[0]"),
    ({"messages": [user("hi"), TOOL_USE, user("go on")], "max_tokens": 5}, "messages[1]"),
    ({"messages": [user("hi")], "max_tokens": 5, "tools": [{"name": "f"}]}, "tools[0].input_schema"),
    ({"messages": [user("hi")], "max_tokens": 5, "tools": [{"type": "web_search_20250305", "name": "w"}]}, "tools[0]"),
    ({"messages": [user("hi")], "max_tokens": 5, "thinking": {"type": "enabled"}}, "thinking"),
    ({"messages": [user("hi")], "max_tokens": 0}, "max_tokens"),
    ({"messages": [user("hi"), {"role": "assistant", "content": "Sure"}], "max_tokens": 5}, "messages[1]"),
])
def test_invalid_requests_are_400_in_anthropics_shape(server, body, param):
    status, data = post(server, "/messages", {"model": "any", **body})
    assert status == 400 and data["type"] == "error" and data["error"]["type"] == "invalid_request_error"
    assert param in data["error"]["message"]


def test_sdk_exceptions_and_a_refused_request_leaves_the_conversation_intact(lm):
    with start(lm, ServerConfig(defaults=PARAMS, api_key="sesame")) as running:
        with pytest.raises(anthropic.AuthenticationError):
            ask(client(running, api_key="wrong"), [user("hi")])
        status, data = post(running, "/messages", {"model": "m", "max_tokens": 5, "messages": [user("hi")]},
                            headers={"Authorization": "Bearer sesame"})
        assert status == 200 and data["type"] == "message"
        status, data = post(running, "/messages/count_tokens", {"model": "m", "messages": [user("hi")]})
        assert status == 401 and data["error"]["type"] == "authentication_error" and "x-api-key" in data["error"]["message"]
        # OpenAI's routes take the bearer token only, and answer in OpenAI's shape
        status, data = post(running, "/chat/completions", {"messages": [user("hi")]}, headers={"x-api-key": "sesame"})
        assert status == 401 and data["error"]["code"] == "invalid_api_key"
        c = client(running, api_key="sesame")
        with pytest.raises(anthropic.NotFoundError):
            c.get("/v1/nothing-here", cast_to=object)
        (first,) = conversation(c, ["My name is Ada."])
        history = [user("My name is Ada."), {"role": "assistant", "content": [b.model_dump() for b in first.content]}]
        with pytest.raises(anthropic.BadRequestError, match="image"):
            ask(c, [*history, {"role": "user", "content": [{"type": "image", "source": {
                "type": "base64", "media_type": "image/png", "data": "AAAA"}}]}])
        r = ask(c, [*history, user("What is my name?")])
    assert text_of(r) == replies_in_process(lm, ["My name is Ada.", "What is my name?"])[1]
    assert r.usage.cache_read_input_tokens == first.usage.input_tokens + first.usage.output_tokens


@pytest.mark.parametrize("exc, status, kind", [
    (SessionBusyError("busy"), 409, "invalid_request_error"),
    (OverloadedError("later"), 503, "overloaded_error"),
    (ContextWindowExceededError("long", prompt_tokens=9, context_length=8), 413, "request_too_large"),
    (UnknownResponseError("no"), 404, "not_found_error"),
    (RuntimeError("secret"), 500, "api_error"),
])
def test_every_error_has_anthropics_type_and_chatkits_status(exc, status, kind):
    got, body = error_body(exc)
    assert (got, body["type"], body["error"]["type"]) == (status, "error", kind)
    assert "secret" not in body["error"]["message"]


@pytest.mark.parametrize("anthropic_choice, openai_choice", [
    (None, {}),
    ({"type": "auto"}, {"tool_choice": "auto"}),
    ({"type": "none"}, {"tool_choice": "none"}),
    ({"type": "any"}, {"tool_choice": "required"}),
    ({"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
     {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}, "parallel_tool_calls": False}),
])
def test_anthropics_tools_and_tool_choice_read_as_openais_by_the_one_reader(anthropic_choice, openai_choice):
    from chatkit.server.anthropic_wire import parse_messages
    from chatkit.server.chat_completions import parse_chat

    choice = {"tool_choice": anthropic_choice} if anthropic_choice is not None else {}
    ours = parse_messages({"max_tokens": 5, "messages": [user("Weather?")], "tools": [WEATHER], **choice}, PARAMS)
    function = {"name": WEATHER["name"], "description": WEATHER["description"], "parameters": WEATHER["input_schema"]}
    theirs = parse_chat({"messages": [user("Weather?")], "tools": [{"type": "function", "function": function}],
                         **openai_choice}, PARAMS)
    fields = ("tools", "tool_choice", "tool_name", "parallel_tool_calls", "strict_tools")
    assert [getattr(ours, f) for f in fields] == [getattr(theirs, f) for f in fields]

"""A real ``chatkit serve`` process (the demo model) driven by the official ``anthropic`` SDK, as an agent
written for Anthropic's API would drive a local model: a message, a stream, count_tokens, an error, and
a re-sent conversation that reads its prompt from the cache."""

import anthropic
import pytest


def client(served):
    return anthropic.Anthropic(base_url=served.url, api_key="local", max_retries=0)


def ask(c, messages, **kw):
    return c.messages.create(model="demo", system="Be brief.", messages=messages, max_tokens=16, **kw)


def text_of(message):
    return "".join(b.text for b in message.content if b.type == "text")


def test_a_message_and_its_stream_say_the_same(demo_server):
    c = client(demo_server)
    messages = [{"role": "user", "content": "Hello! What can you do?"}]
    r = ask(c, messages)
    assert r.type == "message" and r.role == "assistant" and text_of(r)
    assert r.stop_reason in ("end_turn", "max_tokens") and r.usage.output_tokens > 0
    with c.messages.stream(model="demo", system="Be brief.", messages=messages, max_tokens=16) as s:
        streamed = "".join(s.text_stream)
        final = s.get_final_message()
    assert streamed == text_of(final) == text_of(r) and final.stop_reason == r.stop_reason


def test_count_tokens_and_an_error(demo_server):
    c = client(demo_server)
    messages = [{"role": "user", "content": "Count my tokens."}]
    n = c.messages.count_tokens(model="demo", system="Be brief.", messages=messages).input_tokens
    r = ask(c, messages)
    assert n == r.usage.input_tokens + r.usage.cache_read_input_tokens > 0
    with pytest.raises(anthropic.BadRequestError, match="tool_use_id"):
        ask(c, [*messages, {"role": "assistant", "content": "Sure."},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "nope", "content": "1"}]}])


def test_a_re_sent_conversation_reads_its_prompt_from_the_cache(demo_server):
    c = client(demo_server)
    messages, replies = [], []
    for prompt in ("My name is Ada.", "What is my name?", "Thanks!"):
        messages.append({"role": "user", "content": prompt})
        replies.append(ask(c, messages))
        messages.append({"role": "assistant", "content": [b.model_dump() for b in replies[-1].content]})
    for before, r in zip(replies, replies[1:]):
        seen = before.usage.input_tokens + before.usage.cache_read_input_tokens + before.usage.output_tokens
        assert r.usage.cache_read_input_tokens == seen and r.usage.input_tokens < 30

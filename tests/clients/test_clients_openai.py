"""A real ``chatkit serve`` process (the demo model) through the official openai SDK, endpoint by
endpoint: models, chat completions (plain and streamed), responses (create, retrieve, delete, input
items), /health and /metrics, and a response chain that outlives a restart."""

import re

import httpx
import openai
import pytest

SYSTEM = "Be brief."


def sdk(served):
    return openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0, timeout=120)


def metrics(served):
    r = httpx.get(f"{served.url}/metrics", timeout=60)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    found = re.findall(r'^([a-z_]+(?:\{.*\})?) ([0-9.e+-]+|\+Inf)$', r.text, re.MULTILINE)
    return {name: float(value) for name, value in found}


def test_models(demo_server):
    c = sdk(demo_server)
    assert [m.id for m in c.models.list()] == ["demo"]
    assert c.models.retrieve("demo").id == "demo"
    with pytest.raises(openai.NotFoundError):
        c.models.retrieve("gpt-4o")


def test_chat_completions_plain_and_streamed_agree(demo_server):
    c = sdk(demo_server)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "My name is Ada."}]
    plain = c.chat.completions.create(model="demo", messages=messages)
    stream = c.chat.completions.create(model="demo", messages=messages, stream=True)
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert plain.choices[0].message.content and streamed == plain.choices[0].message.content
    messages += [{"role": "assistant", "content": streamed}, {"role": "user", "content": "What is my name?"}]
    again = c.chat.completions.create(model="demo", messages=messages)
    assert "Ada" in again.choices[0].message.content
    assert again.usage.prompt_tokens_details.cached_tokens >= plain.usage.prompt_tokens


def test_responses_create_retrieve_input_items_delete(demo_server):
    c = sdk(demo_server)
    r1 = c.responses.create(model="demo", input="My name is Ada.", instructions=SYSTEM)
    r2 = c.responses.create(model="demo", input="What is my name?", instructions=SYSTEM, previous_response_id=r1.id)
    assert "Ada" in r2.output_text and c.responses.retrieve(r2.id).output_text == r2.output_text
    items = c.responses.input_items.list(r2.id, order="asc").data
    assert [(i.role, i.content[0].text) for i in items] == [
        ("user", "My name is Ada."), ("assistant", r1.output_text), ("user", "What is my name?")]
    assert [i.id for i in c.responses.input_items.list(r2.id, limit=1)] == [i.id for i in reversed(items)]
    c.responses.delete(r1.id)  # the SDK returns nothing; a second delete is a 404
    with pytest.raises(openai.NotFoundError):
        c.responses.delete(r1.id)
    with pytest.raises(openai.NotFoundError):
        c.responses.create(model="demo", input="And?", instructions=SYSTEM, previous_response_id=r2.id)
    assert c.responses.retrieve(r2.id).output_text == r2.output_text


def test_health_and_metrics(demo_server):
    health = httpx.get(f"{demo_server.url}/health", timeout=60)
    assert health.status_code == 200 and health.json()["status"] == "ok"
    before = metrics(demo_server)
    reply = sdk(demo_server).chat.completions.create(model="demo", messages=[{"role": "user", "content": "Spell cat."}])
    after = metrics(demo_server)
    route = 'chatkit_requests_total{method="POST",route="/v1/chat/completions",status="200"}'
    assert after[route] == before.get(route, 0) + 1
    assert after["chatkit_completion_tokens_total"] == before["chatkit_completion_tokens_total"] + reply.usage.completion_tokens
    assert after["chatkit_prompt_tokens_total"] == before["chatkit_prompt_tokens_total"] + reply.usage.prompt_tokens
    assert after["chatkit_time_to_first_token_seconds_count"] == before["chatkit_time_to_first_token_seconds_count"] + 1
    assert after["chatkit_sessions_pooled"] >= 1 and after["chatkit_kv_cache_memory_bytes"] > 0


@pytest.mark.slow
def test_a_response_chain_survives_a_restart(demo_server):
    served = demo_server  # restarted here: the module's other cases need no fresh server, only a working one
    c = sdk(served)
    r1 = c.responses.create(model="demo", input="My name is Ada.", instructions=SYSTEM)
    r2 = c.responses.create(model="demo", input="What is 7 + 5?", instructions=SYSTEM, previous_response_id=r1.id)
    served.restart()
    c = sdk(served)
    assert c.responses.retrieve(r2.id).output_text == r2.output_text
    assert len(c.responses.input_items.list(r2.id).data) == 3
    r3 = c.responses.create(model="demo", input="What is my name?", instructions=SYSTEM, previous_response_id=r2.id)
    assert "Ada" in r3.output_text
    assert r3.usage.input_tokens_details.cached_tokens == r2.usage.input_tokens + r2.usage.output_tokens
    assert metrics(served)["chatkit_kv_cache_disk_bytes"] > 0

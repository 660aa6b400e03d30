"""The chat page's side of chatkit serve: ``GET /`` serves the page and its files without the API key
check, and ``GET /v1/conversations`` lists the stored conversations (branches under their first
response, newest first, across a restart) and ``GET /v1/conversations/{id}`` gives a chain's turns.
The page itself, in a real browser: tests/clients/test_web_page.py."""

import chatkit
from chatkit import GenerateParams
from chatkit.server import ServerConfig, start

import httpx
import pytest

PARAMS = GenerateParams(max_tokens=24, temperature=0.0)
KEY = {"Authorization": "Bearer secret"}


@pytest.fixture(scope="module")
def demo():
    return chatkit.load("demo")


def root(running):
    return running.url.removesuffix("/v1")


def test_the_page_and_its_files_are_served_without_the_api_key(demo):
    with start(demo, ServerConfig(api_key="secret", defaults=PARAMS)) as running:
        page = httpx.get(root(running) + "/")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        for name, kind in (("app.js", "javascript"), ("style.css", "text/css")):
            assert f"static/{name}" in page.text
            file = httpx.get(f"{root(running)}/static/{name}")
            assert file.status_code == 200 and kind in file.headers["content-type"] and file.text
        assert httpx.get(f"{root(running)}/static/nothing.js").status_code == 404
        # the API behind it still wants the key, the listing included
        assert httpx.get(f"{running.url}/conversations").status_code == 401
        assert httpx.get(f"{running.url}/conversations", headers=KEY).json()["data"] == []


def respond(running, text, previous=None, **kw):
    body = {"input": text, "previous_response_id": previous, **kw}
    r = httpx.post(f"{running.url}/responses", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def output_text(response):
    return "".join(p["text"] for item in response["output"] if item["type"] == "message" for p in item["content"])


def test_conversations_list_stored_chains_with_their_branches_across_a_restart(demo, tmp_path):
    config = ServerConfig(defaults=PARAMS, store=str(tmp_path / "store"))
    with start(demo, config) as running:
        a = respond(running, "My name is  Noor.")
        b = respond(running, "What did I say my name was?", a["id"])
        again = respond(running, "What did I say my name was?", a["id"])  # regenerated: a branch, now the head
        other = respond(running, "What is my favourite colour?")
        respond(running, "Not kept", other["id"], store=False)
        listed = httpx.get(f"{running.url}/conversations").json()["data"]
        turns = httpx.get(f"{running.url}/conversations/{b['id']}").json()
        assert httpx.get(f"{running.url}/conversations/resp_nothing").status_code == 404
    assert [(c["id"], c["head"], c["turns"], c["title"]) for c in listed] == [
        (other["id"], other["id"], 1, "What is my favourite colour?"),
        (a["id"], again["id"], 2, "My name is Noor."),  # the title with its spaces folded
    ]
    assert listed[1]["updated_at"] == again["created_at"]
    assert turns["head"] == b["id"]
    assert [t["response"] for t in turns["data"]] == [a, b]
    assert [t["input"] for t in turns["data"]] == [
        [{"type": "message", "role": "user", "content": "My name is  Noor."}],
        [{"type": "message", "role": "user", "content": "What did I say my name was?"}]]
    assert "Noor" in output_text(b)
    with start(demo, config) as running:  # the same from the store, in the same order
        assert httpx.get(f"{running.url}/conversations").json()["data"] == listed
        assert httpx.get(f"{root(running)}/conversations/{b['id']}").json() == turns  # also without /v1


def test_a_conversation_shows_the_tool_calls_and_results_of_its_turns(demo):
    calculate = {"type": "function", "name": "calculate", "parameters": {
        "type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}
    with start(demo, ServerConfig(defaults=PARAMS)) as running:
        asked = respond(running, "What is 25 + 30?", tools=[calculate])
        call = next(item for item in asked["output"] if item["type"] == "function_call")
        result = {"type": "function_call_output", "call_id": call["call_id"], "output": "55"}
        answered = respond(running, [result], asked["id"], tools=[calculate])
        turns = httpx.get(f"{running.url}/conversations/{answered['id']}").json()["data"]
    assert call["name"] == "calculate" and "55" in output_text(answered)
    assert [t["input"] for t in turns] == [[{"type": "message", "role": "user", "content": "What is 25 + 30?"}],
                                           [result]]
    assert turns[0]["response"]["output"] == asked["output"]

"""Issue 51, item 3: deleting a response in the middle or at the root of a chain leaves the rest of its
conversation listed (``GET /v1/conversations``) and openable (``GET /v1/conversations/{id}``, with
``gap``: earlier turns were deleted), across a restart too."""

from chatkit import GenerateParams
from chatkit.server import ServerConfig, start

import httpx
import pytest

PARAMS = GenerateParams(max_tokens=3, temperature=0.0)


def respond(running, text, previous=None):
    r = httpx.post(f"{running.url}/responses", json={"input": text, "previous_response_id": previous}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["id"]


def listed(running):
    return [(c["id"], c["head"], c["turns"]) for c in httpx.get(f"{running.url}/conversations").json()["data"]]


def opened(running, rid):
    r = httpx.get(f"{running.url}/conversations/{rid}", timeout=60)
    assert r.status_code == 200, r.text
    return [t["response"]["id"] for t in r.json()["data"]], r.json().get("gap", False)


@pytest.mark.slow
def test_deleting_the_middle_or_the_root_of_a_chain_keeps_the_rest_listed_and_openable(tiny, tmp_path):
    config = ServerConfig(defaults=PARAMS, store=str(tmp_path))
    with start(tiny("qwen3", "bpe", 0), config) as running:
        a = respond(running, "one")
        b = respond(running, "two", a)
        c = respond(running, "three", b)
        d = respond(running, "four", c)
        x = respond(running, "other")
        y = respond(running, "other two", x)
        assert opened(running, d) == ([a, b, c, d], False)
        for rid in (b, x):  # the middle of one chain, the root of another
            assert httpx.delete(f"{running.url}/responses/{rid}").status_code == 200
        before = listed(running)
        assert before == [(y, y, 1), (c, d, 2), (a, a, 1)], before
        assert opened(running, d) == ([c, d], True)
        assert opened(running, y) == ([y], True)
        assert opened(running, a) == ([a], False)
    with start(tiny("qwen3", "bpe", 0), config) as running:  # the same from the store
        assert listed(running) == before
        assert opened(running, d) == ([c, d], True)


@pytest.mark.slow
def test_conversations_are_listed_a_page_at_a_time_newest_first(tiny):
    """Issue 51, item 5: ``GET /v1/conversations`` pages with ``limit`` and ``after``."""
    with start(tiny("qwen3", "bpe", 0), ServerConfig(defaults=PARAMS)) as running:
        made = [respond(running, f"conversation {i}") for i in range(25)][::-1]  # newest first
        first = httpx.get(f"{running.url}/conversations").json()
        assert [c["id"] for c in first["data"]] == made[:20] and first["has_more"]
        assert first["first_id"] == made[0] and first["last_id"] == made[19]
        rest = httpx.get(f"{running.url}/conversations", params={"after": first["last_id"], "limit": 10}).json()
        assert [c["id"] for c in rest["data"]] == made[20:] and not rest["has_more"]
        small = httpx.get(f"{running.url}/conversations", params={"limit": 3}).json()
        assert [c["id"] for c in small["data"]] == made[:3]
        for query, param in (({"limit": 0}, "limit"), ({"limit": 101}, "limit"), ({"after": "resp_nope"}, "after")):
            r = httpx.get(f"{running.url}/conversations", params=query)
            assert r.status_code == 400 and r.json()["error"]["param"] == param

"""A turn the server opened is settled (its slot freed, its session free) however the request ends: a
handler failing after it opened the turn, or a streamed response whose body never ran (a client gone
before the headers went out: Starlette then never iterates the handler's generator)."""

import asyncio
import json

from chatkit import GenerateParams
from chatkit.server import ServerConfig
from chatkit.server.app import create_app

import httpx
import pytest

PARAMS = GenerateParams(max_tokens=4, temperature=0.0)
BODY = {"model": "any", "messages": [{"role": "user", "content": "Hi"}]}


@pytest.fixture(scope="module")
def lm(tiny):
    return tiny("qwen3", "bpe", 0)


def with_app(lm, scenario):
    """Run ``scenario(app, client)`` inside the app's lifespan, one turn at a time and no queue: a slot
    that is never freed makes the next request a 503."""
    app = create_app(lm, ServerConfig(defaults=PARAMS, parallel=1, queue=0))

    async def main():
        async with app.router.lifespan_context(app):
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
                return await scenario(app, client)

    return asyncio.run(main())


def test_a_handler_failing_after_it_opened_the_turn_frees_the_slot(lm, monkeypatch):
    from chatkit.server import turns

    real = turns.new_id

    def failing(prefix):
        raise RuntimeError("boom")

    async def scenario(app, client):
        monkeypatch.setattr(turns, "new_id", failing)
        failed = await client.post("/v1/chat/completions", json=BODY)
        monkeypatch.setattr(turns, "new_id", real)
        after = await client.post("/v1/chat/completions", json=BODY)
        return failed.status_code, after.status_code

    assert with_app(lm, scenario) == (500, 200)


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {**BODY, "stream": True}),
    ("/v1/responses", {"model": "any", "input": "Hi", "stream": True}),
    ("/v1/messages", {"model": "any", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}], "stream": True}),
])
def test_a_streamed_turn_whose_body_never_ran_is_settled(lm, path, body):
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "root_path": "",
             "query_string": b"", "headers": [(b"content-type", b"application/json"), (b"host", b"test")],
             "server": ("127.0.0.1", 80), "client": ("127.0.0.1", 1)}

    async def scenario(app, client):
        messages = [{"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}]

        async def receive():
            return messages.pop(0) if messages else {"type": "http.disconnect"}

        async def send(message):
            if message["type"] == "http.response.start":
                raise OSError("the client is gone")  # as a server reports a closed connection

        try:
            await app(scope, receive, send)
        except Exception:  # Starlette reports the client gone (ClientDisconnect)
            pass
        after = await client.post("/v1/chat/completions", json=BODY)
        return after.status_code

    assert with_app(lm, scenario) == 200


@pytest.mark.slow  # runs the app
def test_a_request_samples_with_its_own_settings_and_the_pooled_session_keeps_its_own(lm, monkeypatch):
    # The server passes a request's sampling to its turn (params=): the pooled session's own settings
    # stay the server's defaults, for every choice of n > 1 too.
    from chatkit.server.session_index import SessionIndex

    indexes = []
    real = SessionIndex.__init__

    def init(self, *args, **kwargs):
        real(self, *args, **kwargs)
        indexes.append(self)

    monkeypatch.setattr(SessionIndex, "__init__", init)
    body = {**BODY, "temperature": 0.9, "seed": 5, "max_tokens": 3, "n": 2}

    async def scenario(app, client):
        r = await client.post("/v1/chat/completions", json=body)
        (index,) = indexes
        return r.status_code, len(r.json()["choices"]), [index.pool.get(c).generate_params for c in index.pool]

    status, choices, pooled = with_app(lm, scenario)
    assert status == 200 and choices == 2 and len(pooled) == 1
    assert pooled[0].temperature == PARAMS.temperature and pooled[0].seed is None and pooled[0].max_tokens == 4

"""The request path's own costs: ``X-Chatkit-Trace`` stamps (chatkit/server/trace.py) sent back only when
asked, in the order the stages ran; and the async stream under them: turns reuse a worker thread, a
stream started before it is read (as the server starts it) holds at most its first chunk."""

import asyncio
import json
import threading
import time

from chatkit import GenerateParams
from chatkit.server import ServerConfig, start

import httpx
import pytest
from conftest import assert_ledger_matches_cache, fresh_reply, session_for

PARAMS = GenerateParams(max_tokens=6, temperature=0.0)
ORDER = ["handler", "body", "parsed", "slot", "session", "opened", "headers", "turn", "token"]


@pytest.fixture(scope="module")
def server(tiny):
    with start(tiny("qwen3", "bpe", 0), ServerConfig(defaults=PARAMS)) as running:
        yield running


def streamed(url: str, path: str, body: dict, headers: dict) -> tuple[list[str], int, int]:
    """(the lines of a streamed reply, perf_counter_ns before sending, after reading)."""
    t0 = time.perf_counter_ns()
    with httpx.stream("POST", f"{url}/{path}", json={**body, "stream": True}, headers=headers, timeout=60) as r:
        r.raise_for_status()
        lines = list(r.iter_lines())
    return lines, t0, time.perf_counter_ns()


@pytest.mark.parametrize("path, body", [
    ("chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
    ("responses", {"input": "Hi"}),
    ("messages", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6}),
])
def test_a_traced_request_gets_its_stages_in_order_and_others_nothing(server, path, body):
    plain, _, _ = streamed(server.url, path, body, {})
    assert not any(line.startswith(": chatkit-trace") for line in plain)

    lines, t0, t1 = streamed(server.url, path, body, {"X-Chatkit-Trace": "1"})
    [comment] = [line for line in lines if line.startswith(": chatkit-trace ")]
    assert lines[-1] == comment or lines.index(comment) > max(i for i, x in enumerate(lines) if x.startswith("data:"))
    trace = json.loads(comment[len(": chatkit-trace "):])
    stamps = dict(trace["stamps"])
    names = [name for name, _ in trace["stamps"]]
    assert [n for n in names if n in ORDER] == [n for n in ORDER if n in stamps]
    assert set(ORDER) <= set(stamps) and "settled" in stamps
    # one clock: the server's stamps fall between the client's sending and its last read
    assert t0 <= stamps["handler"] <= stamps["token"] <= stamps["settled"] <= t1
    assert trace["prefilled_tokens"] > 0 and trace["prefill_ms"] > 0
    if path == "responses":
        assert "stored" in stamps


def test_a_reply_that_is_not_streamed_carries_its_trace_in_a_header(server):
    body = {"model": "any", "input": "Hello"}
    assert "x-chatkit-trace" not in httpx.post(f"{server.url}/responses", json=body, timeout=60).headers
    r = httpx.post(f"{server.url}/responses", json=body, headers={"X-Chatkit-Trace": "1"}, timeout=60)
    stamps = dict(json.loads(r.headers["x-chatkit-trace"])["stamps"])
    assert {"handler", "body", "parsed", "session", "opened", "settled", "stored"} <= set(stamps)
    assert "headers" not in stamps  # no streamed body: its sends are not stamped


def test_async_turns_reuse_idle_worker_threads(tiny):
    lm = tiny()
    threads = []

    def record(tokens, logits):
        threads.append(threading.get_ident())
        return logits

    session = session_for(lm, params=GenerateParams(max_tokens=3, logits_processors=[record]))

    async def main():
        await session.arespond("Hi")
        before = {t.ident for t in threading.enumerate()}
        del threads[:]
        for prompt in ("Again", "Once more"):
            await session.arespond(prompt)
        return before

    before = asyncio.run(main())
    assert threads and set(threads) <= before - {threading.get_ident()}  # no new thread: an idle one ran them
    assert_ledger_matches_cache(session)


def test_a_stream_started_before_reading_holds_one_chunk_until_read(tiny):
    lm = tiny()
    endless = GenerateParams(max_tokens=50, logit_bias={i: -1e9 for i in lm.tokenizer.eos_token_ids})
    session = session_for(lm, params=endless)
    expected = fresh_reply(session, "Talk")

    async def main():
        stream = session.astream_respond("Talk")
        stream.start()
        for _ in range(500):  # the worker prefills and computes the first chunk ...
            if stream.tokens:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)  # ... then waits: it would have run ahead meanwhile
        await stream.aclose()

    asyncio.run(main())
    assert session.last_stats.generation_tokens == 1 and session.last_stats.finish_reason == "cancelled"
    assert_ledger_matches_cache(session)

    session = session_for(lm, params=endless)

    async def read_all():
        stream = session.astream_respond("Talk")
        stream.start()
        await asyncio.sleep(0.05)
        async with stream:
            return [chunk.token async for chunk in stream]

    assert asyncio.run(read_all()) == expected  # started early, read later: the same reply


def test_a_stored_response_is_on_disk_before_the_client_hears_it_completed(tiny, tmp_path):
    with start(tiny("qwen3", "bpe", 0), ServerConfig(defaults=PARAMS, store=str(tmp_path))) as running:
        with httpx.stream("POST", f"{running.url}/responses", json={"input": "Hi", "stream": True}, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and ('"response.completed"' in line or '"response.incomplete"' in line):
                    rid = json.loads(line[6:])["response"]["id"]
                    assert (tmp_path / "responses" / f"{rid}.json").exists()  # written (off the loop) first
                    break
            else:
                pytest.fail("no response.completed event")
        assert httpx.get(f"{running.url}/responses/{rid}", timeout=60).json()["id"] == rid


def test_serve_freezes_what_is_loaded_before_it_serves(tiny, monkeypatch):
    import gc

    import chatkit.server.run as run

    frozen = []
    monkeypatch.setattr(run.uvicorn, "run", lambda app, **kwargs: frozen.append(gc.get_freeze_count()))
    try:
        run.serve(tiny("qwen3", "bpe", 0), ServerConfig(defaults=PARAMS))
    finally:
        gc.unfreeze()
    assert frozen and frozen[0] > 10_000  # the model, its tokenizer and the libraries: out of the collector's reach


def test_a_messages_key_json_is_remembered_only_where_it_is_safe():
    from chatkit.messages import ChatMessage, ToolCall
    from chatkit.server.keys import message_json, prefix_keys

    def plain(m):
        return json.dumps(m.to_dict(), ensure_ascii=False, sort_keys=True)

    text = "Question: the castle and the river?"
    first, again = ChatMessage.user(text), ChatMessage.user(text)  # a client re-sends the same message
    assert message_json(first) == plain(first) and message_json(again) is message_json(first)  # made once
    assert message_json(ChatMessage.user(text + "!")) != message_json(first)
    call = ChatMessage.assistant("", tool_calls=(ToolCall("c1", "add", {"a": 1, "b": [2]}),))  # unhashable arguments
    assert message_json(call) == plain(call)
    history = (first, call)
    assert prefix_keys("sys", history) == prefix_keys("sys", (again, call))
    assert prefix_keys("sys", history)[-1] != prefix_keys("sys", (ChatMessage.user(text + "!"), call))[-1]


def test_a_stored_streamed_response_crosses_two_threads_and_its_writes_queue_on_the_worker(tiny, tmp_path, monkeypatch):
    # The event loop hands a streamed Responses request with ``store`` to two threads only: the index's
    # one worker (open the turn; then write the stored response, and the cache behind the turn, in order)
    # and the turn's generation thread.
    from chatkit import ChatSession
    from chatkit.server import response_store

    seen: dict[str, set[str]] = {"open": set(), "generate": set(), "store": set(), "save": set()}

    def note(what):
        seen[what].add(threading.current_thread().name)

    def record(tokens, logits):
        note("generate")
        return logits

    opens, saves, writes = ChatSession.astream_respond, ChatSession.save_cache, response_store.write_file
    monkeypatch.setattr(ChatSession, "astream_respond", lambda self, *a, **kw: note("open") or opens(self, *a, **kw))
    monkeypatch.setattr(ChatSession, "save_cache", lambda self, *a, **kw: note("save") or saves(self, *a, **kw))
    monkeypatch.setattr(response_store, "write_file", lambda *a: note("store") or writes(*a))
    params = GenerateParams(max_tokens=4, temperature=0.0, logits_processors=[record])
    with start(tiny("qwen3", "bpe", 0), ServerConfig(defaults=params, store=str(tmp_path))) as running:
        lines, _, _ = streamed(running.url, "responses", {"input": "Hi", "store": True}, {})
        assert any(line.startswith(("event: response.completed", "event: response.incomplete")) for line in lines)
        time.sleep(1.0)  # the write behind the turn (SAVE_DELAY later)
    assert all(seen.values()), seen
    (worker,) = seen["open"]
    assert seen["store"] == seen["save"] == {worker} and worker.startswith("chatkit-server")
    assert worker not in seen["generate"] and len(seen["generate"]) == 1

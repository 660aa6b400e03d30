"""A turn can be discarded: stopped with nothing committed, the session as it was before the turn
(``ReplyStream.discard``, ``AsyncResponseStream.adiscard`` / ``discard_unless``). The server uses it for a
client that goes away before any piece of the reply reached it (issue 51): the pooled conversation, a
stored response chain and the next request are as if the request had never come."""

import asyncio
import json
import threading

from chatkit import GenerateParams
from chatkit.server import ServerConfig, start
from chatkit.server.session_index import SessionIndex
from chatkit.session import aio

import httpx
import pytest
from conftest import assert_ledger_matches_cache, fresh_reply, session_for


@pytest.fixture(scope="module")
def lm(tiny):
    return tiny("qwen3", "bpe", 0)


def endless(lm, n=12):
    return GenerateParams(max_tokens=n, temperature=0.0, logit_bias={i: -1e9 for i in lm.tokenizer.eos_token_ids})


# -- the session ------------------------------------------------------------------------------------
@pytest.mark.parametrize("taken", [0, 1, 3])
def test_a_discarded_turn_leaves_the_session_as_it_was(lm, taken):
    session = session_for(lm, params=endless(lm))
    session.respond("Hi")
    before, tokens = session.history, session.token_count
    stream = session.stream_respond("Talk")
    for _ in range(taken):
        next(stream)
    stream.discard()
    assert stream.discarded and stream.closed
    assert session.history == before and session.token_count == tokens
    assert_ledger_matches_cache(session)
    expected = fresh_reply(session, "Again")
    with session.stream_respond("Again") as again:
        assert [c.token for c in again] == expected  # as if the discarded turn had never run
    assert_ledger_matches_cache(session)


def test_discard_after_the_commit_changes_nothing(lm):
    session = session_for(lm)
    stream = session.stream_respond("Hi")
    for _ in stream:
        pass
    committed = session.history
    stream.discard()
    assert not stream.discarded and session.history == committed and len(committed) == 2


def test_a_tool_loop_in_its_first_round_is_discarded_whole(lm):
    tool = {"type": "function", "function": {"name": "look", "description": "Look.", "parameters": {
        "type": "object", "properties": {}}}}
    session = session_for(lm, params=endless(lm), tools=[tool])
    before = session.history
    stream = session.stream_respond("Look around")
    next(stream)
    stream.discard()
    assert stream.discarded and session.history == before
    assert session.respond("Hi") is not None and len(session.history) == len(before) + 2  # free again


def run_async(session, prompt, *, keep, take, discard=False):
    async def main():
        stream = session.astream_respond(prompt)
        if keep is not None:
            stream.discard_unless(lambda: keep)
        async for _ in stream:
            take[0] -= 1
            if take[0] <= 0:
                break
        await (stream.adiscard() if discard else stream.aclose())
        return stream

    return asyncio.run(main())


@pytest.mark.parametrize("keep, discard, kept", [(False, False, False), (True, False, True), (None, False, True),
                                                 (None, True, False), (True, True, False)])
def test_an_async_stream_stopped_early_is_discarded_when_told(lm, keep, discard, kept):
    session = session_for(lm, params=endless(lm))
    before = session.history
    stream = run_async(session, "Talk", keep=keep, take=[2], discard=discard)
    assert stream.discarded is not kept
    if kept:
        assert len(session.history) == len(before) + 2 and session.history[-1].content == stream.text
        assert session.last_stats.finish_reason == "cancelled"
    else:
        assert session.history == before
    assert_ledger_matches_cache(session)


def test_an_async_stream_that_ended_is_committed_whatever_keep_says(lm):
    session = session_for(lm)
    stream = run_async(session, "Hi", keep=False, take=[10**6])
    assert not stream.discarded and len(session.history) == 2 and session.last_stats.finish_reason != "cancelled"


# -- the server: a client gone before any piece of the reply ----------------------------------------
class Gate:
    """A logits processor that holds every turn at its first token while closed (``entered``: a turn
    is there, its prompt prefilled)."""

    def __init__(self):
        self.opened, self.entered = threading.Event(), threading.Event()

    def __call__(self, tokens, logits):
        self.entered.set()
        self.opened.wait(60)
        return logits


SYSTEM = {"role": "system", "content": "Be brief."}
CHAT = {"model": "any", "messages": [SYSTEM, {"role": "user", "content": "Hi"}]}
MESSAGES = {"model": "any", "max_tokens": 8, "system": "Be brief.", "messages": [{"role": "user", "content": "Hi"}]}


@pytest.fixture
def served(lm, tmp_path, monkeypatch):
    """A server whose turns wait at their first token while ``gate`` is closed, and what it settled:
    per finished lease, (messages the turn added to its session, whether it was discarded)."""
    gate, stopped, finished = Gate(), threading.Event(), []
    real_stop, real_finish = aio.AsyncResponseStream._stop, SessionIndex.finish

    def stop(self):
        if not self._ended:  # a stream in the middle of its turn (not one that ended, being collected)
            stopped.set()  # the server noticed the client had gone, and stops the turn
        real_stop(self)

    async def finish(self, lease):
        await real_finish(self, lease)
        finished.append((len(lease.session.history) - lease.base, lease.stream.discarded))

    monkeypatch.setattr(aio.AsyncResponseStream, "_stop", stop)
    monkeypatch.setattr(SessionIndex, "finish", finish)
    params = GenerateParams(max_tokens=8, temperature=0.0, logits_processors=[gate])
    with start(lm, ServerConfig(defaults=params, parallel=1, store=str(tmp_path))) as running:
        yield running, gate, stopped, finished


def gone_before_the_reply(running, gate, stopped, path, body):
    """Send ``body`` streamed, wait for the headers (the turn is open), hang up, let the turn go on."""
    gate.opened.clear()
    gate.entered.clear()
    stopped.clear()
    with httpx.Client(timeout=60) as c:
        with c.stream("POST", f"{running.url.removesuffix('/v1')}{path}", json={**body, "stream": True}) as r:
            assert r.status_code == 200
            assert gate.entered.wait(30)  # the turn is generating its first token
    assert stopped.wait(30)  # the server noticed: only now may the first token come
    gate.opened.set()


def post(running, path, body):
    r = httpx.post(f"{running.url.removesuffix('/v1')}{path}", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def cancelled_turns(running):
    metrics = httpx.get(f"{running.url.removesuffix('/v1')}/metrics", timeout=30).text
    return [line for line in metrics.splitlines() if 'finish_reason="cancelled"' in line]


@pytest.mark.slow
@pytest.mark.parametrize("path, body, text", [
    ("/v1/chat/completions", CHAT, lambda r: r["choices"][0]["message"]["content"]),
    ("/v1/messages", MESSAGES, lambda r: "".join(b.get("text", "") for b in r["content"])),
])
def test_a_client_gone_before_the_first_piece_commits_nothing(lm, served, path, body, text):
    running, gate, stopped, finished = served
    gate.opened.set()
    expected = text(post(running, path, body))  # the conversation's reply, then the conversation is pooled
    finished.clear()
    gone_before_the_reply(running, gate, stopped, path, body)
    again = post(running, path, body)  # waits for the only slot: the aborted turn has settled
    assert finished[0] == (0, True)  # the pooled session gained nothing
    assert text(again) == expected
    assert not cancelled_turns(running)


@pytest.mark.slow
def test_a_response_chain_gains_no_response_from_a_client_gone_before_the_first_piece(lm, served, tmp_path):
    running, gate, stopped, finished = served
    gate.opened.set()
    first = post(running, "/v1/responses", {"model": "any", "input": "Hi", "instructions": "Be brief."})
    body = {"model": "any", "input": "And then?", "previous_response_id": first["id"], "max_output_tokens": 8}
    expected = post(running, "/v1/responses", body)
    stored = sorted(p.name for p in (tmp_path / "responses").glob("*.json"))
    finished.clear()
    gone_before_the_reply(running, gate, stopped, "/v1/responses", body)
    again = post(running, "/v1/responses", body)
    assert finished[0] == (0, True)
    assert [o["content"] for o in again["output"]] == [o["content"] for o in expected["output"]]
    now = sorted(p.name for p in (tmp_path / "responses").glob("*.json"))
    assert set(now) - set(stored) == {f"{again['id']}.json"}  # the aborted one was never stored
    assert not cancelled_turns(running)


@pytest.mark.slow
def test_a_client_gone_after_a_piece_still_commits_it_cancelled(lm, served):
    running, gate, stopped, finished = served
    gate.opened.set()
    finished.clear()
    with httpx.Client(timeout=60) as c:
        with c.stream("POST", f"{running.url.removesuffix('/v1')}/v1/chat/completions",
                      json={**CHAT, "stream": True, "max_tokens": 400, "logit_bias": {
                          str(t): -100 for t in lm.tokenizer.eos_token_ids}}) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and json.loads(line[6:])["choices"][0]["delta"].get("content"):
                    break  # a piece of the reply arrived: then the client goes
    post(running, "/v1/chat/completions", CHAT)
    assert finished[0][0] == 2 and finished[0][1] is False  # the prompt and its partial reply
    assert cancelled_turns(running)

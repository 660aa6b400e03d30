"""The server over the prompt cache (issue 46): new conversations sharing a system prompt report the
tokens they reused in every API's usage, and /metrics shows the prompt cache."""

import re

from chatkit import ChatSession, GenerateParams, PromptCache
from chatkit.server import ServerConfig, start

import httpx
import pytest

PARAMS = GenerateParams(max_tokens=6, temperature=0.0)
SYSTEM = "You are the help desk of a library. " + " ".join(f"Policy {i}: loans last {i + 7} days." for i in range(60))
QUESTIONS = ["Can I renew a book?", "Where is the map room?", "Do you open on Sundays?"]

pytestmark = pytest.mark.slow  # starts servers


@pytest.fixture(scope="module")
def lm(tiny):
    return tiny("qwen3", "bpe", 0)


def chat_completions(url, question):
    body = {"model": "any", "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]}
    r = httpx.post(f"{url}/chat/completions", json=body, timeout=120)
    r.raise_for_status()
    data = r.json()
    return data["choices"][0]["message"]["content"], data["usage"]["prompt_tokens_details"]["cached_tokens"]


def responses(url, question):
    r = httpx.post(f"{url}/responses", json={"model": "any", "instructions": SYSTEM, "input": question}, timeout=120)
    r.raise_for_status()
    data = r.json()
    return data["output"][-1]["content"][0]["text"], data["usage"]["input_tokens_details"]["cached_tokens"]


def messages(url, question):
    body = {"model": "any", "system": SYSTEM, "max_tokens": 6, "messages": [{"role": "user", "content": question}]}
    r = httpx.post(f"{url.removesuffix('/v1')}/v1/messages", json=body, timeout=120, headers={"x-api-key": "x"})
    r.raise_for_status()
    data = r.json()
    return data["content"][0]["text"], data["usage"]["cache_read_input_tokens"]


@pytest.mark.parametrize("api", [chat_completions, responses, messages])
def test_new_conversations_sharing_a_system_prompt_report_cached_tokens(lm, api):
    pc = PromptCache(block_tokens=16)
    with start(lm, ServerConfig(model_id="tiny", defaults=PARAMS, prompt_cache=pc)) as running:
        got = [api(running.url, q) for q in QUESTIONS]
    cached = [c for _, c in got]
    assert cached[0] == 0 and cached[1] > 0 and cached[2] > 0, cached
    for (text, _), q in zip(got, QUESTIONS):  # the same replies as a session that computes everything
        alone = ChatSession.builder(lm).generate_params(PARAMS.copy()).instructions(SYSTEM).prompt_cache(None).build()
        assert text == alone.respond(q)


def test_on_by_default_and_in_metrics(lm, default_prompt_cache_on):
    with start(lm, ServerConfig(model_id="tiny", defaults=PARAMS)) as running:
        cached = [chat_completions(running.url, q)[1] for q in QUESTIONS]
        text = httpx.get(f"{running.url.removesuffix('/v1')}/metrics", timeout=30).text
    assert cached[1] >= 256 and cached[2] >= 256, cached  # the model's process-wide cache, 256-token blocks
    hits = int(re.search(r"^chatkit_prompt_cache_hits_total (\d+)$", text, re.M).group(1))
    assert hits >= 2
    for name in ("chatkit_prompt_cache_misses_total", "chatkit_prompt_cache_ram_evictions_total",
                 "chatkit_prompt_cache_disk_evictions_total", "chatkit_prompt_cache_ram_bytes",
                 "chatkit_prompt_cache_disk_bytes", "chatkit_prompt_cache_blocks"):
        assert re.search(rf"^{name} \d+$", text, re.M), name


def test_off_reports_nothing_cached(lm):
    with start(lm, ServerConfig(model_id="tiny", defaults=PARAMS, prompt_cache=None)) as running:
        cached = [chat_completions(running.url, q)[1] for q in QUESTIONS[:2]]
        text = httpx.get(f"{running.url.removesuffix('/v1')}/metrics", timeout=30).text
    assert cached == [0, 0]
    assert "chatkit_prompt_cache_hits_total" not in text


def test_a_bad_prompt_cache_setting_is_refused_before_serving(lm):
    from chatkit import InvalidParamsError

    with pytest.raises(InvalidParamsError, match="ServerConfig.prompt_cache"):
        start(lm, ServerConfig(prompt_cache="ram"))


def test_a_branch_off_a_pooled_conversation_reuses_their_prefix_in_memory(lm, monkeypatch):
    # A client that goes back to an earlier message starts a new conversation that begins as a pooled one
    # does: the prompt cache serves the prefix they share, no cache file is written for it (the server
    # used to write the pooled session's cache to a hand-off file and read it back), and the reply is the
    # one a session computing everything gives.
    saved = []
    monkeypatch.setattr(ChatSession, "save_cache", lambda self, path, **kw: saved.append(path) or 0)
    pc = PromptCache(block_tokens=16)
    url_messages = [{"role": "system", "content": SYSTEM}]
    with start(lm, ServerConfig(model_id="tiny", defaults=PARAMS, prompt_cache=pc)) as running:
        usages = []
        for q in QUESTIONS:
            url_messages.append({"role": "user", "content": q})
            r = httpx.post(f"{running.url}/chat/completions", json={"model": "any", "messages": url_messages}, timeout=120)
            url_messages.append(r.json()["choices"][0]["message"])
            usages.append(r.json()["usage"])
        branch = [*url_messages[:3], {"role": "user", "content": "And on Mondays?"}]
        r = httpx.post(f"{running.url}/chat/completions", json={"model": "any", "messages": branch}, timeout=120)
        reply, usage = r.json()["choices"][0]["message"]["content"], r.json()["usage"]
    shared = usages[0]["prompt_tokens"] + usages[0]["completion_tokens"]  # the first exchange, as cached
    assert saved == []
    assert shared - 16 <= usage["prompt_tokens_details"]["cached_tokens"] < usage["prompt_tokens"], (usage, shared)
    alone = ChatSession.builder(lm).generate_params(PARAMS.copy()).instructions(SYSTEM).prompt_cache(None).build()
    alone.respond(QUESTIONS[0])
    assert reply == alone.respond("And on Mondays?")


def test_a_branch_that_diverges_mid_history_is_a_fork_in_memory_without_a_prompt_cache(lm, monkeypatch):
    # The client re-sends the first exchange, then an edited second one: a new conversation sharing two
    # messages with a pooled one. With the prompt cache off it is seeded by a fork of the pooled session in
    # memory (it used to be written to a hand-off file and read back): no file, the shared prefix reused,
    # the reply the one a session computing everything gives.
    saved = []
    monkeypatch.setattr(ChatSession, "save_cache", lambda self, path, **kw: saved.append(path) or 0)
    history = [{"role": "system", "content": SYSTEM}]
    with start(lm, ServerConfig(model_id="tiny", defaults=PARAMS, prompt_cache=None)) as running:
        for q in QUESTIONS[:2]:
            history.append({"role": "user", "content": q})
            r = httpx.post(f"{running.url}/chat/completions", json={"model": "any", "messages": history}, timeout=120)
            history.append(r.json()["choices"][0]["message"])
        first = r.json()["usage"]
        edited = [*history[:3], {"role": "user", "content": "Edited question"}, {"role": "assistant", "content": "ok"},
                  {"role": "user", "content": "And on Mondays?"}]
        r = httpx.post(f"{running.url}/chat/completions", json={"model": "any", "messages": edited}, timeout=120)
        reply, usage = r.json()["choices"][0]["message"]["content"], r.json()["usage"]
    assert saved == []
    assert 0 < usage["prompt_tokens_details"]["cached_tokens"] < first["prompt_tokens"] < usage["prompt_tokens"], usage
    alone = ChatSession.builder(lm).generate_params(PARAMS.copy()).instructions(SYSTEM).prompt_cache(None).history(
        [{"role": "user", "content": QUESTIONS[0]}, history[2], edited[3], edited[4]]).build()
    assert reply == alone.respond("And on Mondays?")

"""chatkit serve writes each conversation's cache behind its turn (issue 33, item 15): after a crash
(``kill -9``) the next turn reuses as many cached tokens as it would have without the crash, and the
writes never hold up or refuse a turn."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import chatkit
from chatkit import GenerateParams
from chatkit.server import ServerConfig, start

import openai
import pytest

SYSTEM = "Be brief."
CHAIN = "Answer in one line."  # another conversation than the chat's (the index goes by content)
PARAMS = GenerateParams(max_tokens=24, temperature=0.0)
PROMPTS = ["My name is Ada.", "What is 7 + 5?", "What is my name?"]


@pytest.fixture(scope="module")
def demo():
    return chatkit.load("demo")


def client(url):
    return openai.OpenAI(base_url=url, api_key="unused", max_retries=0)


def saved_turns(store):
    """The replies each cache file in ``store`` holds, sorted, once the manifest lists every file."""
    try:
        listed = json.loads((store / "conversations.json").read_text())["conversations"]
    except (OSError, ValueError):
        return []
    files = [p for p in (store / "caches").glob("*.safetensors") if not p.name.startswith(".")]
    if len(files) != len(listed):
        return []
    try:
        return sorted(chatkit.inspect_cache(p).turns for p in files)
    except chatkit.ChatKitError:  # being replaced right now
        return []


def wait_for(predicate, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


class Conversations:
    """A chat completions conversation (the client re-sends everything) and a responses chain."""

    def __init__(self):
        self.messages = [{"role": "system", "content": SYSTEM}]
        self.previous = None

    def chat(self, c, prompt):
        self.messages.append({"role": "user", "content": prompt})
        r = c.chat.completions.create(model="any", messages=self.messages)
        self.messages.append({"role": "assistant", "content": r.choices[0].message.content})
        return r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.prompt_tokens_details.cached_tokens

    def respond(self, c, prompt):
        r = c.responses.create(model="any", input=prompt, instructions=CHAIN, previous_response_id=self.previous)
        self.previous = r.id
        return r.usage.input_tokens, r.usage.output_tokens, r.usage.input_tokens_details.cached_tokens

    def two_turns(self, c):
        """Two turns of each; returns the tokens the next turn of each should take from the cache."""
        for prompt in PROMPTS[:2]:
            chat = self.chat(c, prompt)
            resp = self.respond(c, prompt)
        return chat[0] + chat[1], resp[0] + resp[1]

    def third_turn(self, c):
        return self.chat(c, PROMPTS[2])[2], self.respond(c, PROMPTS[2])[2]


def test_each_turn_is_saved_behind_it_while_the_server_runs(demo, tmp_path):
    store, crashed = tmp_path / "store", tmp_path / "crashed"
    talk = Conversations()
    with start(demo, ServerConfig(defaults=PARAMS, store=str(store))) as running:
        expected = talk.two_turns(client(running.url))
        wait_for(lambda: saved_turns(store) == [2, 2])  # written while the server goes on running
        shutil.copytree(store, crashed)  # what a kill -9 now would leave behind
    with start(demo, ServerConfig(defaults=PARAMS, store=str(crashed))) as running:
        assert talk.third_turn(client(running.url)) == expected


@pytest.mark.parametrize("budget", [2**30, 1], ids=["in memory", "evicted every turn"])
def test_rapid_turns_are_never_held_up_or_refused_by_the_writes(demo, tmp_path, monkeypatch, budget):
    """With no delay every turn's write starts at once, so the next turn of the same conversation
    meets it: it waits for it (never a 409) and reuses the whole cache."""
    monkeypatch.setattr("chatkit.server.write_behind.SAVE_DELAY", 0.0)
    talk = Conversations()
    prompts = ["My name is Ada.", "What is 2 + 2?", "Spell cat.", "What is 3 + 4?", "What is my name?"]
    with start(demo, ServerConfig(defaults=PARAMS, store=str(tmp_path), max_cache_bytes=budget)) as running:
        c = client(running.url)
        before = None
        for prompt in prompts:
            prompt_tokens, completion_tokens, cached = talk.chat(c, prompt)
            assert cached == (0 if before is None else before)
            before = prompt_tokens + completion_tokens
    assert saved_turns(tmp_path) == [len(prompts)]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(store, port):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "chatkit", "serve", "--port", str(port), "--store", str(store),
                             "--max-tokens", "24", "--log-level", "warning"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    c = client(f"http://127.0.0.1:{port}/v1")
    for _ in range(1200):  # up to two minutes to import and load
        try:
            c.models.list()
            return proc, c
        except openai.APIConnectionError:
            assert proc.poll() is None, proc.communicate()[1]
            time.sleep(0.1)
    raise AssertionError("chatkit serve did not start")


@pytest.mark.slow
def test_after_kill_9_the_next_turn_reuses_the_cache_as_before(tmp_path):
    store = tmp_path / "store"
    talk = Conversations()
    proc, c = serve(store, free_port())
    try:
        expected = talk.two_turns(c)
        wait_for(lambda: saved_turns(store) == [2, 2])
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    proc, c = serve(store, free_port())
    try:
        assert talk.third_turn(c) == expected
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err

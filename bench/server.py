"""Time to first token over HTTP: ``chatkit serve`` against the in-process session, a stateless
re-prefill, and ``mlx_lm.server`` run beside it on the same model folder.

    .venv/bin/python bench/server.py [--turns 20] [--rounds 3] [--max-tokens 16] [--store]
                                     [--api chat,responses,messages] [--model bench|demo|tiny] [--quick]

The model is the benchmarks' ~29M-parameter Qwen3 (float32, random weights; ``bench/_common.py``),
saved in a folder that both servers load (``--model demo``: chatkit's bundled demo model, 4 layers of
96; ``--model tiny``: the tests' 2-layer Qwen3: the smaller the model, the more the server's own
overhead shows). A conversation of ``--turns`` user messages (about 40
tokens each, a system prompt in front) is played, greedy, up to ``--max-tokens`` per reply, by:

* **in-process**: one ``ChatSession``, ``stream_respond(message)`` per turn (timed from that call:
  rendering the prompt is part of a turn, in-process as over HTTP);
* **re-prefill**: per turn, a fresh session built with the whole history so far (what a stateless
  server without a prompt cache does): the whole conversation is prefilled every turn;
* **chatkit serve** and **mlx_lm.server** (each its own process on 127.0.0.1, mlx_lm.server with the
  OpenBLAS that chatkit loads, through ``LD_PRELOAD``): a stateless client that re-sends the whole
  conversation each turn, streaming (``/v1/chat/completions``), as apps do.

With ``--store``, a third server runs beside them, **chatkit serve --store** (a temporary folder):
each conversation's cache is written behind its turns (``chatkit/server/write_behind.py``), which
must leave the request path's TTFT as it is; the summary gives its TTFT against ``chatkit serve``
without a store, turn by turn. ``--think S``: S seconds more after each HTTP client's turn (a user
reading the reply; with ``--store``, ``--think 0.6`` lets the write behind a turn, half a second after
its reply, run before the next contender's turn rather than during it).

``--api``: the APIs chatkit serve is played over, each by its own client and its own ``chatkit serve``
process (one server each, so that no API's conversation meets another's in the pool): ``chat``
(chat completions, re-sending the whole conversation), ``responses`` (OpenAI's Responses API, each turn
only the new message and ``previous_response_id``; the cached tokens from
``usage.input_tokens_details.cached_tokens``) and ``messages`` (Anthropic's Messages API, re-sending the
whole conversation; ``usage.cache_read_input_tokens``). mlx_lm.server, which serves chat completions
only, is played with ``chat``.

**Where the time goes**: after the rounds, one more conversation (``--trace-turns`` turns) per API is
played with the header ``X-Chatkit-Trace: 1``, on which the server stamps each stage of a request
(``chatkit/server/trace.py``) and sends the stamps back; the table gives each stage's median ms over
its turns after the first (a continued conversation, the case that matters), beside the in-process
session's render, prefill and total.

``--quick``: the tests' tiny model (unless ``--model``), 6 turns, 1 round (unless ``--turns`` / ``--rounds``
say otherwise), no re-prefill, no
mlx_lm.server, no waiting for a quiet machine (to check that the script runs, or to compare two
versions of chatkit serve on a busy machine; its figures are not worth reporting).

**How it is timed, fairly.** TTFT is from the start of a turn to the first chunk with text: in-process,
from the ``stream_respond`` call; over HTTP, from the request's first byte sent (its JSON made before
the clock starts, as the message is, in-process) to the first event with text read and parsed, by a
client on ``http.client`` (one kept-alive connection; it parses the real server-sent events, and
does little else, so the client's own work is not counted as the server's). The contenders are
**paired**: a round plays the conversation turn by turn, every contender's turn t (same prompt)
before anyone's turn t + 1, in an order that changes from turn to turn (``order``: over two turns
each contender goes once before and once after the in-process session), ``--settle`` seconds between
two turns (longer than OpenBLAS's threads spin after their last work, so that one contender's idle
threads do not take the cores from the next one's; a server's worker threads stay warm, as they do for
a client that keeps talking); each HTTP turn's ratio is to the in-process turn of the same round, played seconds before
or after it (load that drifts over a minute cancels out), and the table shows per turn the median
TTFT and the median of those ratios over the rounds, the summary also the ratios' 90th percentile and
maximum over every turn of every round (the spread). Each round uses its own system prompt (no server
can reuse another round's conversation). After the warm-up (a 2-turn conversation each) the bench
process calls ``gc.freeze()``, as ``chatkit serve`` does once its model is loaded, so that no full
garbage collection over the model's objects lands in a timed turn on either side.

Checks: all four produce the same replies, token for token (greedy), and the servers report how many
prompt tokens they took from their cache (``usage.prompt_tokens_details.cached_tokens``).
"""

from __future__ import annotations

import argparse
import gc
import http.client
import json
import os
import select
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import chatkit
import chatkit._blas
from chatkit import ChatSession, ContextPolicy, GenerateParams, PromptCache

import httpx  # only to wait for the servers to answer
from _common import OtherLoad, describe, load_model, median, wait_until_quiet

STORED = "chatkit serve --store"
APIS = {"chat": "chatkit serve", "responses": "chatkit serve responses", "messages": "chatkit serve messages"}
WORDS = ("castle river winter market bridge tower harvest road library mill shepherd valley snow wool "
         "cheese salt iron cloth honey ledger steward gate well fire wall autumn merchant village").split()
TRACE_HEADER = "X-Chatkit-Trace"
TRACE_COMMENT = ": chatkit-trace "
# The stages of one request as the table shows them: (label, from stamp, to stamp); "sent" is the client
# sending the request, "got" the client reading the first text (chatkit/server/trace.py names the rest).
STAGES = [
    ("HTTP in: request read, routed", "sent", "handler"),
    ("body read, JSON parsed", "handler", "body"),
    ("checked, read into a request", "body", "parsed"),
    ("slot taken", "parsed", "slot"),
    ("session found (index, pool)", "slot", "session"),
    ("turn opened (render, tokenize)", "session", "opened"),
    ("response started (headers)", "opened", "headers"),
    ("events before the first token", "headers", "turn"),
    ("to the first token on the loop", "turn", "token"),
    ("first text event made", "token", "text"),
    ("first text event written", "text", "text_sent"),
    ("HTTP out: client reads it", "text_sent", "got"),
]


def prompts(turns: int) -> list[str]:
    """``turns`` user messages of about 40 tokens, different from each other, deterministic."""
    out = []
    for t in range(turns):
        words = [WORDS[(t * 7 + i * 3) % len(WORDS)] for i in range(24)]
        out.append(f"Question {t + 1}: tell me about the " + " and the ".join(" ".join(words[i:i + 3])
                                                                            for i in range(0, 24, 6)) + ".")
    return out


@dataclass
class Turn:
    """One turn of one contender: its TTFT (s), the reply, the cached prompt tokens the server reported
    (-1: none) and (in-process, or traced) its stage times in ms."""

    ttft: float
    reply: str
    cached: int = -1
    stages: dict[str, float] = field(default_factory=dict)


class InProcess:
    """The in-process session: ``stream_respond(message)`` per turn, timed from that call. It has a prompt
    cache of its own, as each server process does: the process-wide one would also hold the re-prefill's
    blocks of the same conversation, played seconds before, and serve this turn from them."""

    def __init__(self, lm, system: str, params: GenerateParams) -> None:
        self.session = (ChatSession.builder(lm).instructions(system).generate_params(params.copy())
                        .prompt_cache(PromptCache())
                        .context_policy(ContextPolicy.rolling()).build())  # the server's default (a small window)

    def turn(self, message: str) -> Turn:
        return first_text(lambda: self.session.stream_respond(message))


class RePrefill:
    """A stateless re-prefill: per turn a fresh session built with the whole history so far (no prompt cache)."""

    def __init__(self, lm, system: str, params: GenerateParams) -> None:
        self.lm, self.system, self.params, self.history = lm, system, params, []

    def turn(self, message: str) -> Turn:
        session = (ChatSession.builder(self.lm).instructions(self.system).history(self.history).prompt_cache(None)
                   .generate_params(self.params.copy()).context_policy(ContextPolicy.rolling()).build())
        played = first_text(lambda: session.stream_respond(message))
        self.history += [{"role": "user", "content": message}, {"role": "assistant", "content": played.reply}]
        return played


def first_text(open_stream) -> Turn:
    """Open an in-process stream (``open_stream()``: rendering the prompt is part of the turn) and iterate
    it to its end: its TTFT (to the first chunk with text), its reply and its stages in ms."""
    t0 = time.perf_counter()
    stream = open_stream()
    opened = time.perf_counter()
    ttft = None
    with stream:
        for chunk in stream:
            if ttft is None and chunk.text:
                ttft = time.perf_counter() - t0
    ttft = ttft if ttft is not None else time.perf_counter() - t0
    stats = stream.stats
    prefill = stats.prefilled_tokens / stats.prompt_tps if stats is not None and stats.prompt_tps > 0 else 0.0
    return Turn(ttft, stream.text, stages={"render": (opened - t0) * 1e3, "prefill": prefill * 1e3, "total": ttft * 1e3})


class OverHttp:
    """A client playing the conversation over ``api`` (see ``request_body``), streaming, on one kept-alive
    connection (``http.client``: little work of its own between the bytes and the first text, unlike a
    full client library); ``trace``: asks the server for its stage stamps (``X-Chatkit-Trace``)."""

    def __init__(self, url: str, system: str, max_tokens: int, api: str = "chat", trace: bool = False) -> None:
        self.http = http.client.HTTPConnection(url.split("//", 1)[1], timeout=600)
        self.system, self.max_tokens, self.api = system, max_tokens, api
        self.headers = {"Content-Type": "application/json", **({TRACE_HEADER: "1"} if trace else {})}
        self.convo: list[dict] = []
        self.previous: str | None = None

    def close(self) -> None:
        self.http.close()

    def connected(self) -> None:
        """Connected, before the clock starts: again if the server closed the connection meanwhile
        (uvicorn after 5 idle seconds, mlx_lm.server after each reply), as a client's pool does."""
        sock = self.http.sock
        if sock is not None and select.select([sock], [], [], 0)[0]:  # readable while idle: closed
            self.http.close()
            sock = None
        if sock is None:
            self.http.connect()

    def turn(self, message: str) -> Turn:
        self.convo.append({"role": "user", "content": message})
        path, body = request_body(self.api, self.system, self.convo, message, self.max_tokens, self.previous)
        payload = json.dumps(body).encode()  # the request made before the clock starts: the client's work
        self.connected()
        text, got, hits, stamps = "", None, -1, None
        t0 = time.perf_counter_ns()
        self.http.request("POST", f"/v1/{path}", payload, self.headers)
        r = self.http.getresponse()
        if r.status != 200:
            raise SystemExit(f"{self.api}: HTTP {r.status}: {r.read()[:500]!r}")
        for raw in r:  # server-sent events, line by line
            line = raw.decode().rstrip("\r\n")
            if line.startswith(TRACE_COMMENT):
                stamps = json.loads(line[len(TRACE_COMMENT):])
            if not line.startswith("data: {"):
                continue
            data = json.loads(line[6:])
            piece, hits = read_event(data, hits)
            if piece and got is None:
                got = time.perf_counter_ns()
            text += piece
            if data.get("type") in ("response.completed", "response.incomplete"):
                self.previous = data["response"]["id"]
        got = got if got is not None else time.perf_counter_ns()
        self.convo.append({"role": "assistant", "content": text})
        return Turn((got - t0) / 1e9, text, hits, stage_times(t0, got, stamps) if stamps is not None else {})


def request_body(api: str, system: str, convo: list[dict], message: str, max_tokens: int,
                 previous: str | None) -> tuple[str, dict]:
    """(path, body) of one streamed turn: chat completions and the Messages API re-send the whole
    conversation; the Responses API sends the new message after ``previous`` (a response id)."""
    if api == "responses":
        body = {"model": "default_model", "input": message, "instructions": system, "stream": True,
                "max_output_tokens": max_tokens, "temperature": 0.0}
        return "responses", {**body, "previous_response_id": previous} if previous else body
    body = {"model": "default_model", "messages": convo, "stream": True, "max_tokens": max_tokens,
            "temperature": 0.0}
    if api == "messages":
        return "messages", {**body, "system": system}
    return "chat/completions", {**body, "messages": [{"role": "system", "content": system}, *convo],
                                "stream_options": {"include_usage": True}}


def read_event(data: dict, cached: int) -> tuple[str, int]:
    """The text of one streamed event (a chat completion chunk, a Messages API event or a Responses API
    event) and the cached prompt tokens its usage reports (``cached`` when it reports none)."""
    kind = data.get("type")
    if kind == "content_block_delta":
        return data["delta"].get("text", ""), cached
    if kind == "message_delta":
        return "", data["usage"].get("cache_read_input_tokens", cached)
    if kind == "response.output_text.delta":
        return data["delta"], cached
    if kind in ("response.completed", "response.incomplete"):
        return "", data["response"]["usage"]["input_tokens_details"]["cached_tokens"]
    if kind is not None:
        return "", cached
    text = "".join((choice.get("delta") or {}).get("content") or "" for choice in data.get("choices") or [])
    usage = data.get("usage")
    return text, ((usage.get("prompt_tokens_details") or {}).get("cached_tokens", cached) if usage else cached)


def stage_times(sent: int, got: int, trace: dict) -> dict[str, float]:
    """A traced request's stages in ms (``STAGES``; absent stamps leave their stages out), its prefill
    (the model's part of "to the first token") and the total, from the client's ``sent`` and ``got``
    (``perf_counter_ns``, the clock the server stamps with on the same machine)."""
    at = {"sent": sent, **dict(trace["stamps"]), "got": got}
    out = {label: (at[b] - at[a]) / 1e6 for label, a, b in STAGES if a in at and b in at}
    out["prefill"] = trace.get("prefill_ms", 0.0)
    out["total"] = (got - sent) / 1e6
    return out


def stage_table(traced: dict[str, list[dict[str, float]]], local: list[dict[str, float]]) -> str:
    """The median ms of each stage over the turns after the first, per API, beside the in-process
    session's: its render (``stream_respond``), its prefill, the rest, its total."""
    apis = [api for api in traced if len(traced[api]) > 1]
    if not apis:
        return "(the servers sent no stamps: a chatkit without X-Chatkit-Trace)"

    def cell(turns: list[dict[str, float]], key: str) -> str:
        values = [t[key] for t in turns[1:] if key in t]
        return f"{median(values):.2f}" if values else "-"

    for t in local:
        t["rest"] = t["total"] - t["render"] - t["prefill"]
        t["overhead"] = t["total"] - t["prefill"]
    for turns in traced.values():
        for t in turns:
            if "to the first token on the loop" in t:
                t["hand-off"] = t["to the first token on the loop"] - t["prefill"]
            t["overhead"] = t["total"] - t["prefill"]
    rows = [(label, label, "render" if label.startswith("turn opened") else None) for label, _, _ in STAGES]
    at = next(i for i, r in enumerate(rows) if r[0].startswith("to the first token")) + 1
    rows[at:at] = [("- of which the prefill (the model)", "prefill", "prefill"),
                   ("- of which the hand-off to the turn's thread and back, the cache plan", "hand-off", "rest")]
    rows.append(("**all but the prefill**", "overhead", "overhead"))
    rows.append(("**TTFT**", "total", "total"))
    lines = ["| stage (ms, median of turns 2+) | " + " | ".join(apis) + " | in-process |",
             "|---" * (len(apis) + 2) + "|"]
    for label, key, local_key in rows:
        mine = f"{cell(local, local_key)} ({local_key})" if local_key else ""
        lines.append(f"| {label} | " + " | ".join(cell(traced[a], key) for a in apis) + f" | {mine} |")
    return "\n".join(lines)


def order(names: list[str], k: int) -> list[str]:
    """The order of the ``k``-th turn played (round plus turn): rotated by one every other time, and
    mirrored every other time, so that over two turns each contender goes once before and once after
    each other one (the in-process session included); the two chatkit servers side by side."""
    j = (k // 2) % len(names)
    names = names[j:] + names[:j]
    if k % 2:
        names.reverse()
    if STORED in names:
        names.remove(STORED)
        names.insert(names.index("chatkit serve") + (k // 2 % 2 == 0), STORED)
    return names


def play(players: dict, messages: list[str], r: int, settle: float, think: float = 0.0) -> dict[str, list[Turn]]:
    """Round ``r``: the conversation turn by turn, every contender's turn t before any contender's turn
    t + 1, in an order that changes from turn to turn (``order``), ``settle`` seconds between two
    contenders' turns (``think`` more after an HTTP client's: a user reading the reply)."""
    out: dict[str, list[Turn]] = {n: [] for n in players}
    for t, m in enumerate(messages):
        for n in order(list(players), r + t):
            out[n].append(players[n].turn(m))
            time.sleep(settle + (think if isinstance(players[n], OverHttp) else 0.0))
    for p in players.values():
        if isinstance(p, OverHttp):
            p.close()
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args: list[str], port: int) -> subprocess.Popen:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    if chatkit._blas.BLAS and args[0] == "mlx_lm":  # the same BLAS chatkit loads, for a fair comparison
        env["LD_PRELOAD"] = chatkit._blas.BLAS
    proc = subprocess.Popen([sys.executable, "-m", *args], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    for _ in range(1200):
        try:
            if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=5).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        if proc.poll() is not None:
            raise SystemExit(f"{args[0]} did not start: {proc.stderr.read()[-2000:] if proc.stderr else ''}")
        time.sleep(0.1)
    raise SystemExit(f"{args[0]} did not answer within two minutes")


def pick_model(name: str):
    if name == "demo":
        return chatkit.load("demo")
    if name == "tiny":
        from chatkit.testing import tiny_model

        return tiny_model("qwen3", "bpe", 0)
    return load_model()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--turns", type=int, help="user messages per conversation (default 20; --quick: 6)")
    ap.add_argument("--rounds", type=int, help="conversations per contender (default 3; --quick: 1)")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--store", action="store_true", help="also run chatkit serve --store (a temporary folder)")
    ap.add_argument("--settle", type=float, help="seconds between two contenders' turns (default 0.25; --quick: 0.05)")
    ap.add_argument("--think", type=float, default=0.0, help="seconds more after an HTTP client's turn")
    ap.add_argument("--api", default="chat,responses,messages",
                    help="the APIs chatkit serve is played over: chat, responses, messages (comma-separated)")
    ap.add_argument("--model", choices=("bench", "demo", "tiny"), help="default bench; --quick: tiny")
    ap.add_argument("--trace-turns", type=int, help="turns of the traced conversation (stage table; default 8, --quick: 4)")
    ap.add_argument("--max-wait", type=float, default=300.0,
                    help="seconds to wait for a quiet machine before the rounds (default 300; --quick: 0)")
    ap.add_argument("--quick", action="store_true", help="a short run that checks the script works")
    a = ap.parse_args()
    apis = [x.strip() for x in a.api.split(",") if x.strip()]
    if not apis or any(x not in APIS for x in apis):
        ap.error(f"--api: a comma-separated list of {', '.join(APIS)}")
    a.settle = a.settle if a.settle is not None else (0.05 if a.quick else 0.25)
    a.trace_turns = a.trace_turns or (4 if a.quick else 8)
    a.model = a.model or ("tiny" if a.quick else "bench")
    a.turns = a.turns or (6 if a.quick else 20)
    a.rounds = a.rounds or (1 if a.quick else 3)

    lm = pick_model(a.model)
    folder = str(lm.source)
    params = GenerateParams(max_tokens=a.max_tokens, temperature=0.0)
    messages = prompts(a.turns)
    print(describe(lm) + (" (here: chatkit's bundled demo model)" if a.model == "demo" else ""))
    print(f"model folder: {folder}\n")

    serve = ["chatkit", "serve", "--log-level", "warning"]
    servers = {APIS[api]: serve for api in apis}
    api_of = {APIS[api]: api for api in apis}
    if "chat" in apis and not a.quick:
        servers["mlx_lm.server"] = ["mlx_lm", "server", "--log-level", "WARNING"]
        api_of["mlx_lm.server"] = "chat"
    if a.store and "chat" in apis:
        servers[STORED] = [*serve, "--store", tempfile.mkdtemp(prefix="bench-serve-")]
        api_of[STORED] = "chat"
    ports = {n: free_port() for n in servers}
    procs = [launch([*cmd, "--model", folder, "--port", str(ports[n]), "--max-tokens", str(a.max_tokens)], ports[n])
             for n, cmd in servers.items()]
    def players(system: str, names: list[str], trace: bool = False) -> dict:
        made = {}
        for n in names:
            if n == "in-process":
                made[n] = InProcess(lm, system, params)
            elif n == "re-prefill":
                made[n] = RePrefill(lm, system, params)
            else:
                made[n] = OverHttp(f"http://127.0.0.1:{ports[n]}", system, a.max_tokens, api_of[n], trace)
        return made

    try:
        names = ["in-process", *([] if a.quick else ["re-prefill"]), *servers]
        play(players("warm-up", names), messages[:2], 0, 0.0)  # one short conversation each
        gc.collect()
        gc.freeze()  # as chatkit serve does once its model is loaded: no full collection over the model's objects
        print(wait_until_quiet(max_wait=0 if a.quick else a.max_wait))
        load = OtherLoad()
        rounds = []
        for r in range(a.rounds):
            system = f"Round {r + 1}. You are the archivist of a mountain castle; answer precisely."
            rounds.append(play(players(system, names), messages, r, a.settle, a.think))
        # where the time goes: one traced conversation per API, beside the in-process session's
        system = "Traced. You are the archivist of a mountain castle; answer precisely."
        traced_names = ["in-process", *(APIS[api] for api in apis)]
        traced = play(players(system, traced_names, trace=True), prompts(a.trace_turns), 0, a.settle)
        print(load.report())
    finally:
        for p in procs:
            p.terminate()
            p.wait(timeout=60)
    report(a, names, servers, api_of, messages, rounds)
    print(f"\nWhere the time goes: one request, stage by stage ({a.trace_turns}-turn conversation per API, "
          "chatkit serve; X-Chatkit-Trace)\n")
    print(stage_table({api: [t.stages for t in traced[APIS[api]]] for api in apis},
                      [t.stages for t in traced["in-process"]]))


def report(a, names: list[str], servers: dict, api_of: dict, messages: list[str],
           rounds: list[dict[str, list[Turn]]]) -> None:
    """The replies' check, the TTFT table per turn with each contender's ratio to the in-process turn
    played beside it (the median over the rounds of those paired ratios), and the summary."""
    for n in names[1:]:
        same = sum(x.reply == y.reply for played in rounds for x, y in zip(played[n], played["in-process"], strict=True))
        print(f"replies equal to the in-process session's: {n}: {same}/{a.rounds * len(messages)}")
    print(f"\nTTFT per turn, median of {a.rounds} rounds, ms (median of the ratios to the in-process turn played "
          "beside it in the same round); cached = prompt tokens the server reused (last round)\n")
    print("HTTP clients: " + "; ".join(f"{n}: {api_of[n]}" for n in servers) + "\n")
    print("| turn | " + " | ".join(names) + " | cached: " + " / ".join(servers) + " |")
    print("|---" * (len(names) + 2) + "|")
    ms = {n: [median([p[n][t].ttft for p in rounds]) * 1e3 for t in range(len(messages))] for n in names}
    paired = {n: [[p[n][t].ttft / p["in-process"][t].ttft for p in rounds] for t in range(len(messages))]
              for n in names}
    ratio = {n: [median(rs) for rs in paired[n]] for n in names}
    for t in range(len(messages)):
        cells = [f"{ms['in-process'][t]:.1f}"] + [f"{ms[n][t]:.1f} ({ratio[n][t]:.2f}x)" for n in names[1:]]
        cached = " / ".join(str(rounds[-1][n][t].cached) for n in servers)
        print(f"| {t + 1} | " + " | ".join(cells) + f" | {cached} |")
    print()
    for n in names[1:]:
        every = sorted(x for rs in paired[n] for x in rs)
        print(f"{n}: median ratio to in-process over all turns {median(ratio[n]):.2f}x; "
              f"turn 1 {ratio[n][0]:.2f}x, turn {len(messages)} {ratio[n][-1]:.2f}x, worst turn {max(ratio[n]):.2f}x; "
              f"all {len(every)} paired turns: p90 {every[int(0.9 * (len(every) - 1))]:.2f}x, max {every[-1]:.2f}x")
    best = {n: [min(p[n][t].ttft for p in rounds) for t in range(len(messages))] for n in names}
    print("best of the rounds per turn (what a busy machine cannot add to), median ratio over the turns: " + "; ".join(
        f"{n} {median([b / i for b, i in zip(best[n], best['in-process'], strict=True)]):.3f}x" for n in names[1:]))
    if a.store and STORED in servers:
        rs = [median([p[STORED][t].ttft / p["chatkit serve"][t].ttft for p in rounds]) for t in range(len(messages))]
        same = [p.cached for p in rounds[-1][STORED]] == [p.cached for p in rounds[-1]["chatkit serve"]]
        print(f"\nwrite-behind: {STORED} / chatkit serve, TTFT per turn: median {median(rs):.3f}x, "
              f"mean {sum(rs) / len(rs):.3f}x, worst {max(rs):.3f}x (target <= 1.02x); cached tokens equal: {same}")


if __name__ == "__main__":
    main()

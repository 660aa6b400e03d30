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
without a store, turn by turn. ``--think S``: the HTTP clients wait S seconds after each reply (a
user reading it), so that with ``--think 0.6`` a write behind the last turn (it starts half a second
after the reply) runs while the next request arrives.

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

``--quick``: 6 turns, 1 round, no re-prefill, no mlx_lm.server, no waiting for a quiet machine (to
check that the script runs; its figures are not worth reporting).

Time to first token (TTFT) is from sending the message to the first chunk with text. Each round
uses its own system prompt (no server can reuse another round's conversation) and runs the
contenders in an order that rotates from round to round, ``--settle`` seconds apart; the table shows per-turn medians over the rounds.
Checks: all four produce the same replies, token for token (greedy), and the servers report how many
prompt tokens they took from their cache (``usage.prompt_tokens_details.cached_tokens``).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import chatkit
import chatkit._blas
from chatkit import ChatSession, ContextPolicy, GenerateParams

import httpx
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
class Played:
    """One contender's conversation: per turn, the TTFT (s), the reply, the cached prompt tokens the
    server reported and (traced) the stage times in ms."""

    ttfts: list[float] = field(default_factory=list)
    replies: list[str] = field(default_factory=list)
    cached: list[int] = field(default_factory=list)
    stages: list[dict[str, float]] = field(default_factory=list)


def first_text(open_stream) -> tuple[float, object, dict[str, float]]:
    """Open an in-process stream (``open_stream()``: rendering the prompt is part of the turn) and iterate
    it: (seconds to the first chunk with text, the stream, its stages in ms)."""
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
    return ttft, stream, {"render": (opened - t0) * 1e3, "prefill": prefill * 1e3, "total": ttft * 1e3}


def in_process(lm, system: str, messages: list[str], params: GenerateParams) -> Played:
    session = (ChatSession.builder(lm).instructions(system).generate_params(params.copy())
               .context_policy(ContextPolicy.rolling()).build())  # the server's default (a small window)
    out = Played()
    for m in messages:
        ttft, stream, stages = first_text(lambda m=m: session.stream_respond(m))
        out.ttfts.append(ttft)
        out.replies.append(stream.text)
        out.stages.append(stages)
    return out


def re_prefill(lm, system: str, messages: list[str], params: GenerateParams) -> Played:
    history: list[dict] = []
    out = Played()
    for m in messages:
        session = (ChatSession.builder(lm).instructions(system).history(history).generate_params(params.copy())
                   .context_policy(ContextPolicy.rolling()).build())
        ttft, stream, _ = first_text(lambda m=m, session=session: session.stream_respond(m))
        out.ttfts.append(ttft)
        out.replies.append(stream.text)
        history += [{"role": "user", "content": m}, {"role": "assistant", "content": stream.text}]
    return out


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


def over_http(url: str, system: str, messages: list[str], max_tokens: int, think: float = 0.0,
              api: str = "chat", trace: bool = False) -> Played:
    """A client playing the conversation over ``api`` (see ``request_body``), ``think`` seconds after each
    reply; ``trace``: asks the server for its stage stamps (``X-Chatkit-Trace``)."""
    convo: list[dict] = []
    out, previous = Played(), None
    headers = {TRACE_HEADER: "1"} if trace else {}
    with httpx.Client(timeout=600) as http:
        for m in messages:
            convo.append({"role": "user", "content": m})
            path, body = request_body(api, system, convo, m, max_tokens, previous)
            text, got, hits, stamps = "", None, -1, None
            t0 = time.perf_counter_ns()
            with http.stream("POST", f"{url}/v1/{path}", json=body, headers=headers) as r:
                r.raise_for_status()
                for line in r.iter_lines():
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
                        previous = data["response"]["id"]
            got = got if got is not None else time.perf_counter_ns()
            out.ttfts.append((got - t0) / 1e9)
            out.replies.append(text)
            out.cached.append(hits)
            if stamps is not None:
                out.stages.append(stage_times(t0, got, stamps))
            convo.append({"role": "assistant", "content": text})
            time.sleep(think)
    return out


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


def order(names: list[str], r: int) -> list[str]:
    """Round ``r``'s order: rotated by one each round; the two chatkit servers side by side, their
    order swapped every other round (each of the pair follows the same contenders equally often)."""
    names = names[r % len(names):] + names[:r % len(names)]
    if STORED in names:
        names.remove(STORED)
        at = names.index("chatkit serve")
        names.insert(at + (r % 2 == 0), STORED)
    return names


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
    ap.add_argument("--turns", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--store", action="store_true", help="also run chatkit serve --store (a temporary folder)")
    ap.add_argument("--settle", type=float, default=2.0, help="seconds between two contenders")
    ap.add_argument("--think", type=float, default=0.0, help="seconds an HTTP client waits after each reply")
    ap.add_argument("--api", default="chat,responses,messages",
                    help="the APIs chatkit serve is played over: chat, responses, messages (comma-separated)")
    ap.add_argument("--model", choices=("bench", "demo", "tiny"), default="bench")
    ap.add_argument("--trace-turns", type=int, default=8, help="turns of the traced conversation (stage table)")
    ap.add_argument("--quick", action="store_true", help="a short run that checks the script works")
    a = ap.parse_args()
    apis = [x.strip() for x in a.api.split(",") if x.strip()]
    if not apis or any(x not in APIS for x in apis):
        ap.error(f"--api: a comma-separated list of {', '.join(APIS)}")
    if a.quick:
        a.turns, a.rounds, a.settle, a.trace_turns = 6, 1, 0.3, 4

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
    try:
        # warm-up: one short conversation each
        in_process(lm, "warm-up", messages[:2], params)
        for n, port in ports.items():
            over_http(f"http://127.0.0.1:{port}", "warm-up", messages[:2], a.max_tokens, api=api_of[n])
        print(wait_until_quiet(max_wait=0 if a.quick else 300))
        load = OtherLoad()
        names = ["in-process", *([] if a.quick else ["re-prefill"]), *servers]
        ttft = {n: [[] for _ in messages] for n in names}
        cached: dict[str, list[int]] = {}
        replies: dict[str, list[list[str]]] = {n: [] for n in names}  # per system, per round
        for r in range(a.rounds):
            system = f"Round {r + 1}. You are the archivist of a mountain castle; answer precisely."
            for n in order(names, r):
                if n == "in-process":
                    played = in_process(lm, system, messages, params)
                elif n == "re-prefill":
                    played = re_prefill(lm, system, messages, params)
                else:
                    played = over_http(f"http://127.0.0.1:{ports[n]}", system, messages, a.max_tokens, a.think,
                                       api_of[n])
                    cached[n] = played.cached
                time.sleep(a.settle)  # a server may still be busy after its last reply (mlx_lm.server is)
                for t, x in enumerate(played.ttfts):
                    ttft[n][t].append(x)
                replies[n].append(played.replies)
        # where the time goes: one traced conversation per API
        system = "Traced. You are the archivist of a mountain castle; answer precisely."
        traced_turns = prompts(a.trace_turns)
        local = in_process(lm, system, traced_turns, params).stages
        traced = {api: over_http(f"http://127.0.0.1:{ports[APIS[api]]}", system, traced_turns, a.max_tokens,
                                 api=api, trace=True).stages for api in apis}
        print(load.report())
    finally:
        for p in procs:
            p.terminate()
            p.wait(timeout=60)
    report(a, names, servers, api_of, messages, ttft, cached, replies)
    print(f"\nWhere the time goes: one request, stage by stage ({a.trace_turns}-turn conversation per API, "
          "chatkit serve; X-Chatkit-Trace)\n")
    print(stage_table(traced, local))


def report(a, names, servers, api_of, messages, ttft, cached, replies) -> None:
    """The replies' check, the TTFT table per turn and the ratios to in-process."""
    for n in names[1:]:
        same = sum(x == y for r in range(a.rounds) for x, y in zip(replies[n][r], replies["in-process"][r], strict=True))
        print(f"replies equal to the in-process session's: {n}: {same}/{a.rounds * len(messages)}")
    print(f"\nTTFT per turn, median of {a.rounds} rounds, ms (ratio to in-process); cached = prompt tokens the"
          " server reused (last round)\n")
    print("HTTP clients: " + "; ".join(f"{n}: {api_of[n]}" for n in servers) + "\n")
    print("| turn | " + " | ".join(names) + " | cached: " + " / ".join(servers) + " |")
    print("|---" * (len(names) + 2) + "|")
    med = {n: [median(ts) for ts in ttft[n]] for n in names}
    for t in range(len(messages)):
        ip = med["in-process"][t]
        cells = [f"{ip * 1e3:.1f}"] + [f"{med[n][t] * 1e3:.1f} ({med[n][t] / ip:.2f}x)" for n in names[1:]]
        print(f"| {t + 1} | " + " | ".join(cells) + " | " + " / ".join(str(cached[n][t]) for n in servers) + " |")
    print()
    for n in names[1:]:
        ratios = [med[n][t] / med["in-process"][t] for t in range(len(messages))]
        print(f"{n}: median ratio to in-process over all turns {median(ratios):.2f}x; "
              f"turn 1 {ratios[0]:.2f}x, turn {len(messages)} {ratios[-1]:.2f}x, worst turn {max(ratios):.2f}x")
    if a.store and STORED in servers:
        ratios = [med[STORED][t] / med["chatkit serve"][t] for t in range(len(messages))]
        print(f"\nwrite-behind: {STORED} / chatkit serve, TTFT per turn: median {median(ratios):.3f}x, "
              f"mean {sum(ratios) / len(ratios):.3f}x, worst {max(ratios):.3f}x (target <= 1.02x); cached tokens "
              f"equal: {cached[STORED] == cached['chatkit serve']}")


if __name__ == "__main__":
    main()

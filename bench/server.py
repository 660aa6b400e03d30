"""Time to first token over HTTP: ``chatkit serve`` against the in-process session, a stateless
re-prefill, and ``mlx_lm.server`` run beside it on the same model folder.

    .venv/bin/python bench/server.py [--turns 20] [--rounds 3] [--max-tokens 16] [--store] [--api messages]

The model is the benchmarks' ~29M-parameter Qwen3 (float32, random weights; ``bench/_common.py``),
saved in a folder that both servers load. A conversation of ``--turns`` user messages (about 40
tokens each, a system prompt in front) is played, greedy, up to ``--max-tokens`` per reply, by:

* **in-process**: one ``ChatSession``, ``stream_respond(message)`` per turn;
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

``--api messages``: the HTTP clients speak Anthropic's Messages API (``/v1/messages``, streaming; the
cached tokens from ``usage.cache_read_input_tokens``) to chatkit serve; mlx_lm.server, which does not
serve it, is left out.

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

import chatkit._blas
from chatkit import ChatSession, GenerateParams

import httpx
from _common import OtherLoad, describe, load_model, median, wait_until_quiet

STORED = "chatkit serve --store"
WORDS = ("castle river winter market bridge tower harvest road library mill shepherd valley snow wool "
         "cheese salt iron cloth honey ledger steward gate well fire wall autumn merchant village").split()


def prompts(turns: int) -> list[str]:
    """``turns`` user messages of about 40 tokens, different from each other, deterministic."""
    out = []
    for t in range(turns):
        words = [WORDS[(t * 7 + i * 3) % len(WORDS)] for i in range(24)]
        out.append(f"Question {t + 1}: tell me about the " + " and the ".join(" ".join(words[i:i + 3])
                                                                            for i in range(0, 24, 6)) + ".")
    return out


def first_text(stream) -> tuple[float, list]:
    """Iterate an in-process stream: (seconds to the first chunk with text, all chunks)."""
    t0 = time.perf_counter()
    chunks, ttft = [], None
    for chunk in stream:
        if ttft is None and chunk.text:
            ttft = time.perf_counter() - t0
        chunks.append(chunk)
    return (ttft if ttft is not None else time.perf_counter() - t0), chunks


def in_process(lm, system: str, messages: list[str], params: GenerateParams) -> tuple[list[float], list[str]]:
    session = ChatSession.builder(lm).instructions(system).generate_params(params.copy()).build()
    ttfts, replies = [], []
    for m in messages:
        with session.stream_respond(m) as stream:
            ttft, _ = first_text(stream)
        ttfts.append(ttft)
        replies.append(stream.text)
    return ttfts, replies


def re_prefill(lm, system: str, messages: list[str], params: GenerateParams) -> tuple[list[float], list[str]]:
    history: list[dict] = []
    ttfts, replies = [], []
    for m in messages:
        session = ChatSession.builder(lm).instructions(system).history(history).generate_params(params.copy()).build()
        with session.stream_respond(m) as stream:
            ttft, _ = first_text(stream)
        ttfts.append(ttft)
        replies.append(stream.text)
        history += [{"role": "user", "content": m}, {"role": "assistant", "content": stream.text}]
    return ttfts, replies


def over_http(url: str, system: str, messages: list[str], max_tokens: int,
              think: float = 0.0, api: str = "chat") -> tuple[list[float], list[str], list[int]]:
    """A stateless client: re-sends the whole conversation every turn, ``think`` seconds after the last
    reply, over chat completions or (``api="messages"``) Anthropic's Messages API. (TTFTs, replies, cached tokens)"""
    convo = [] if api == "messages" else [{"role": "system", "content": system}]
    ttfts, replies, cached = [], [], []
    with httpx.Client(timeout=600) as http:
        for m in messages:
            convo.append({"role": "user", "content": m})
            body = {"model": "default_model", "messages": convo, "stream": True, "max_tokens": max_tokens,
                    "temperature": 0.0}
            if api == "messages":
                body["system"] = system
            else:
                body["stream_options"] = {"include_usage": True}
            text, ttft, hits = "", None, -1
            t0 = time.perf_counter()
            with http.stream("POST", f"{url}/v1/{'messages' if api == 'messages' else 'chat/completions'}", json=body) as r:
                r.raise_for_status()
                for line in r.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    piece, hits = read_event(json.loads(line[6:]), hits)
                    if piece and ttft is None:
                        ttft = time.perf_counter() - t0
                    text += piece
            ttfts.append(ttft if ttft is not None else time.perf_counter() - t0)
            replies.append(text)
            cached.append(hits)
            convo.append({"role": "assistant", "content": text})
            time.sleep(think)
    return ttfts, replies, cached


def read_event(data: dict, cached: int) -> tuple[str, int]:
    """The text of one streamed event (a chat completion chunk or a Messages API event) and the cached
    prompt tokens its usage reports (``cached`` when it reports none)."""
    if data.get("type") == "content_block_delta":
        return data["delta"].get("text", ""), cached
    if data.get("type") == "message_delta":
        return "", data["usage"].get("cache_read_input_tokens", cached)
    text = "".join((choice.get("delta") or {}).get("content") or "" for choice in data.get("choices") or [])
    usage = data.get("usage")
    return text, ((usage.get("prompt_tokens_details") or {}).get("cached_tokens", cached) if usage else cached)


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--turns", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--store", action="store_true", help="also run chatkit serve --store (a temporary folder)")
    ap.add_argument("--settle", type=float, default=2.0, help="seconds between two contenders")
    ap.add_argument("--think", type=float, default=0.0, help="seconds an HTTP client waits after each reply")
    ap.add_argument("--api", choices=("chat", "messages"), default="chat",
                    help="what the HTTP clients speak: chat completions, or Anthropic's Messages API (chatkit only)")
    a = ap.parse_args()

    lm = load_model()
    folder = lm.source
    params = GenerateParams(max_tokens=a.max_tokens, temperature=0.0)
    messages = prompts(a.turns)
    print(describe(lm))
    print(f"model folder: {folder}\n")

    servers = {"chatkit serve": ["chatkit", "serve", "--log-level", "warning"],
               "mlx_lm.server": ["mlx_lm", "server", "--log-level", "WARNING"]}
    if a.api == "messages":
        del servers["mlx_lm.server"]  # it does not serve /v1/messages
    if a.store:
        servers[STORED] = [*servers["chatkit serve"], "--store", tempfile.mkdtemp(prefix="bench-serve-")]
    ports = {n: free_port() for n in servers}
    procs = [launch([*cmd, "--model", folder, "--port", str(ports[n]), "--max-tokens", str(a.max_tokens)], ports[n])
             for n, cmd in servers.items()]
    try:
        # warm-up: one short conversation each
        in_process(lm, "warm-up", messages[:2], params)
        for port in ports.values():
            over_http(f"http://127.0.0.1:{port}", "warm-up", messages[:2], a.max_tokens, api=a.api)
        print(wait_until_quiet())
        load = OtherLoad()
        names = ["in-process", "re-prefill", *servers]
        ttft = {n: [[] for _ in messages] for n in names}
        cached: dict[str, list[int]] = {}
        replies: dict[str, list[list[str]]] = {n: [] for n in names}  # per system, per round
        for r in range(a.rounds):
            system = f"Round {r + 1}. You are the archivist of a mountain castle; answer precisely."
            for n in order(names, r):
                if n == "in-process":
                    times, said = in_process(lm, system, messages, params)
                elif n == "re-prefill":
                    times, said = re_prefill(lm, system, messages, params)
                else:
                    times, said, cached[n] = over_http(f"http://127.0.0.1:{ports[n]}", system, messages, a.max_tokens,
                                                       a.think, a.api)
                time.sleep(a.settle)  # a server may still be busy after its last reply (mlx_lm.server is)
                for t, x in enumerate(times):
                    ttft[n][t].append(x)
                replies[n].append(said)
        print(load.report())
    finally:
        for p in procs:
            p.terminate()
            p.wait(timeout=60)

    for n in names[1:]:
        same = sum(x == y for r in range(a.rounds) for x, y in zip(replies[n][r], replies["in-process"][r], strict=True))
        print(f"replies equal to the in-process session's: {n}: {same}/{a.rounds * len(messages)}")
    print(f"\nTTFT per turn, median of {a.rounds} rounds, ms (ratio to in-process); cached = prompt tokens the"
          " server reused (last round)\n")
    print(f"HTTP clients: {'the Messages API' if a.api == 'messages' else 'chat completions'}\n")
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
              f"turn 1 {ratios[0]:.2f}x, turn {len(messages)} {ratios[-1]:.2f}x")
    if a.store:
        ratios = [med[STORED][t] / med["chatkit serve"][t] for t in range(len(messages))]
        print(f"\nwrite-behind: {STORED} / chatkit serve, TTFT per turn: median {median(ratios):.3f}x, "
              f"mean {sum(ratios) / len(ratios):.3f}x, worst {max(ratios):.3f}x (target <= 1.02x); cached tokens "
              f"equal: {cached[STORED] == cached['chatkit serve']}")


if __name__ == "__main__":
    main()

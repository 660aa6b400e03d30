"""The prompt cache (issue 46): a new conversation that shares a long system prompt with an earlier one.

    .venv/bin/python bench/prompt_cache.py [--system-tokens 2000] [--rounds 5] [--conversations 1000]
                                           [--prompts 50] [--mlx-server] [--quick]

(a) **server**: ``chatkit serve`` (in this process, over HTTP, streaming chat completions) answers a first
    conversation, then a new one with the same system prompt and another question: its TTFT against raw
    mlx-lm appending only the new tokens to a cache that holds the shared prefix (``generate_step`` over the
    suffix, the prefix prefilled before the clock starts), paired turn by turn, and with ``--mlx-server``
    ``mlx_lm.server`` on the same model folder and requests beside them.
(b) **restart**: a new ``PromptCache`` over the same folder (RAM empty: the blocks come from disk) and a new
    server: the same TTFT against raw append, the blocks' load included.
(c) **many**: ``--conversations`` one-turn conversations over ``--prompts`` system prompts (300 to 360 tokens)
    with small RAM and disk budgets, on the tests' tiny model (what is counted is blocks, bytes and lookups,
    not model speed): the budgets are checked after every conversation, the hit rate reported; then the cost
    of one lookup (a 2k-token prompt) with 10 and with 1,000 prompts' blocks cached, one cached, one not.

Timings are medians over ``--rounds``; ratios are chatkit / raw (lower is better; the issue's targets are
(a) <= 1.15x, (b) <= 1.3x, on an idle machine). ``--quick``: the tests' tiny model, a 600-token system
prompt, 2 rounds, 100 conversations over 10 prompts: it checks that the script runs, not a measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from chatkit import ChatSession, GenerateParams, PromptCache  # noqa: E402
from chatkit.server import ServerConfig, start  # noqa: E402

import _common  # noqa: E402,F401  (first: OpenBLAS before MLX)
import httpx  # noqa: E402
import mlx.core as mx  # noqa: E402
from mlx_lm.generate import generate_step  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402


def system_prompt(lm, tokens: int, seed: int) -> str:
    words, text = [], ""
    while len(lm.tokenizer.encode(text)) < tokens:
        words.append(f"Rule {seed}.{len(words)}: answer the question in at most {len(words) % 9 + 3} words.")
        text = " ".join(words)
    return text


def ids_of(lm, system: str, question: str) -> list[int]:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    return list(lm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))


def raw_append_ttft(lm, earlier: list[int], ids: list[int]) -> float:
    """mlx-lm alone: a cache holding the prefix ``ids`` shares with ``earlier`` (prefilled untimed), then
    the time to the first token of the new tokens only."""
    shared = next((i for i, (a, b) in enumerate(zip(earlier, ids)) if a != b), min(len(earlier), len(ids)))
    shared = min(shared, len(ids) - 1)
    cache = make_prompt_cache(lm.model)
    lm.model(mx.array([ids[:shared]]), cache=cache)
    mx.eval([c.state for c in cache])
    time.sleep(SETTLE)
    start = time.perf_counter()
    token, _ = next(generate_step(mx.array(ids[shared:]), lm.model, prompt_cache=cache, max_tokens=1))
    return time.perf_counter() - start


SETTLE = 0.25  # seconds before each timed turn: OpenBLAS's threads spin after their last work (bench/server.py)


CLIENT = httpx.Client(timeout=600)  # kept open, as an SDK's client is: a new one per request costs the
# client ~40 ms here (its SSL context), which is neither server's time


def http_ttft(url: str, system: str, question: str, model: str = "any") -> tuple[float, int]:
    """Streaming chat completion: seconds to the first chunk with text, and the cached tokens reported."""
    time.sleep(SETTLE)
    body = {"model": model, "stream": True, "max_tokens": 4, "temperature": 0.0, "stream_options": {"include_usage": True},
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]}
    first, cached = None, 0
    start = time.perf_counter()
    with CLIENT.stream("POST", f"{url}/chat/completions", json=body) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if first is None and event.get("choices") and event["choices"][0].get("delta", {}).get("content"):
                first = time.perf_counter() - start
            usage = event.get("usage") or {}
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", cached) or cached
    return (first if first is not None else time.perf_counter() - start), cached


def paired(lm, url, system_tokens, rounds, mlx_url=None):
    rows = []
    for r in range(rounds):
        system = system_prompt(lm, system_tokens, seed=1000 * r)
        http_ttft(url, system, "What is the first rule?")  # an earlier conversation fills the prompt cache
        if mlx_url:
            http_ttft(mlx_url, system, "What is the first rule?", model="default_model")
        question = f"Question {r}: which rule is about five words?"
        ours, cached = http_ttft(url, system, question)
        raw = raw_append_ttft(lm, ids_of(lm, system, "What is the first rule?"), ids_of(lm, system, question))
        theirs = http_ttft(mlx_url, system, question, model="default_model")[0] if mlx_url else None
        rows.append((ours, raw, theirs, cached))
    return rows


def report(title, rows, target):
    ours = statistics.median(r[0] for r in rows)
    raw = statistics.median(r[1] for r in rows)
    ratios = [r[0] / r[1] for r in rows]
    print(f"\n## {title}")
    print(f"chatkit serve TTFT {ours * 1e3:8.1f} ms   raw mlx-lm append {raw * 1e3:8.1f} ms   "
          f"ratio median {statistics.median(ratios):.2f}x (max {max(ratios):.2f}x; target <= {target}x)   "
          f"cached tokens {[r[3] for r in rows]}")
    if rows[0][2] is not None:
        theirs = statistics.median(r[2] for r in rows)
        print(f"mlx_lm.server TTFT {theirs * 1e3:8.1f} ms   ratio to raw {theirs / raw:.2f}x   "
              f"chatkit / mlx_lm.server {ours / theirs:.2f}x")


def mlx_server(folder: Path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "LD_PRELOAD": os.environ.get("LD_PRELOAD", "")}
    proc = subprocess.Popen([sys.executable, "-m", "mlx_lm", "server", "--model", str(folder), "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    url = f"http://127.0.0.1:{port}/v1"
    for _ in range(600):
        try:
            httpx.get(f"{url}/models", timeout=1)
            return proc, url
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("mlx_lm.server did not start")


def many(lm, conversations, prompts, ram, disk, folder):
    pc = PromptCache(folder, ram_bytes=ram, disk_bytes=disk)
    systems = [system_prompt(lm, 300 + 10 * (i % 7), seed=5000 + i) for i in range(prompts)]
    params = GenerateParams(max_tokens=1, temperature=0.0)
    worst_ram = worst_disk = reused = total = 0
    start = time.perf_counter()
    for i in range(conversations):
        s = ChatSession.builder(lm).instructions(systems[(i * 7) % prompts]).generate_params(params).prompt_cache(pc).build()
        s.respond(f"Conversation {i}: hello.")
        reused, total = reused + s.last_stats.reused_tokens, total + s.last_stats.prompt_tokens
        u = pc.usage()
        worst_ram, worst_disk = max(worst_ram, u.ram_bytes), max(worst_disk, u.disk_bytes)
        assert u.ram_bytes <= ram and u.disk_bytes <= disk, u
    u = pc.usage()
    print(f"\n## {conversations} conversations over {prompts} system prompts ({time.perf_counter() - start:.1f} s)")
    print(f"RAM peak {worst_ram:,} <= budget {ram:,} B; disk peak {worst_disk:,} <= budget {disk:,} B; "
          f"block hit rate {u.hits / max(1, u.hits + u.misses):.2f} ({u.hits} hits, {u.misses} misses); "
          f"{reused / max(1, total):.0%} of prompt tokens reused; evictions RAM {u.ram_evictions}, disk {u.disk_evictions}")


def lookup_cost(cached_prompts: int, tokens: int = 2048) -> tuple[float, float]:
    """Seconds per lookup of a 2k-token prompt with ``cached_prompts`` prompts' blocks cached (tiny arrays:
    the cost of finding blocks, not of copying them): one that is cached, one that is not."""
    from mlx_lm.models.cache import KVCache

    pc = PromptCache(block_tokens=256, ram_bytes=2**40)
    shared = pc.bind({"model": "bench"})
    layer = KVCache()
    layer.keys = layer.values = mx.zeros((1, 1, tokens, 1))
    layer.offset = tokens
    for p in range(cached_prompts):
        shared.insert([p] + list(range(tokens - 1)), [layer])
    probe = [cached_prompts // 2] + list(range(tokens - 1)) + [7]
    shared.fetch(probe)
    costs = []
    for prompt in (probe, [-1] + probe[1:]):
        start = time.perf_counter()
        for _ in range(50):
            shared.fetch(prompt)
        costs.append((time.perf_counter() - start) / 50)
    return costs[0], costs[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--system-tokens", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--conversations", type=int, default=1000)
    p.add_argument("--prompts", type=int, default=50)
    p.add_argument("--mlx-server", action="store_true", help="also time mlx_lm.server on the same requests")
    p.add_argument("--quick", action="store_true")
    a = p.parse_args()
    global SETTLE
    if a.quick:
        SETTLE = 0.05
        a.system_tokens, a.rounds, a.conversations, a.prompts = 600, 2, 100, 10
        from chatkit.testing import tiny_model

        lm = tiny_model("qwen3", "bpe")
        folder = None
    else:
        from chatkit.testing import tiny_model_path

        lm = _common.load_model()
        folder = tiny_model_path("qwen3", "bpe", 0, **_common.MODEL_CONFIG)
    print(_common.describe(lm))
    params = GenerateParams(max_tokens=4, temperature=0.0)
    with tempfile.TemporaryDirectory(prefix="chatkit-bench-prompt-cache-") as tmp:
        proc, mlx_url = mlx_server(folder) if a.mlx_server and folder is not None else (None, None)
        try:
            pc = PromptCache(Path(tmp) / "blocks")
            with start(lm, ServerConfig(defaults=params, prompt_cache=pc)) as running:
                rows = paired(lm, running.url, a.system_tokens, a.rounds, mlx_url)
            report(f"(a) new conversation, {a.system_tokens}-token system prompt shared with an earlier one", rows, 1.15)
            restarted = PromptCache(Path(tmp) / "blocks")
            with start(lm, ServerConfig(defaults=params, prompt_cache=restarted)) as running:
                rows = []
                for r in range(a.rounds):  # conversations (a) played first: their blocks are on disk only
                    system = system_prompt(lm, a.system_tokens, seed=1000 * r)
                    question = f"After the restart {r}: which rule is the last?"
                    ours, cached = http_ttft(running.url, system, question)
                    raw = raw_append_ttft(lm, ids_of(lm, system, "What is the first rule?"), ids_of(lm, system, question))
                    rows.append((ours, raw, None, cached))
            report("(b) the same after a restart, blocks from the disk tier", rows, 1.3)
        finally:
            if proc is not None:
                proc.kill()
        from chatkit.testing import tiny_model

        small = tiny_model("qwen3", "bpe")  # (c) counts blocks, bytes and lookups: the tests' model keeps it short
        block = 2 * len(small.model.layers) * 256 * 4 * (small.config.get("num_key_value_heads", 1)
                                                         * (small.head_dim or 64))
        many(small, a.conversations, a.prompts, ram=12 * block, disk=40 * block, folder=Path(tmp) / "many")
    (ten, ten_miss), (thousand, thousand_miss) = lookup_cost(10), lookup_cost(1000)
    print(f"\n## lookup of a 2k-token prompt: {ten * 1e6:.0f} us with 10 prompts cached, {thousand * 1e6:.0f} us "
          f"with 1,000 ({thousand / ten:.2f}x; flat is 1.0x); one not cached: {ten_miss * 1e6:.0f} us and "
          f"{thousand_miss * 1e6:.0f} us ({thousand_miss / ten_miss:.2f}x)")


if __name__ == "__main__":
    main()

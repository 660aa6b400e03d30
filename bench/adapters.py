"""Adapters per session: the cost of switching, and decode speed with an adapter, fused, and without.

    .venv/bin/python bench/adapters.py [--rounds 3] [--tokens 64] [--rank 8] [--no-wait]

The benchmarks' ~29M-parameter Qwen3 model with a random LoRA adapter (``chatkit.testing.random_adapter``)
on ``q_proj``, ``v_proj`` and ``down_proj`` of every layer. Rows:

- switch: what changing the active adapter costs (``model/switchable.py``: a ``ContextVar`` set and reset
  around each step of a turn's generator), per switch, against one decode step of the base model;
- decode tokens/s of one fresh greedy turn (``--tokens`` tokens, EOS biased away), after the first token:
  base model, adapted session (the LoRA branch added per layer), fused copy (``lm.fuse``), and two
  sessions with different adapters alternating token by token (a switch before every step).

Runs alternate between the kinds in each round; medians of ``--rounds``.
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
import time

from chatkit import ChatSession, GenerateParams
from chatkit.model.switchable import activate, applying
from chatkit.testing import random_adapter

from _common import add_quick, describe, load_model, median, quick, wait_until_quiet

PROMPT = "Tell me everything you know about the history of the bicycle, in detail."


def params(lm, tokens: int) -> GenerateParams:
    bias = {int(t): -1e9 for t in lm.tokenizer.eos_token_ids}
    return GenerateParams(max_tokens=tokens, temperature=0.0, logit_bias=bias)


def decode_rate(sessions: list[ChatSession]) -> float:
    """Tokens/s after the first token, of fresh turns in ``sessions`` stepped in turn, token by token."""
    for s in sessions:
        s.clear()
    streams = [s.stream_respond(PROMPT) for s in sessions]
    for stream in streams:
        next(stream)
    start, count, live = time.perf_counter(), 0, list(streams)
    while live:
        for stream in list(live):
            if next(stream, None) is None:
                stream.close()
                live.remove(stream)
            else:
                count += 1
    return count / (time.perf_counter() - start)


def switch_cost(lm, active, n: int = 20000) -> float:
    """Seconds per switch: entering and leaving ``applying`` (what a turn's step pays)."""
    start = time.perf_counter()
    for _ in range(n):
        with applying(lm.model, active):
            pass
    return (time.perf_counter() - start) / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--no-wait", action="store_true", help="do not wait for the CPU to quiet down")
    add_quick(ap)
    args = ap.parse_args()
    if quick(args):
        args.rounds, args.tokens = 1, 8
    lm = load_model()
    with tempfile.TemporaryDirectory() as tmp:
        a = lm.adapter(random_adapter(f"{tmp}/a", lm, seed=1, rank=args.rank))
        b = lm.adapter(random_adapter(f"{tmp}/b", lm, seed=2, rank=args.rank))
    p = params(lm, args.tokens)
    fused = lm.fuse(a)
    kinds = {
        "base": [ChatSession.builder(lm).generate_params(p).build()],
        "adapter": [ChatSession.builder(lm).generate_params(p).adapter(a).build()],
        "fused": [ChatSession.builder(fused).generate_params(p).build()],
        "a/b alternating": [ChatSession.builder(lm).generate_params(p).adapter(x).build() for x in (a, b)],
    }
    print(describe(lm))
    print(wait_until_quiet() if not args.no_wait else "(not waiting for a quiet CPU)")
    print("uptime:", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
    decode_rate(kinds["base"])  # warm-up
    rates: dict[str, list[float]] = {k: [] for k in kinds}
    for _ in range(args.rounds):
        for kind, sessions in kinds.items():
            rates[kind].append(decode_rate(sessions))
    switch = median([switch_cost(lm, activate(lm, a)) for _ in range(3)])
    step = 1.0 / median(rates["base"])
    print(f"\nswitch: {switch * 1e6:.2f} us per switch = {switch / step:.2e} of a base decode step ({step * 1e3:.1f} ms)")
    print(f"\n{'kind':<18} {'decode tok/s':>12} {'vs base':>8}")
    for kind, values in rates.items():
        print(f"{kind:<18} {median(values):>12.1f} {median(values) / median(rates['base']):>8.3f}")


if __name__ == "__main__":
    main()

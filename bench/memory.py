"""Memory over a long conversation: 100 turns, no growth beyond the KV cache; and batched sessions' peak.

Run: .venv/bin/python bench/memory.py [--batch-sessions 16] [--history 2000] [--skip-turns]

Part 1: after every turn it reads MLX's active memory and the session's cache bytes (with
checkpoints); what is left after the model's weights and the cache must stay flat. It also reads each
turn's peak and shows that release_cache() gives the cache's memory back.

Part 2 (issue 36, one copy of a batched session's cache): ``--batch-sessions`` sessions, each with a
``--history``-token conversation already in its cache, answer one more turn each, all at once on one
``BatchEngine``; the peak of MLX's memory over that turn (weights left out) against the sum of the
sessions' caches before it. One copy of each cache is 1.0x; a cache held by both its session and the
batch's rows is 2.0x; what is above 1.0x is the batch's working memory (its rows grow in 256-token
steps, a joining row is copied into the batch once, the forward pass's activations).
"""

from __future__ import annotations

import argparse
import threading

from chatkit import BatchEngine, ChatSession, GenerateParams

import mlx.core as mx
from _common import add_quick, describe, load_model, quick
from mlx.utils import tree_flatten

TURNS = 100
MB = 2**20


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch-sessions", type=int, default=16)
    ap.add_argument("--history", type=int, default=2000)
    ap.add_argument("--skip-turns", action="store_true", help="only part 2")
    add_quick(ap)
    args = ap.parse_args()
    if quick(args):
        global TURNS
        TURNS, args.batch_sessions, args.history = 12, 2, 200
    lm = load_model()
    print(describe(lm))
    if not args.skip_turns:
        long_conversation(lm)
    batched_peak(lm, args.batch_sessions, args.history)


def long_conversation(lm) -> None:
    weights = sum(v.nbytes for _, v in tree_flatten(lm.model.parameters()))
    eos = {i: -1e9 for i in lm.tokenizer.eos_token_ids}
    session = (
        ChatSession.builder(lm)
        .instructions("You are a helpful assistant.")
        .generate_params(GenerateParams(max_tokens=10, logit_bias=eos))
        .build()
    )
    rows, others = [], []
    for turn in range(1, TURNS + 1):
        session.respond(f"Turn {turn}: and then?")
        mx.clear_cache()  # drop MLX's buffer cache: measure what is really held
        active = mx.get_active_memory()
        info = session.cache_info()
        # the session's KV cache, and the copies of its blocks in the model's prompt cache (on by default,
        # within its own RAM budget: docs/caching.md)
        shared = session.prompt_cache.usage().ram_bytes if session.prompt_cache is not None else 0
        cache = info.nbytes + info.checkpoint_bytes + shared
        other = active - weights - cache
        others.append(other)
        if turn == 1 or turn % 10 == 0:
            rows.append((turn, info.tokens, active / MB, cache / MB, other / MB, session.last_stats.peak_memory_bytes / MB))
    print(f"\nweights: {weights / MB:.1f} MiB; after each turn, MiB:")
    print("(kv cache: the session's and its blocks' copies in the prompt cache)")
    print(f"{'turn':>5} {'tokens':>7} {'active':>8} {'kv cache':>9} {'other':>7} {'turn peak':>10}")
    for turn, tokens, active, cache, other, peak in rows:
        print(f"{turn:>5} {tokens:>7} {active:>8.1f} {cache:>9.1f} {other:>7.2f} {peak:>10.1f}")
    spread = (max(others[9:]) - min(others[9:])) / MB
    print(f"\nactive - weights - cache over turns 10..{TURNS}: min {min(others[9:]) / MB:.2f} MiB, "
          f"max {max(others[9:]) / MB:.2f} MiB, spread {spread:.2f} MiB")
    before = mx.get_active_memory()
    session.release_cache()
    if session.prompt_cache is not None:
        session.prompt_cache.clear()  # its blocks are the prompt cache's, not the session's
    mx.clear_cache()
    after = mx.get_active_memory()
    print(f"release_cache() and prompt_cache.clear(): active {before / MB:.1f} -> {after / MB:.1f} MiB (weights {weights / MB:.1f})")
    ok = spread < 1.0 and after - weights < 1 * MB
    print(f"target: no growth beyond the KV cache (spread < 1 MiB) and release frees it: {'PASS' if ok else 'FAIL'}")



def batched_peak(lm, n: int, history: int) -> None:
    """Part 2: the peak memory of ``n`` sessions' batched turn over ``history``-token caches."""
    weights = sum(v.nbytes for _, v in tree_flatten(lm.model.parameters()))
    eos = {i: -1e9 for i in lm.tokenizer.eos_token_ids}
    words = "the river town keeps a small library where seven old maps show roads that no longer exist".split()
    with BatchEngine(lm, max_batch=n, prefix_cache_bytes=0) as engine:
        sessions = []
        for i in range(n):  # each history prefilled on the engine, one session after another (not measured)
            text = " ".join(words[(i + k) % len(words)] for k in range(history))
            params = GenerateParams(max_tokens=16, logit_bias=eos)
            sessions.append(ChatSession.builder(lm).generate_params(params).engine(engine).build())
            sessions[-1].respond(text)
        tokens = [s.cache_info().tokens for s in sessions]
        caches = sum(s.cache_info().nbytes for s in sessions)
        mx.clear_cache()
        reset = mx.reset_peak_memory
        mx.reset_peak_memory = lambda: None  # each turn resets the peak at its start: keep one over all of them
        try:
            reset()
            start = mx.get_active_memory()
            threads = [threading.Thread(target=_turn, args=(s,)) for s in sessions]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            peak = mx.get_peak_memory()
        finally:
            mx.reset_peak_memory = reset
        mx.clear_cache()
        after = sum(s.cache_info().nbytes for s in sessions)
    print(f"\n{n} sessions batched, {min(tokens)}-{max(tokens)} cached tokens each, one more turn each (16 tokens):")
    print(f"  caches before the turn: {caches / MB:.1f} MiB; active at its start, weights left out: "
          f"{(start - weights) / MB:.1f} MiB")
    print(f"  peak during the turn, weights left out: {(peak - weights) / MB:.1f} MiB = "
          f"{(peak - weights) / caches:.2f}x the caches (2.0x: each cache held twice)")
    print(f"  caches after the turn: {after / MB:.1f} MiB")


def _turn(session) -> None:
    session.respond("And then? Say more.")
    mx.clear_streams()


if __name__ == "__main__":
    main()

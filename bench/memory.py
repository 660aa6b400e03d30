"""Memory over a long conversation: 100 turns, no growth beyond the KV cache.

Run: .venv/bin/python bench/memory.py

After every turn it reads MLX's active memory and the session's cache bytes (with checkpoints); what
is left after the model's weights and the cache must stay flat. It also reads each turn's peak and
shows that release_cache() gives the cache's memory back.
"""

from __future__ import annotations

from chatkit import ChatSession, GenerateParams

import mlx.core as mx
from _common import describe, load_model
from mlx.utils import tree_flatten

TURNS = 100
MB = 2**20


def main() -> None:
    lm = load_model()
    print(describe(lm))
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
        cache = info.nbytes + info.checkpoint_bytes
        other = active - weights - cache
        others.append(other)
        if turn == 1 or turn % 10 == 0:
            rows.append((turn, info.tokens, active / MB, cache / MB, other / MB, session.last_stats.peak_memory_bytes / MB))
    print(f"\nweights: {weights / MB:.1f} MiB; after each turn, MiB:")
    print(f"{'turn':>5} {'tokens':>7} {'active':>8} {'kv cache':>9} {'other':>7} {'turn peak':>10}")
    for turn, tokens, active, cache, other, peak in rows:
        print(f"{turn:>5} {tokens:>7} {active:>8.1f} {cache:>9.1f} {other:>7.2f} {peak:>10.1f}")
    spread = (max(others[9:]) - min(others[9:])) / MB
    print(f"\nactive - weights - cache over turns 10..{TURNS}: min {min(others[9:]) / MB:.2f} MiB, "
          f"max {max(others[9:]) / MB:.2f} MiB, spread {spread:.2f} MiB")
    before = mx.get_active_memory()
    session.release_cache()
    mx.clear_cache()
    after = mx.get_active_memory()
    print(f"release_cache(): active {before / MB:.1f} -> {after / MB:.1f} MiB (weights {weights / MB:.1f})")
    ok = spread < 1.0 and after - weights < 1 * MB
    print(f"target: no growth beyond the KV cache (spread < 1 MiB) and release frees it: {'PASS' if ok else 'FAIL'}")


if __name__ == "__main__":
    main()

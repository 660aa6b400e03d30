"""chatkit's streaming decode against raw mlx_lm.stream_generate: same prompt, cache state, sampler.

    .venv/bin/python bench/overhead.py [--rounds 6] [--tokens 128] [--profile]

Two cases, each timed in alternating rounds (A/B, then B/A, ...) after a warm-up:

* fresh: a ~50-token prompt into an empty cache. chatkit: ``session.stream_respond`` on a cleared
  session; raw: ``stream_generate`` with the same prompt ids and a fresh ``make_prompt_cache``.
* context: a session that already holds ~900 tokens of conversation. chatkit: a ``fork()`` of it
  answers one more message; raw: ``stream_generate`` over a copy of the same cache layers, fed the
  same suffix that chatkit prefilled.

Both sides decode greedily with the same logit bias (EOS at -1e9, so both produce exactly
``--tokens`` tokens; counts are asserted). Decode throughput excludes prefill: (n - 1) tokens over
the time from the first token to the last. ``--profile`` runs cProfile over chatkit's decode loop.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import pstats
import sys
import time

from _common import describe, load_model, median

import mlx.core as mx
from mlx_lm import stream_generate
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_logits_processors, make_sampler

from chatkit import ChatSession, GenerateParams
from chatkit.cache.state import copy_layer

PROMPT = "Tell me a long story about a dragon who guards a castle in the mountains, and the knight who comes to talk to it."
HISTORY_TURN = (
    "Here is some background for the conversation, about the castle, its towers, its gates and "
    "the villages in the valley below, which trade wool and cheese with the towns by the river. "
)


def chatkit_decode(stream) -> tuple[int, float]:
    """Iterate a ResponseStream; (tokens, seconds from the first chunk to the last)."""
    n, t_first = 0, 0.0
    with stream:
        for _ in stream:
            if n == 0:
                t_first = time.perf_counter()
            n += 1
    return n, time.perf_counter() - t_first


def raw_decode(lm, prompt_ids, cache, n_tokens, bias) -> tuple[int, float]:
    """stream_generate over ``cache``; (tokens, seconds from the first response to the last)."""
    n, t_first = 0, 0.0
    for _ in stream_generate(
        lm.model,
        lm.tokenizer,
        mx.array(prompt_ids, dtype=mx.uint32),
        max_tokens=n_tokens,
        sampler=make_sampler(temp=0.0),
        logits_processors=make_logits_processors(logit_bias=bias),
        prompt_cache=cache,
    ):
        if n == 0:
            t_first = time.perf_counter()
        n += 1
    return n, time.perf_counter() - t_first


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--profile", action="store_true", help="cProfile chatkit's decode loop")
    args = ap.parse_args()
    N = args.tokens

    lm = load_model("bpe")
    print(describe(lm))
    bias = {int(e): -1e9 for e in lm.tokenizer.eos_token_ids}
    params = GenerateParams(max_tokens=N, temperature=0.0, logit_bias=bias)
    session = ChatSession.builder(lm).generate_params(params).build()

    # The context case: a session holding some conversation (its replies capped at 40 tokens).
    base = ChatSession.builder(lm).generate_params(params.copy(max_tokens=40)).build()
    for i in range(6):
        base.respond(HISTORY_TURN * 2 + f"Question {i}: what happened next?")
    base.generate_params = params.copy()
    ctx_tokens = len(base._cache.ledger.tokens)

    def run_chatkit_fresh():
        session.clear()
        return chatkit_decode(session.stream_respond(PROMPT))

    fresh_ids = None

    def run_raw_fresh():
        return raw_decode(lm, fresh_ids, make_prompt_cache(lm.model), N, bias)

    ctx_suffix = None

    def run_chatkit_ctx():
        return chatkit_decode(base.fork().stream_respond(PROMPT))

    def run_raw_ctx():
        cache = [copy_layer(c) for c in base._cache.layers]
        return raw_decode(lm, ctx_suffix, cache, N, bias)

    # The prompt ids chatkit fed, read back from its ledger: the raw side gets exactly those.
    session.clear()
    session.respond(PROMPT)
    fresh_ids = list(session._cache.ledger.tokens[: session.last_stats.prefilled_tokens])
    fork = base.fork()
    fork.respond(PROMPT)
    ledger = fork._cache.ledger.tokens
    assert ledger[:ctx_tokens] == base._cache.ledger.tokens
    ctx_suffix = list(ledger[ctx_tokens : ctx_tokens + fork.last_stats.prefilled_tokens])
    assert fork.last_stats.reused_tokens == ctx_tokens

    cases = [
        ("fresh", f"{len(fresh_ids)}-token prompt, empty cache", run_chatkit_fresh, run_raw_fresh),
        ("context", f"{ctx_tokens} cached tokens + {len(ctx_suffix)}-token suffix", run_chatkit_ctx, run_raw_ctx),
    ]
    print(f"decode : greedy, {N} tokens per run (EOS logit -1e9), {args.rounds} rounds A/B alternating "
          "after a warm-up; tokens/s = (n-1) / (last token - first token)")
    print()
    results = {}
    for name, what, ck, raw in cases:
        for f in (ck, raw, ck, raw):  # warm-up
            f()
        ck_tps, raw_tps = [], []
        for r in range(args.rounds):
            order = [("chatkit", ck), ("raw", raw)] if r % 2 == 0 else [("raw", raw), ("chatkit", ck)]
            for label, f in order:
                gc.collect()
                n, dt = f()
                assert n == N, f"{label} produced {n} tokens, not {N}"
                (ck_tps if label == "chatkit" else raw_tps).append((n - 1) / dt)
        results[name] = (what, ck_tps, raw_tps)

    print(f"{'case':8} {'':44} {'chatkit tok/s':>14} {'raw tok/s':>10} {'chatkit/raw':>12}")
    for name, (what, ck_tps, raw_tps) in results.items():
        for r, (a, b) in enumerate(zip(ck_tps, raw_tps)):
            print(f"{name:8} {'round ' + str(r + 1):44} {a:14.1f} {b:10.1f} {a / b:12.3f}")
        a, b = median(ck_tps), median(raw_tps)
        print(f"{name:8} {'median (' + what + ')':44} {a:14.1f} {b:10.1f} {a / b:12.3f}   "
              f"target >= 0.98: {'met' if a / b >= 0.98 else 'NOT met'}")
        print()

    if args.profile:
        profile(session, N)


def profile(session, n_tokens) -> None:
    """cProfile chatkit's per-token path (one fresh turn), sorted by own time."""
    session.clear()
    prof = cProfile.Profile()
    stream = session.stream_respond(PROMPT)
    next(stream)  # prefill outside the profile
    prof.enable()
    for _ in stream:
        pass
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(25)
    print(f"cProfile of chatkit's decode loop ({n_tokens - 1} tokens), by own time:")
    print(out.getvalue())


if __name__ == "__main__":
    sys.exit(main())

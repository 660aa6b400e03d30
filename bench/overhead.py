"""chatkit's streaming decode against raw mlx_lm.stream_generate: same prompt, cache state, sampler.

    .venv/bin/python bench/overhead.py [--rounds 14] [--tokens 128] [--profile]

Three cases, each timed in alternating rounds (A/B, then B/A, ...) after a warm-up:

* fresh: a ~50-token prompt into an empty cache. chatkit: ``session.stream_respond`` on a cleared
  session; raw: ``stream_generate`` with the same prompt ids and a fresh ``make_prompt_cache``.
* context: a session that already holds ~900 tokens of conversation. chatkit: a ``fork()`` of it
  answers one more message; raw: ``stream_generate`` over a copy of the same cache layers, fed the
  same suffix that chatkit prefilled.
* small: the fresh case on the default 1.5M-parameter test model, whose ~1.3 ms step makes a
  per-token overhead of chatkit's Python code ten times as visible (reported in us per token).

Both sides decode greedily with the same logit bias (EOS at -1e9, so both produce exactly
``--tokens`` tokens; counts are asserted). Decode speed excludes prefill, two ways: (n - 1) tokens
over the time from the first token to the last, and 1 / the median time between two tokens (robust
to a burst of other work on the machine). ``--profile`` runs cProfile over chatkit's decode loop.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import pstats
import sys
import time

from chatkit import ChatSession, GenerateParams
from chatkit.testing import tiny_model

import mlx.core as mx
from _common import (
    OtherLoad,
    add_quick,
    cache_state,
    clone,
    describe,
    load_model,
    median,
    n_params,
    quick,
    wait_until_quiet,
)
from mlx_lm import stream_generate
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_logits_processors, make_sampler

PROMPT = "Tell me a long story about a dragon who guards a castle in the mountains, and the knight who comes to talk to it."
HISTORY_TURN = (
    "Here is some background for the conversation, about the castle, its towers, its gates and "
    "the villages in the valley below, which trade wool and cheese with the towns by the river. "
)


def chatkit_decode(stream) -> list[float]:
    """Iterate a ResponseStream; the time of each chunk (one chunk per token)."""
    stamps = []
    with stream:
        for _ in stream:
            stamps.append(time.perf_counter())
    return stamps


def raw_decode(lm, prompt_ids, cache, n_tokens, bias) -> list[float]:
    """stream_generate over ``cache``; the time of each response (one per token)."""
    stamps = []
    for _ in stream_generate(
        lm.model,
        lm.tokenizer,
        mx.array(prompt_ids, dtype=mx.uint32),
        max_tokens=n_tokens,
        sampler=make_sampler(temp=0.0),
        logits_processors=make_logits_processors(logit_bias=bias),
        prompt_cache=cache,
    ):
        stamps.append(time.perf_counter())
    return stamps


def rates(stamps: list[float]) -> tuple[float, float]:
    """(tokens/s from the first token to the last, 1 / median time between two tokens)."""
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    return (len(stamps) - 1) / (stamps[-1] - stamps[0]), 1.0 / median(gaps)


def fresh_case(lm, n_tokens: int):
    """A prompt into an empty cache: (description, chatkit run, raw run, the chatkit session)."""
    bias = {int(e): -1e9 for e in lm.tokenizer.eos_token_ids}
    session = ChatSession.builder(lm).generate_params(GenerateParams(max_tokens=n_tokens, logit_bias=bias)).build()
    session.respond(PROMPT)  # the prompt ids chatkit feeds, read back from its ledger
    ids = list(cache_state(session).ledger.tokens[: session.last_stats.prefilled_tokens])

    def chatkit():
        session.clear()
        return chatkit_decode(session.stream_respond(PROMPT))

    def raw():
        return raw_decode(lm, ids, make_prompt_cache(lm.model), n_tokens, bias)

    return f"{len(ids)}-token prompt, empty cache", chatkit, raw, session


def context_case(lm, n_tokens: int):
    """One more turn on a session that holds ~900 tokens of conversation."""
    bias = {int(e): -1e9 for e in lm.tokenizer.eos_token_ids}
    params = GenerateParams(max_tokens=40, logit_bias=bias)
    base = ChatSession.builder(lm).generate_params(params).build()
    for i in range(6):
        base.respond(HISTORY_TURN * 2 + f"Question {i}: what happened next?")
    base.generate_params = params.copy(max_tokens=n_tokens)
    probe = base.fork()
    probe.respond(PROMPT)
    ledger, stats = cache_state(probe).ledger.tokens, probe.last_stats
    reused = stats.reused_tokens  # the random model's replies re-tokenize differently: chatkit trims
    assert ledger[:reused] == cache_state(base).ledger.tokens[:reused]
    suffix = list(ledger[reused : stats.prompt_tokens])

    def chatkit():
        fork = base.fork()
        cache_state(fork).layers = clone(cache_state(base).layers)
        return chatkit_decode(fork.stream_respond(PROMPT))

    def raw():
        cache = clone(cache_state(base).layers)
        for c in cache:
            c.trim(c.offset - reused)  # where the prompt leaves the cached ids, as chatkit does
        return raw_decode(lm, suffix, cache, n_tokens, bias)

    return f"{reused} tokens reused + {len(suffix)} prefilled", chatkit, raw


def measure(ck, raw, rounds: int, n_tokens: int):
    """Warm up, then ``rounds`` pairs in alternating order; per round (chatkit, raw) rates."""
    for f in (ck, raw, ck, raw):
        f()
    out = []
    for r in range(rounds):
        pair = {}
        for label in (("chatkit", "raw") if r % 2 == 0 else ("raw", "chatkit")):
            gc.collect()
            stamps = (ck if label == "chatkit" else raw)()
            assert len(stamps) == n_tokens, f"{label} produced {len(stamps)} tokens, not {n_tokens}"
            pair[label] = rates(stamps)
        out.append((pair["chatkit"], pair["raw"]))
    return out


def report(name: str, what: str, rows) -> dict:
    print(f"{name:8} {what}")
    for r, (a, b) in enumerate(rows):
        print(f"{'':8} round {r + 1:<3} {a[0]:8.1f} {b[0]:8.1f} {a[0] / b[0]:6.3f} | "
              f"{a[1]:8.1f} {b[1]:8.1f} {a[1] / b[1]:6.3f}")
    res = {}
    for i, how in ((0, "throughput"), (1, "median gap")):
        ck, raw = median([a[i] for a, _ in rows]), median([b[i] for _, b in rows])
        ratios = sorted(a[i] / b[i] for a, b in rows)
        q1, q3 = ratios[len(ratios) // 4], ratios[(3 * len(ratios)) // 4]
        extra_us = median([1e6 * (1 / a[i] - 1 / b[i]) for a, b in rows])  # paired, per round
        res[how] = (ck, raw, ck / raw, median(ratios), q1, q3, extra_us)
    (t_ck, t_raw, t_r, *_), (m_ck, m_raw, m_r, *_) = res["throughput"], res["median gap"]
    print(f"{'':8} {'median':9} {t_ck:8.1f} {t_raw:8.1f} {t_r:6.3f} | {m_ck:8.1f} {m_raw:8.1f} {m_r:6.3f}")
    for how, (ck, raw, ratio, med, q1, q3, extra_us) in res.items():
        print(f"{'':8} {how}: ratio of the medians {ratio:.3f}; median of the per-round ratios {med:.3f} "
              f"(quartiles {q1:.3f}..{q3:.3f}); chatkit costs {extra_us:+.0f} us per token (median per round)")
    print()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=14)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--profile", action="store_true", help="cProfile chatkit's decode loop")
    add_quick(ap)
    args = ap.parse_args()
    if quick(args):
        args.rounds, args.tokens = 1, 16
    N = args.tokens

    lm = load_model("bpe")
    print(describe(lm))
    small = tiny_model("qwen3", "bpe")  # the default test model: its step is short, overhead shows
    n_small = n_params(small)
    print(f"small   : the default tiny_model('qwen3', 'bpe'), {n_small / 1e6:.1f}M params "
          f"(hidden_size={small.config['hidden_size']}, num_hidden_layers={small.config['num_hidden_layers']})")
    what_f, ck_f, raw_f, session = fresh_case(lm, N)
    what_c, ck_c, raw_c = context_case(lm, N)
    what_s, ck_s, raw_s, _ = fresh_case(small, N)
    print(wait_until_quiet())
    load = OtherLoad()
    print(f"decode : greedy, {N} tokens per run (EOS logit -1e9), {args.rounds} rounds A/B alternating "
          "after a warm-up (prefill excluded)")
    print()
    print("tok/s: throughput from the first token to the last | 1 / median time between tokens")
    print(f"{'case':8} {'':9} {'chatkit':>8} {'raw':>8} {'ratio':>6} | {'chatkit':>8} {'raw':>8} {'ratio':>6}")
    results = {
        "fresh": report("fresh", f"({what_f})", measure(ck_f, raw_f, args.rounds, N)),
        "context": report("context", f"({what_c})", measure(ck_c, raw_c, args.rounds, N)),
        "small": report("small", f"(small model: {what_s})", measure(ck_s, raw_s, args.rounds, N)),
    }
    # The verdict uses the median of the per-round ratios: chatkit and raw run back to back in each
    # round, so a burst of other work on the machine moves both (or spoils one round, not the median).
    for name in ("fresh", "context"):
        t, m = results[name]["throughput"][3], results[name]["median gap"][3]
        print(f"target chatkit/raw >= 0.98, {name} (median of the per-round ratios): throughput {t:.3f} "
              f"({'met' if t >= 0.98 else 'NOT met'}), median gap {m:.3f} ({'met' if m >= 0.98 else 'NOT met'})")
    gap = results["small"]["median gap"][6]
    per_token = 1e6 / results["fresh"]["median gap"][1]
    print(f"isolated overhead (small model, median gaps, median per round): {gap:+.0f} us per token = {gap / per_token:+.2%} "
          f"of a {per_token / 1e3:.1f} ms benchmark-model token -> chatkit/raw ~ {per_token / (per_token + gap):.3f}")
    print(load.report())
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
    stats = pstats.Stats(prof, stream=out)
    stats.sort_stats("tottime").print_stats(25)
    print(f"cProfile of chatkit's decode loop ({n_tokens - 1} tokens), by own time:")
    print(out.getvalue())
    total = stats.total_tt
    mine = sum(tt for (path, _, _), (_, _, tt, _, _) in stats.stats.items() if "/chatkit/" in path)
    per = mine / (n_tokens - 1)
    print(f"time spent in chatkit's own functions: {mine * 1e3:.1f} ms of {total * 1e3:.0f} ms "
          f"= {per * 1e6:.0f} us per token ({mine / total:.2%} of the decode loop)")


if __name__ == "__main__":
    sys.exit(main())

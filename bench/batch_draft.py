"""Draft models inside a BatchEngine: N sessions each with a draft, against the same N batched without one.

    .venv/bin/python bench/batch_draft.py [--sessions 4,8] [--tokens 96] [--rounds 3] [--cases poor,demo,agreeing]

For each case and N: N turns started at once from N threads on sessions built with ``.engine(engine)``
over one ``BatchEngine(lm, max_batch=16, prefix_cache_bytes=0)``, each a distinct prompt, greedy,
``--tokens`` tokens (EOS biased -1e9 through the session's ``logit_bias``: no turn ends early), with
``SpeculativeConfig(draft)`` (the adaptive draft length, the default) against without speculation.
Aggregate tok/s = all tokens / wall time from the first start to the last token (prefill included).
The two runs of a round are back to back, in alternating order; "paired" is the median of the rounds'
ratios (the sturdier figure on a busy machine), "per CPU s" the same for the tokens per CPU second of
this process (what other processes' load disturbs least). Every speculative run's tokens must equal the runs'
without speculation. A warm-up round per case first (kernels; the pair's costs, which the process's
sessions share and a fresh session starts from, as in an application that has served a few turns).

Cases (as in bench/speculative.py): ``poor``: the benchmark target (~29M parameters) with a random
one-layer draft (another seed: its drafts are all but always rejected; the floor); ``demo``: the bundled
demo pair (``chatkit.demo``) on in-world prompts, when its files are installed; ``agreeing``: fresh copies
of the target and of a draft whose blocks' output projections are zeroed, sharing the embedding, so
the draft's proposals are (all but) always accepted. Targets (issue 47, idle machine): poor >= 0.95x,
demo >= 1.0x, agreeing >= 1.3x.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time

import chatkit
from chatkit import BatchEngine, ChatSession, GenerateParams, SpeculativeConfig
from chatkit.testing import tiny_model, tiny_model_path

import mlx.core as mx
from _common import MODEL_CONFIG, OtherLoad, add_quick, describe, median, quick, wait_until_quiet
from speculative import DRAFT_CONFIG, load_demo_pair, share_head, zero_blocks

WORDS = ("the river town keeps a small library where seven old maps show roads that no longer exist "
         "and every evening a clerk writes down who came to read them").split()
DEMO_PROMPTS = ["My name is Ada. What is 7 + 5?", "Spell apple.", "How many letters are in banana?",
                "I live in Lyon. Where do I live?", "Hello! What is 3 + 4?", "What is my name? I am Bob.",
                "Spell banana.", "What is 2 + 9?"]
TARGETS = {"poor": 0.95, "demo": 1.0, "agreeing": 1.3}


def prompts(case: str, n: int) -> list[str]:
    if case == "demo":
        return [DEMO_PROMPTS[i % len(DEMO_PROMPTS)] + " " * (i // len(DEMO_PROMPTS)) for i in range(n)]
    return [f"Question {i}: " + " ".join(WORDS[(i * 7 + k) % len(WORDS)] for k in range(30)) for i in range(n)]


def batch_run(lm, draft, texts: list[str], tokens: int):
    """The turns of ``texts`` at once on a new engine, each with ``draft`` (or none): (aggregate tok/s,
    each turn's tokens, drafted, accepted, tokens per CPU second of this process)."""
    eos = {t: -1e9 for t in lm.tokenizer.eos_token_ids}
    params = GenerateParams(max_tokens=tokens, temperature=0.0, logit_bias=eos)
    out: list = [None] * len(texts)
    with BatchEngine(lm, max_batch=16, prefix_cache_bytes=0) as engine:
        sessions = []
        for _ in texts:
            b = ChatSession.builder(lm).generate_params(params.copy()).engine(engine)
            sessions.append((b.speculative(SpeculativeConfig(draft)) if draft is not None else b).build())

        def turn(i: int) -> None:
            with sessions[i].stream_respond(texts[i]) as stream:
                for _ in stream:
                    pass
            out[i] = (time.perf_counter(), stream.tokens)
            mx.clear_streams()  # what MLX asks of a thread that ran MLX work, before it ends

        threads = [threading.Thread(target=turn, args=(i,)) for i in range(len(texts))]
        t0, cpu = time.perf_counter(), time.process_time()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        cpu = time.process_time() - cpu
    wall = max(end for end, _ in out) - t0
    stats = [s.last_stats for s in sessions]
    total = sum(len(t) for _, t in out)
    return (total / wall, [t for _, t in out], sum(s.draft_tokens_proposed for s in stats),
            sum(s.draft_tokens_accepted for s in stats), total / cpu)


def bench(case: str, lm, draft, n: int, tokens: int, rounds: int):
    """(median tok/s without, with, paired ratio, acceptance, identical, paired ratio of tokens per CPU
    second) over ``rounds`` rounds."""
    texts = prompts(case, n)
    batch_run(lm, draft, texts, min(tokens, 24))  # warm-up (the pair's costs learned here are shared)
    batch_run(lm, None, texts, min(tokens, 24))
    plain, spec, ratios, cpu, drafted, accepted, same = [], [], [], [], 0, 0, True
    for r in range(rounds):
        order = [None, draft] if r % 2 == 0 else [draft, None]
        got = {id(d): batch_run(lm, d, texts, tokens) for d in order}
        a, b = got[id(None)], got[id(draft)]
        plain.append(a[0])
        spec.append(b[0])
        ratios.append(b[0] / a[0])
        cpu.append(b[4] / a[4])
        same &= a[1] == b[1]
        drafted, accepted = drafted + b[2], accepted + b[3]
        print(f"  {case} x{n} round {r + 1}: no speculation {a[0]:.1f} tok/s, with the draft {b[0]:.1f} tok/s "
              f"({b[0] / a[0]:.2f}x; per CPU second {b[4] / a[4]:.2f}x; {b[3]}/{b[2]} drafts accepted)", flush=True)
    acceptance = accepted / drafted if drafted else float("nan")
    return median(plain), median(spec), median(ratios), acceptance, same, median(cpu)


def models(case: str, quick_mode: bool):
    """(target, draft) of a case, or None when it cannot run here (and why)."""
    config, draft_config = ({}, {}) if quick_mode else (MODEL_CONFIG, DRAFT_CONFIG)
    if case == "poor":
        return (tiny_model("qwen3", "bpe", 0, **config), tiny_model("qwen3", "bpe", 1, **draft_config)), ""
    if case == "agreeing":
        target = chatkit.load(tiny_model_path("qwen3", "bpe", 0, **config))
        draft = chatkit.load(tiny_model_path("qwen3", "bpe", 2, **draft_config))
        zero_blocks(target)
        zero_blocks(draft)
        share_head(target, draft)
        return (target, draft), ""
    return load_demo_pair()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sessions", default="4,8")
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cases", default="poor,demo,agreeing")
    ap.add_argument("--max-wait", type=float, default=300.0)
    add_quick(ap)
    args = ap.parse_args()
    if quick(args):
        args.sessions, args.tokens, args.rounds, args.cases = "2", 12, 1, "poor,agreeing"
    sizes = [int(x) for x in args.sessions.split(",")]
    print(describe(tiny_model("qwen3", "bpe", 0, **({} if args.quick else MODEL_CONFIG))))
    print(f"load    : {wait_until_quiet(args.max_wait)}")
    other = OtherLoad()
    rows, failed = [], False
    for case in args.cases.split(","):
        pair, why = models(case, args.quick)
        if pair is None:
            print(f"{case}: skipped ({why})")
            continue
        for n in sizes:
            plain, spec, paired, acc, same, cpu = bench(case, *pair, n, args.tokens, args.rounds)
            rows.append((case, n, plain, spec, paired, acc, same, cpu))
            failed |= not same
    print(f"\n{args.tokens} tokens per session, greedy, EOS biased -1e9; medians of {args.rounds} rounds; "
          "paired: the median of the rounds' ratios; per CPU s: the same for tokens per CPU second of this process "
          "(less sensitive to other load)")
    print(f"{'case':>9} | sessions | {'no speculation tok/s':>20} | {'with a draft tok/s':>18} | paired | target | "
          "per CPU s | acceptance | same tokens")
    for case, n, plain, spec, paired, acc, same, cpu in rows:
        print(f"{case:>9} | {n:>8} | {plain:>20.1f} | {spec:>18.1f} | {paired:5.2f}x | {TARGETS[case]:5.2f}x | "
              f"{cpu:8.2f}x | {acc:>10.1%} | {same!s:>11}")
    print(other.report())
    if failed:
        print("FAIL: batched speculative tokens differ from the batch's without speculation")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""How inexact a context shift is: greedy agreement of the reply at each shifting turn with the reply of a
session that prefilled the same context afresh.

    .venv/bin/python bench/shift_agreement.py                   # the benchmark model and SmolLM2, 50 shifts each
    .venv/bin/python bench/shift_agreement.py --models bench    # one of them

``ContextPolicy.rolling(shift=True)`` drops the oldest exchanges from the KV cache and re-rotates the kept
keys; the kept values were computed attending to the dropped tokens, so the next reply may differ from
what a fresh prefill of the same context gives (docs/context.md). For every turn that shifted, a fresh
session (no prompt cache) built from the context the shifted session saw before the turn answers the same
message; the table counts identical replies and the mean share of the reply equal up to the first
difference. Greedy, free replies (``max_tokens`` each), user messages from a fixed list.
"""

from __future__ import annotations

import argparse
import time

from chatkit import ChatSession, ContextPolicy, GenerateParams, LoadedModel

from _common import add_quick, describe, load_model, median, quick

TOPICS = ["whales", "volcanoes", "the moon", "bees", "rain", "chess", "bread", "rivers", "trains", "owls", "salt",
          "kites", "glaciers", "maps", "bridges", "tea", "clocks", "forests", "deserts", "comets"]
ASKS = ["Tell me a fun fact about {}.", "What is {} known for?", "Describe {} in one sentence.",
        "Why do people like {}?"]
INSTRUCTIONS = "You are a helpful assistant. Answer in one or two sentences."


def prompts(n: int) -> list[str]:
    return [ASKS[i % len(ASKS)].format(TOPICS[(i * 7) % len(TOPICS)]) for i in range(n)]


def fresh_reply(lm, context, prompt: str, params: GenerateParams) -> list[int]:
    """The reply of a session that prefills ``context`` (system first) afresh."""
    system, *history = context
    session = (ChatSession.builder(lm).instructions(system.content).history(history).generate_params(params.copy())
               .prompt_cache(None).build())
    with session.stream_respond(prompt) as stream:
        for _ in stream:
            pass
    return list(stream.tokens)


def agreement(lm, window: int, shifts: int, max_tokens: int) -> dict:
    """Play turns until ``shifts`` turns shifted; per shift (identical, share equal before the first difference)."""
    small = LoadedModel(lm.model, lm.tokenizer, {**lm.config, "max_position_embeddings": window}, lm.source)
    params = GenerateParams(max_tokens=max_tokens, temperature=0.0)
    session = (ChatSession.builder(small).instructions(INSTRUCTIONS).generate_params(params.copy())
               .context_policy(ContextPolicy.rolling(shift=True)).prompt_cache(None).build())
    rows, turns = [], 0
    for prompt in prompts(40 * shifts):
        shifted_before = session._state.conversation.cache.ledger.shifted  # the bench's one look inside
        with session.stream_respond(prompt) as stream:
            for _ in stream:
                pass
        turns += 1
        if session._state.conversation.cache.ledger.shifted == shifted_before:
            continue  # no shift this turn (or a turn that fell back to a re-prefill)
        context = session.context[: -2]  # what the model saw before this turn's message
        truth = fresh_reply(small, context, prompt, params)
        got = list(stream.tokens)
        same = next((i for i, (a, b) in enumerate(zip(got, truth)) if a != b), min(len(got), len(truth)))
        rows.append((got == truth, same / max(len(truth), 1)))
        if len(rows) == shifts:
            break
    return dict(turns=turns, shifts=len(rows), identical=sum(r[0] for r in rows),
                prefix=sum(r[1] for r in rows) / max(len(rows), 1), median_prefix=median([r[1] for r in rows]) if rows else 0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="bench,smollm2", help="comma-separated: bench (the 29M model), smollm2")
    ap.add_argument("--shifts", type=int, default=50)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=32)
    add_quick(ap)
    args = ap.parse_args()
    if quick(args):
        args.models, args.shifts, args.window, args.max_tokens = "bench", 3, 384, 12
    print(f"{'model':<10} {'window':>6} {'turns':>5} {'shifts':>6} {'identical replies':>18} "
          f"{'reply equal before the first difference (mean, median)':>56}  time")
    for name in [m.strip() for m in args.models.split(",") if m.strip()]:
        t0 = time.perf_counter()
        if name == "smollm2":
            import chatkit

            lm = chatkit.load("smollm2")
        else:
            lm = load_model("bpe")
        if name == args.models.split(",")[0]:
            print(describe(lm))
        r = agreement(lm, args.window, args.shifts, args.max_tokens)
        pct = 100 * r["identical"] / max(r["shifts"], 1)
        print(f"{name:<10} {args.window:>6} {r['turns']:>5} {r['shifts']:>6} {r['identical']:>9} ({pct:5.1f} %) "
              f"{100 * r['prefix']:>40.1f} %, {100 * r['median_prefix']:.1f} %  {time.perf_counter() - t0:.0f} s",
              flush=True)


if __name__ == "__main__":
    main()

"""Conversations that outlive the context window: chatkit's context policies over a long chat (issue 31).

    PYTHONPATH=$PWD .venv/bin/python bench/context.py                # 500 turns, window 2048
    PYTHONPATH=$PWD .venv/bin/python bench/context.py --real         # SmolLM2: a fact told, asked later

A ChatML chat ("bpe" tokenizer) on the ~29M benchmark model with its window cut to ``--window`` tokens (a
``LoadedModel`` over the same weights whose ``max_position_embeddings`` is the window). Each turn: a
~60-token user message and a scripted reply of 12 to 24 tokens, end of turn included (a logits processor
forces an English-like reply, as in bench/turns.py, so that replies re-tokenize to their ids as a trained
model's do; the model still runs every step), ``max_tokens=24``. Every run gets the same turns
(``--runs``; by default rolling and summarize over ``--turns``, model over ``--model-turns``):

rolling       ``ContextPolicy.rolling()`` (low water 0.5), nothing prepared: the turn that crosses the window
              drops the oldest exchanges and re-prefills what is left (under the low-water mark).
summarize     ``ContextPolicy.summarize(summarizer=...)``, a callable writing a ~40-token summary, and
              ``session.prepare_compaction()`` after every turn (untimed: an app calls it while the user types).
model         the same, the summary written by the model itself (greedy, up to window/8 tokens).
rolling-prep  rolling with the same preparation between turns (not run by default).
rolling-shift ``ContextPolicy.rolling(shift=True)``, nothing prepared: the dropped exchanges leave the KV cache
              itself (kept keys re-rotated) and the crossing turn prefills only its message (not by default).
Every session runs without the process-wide prompt cache (``prompt_cache(None)``): this measures the policies,
and a prompt cache keeps blocks of every compacted context up to its own budget (docs/caching.md).

Per turn, (a) and (b) timed once each, in alternating order:
(a) chatkit     ``session.stream_respond(message)`` to its first chunk (render, fit the window, plan, prefill,
                first token); the reply is then read to its end (untimed) and checked.
(b) raw append  mlx-lm ``generate_step`` fed the turn's new tokens (the prompt as it would be without
                compacting, past what the cache holds) over a real copy of the cache as it was before the
                turn: what the turn costs a cache that never drops anything. On a turn that does not compact
                these are the very tokens chatkit prefills (checked: "turns prefilling more").
(s) same suffix on the first ``--same-turns`` compacting turns: ``generate_step`` fed the suffix chatkit
                prefilled over a copy of what chatkit reused: chatkit's own overhead on such a turn.
(c) re-prefill  rolling run only, for ``--erase-turns`` turns from the first that compacted: ``generate_step``
                over a fresh cache fed chatkit's whole prompt, i.e. a rolling window that erases its cache
                every turn (mlx-engine#177; its prompts would fill the window, chatkit's are smaller).
After each turn (and its preparation) MLX's active memory, and the peak of the turn and its preparation
(minus the bench's cache copy when alive). "A full prefill of the low-water context": ``generate_step`` over
a fresh cache fed floor(low_water x window) tokens, the median of ``--bound-reps`` timings before and after
each run. The final table puts the runs side by side against the targets of issue 31.

--real: SmolLM2-135M-Instruct (float32) with a 1,024-token window and ``ContextPolicy.summarize()`` (its own
summaries, prepared between turns), 60 turns: a fact told at turn 2, asked at turns 20, 40, 60; the same
chat under ``rolling()`` as the control. Prints where the fact is when asked (still in view, in the
summary, or gone) and the recall; SmolLM2 is weak, so only "in the summary" has a target.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import math
import random
import sys
import time
import traceback

import chatkit
from chatkit import ChatKitError, ChatSession, ContextPolicy, GenerateParams, LoadedModel
from chatkit.cache.planner import common_prefix_length
from chatkit.session.context import SUMMARY_HEADER

import mlx.core as mx
from _common import OtherLoad, add_quick, cache_state, clone, describe, load_model, median, quick, wait_until_quiet
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache
from turns import Scripted, first_token_time, sentence_text

USER_TOKENS = 60
REPLY_TOKENS = (12, 24)  # end of turn included
MAX_TOKENS = 24
SUMMARY_TOKENS = 40  # the callable summarizer's summary
INSTRUCTIONS = "You are a helpful assistant. Answer in a few sentences."
MB = 2**20
RUNS = ("rolling", "summarize", "model", "rolling-prep", "rolling-shift")
TITLES = {"rolling": "rolling", "summarize": "summarize+prep", "model": "model summary+prep", "rolling-prep": "rolling+prep",
          "rolling-shift": "rolling shift"}


# -- the conversation --------------------------------------------------------------------------
def script(tok, turns: int, seed: int = 31) -> list[tuple[str, list[int]]]:
    """The message and the reply ids of every turn (the same in every run)."""
    rng = random.Random(seed)
    out = []
    for _ in range(turns):
        message = sentence_text(rng, tok, USER_TOKENS, "?")
        n = rng.randint(*REPLY_TOKENS) - 1
        out.append((message, tok.encode(sentence_text(rng, tok, n, "."), add_special_tokens=False)))
    return out


def fixed_summarizer(tok):
    """A summarizer returning a new summary of a fixed length at each call (what it folds is ignored: this
    measures the mechanism, not the summary)."""
    text, calls = sentence_text(random.Random(5), tok, SUMMARY_TOKENS - 4, "."), itertools.count(1)
    return lambda messages: f"Summary {next(calls)}: {text}"


def policy_for(name: str, low_water: float, tok) -> tuple[ContextPolicy, bool]:
    """(the run's policy, whether the compaction is prepared between turns)."""
    if name in ("rolling", "rolling-prep", "rolling-shift"):
        return ContextPolicy.rolling(low_water, shift=name == "rolling-shift"), name == "rolling-prep"
    summarizer = fixed_summarizer(tok) if name == "summarize" else None
    return ContextPolicy.summarize(low_water, summarizer=summarizer), True


# -- caches and timings ------------------------------------------------------------------------
def trimmed_copy(model, layers, keep: int):
    """(a real copy of ``layers`` holding their first ``keep`` tokens, the bytes it holds)."""
    if layers is None or keep == 0:
        return make_prompt_cache(model), 0
    out = clone(layers)
    held = sum(v.nbytes for c in out for _, v in tree_flatten(c.state) if isinstance(v, mx.array))
    for c in out:
        c.trim(c.offset - keep)
    return out, held


def kv_step(lm) -> int:
    """Bytes of 256 tokens of float32 KV cache (mlx-lm's KVCache grows by 256 tokens)."""
    cfg = lm.config
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return 256 * 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * 4


def low_water_prefill(lm, n: int, reps: int) -> list[float]:
    """Seconds to the first token of ``generate_step`` over a fresh cache fed ``n`` tokens, ``reps`` times."""
    tok, rng, ids = lm.tokenizer, random.Random(7), []
    while len(ids) < n:
        ids += tok.encode(sentence_text(rng, tok, 100, ". "), add_special_tokens=False)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    return [first_token_time(lm.model, ids[:n], make_prompt_cache(lm.model), Scripted(len(tok), [ids[0]], end=eos))
            for _ in range(reps)]


def chatkit_turn(session, message: str, held: int) -> tuple[float, object, int]:
    """(a): (seconds to the first chunk, the stream read to its end, the turn's peak memory minus ``held``)."""
    gc.collect()
    mx.reset_peak_memory()
    t0 = time.perf_counter()
    stream = session.stream_respond(message)
    next(stream)
    dt = time.perf_counter() - t0
    for _ in stream:
        pass
    return dt, stream, mx.get_peak_memory() - held


def timed_prepare(session) -> tuple[bool, float, int]:
    """(whether ``prepare_compaction()`` prepared one, its seconds, its peak memory)."""
    gc.collect()
    mx.reset_peak_memory()
    t0 = time.perf_counter()
    ready = session.prepare_compaction()
    return ready, time.perf_counter() - t0, mx.get_peak_memory()


# -- one run -----------------------------------------------------------------------------------
def one_turn(session, lm, i: int, message: str, reply: list[int], same: bool, erase: bool, filled: bool) -> dict:
    """One turn: (a) and (b) in alternating order, then (s) if it compacted and ``same``, and (c) if ``erase``
    once the window has filled (``filled``: it did before, or this turn compacted)."""
    tok, model = lm.tokenizer, lm.model
    eos = tok.convert_tokens_to_ids("<|im_end|>")

    def processor():
        return Scripted(len(tok), reply, end=eos)

    session.generate_params = GenerateParams(max_tokens=MAX_TOKENS, logits_processors=[processor()])
    before = cache_state(session)
    full = tok.encode(session.render(message), add_special_tokens=False)  # the prompt without compacting
    keep = min(common_prefix_length(before.ledger.tokens, full), len(full) - 1)
    new = full[keep:]
    copy, held = trimmed_copy(model, before.layers, keep)
    t_raw = None
    if i % 2:  # (b) first on odd turns: its copy is gone during (a)
        t_raw, copy, held = first_token_time(model, new, copy, processor()), None, 0
    t_ck, stream, peak = chatkit_turn(session, message, held)
    if t_raw is None:
        t_raw = first_token_time(model, new, copy, processor())
    copy = None
    assert list(stream.tokens) == [*reply, eos], f"turn {i}: the scripted reply was not produced"
    stats, after = session.last_stats, cache_state(session)
    prompt = list(after.ledger.tokens[: stats.prompt_tokens])
    suffix = prompt[stats.reused_tokens :]
    assert len(suffix) == stats.prefilled_tokens and (stats.compacted or prompt[-len(new) :] == new)
    t_same = t_full = None
    if stats.compacted and same:
        layers, _ = trimmed_copy(model, after.layers, stats.reused_tokens)
        t_same = first_token_time(model, suffix, layers, processor())
    if erase and (filled or stats.compacted):
        t_full = first_token_time(model, prompt, make_prompt_cache(model), processor())
    return dict(turn=i, prompt=stats.prompt_tokens, reused=stats.reused_tokens, prefilled=stats.prefilled_tokens,
                new=len(new), compacted=stats.compacted, dropped=stats.dropped_tokens, summary=stats.summary_tokens,
                plan=stats.plan, ck=t_ck, raw=t_raw, same=t_same, full=t_full, prep=None, prepared=False, peak=peak)


def run(name: str, lm, turns, args) -> dict:
    """The whole chat under one policy: per-turn rows, and the error that stopped it if any."""
    policy, prepare = policy_for(name, args.low_water, lm.tokenizer)
    session = (ChatSession.builder(lm).instructions(INSTRUCTIONS).generate_params(GenerateParams(max_tokens=MAX_TOKENS))
               .context_policy(policy).prompt_cache(None).build())
    rows: list[dict] = []
    error, ready, filled, erased, same = None, False, False, 0, 0
    for i, (message, reply) in enumerate(turns, 1):
        erase = name == "rolling" and erased < args.erase_turns
        try:
            row = one_turn(session, lm, i, message, reply, same < args.same_turns, erase, filled)
        except (ChatKitError, AssertionError) as exc:
            error = f"turn {i}: {type(exc).__name__}: {exc}"
            traceback.print_exc()
            break
        filled = filled or row["compacted"]
        erased, same = erased + (row["full"] is not None), same + (row["same"] is not None)
        row["used_prepared"] = ready and row["compacted"] and row["plan"] == "append" and row["prefilled"] <= row["new"]
        if prepare:
            ready, row["prep"], peak = timed_prepare(session)
            row.update(prepared=ready, peak=max(row["peak"], peak))
        gc.collect()
        row["active"] = mx.get_active_memory()
        rows.append(row)
        if args.verbose or row["compacted"] or i % 50 == 0:
            print(format_row(row), flush=True)
    return dict(name=name, rows=rows, error=error, history=len(session.history), context=len(session.context))


HEADER = (f"{'turn':>4} {'prompt':>6} {'reused':>6} {'prefilled':>9} {'new':>4} | {'(a) chatkit':>11} {'(b) append':>10} "
          f"{'a/b':>6} | {'(s) same':>8} {'a/s':>5} | {'(c) erase':>9} | {'prep':>7} | {'active':>7} {'peak':>6} | note")


def format_row(r: dict) -> str:
    def ms(x, width):
        return f"{x * 1e3:>{width}.1f}ms" if x is not None else f"{'-':>{width + 2}}"

    same = f"{r['ck'] / r['same']:>5.2f}" if r["same"] else f"{'-':>5}"
    note = ""
    if r["compacted"]:
        note = (f"compacted ({r['plan']}, -{r['dropped']} tokens" + (f", summary {r['summary']}" if r["summary"] else "")
                + (", prepared cache" if r["used_prepared"] else "") + ")")
    elif r["prefilled"] != r["new"]:
        note = f"prefilled {r['prefilled'] - r['new']:+d} vs new"
    return (f"{r['turn']:>4} {r['prompt']:>6} {r['reused']:>6} {r['prefilled']:>9} {r['new']:>4} | {ms(r['ck'], 9)} "
            f"{ms(r['raw'], 8)} {r['ck'] / r['raw']:>6.2f} | {ms(r['same'], 6)} {same} | {ms(r['full'], 7)} | "
            f"{ms(r['prep'], 5)} | {r['active'] / MB:>7.1f} {r['peak'] / MB:>6.1f} | {note}")


# -- figures and the table ---------------------------------------------------------------------
def figures(result: dict, bound: float, k: int) -> dict:
    rows = result["rows"]
    f: dict = dict(result, bound=bound, turns=len(rows))
    if not rows:
        return f
    ratios = [r["ck"] / r["raw"] for r in rows]
    worst, slowest = max(range(len(rows)), key=ratios.__getitem__), max(rows, key=lambda r: r["ck"])
    crossing = [r for r in rows if r["compacted"]]
    f.update(
        ck_median=median([r["ck"] for r in rows]), raw_median=median([r["raw"] for r in rows]),
        median_ratio=median(ratios), ratio_of_means=sum(r["ck"] for r in rows) / sum(r["raw"] for r in rows),
        worst_ratio=ratios[worst], worst_turn=rows[worst]["turn"], slowest=slowest["ck"], slowest_turn=slowest["turn"],
        over_bound=sum(r["ck"] > bound for r in rows), compactions=len(crossing),
        used_prepared=sum(r["used_prepared"] for r in crossing), crossing_ratios=[r["ck"] / r["raw"] for r in crossing],
        crossing_same=[r["ck"] / r["same"] for r in crossing if r["same"]],
        extra=[r["prefilled"] - r["new"] for r in rows if not r["compacted"] and r["prefilled"] != r["new"]],
        prefilled_mean=sum(r["prefilled"] for r in rows) / len(rows), preps=[r["prep"] for r in rows if r["prepared"]],
        prep_runs=any(r["prep"] is not None for r in rows), unprepared=[r["turn"] for r in crossing if not r["used_prepared"]],
    )
    start = next((j for j, r in enumerate(rows) if r["compacted"]), 0)  # flat from the window's first filling on
    k = min(k, (len(rows) - start) // 2) or 1
    first, last = rows[start : start + k], rows[-k:]
    f.update(k=k, active_first=max(r["active"] for r in first), active_last=max(r["active"] for r in last),
             peak_first=max(r["peak"] for r in first), peak_last=max(r["peak"] for r in last))
    erased = [r for r in rows if r["full"] is not None]
    if erased:
        f.update(erase_turns=len(erased), erase_first=erased[0]["turn"], erase_last=erased[-1]["turn"],
                 erase_total=sum(r["full"] for r in erased), erase_ck_total=sum(r["ck"] for r in erased))
    return f


def mark(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def table(results: list[dict], step: int, low: int) -> None:
    """The runs side by side; ``step``: bytes of a KV-cache growth step (what 'flat' tolerates)."""
    lw, tw, width = 46, 16, 24
    print(f"{'':<{lw}}{'target':<{tw}}" + "".join(f"{TITLES[f['name']]:>{width}}" for f in results))

    def line(label: str, target: str, cell) -> None:
        cells = []
        for f in results:
            try:
                cells.append(cell(f) if f["rows"] else "-")
            except (KeyError, ValueError):  # a figure this run has not (no compaction, no preparation...)
                cells.append("-")
        print(f"{label:<{lw}}{target:<{tw}}" + "".join(f"{c:>{width}}" for c in cells))

    def ms(x: float) -> str:
        return f"{x * 1e3:.0f}" if x >= 0.1 else f"{x * 1e3:.1f}"

    line("turns (error)", "no error", lambda f: f"{f['turns']} {mark(not f['error'])}")
    line("compactions (with the prepared cache)", "", lambda f: f"{f['compactions']} ({f['used_prepared']})")
    line("messages at the end: history / context", "", lambda f: f"{f['history']} / {f['context']}")
    line("TTFT median ms: chatkit / raw append", "", lambda f: f"{ms(f['ck_median'])} / {ms(f['raw_median'])}")
    line("chatkit/raw: median of the turns' ratios", "<= 1.10", lambda f: f"{f['median_ratio']:.3f} {mark(f['median_ratio'] <= 1.1)}")
    line("chatkit/raw: mean TTFT / mean TTFT", "<= 1.30",
         lambda f: f"{f['ratio_of_means']:.3f} {mark(f['ratio_of_means'] <= 1.3)}")
    line("chatkit/raw: worst turn", "", lambda f: f"{f['worst_ratio']:.2f} (turn {f['worst_turn']})")
    line(f"slowest turn / full prefill of {low}", "<= 1.00x", lambda f: (
        f"{ms(f['slowest'])}/{ms(f['bound'])}ms={f['slowest'] / f['bound']:.2f}x {mark(f['over_bound'] == 0)}"))
    line("  the slowest turn; turns over the bound", "", lambda f: f"{f['slowest_turn']}; {f['over_bound']}")
    line("slowest turn / median turn (chatkit TTFT)", "<= 2.0 (shift)", lambda f: (
        f"{f['slowest'] / f['ck_median']:.2f}" + (f" {mark(f['slowest'] / f['ck_median'] <= 2)}"
                                                  if f["name"] == "rolling-shift" else "")))
    line("crossing turns chatkit/raw: median, max", "<= 1.20 (prep)", lambda f: (
        f"{median(f['crossing_ratios']):.2f}, {max(f['crossing_ratios']):.2f}"
        + (f" {mark(max(f['crossing_ratios']) <= 1.2)}" if f["prep_runs"] else "")))
    line("crossing turns chatkit/same suffix: med, max", "", lambda f: (
        f"{median(f['crossing_same']):.2f}, {max(f['crossing_same']):.2f}"))
    line("prepare_compaction() that prepared: med, max", "", lambda f: f"{ms(median(f['preps']))}, {ms(max(f['preps']))} ms")
    line("tokens prefilled per turn (mean)", "", lambda f: f"{f['prefilled_mean']:.1f}")
    line("turns prefilling more than their new tokens", "0", lambda f: (
        f"{len(f['extra'])} (max {max(f['extra']):+d})" if f["extra"] else "0"))
    line("active MiB max: first k full-window / last k", "flat", lambda f: (
        f"{f['active_first'] / MB:.1f} / {f['active_last'] / MB:.1f} {mark(f['active_last'] <= f['active_first'] + step)}"))
    line("peak MiB max: first k full-window / last k", "flat", lambda f: (
        f"{f['peak_first'] / MB:.1f} / {f['peak_last'] / MB:.1f} {mark(f['peak_last'] <= f['peak_first'] + step)}"))
    line("re-prefill every turn / chatkit: total TTFT", "(report)", lambda f: (
        f"{f['erase_total']:.1f}/{f['erase_ck_total']:.1f}s={f['erase_total'] / f['erase_ck_total']:.2f}x"))
    line("  over turns", "", lambda f: f"{f['erase_first']}-{f['erase_last']} ({f['erase_turns']})")
    print(f"k = {', '.join(str(f.get('k', '-')) for f in results)} turns; 'flat': the last k turns' max at most "
          f"{step / MB:.1f} MiB (one KV-cache growth step of 256 tokens) above that of the first k 'full-window' turns (from the first that compacted on). raw = (b), same "
          "suffix = (s), re-prefill = (c) (see the docstring); crossing turns = those that compacted.")
    for f in results:
        if f["error"]:
            print(f"{TITLES[f['name']]}: {f['error']}")
        if f.get("prep_runs") and f["unprepared"]:
            print(f"{TITLES[f['name']]}: crossing turns that found no prepared compaction (they compacted by "
                  f"themselves): {f['unprepared']}")


# -- SmolLM2: a fact told early, asked later ---------------------------------------------------
FACT, QUESTION, NAME = "My cat is called Pixel. Please remember that.", "What is my cat called?", "Pixel"
FILLER = ["Tell me a fun fact about {}.", "What is {} known for?", "Describe {} in one sentence."]
TOPICS = ["whales", "volcanoes", "the moon", "bees", "rain", "chess", "bread", "rivers", "trains", "owls", "salt", "kites"]


def real_chat(lm, policy: ContextPolicy, turns: int, asked: list[int]) -> list[dict]:
    """The chat under ``policy`` (prepared between turns): at each asked turn, where the fact was and the reply."""
    session = (ChatSession.builder(lm).instructions("You are a helpful assistant.")
               .generate_params(GenerateParams(max_tokens=40, temperature=0.0)).context_policy(policy).build())
    out = []
    for turn in range(1, turns + 1):
        prompt = FACT if turn == 2 else QUESTION if turn in asked else FILLER[turn % 3].format(TOPICS[turn % len(TOPICS)])
        reply = session.respond(prompt)
        if turn in asked:  # what the model saw at this turn (after its compaction, if it made one)
            in_view = any(m.content == FACT for m in session.context[1:])
            summary = session.context[0].content.partition(SUMMARY_HEADER)[2].strip()
            where = "in view" if in_view else "in the summary" if NAME.lower() in summary.lower() else "gone"
            out.append(dict(turn=turn, where=where, summary=summary, reply=reply, recalled=NAME.lower() in reply.lower(),
                            dropped=len(session.dropped_messages)))
        session.prepare_compaction()
    return out


def real(args) -> None:
    """``--real``: SmolLM2 with a 1,024-token window, ``summarize()`` (its own summaries) and ``rolling()``."""
    turns = args.real_turns
    asked = sorted({max(3, round(turns * j / 3)) for j in (1, 2, 3)})
    base = chatkit.load("smollm2", dequantize=True)
    lm = LoadedModel(base.model, base.tokenizer, {**base.config, "max_position_embeddings": args.real_window}, base.source)
    print(f"SmolLM2-135M-Instruct float32, window {args.real_window} tokens, {turns} turns: the fact at turn 2 "
          f"({FACT!r}), asked at turns {asked} ({QUESTION!r}); greedy, max_tokens=40, prepared between turns")
    results = {}
    for name, policy in (("summarize", ContextPolicy.summarize()), ("rolling", ContextPolicy.rolling())):
        t0 = time.perf_counter()
        results[name] = rows = real_chat(lm, policy, turns, asked)
        print(f"\n== {name} ({time.perf_counter() - t0:.0f} s)")
        for r in rows:
            print(f"turn {r['turn']}: the fact {r['where']}; {r['dropped']} messages dropped; recalled: "
                  f"{'yes' if r['recalled'] else 'no'}\n  reply: {r['reply'][:160]!r}\n  summary: {r['summary'][:300]!r}")
    print(f"\n{'':<44}{'target':<18}{'summarize':>14}{'rolling':>14}")
    for turn_rows in zip(*results.values()):
        label = f"turn {turn_rows[0]['turn']}: where the fact is"
        print(f"{label:<44}{'':<18}" + "".join(f"{r['where']:>14}" for r in turn_rows))
    dropped = [r for r in results["summarize"] if r["where"] != "in view"]
    held = sum(r["where"] == "in the summary" for r in dropped)
    print(f"{'summarize: fact in the summary once dropped':<44}{'every asked turn':<18}"
          + (f"{held}/{len(dropped)} {mark(held == len(dropped))}" if dropped else "- (never dropped)").rjust(14))
    rates = [f"{sum(r['recalled'] for r in rows)}/{len(rows)}" for rows in results.values()]
    print(f"{'recall (the name in the reply)':<44}{'(report)':<18}" + "".join(f"{r:>14}" for r in rates))


# -- main --------------------------------------------------------------------------------------
def arguments():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--turns", type=int, default=500)
    ap.add_argument("--window", type=int, default=2048, help="the context window, in tokens")
    ap.add_argument("--low-water", type=float, default=0.5)
    ap.add_argument("--runs", default="rolling,summarize,model", help=f"comma-separated, from {', '.join(RUNS)}")
    ap.add_argument("--model-turns", type=int, default=60, help="turns of the 'model' run (its summaries are slow)")
    ap.add_argument("--erase-turns", type=int, default=24, help="(c) is timed on this many turns from the first "
                    "that compacts (each is a full prefill of 0.5 to 1 window)")
    ap.add_argument("--same-turns", type=int, default=10, help="(s) is timed on this many compacting turns per run")
    ap.add_argument("--bound-reps", type=int, default=2, help="timings of the full low-water prefill before and "
                    "after each run")
    ap.add_argument("--memory-turns", type=int, default=100, help="memory: this many turns from the first compaction on, against the last as many")
    ap.add_argument("--verbose", action="store_true", help="a line per turn (default: compacting turns, every 50th)")
    ap.add_argument("--no-wait", action="store_true", help="start even if other processes keep the CPU busy")
    ap.add_argument("--real", action="store_true", help="only the SmolLM2 part (a fact told at turn 2, asked later)")
    ap.add_argument("--real-turns", type=int, default=60, help="--real: turns (the fact is asked at 1/3, 2/3, the end)")
    ap.add_argument("--real-window", type=int, default=1024, help="--real: the context window")
    add_quick(ap)
    args = ap.parse_args()
    if quick(args):
        args.turns, args.window, args.model_turns, args.erase_turns, args.same_turns = 16, 512, 10, 3, 2
        args.bound_reps, args.memory_turns = 1, 3
    args.runs = [r.strip() for r in args.runs.split(",") if r.strip()]
    if not args.runs or any(r not in RUNS for r in args.runs):
        ap.error(f"--runs takes names from {', '.join(RUNS)}")
    if args.turns < 2 or args.window < 256 or args.real_turns < 4:
        ap.error("--turns must be >= 2, --window >= 256 (an exchange is ~90 tokens), --real-turns >= 4")
    return args


def main() -> None:
    args = arguments()
    t_start = time.perf_counter()
    print(wait_until_quiet(max_wait=0 if args.no_wait else 300))
    load = OtherLoad()
    if args.real:
        real(args)
    else:
        bench(args)
    print(load.report())
    print(f"total time {time.perf_counter() - t_start:.0f} s")


def bench(args) -> None:
    base = load_model("bpe")
    lm = LoadedModel(base.model, base.tokenizer, {**base.config, "max_position_embeddings": args.window}, base.source)
    tok, low = lm.tokenizer, math.floor(args.low_water * args.window)
    print(describe(base))
    print(f"chat: {args.turns} turns, ~{USER_TOKENS}-token user messages, scripted replies of {REPLY_TOKENS[0]}-"
          f"{REPLY_TOKENS[1]} tokens (max_tokens={MAX_TOKENS}); context window {args.window} tokens, low water "
          f"{args.low_water} ({low} tokens); runs: {', '.join(args.runs)}; TTFT timed once per turn")
    warm = ChatSession.builder(lm).generate_params(GenerateParams(max_tokens=8)).build()  # MLX kernels, the template
    for _ in range(2):
        warm.respond(sentence_text(random.Random(1), tok, USER_TOKENS, "?"))
    low_water_prefill(lm, low, 1)
    gc.freeze()  # what exists now is never garbage: the gc.collect() before each timing stays short
    turns, results = script(tok, args.turns), []
    for name in args.runs:
        n = min(args.model_turns, args.turns) if name == "model" else args.turns
        before = low_water_prefill(lm, low, args.bound_reps)
        print(f"\n== {TITLES[name]}: {n} turns (full prefill of {low} tokens: {median(before) * 1e3:.0f} ms)\n{HEADER}")
        t0, c0 = time.perf_counter(), time.process_time()
        result = run(name, lm, turns[:n], args)
        t1, c1 = time.perf_counter(), time.process_time()
        after = low_water_prefill(lm, low, args.bound_reps)
        print(f"({t1 - t0:.0f} s, {c1 - c0:.0f} s of CPU; full prefill of {low} tokens after: {median(after) * 1e3:.0f} ms)")
        results.append(figures(result, median(before + after), args.memory_turns))
        gc.collect()
    weights = sum(v.nbytes for _, v in tree_flatten(lm.model.parameters()))
    print(f"\nweights {weights / MB:.1f} MiB")
    table(results, kv_step(lm), low)


if __name__ == "__main__":
    sys.exit(main())

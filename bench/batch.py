"""Many sessions at once: a BatchEngine against the same turns run one by one, and the shared prefix cache.

    .venv/bin/python bench/batch.py [--sessions 1,2,4,8,16] [--tokens 64] [--ttft-reps 7] [--max-wait 300]
        [--lookup | --lookup-only] [--lookup-sessions 8] [--lookup-tokens 96] [--lookup-reps 3]

Part 1, throughput. For N sessions: N turns, each a distinct ~40-token prompt (ChatML, no
instructions), greedy, ``--tokens`` tokens each (the EOS logits biased by -1e9 through the session's
own ``logit_bias``, so no turn ends early and every session runs its own logits processor and
sampler). (a) sequential: the N turns one after another on plain sessions (no engine: what an app
gets today); (b) batched: the N turns started at once from N threads on sessions built with
``.engine(engine)`` over one ``BatchEngine(lm, max_batch=16)`` (prefix cache off, so that only batching
differs). Aggregate tok/s = all tokens generated / wall time from the first start to the last end
(prefill included); "per session" is each session's own decode time per token after its first
(median over the sessions). Every batched session's tokens must equal its sequential run's.

Before part 1, the model's own decode step at each batch size (a forward pass and an argmax, no
chatkit, no BatchGenerator) and its own prefill of the prompts, one and N in one batch: what batching
can gain at best on the machine as it is during the run; and mlx-lm's ``BatchGenerator`` alone over the
same prompts; then the engine's own decode step (chatkit's rows, prefilled together as the engine does)
against ``BatchGenerator``'s over the same rows and processors, in alternating rounds: the per-step path
side by side. Decoding gains (one step at batch N costs
far less than N steps at batch 1); prefill hardly does (it is compute-bound already), so the
end-to-end ceiling, prefill included, is lower than the decode step's. Besides the end-to-end speedup,
the table gives the decode speedup: aggregate decode tok/s while the sessions decode, N x each
session's ms/token alone over its ms/token in the batch; and, in its last column, what raw mlx-lm gets
from batching the same N prompts in the same run (``batch_generate`` against N ``stream_generate``
calls, no chatkit): the issue's yardstick, measured side by side.

Part 3 (``--lookup``), prompt lookup inside the batch (issue 36): 8 sessions (``--lookup-sessions``), each
asked to repeat a ~100-token passage of its own prompt, batched with ``SpeculativeConfig("prompt_lookup")``
(the adaptive draft length, and a fixed 6) against the same 8 batched without speculation; then the same on a reply
that does not repeat its context. The benchmark model has random weights, so each session's reply is
forced by a logits processor (``Copy``): the passage's tokens in order (copying), or a fixed
pseudo-random token sequence found nowhere in the context (not repeating). It is a pure function of
how many tokens it is shown, costs the same on both sides, and lets greedy tokens be compared: they
must be identical (its logits depend on the model's, so that the forward passes run as with any real
processor). Targets: >= 1.5x aggregate tok/s copying, >= 0.95x not repeating. Before the table, the
verifying step's cost at k = 1..8 drafted tokens per row (all accepted) against a plain step, at the same
number of rows: the ceiling of what drafting can gain on the machine.

Part 2, time to first token of a new session whose ~2,000-token instructions are already in the
engine's prefix cache (another session answered once): ``stream_respond`` to the first chunk, median
of ``--ttft-reps`` new sessions with different questions; against raw mlx-lm ``generate_step`` fed only
the new tokens (the suffix chatkit prefilled) over a copy of the cached prefix made before the clock
starts, to its first token; and, once, chatkit without an engine (no prefix cache: the whole prompt).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from pathlib import Path

from chatkit import BatchEngine, ChatSession, GenerateParams, SpeculativeConfig

import mlx.core as mx
from _common import OtherLoad, add_quick, cache_state, clone, describe, load_model, median, quick, wait_until_quiet
from mlx_lm.generate import BatchGenerator, batch_generate, generate_step, generation_stream, stream_generate
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_logits_processors

WORDS = ("the river town keeps a small library where seven old maps show roads that no longer exist "
         "and every evening a clerk writes down who came to read them").split()


def prompt(i: int, n: int = 30) -> str:
    return f"Question {i}: " + " ".join(WORDS[(i * 7 + k) % len(WORDS)] for k in range(n))


def params(lm, tokens: int) -> GenerateParams:
    return GenerateParams(max_tokens=tokens, temperature=0.0, logit_bias={t: -1e9 for t in lm.tokenizer.eos_token_ids})


def run_all(sessions, texts, got) -> float:
    """Each session's turn on ``texts`` on its own thread, all at once (``run_turn`` fills ``got``); the start."""
    threads = [threading.Thread(target=run_turn, args=(s, t, got, i, True)) for i, (s, t) in enumerate(zip(sessions, texts))]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return t0


def run_turn(session, text, out, i, thread=False):
    times = []
    t0 = time.perf_counter()
    with session.stream_respond(text) as stream:
        for _ in stream:
            times.append(time.perf_counter())
    out[i] = (t0, times, stream.tokens)
    if thread:
        mx.clear_streams()  # what MLX asks of a thread that ran MLX work, before it ends


def throughput(lm, n: int, tokens: int, engine: BatchEngine):
    texts = [prompt(i) for i in range(n)]
    # (a) one by one, no engine
    seq = [None] * n
    t0 = time.perf_counter()
    for i, text in enumerate(texts):
        run_turn(ChatSession.builder(lm).generate_params(params(lm, tokens)).build(), text, seq, i)
    seq_wall = time.perf_counter() - t0
    # (b) all at once on the engine
    sessions = [ChatSession.builder(lm).generate_params(params(lm, tokens)).engine(engine).build() for _ in texts]
    got = [None] * n
    t0 = run_all(sessions, texts, got)
    batch_wall = max(r[1][-1] for r in got) - t0  # type: ignore[index]
    same = all(g[2] == s[2] for g, s in zip(got, seq))  # type: ignore[index]

    def per_token(rows):
        return median([(r[1][-1] - r[1][0]) / (len(r[1]) - 1) for r in rows])

    total = n * tokens
    return dict(n=n, seq_tps=total / seq_wall, batch_tps=total / batch_wall, per_seq=per_token(seq),
                per_batch=per_token(got), same=same, peak=engine.peak_batch)


def forward_step(lm, batch: int, steps: int = 30) -> float:
    """The model's own decode step at ``batch`` rows (forward + argmax over a 100-token cache; no chatkit,
    no BatchGenerator): the ceiling of any batching speedup on this machine."""
    cache = make_prompt_cache(lm.model)
    lm.model(mx.array([[5 + i for i in range(100)]] * batch), cache=cache)
    y = mx.array([[7]] * batch)
    for _ in range(3):
        mx.eval(lm.model(y, cache=cache))
    t0 = time.perf_counter()
    for _ in range(steps):
        mx.eval(mx.argmax(lm.model(y, cache=cache)[:, -1, :], axis=-1))
    return (time.perf_counter() - t0) / steps


def prefill(lm, texts: list[str], steps: int = 3) -> float:
    """The model's own prefill of the ChatML prompts of ``texts`` in one batch (right-padded to the
    longest; no chatkit): the part of a turn batching cannot shrink, since it is compute-bound already."""
    ids = [lm.tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True) for t in texts]
    width = max(len(i) for i in ids)
    x = mx.array([i + [0] * (width - len(i)) for i in ids])
    best = float("inf")
    for _ in range(steps):
        cache = make_prompt_cache(lm.model)
        t0 = time.perf_counter()
        mx.eval(lm.model(x, cache=cache))
        best = min(best, time.perf_counter() - t0)
    return best


def generator_step(lm, n: int, tokens: int) -> float:
    """mlx-lm's ``BatchGenerator`` alone over the same N prompts and per-row ``logit_bias`` processors
    (no sessions, no threads): its median step once every row decodes. The engine cannot beat it."""
    eos = list(lm.tokenizer.eos_token_ids)
    ids = [lm.tokenizer.apply_chat_template([{"role": "user", "content": prompt(i)}], add_generation_prompt=True)
           for i in range(n)]
    gen = BatchGenerator(lm.model, completion_batch_size=16, prefill_batch_size=8, prefill_step_size=512)
    gen.insert(ids, max_tokens=[tokens] * n,
               logits_processors=[make_logits_processors(logit_bias={t: -1e9 for t in eos})] * n)
    times: list[float] = []
    done = 0
    while done < n:
        _, out = gen.next()
        times.append(time.perf_counter())
        done += sum(r.finish_reason is not None for r in out)
    gen.close()
    half = times[-(tokens // 2) :]
    return median([b - a for a, b in zip(half, half[1:])])


def joined_rows(lm, ids: list[list[int]], processors: list[list]):
    """chatkit's decode batch (``Rows``) over ``ids``, prefilled together as the engine does, each row
    with its processors (greedy), after one step (every row has fed its prompt)."""
    from chatkit.decode.batch.engine import _row
    from chatkit.decode.batch.job import Job
    from chatkit.decode.batch.prefill import Prefill
    from chatkit.decode.batch.rows import Rows

    from mlx_lm.sample_utils import greedy_sampler

    jobs = [Job(tuple(p), (), 10**6, greedy_sampler, tuple(ps), make_prompt_cache(lm.model), 512)
            for p, ps in zip(ids, processors)]
    group = Prefill(lm.model)
    group.start(jobs)
    while not group.done:
        group.feed(4096)
    jobs, layers = group.take()
    rows = Rows(lm.model)
    rows.join([_row(j) for j in jobs], layers, [j.suffix[-1] for j in jobs])
    rows.plain()
    return rows


def step_paths(lm, n: int, steps: int = 10, rounds: int = 6) -> tuple[float, float]:
    """The engine's decode step (``Rows.plain``) against mlx-lm's ``BatchGenerator`` step over the same N
    prompts and per-row ``logit_bias`` processors, once every row decodes, in alternating rounds (so that
    other load hits both alike): median seconds per step of each."""
    eos = {t: -1e9 for t in lm.tokenizer.eos_token_ids}
    ids = [lm.tokenizer.apply_chat_template([{"role": "user", "content": prompt(i)}], add_generation_prompt=True)
           for i in range(n)]
    with mx.stream(generation_stream):
        rows = joined_rows(lm, ids, [make_logits_processors(logit_bias=eos) for _ in ids])
        gen = BatchGenerator(lm.model, completion_batch_size=16, prefill_batch_size=8, prefill_step_size=512)
        gen.insert(ids, max_tokens=[10**6] * n, logits_processors=[make_logits_processors(logit_bias=eos)] * n)
        while len(gen._generation_batch) < n:
            gen.next()
        times: list[list[float]] = [[], []]
        for r in range(rounds):
            for which in (0, 1) if r % 2 == 0 else (1, 0):
                t0 = time.perf_counter()
                for _ in range(steps):
                    rows.plain() if which == 0 else gen._generation_batch.next()
                times[which].append((time.perf_counter() - t0) / steps)
        gen.close()
    return median(times[0]), median(times[1])


def verify_costs(lm, n: int, reps: int = 8) -> tuple[float, dict[int, float]]:
    """The batch's verifying step against its plain step, every row drafting ``k`` tokens that are all
    accepted (each row's reply forced by ``Copy``), k = 1..8, in alternating order: the plain step's
    seconds and each k's step time as a multiple of it. A step yields k + 1 tokens per row, so
    ``(k + 1) / cost`` is the most drafting can gain at that k."""
    rng = __import__("random").Random(3)
    replies = [rng.sample(range(300, lm.vocab_size - 300), 50) for _ in range(n)]
    ids = [lm.tokenizer.apply_chat_template([{"role": "user", "content": prompt(i)}], add_generation_prompt=True)
           for i in range(n)]
    times: dict[int, list[float]] = {k: [] for k in range(9)}
    with mx.stream(generation_stream):
        rows = joined_rows(lm, ids, [[Copy(r)] for r in replies])
        for rep in range(reps):
            for k in range(9) if rep % 2 == 0 else range(8, -1, -1):
                ys = rows.next_tokens()
                drafts = [[r[(r.index(y) + 1 + j) % len(r)] for j in range(k)] for r, y in zip(replies, ys)]
                t0 = time.perf_counter()
                rows.plain() if k == 0 else rows.verify(drafts)
                mx.eval(rows.next, [lp for lp in rows.next_logprobs if lp is not None])
                times[k].append(time.perf_counter() - t0)
    plain = median(times[0])
    return plain, {k: median(times[k]) / plain for k in range(1, 9)}


def mlx_lm_alone(lm, n: int, tokens: int) -> float:
    """Raw mlx-lm end to end, no chatkit: ``batch_generate`` of the N prompts against N ``stream_generate``
    calls one after another (the same prompts, per-row ``logit_bias``): the speedup mlx-lm itself gets
    from batching on this machine, the yardstick the issue quotes (5.3x at 8 where it was measured)."""
    eos = {t: -1e9 for t in lm.tokenizer.eos_token_ids}
    ids = [lm.tokenizer.apply_chat_template([{"role": "user", "content": prompt(i)}], add_generation_prompt=True)
           for i in range(n)]
    t0 = time.perf_counter()
    for row in ids:
        for _ in stream_generate(lm.model, lm.tokenizer, row, max_tokens=tokens,
                                 logits_processors=make_logits_processors(logit_bias=eos)):
            pass
    sequential = time.perf_counter() - t0
    t0 = time.perf_counter()
    batch_generate(lm.model, lm.tokenizer, ids, max_tokens=tokens, logits_processors=make_logits_processors(logit_bias=eos))
    return sequential / (time.perf_counter() - t0)


def ttft(lm, reps: int):
    instructions = "You are the archivist of the river town. " + " ".join(
        WORDS[k % len(WORDS)] for k in range(1500))
    p = GenerateParams(max_tokens=4, temperature=0.0)
    rows = []
    with BatchEngine(lm, max_batch=16) as engine:
        ChatSession.builder(lm).instructions(instructions).generate_params(p).engine(engine).build().respond("Hello.")
        for i in range(reps + 1):  # the first is a warm-up
            session = ChatSession.builder(lm).instructions(instructions).generate_params(p).engine(engine).build()
            t0 = time.perf_counter()
            with session.stream_respond(prompt(100 + i, 12)) as stream:
                next(stream)
                t_chatkit = time.perf_counter() - t0
            stats = session.last_stats
            assert stats is not None
            ids = list(cache_state(session).ledger.tokens[: stats.prompt_tokens])
            reused = stats.reused_tokens
            # raw mlx-lm: the cached prefix (computed here), a copy made off the clock, only the new tokens fed
            prefix = make_prompt_cache(lm.model)
            lm.model(mx.array([ids[:reused]]), cache=prefix)
            mx.eval([c.state for c in prefix])
            copy = clone(prefix)
            t0 = time.perf_counter()
            steps = generate_step(mx.array(ids[reused:]), lm.model, prompt_cache=copy, max_tokens=4)
            next(steps)
            t_raw = time.perf_counter() - t0
            steps.close()
            if i:
                rows.append((t_chatkit, t_raw, reused, stats.prompt_tokens))
    # chatkit alone, once: no prefix cache, the whole prompt prefilled
    plain = ChatSession.builder(lm).instructions(instructions).generate_params(p).build()
    t0 = time.perf_counter()
    with plain.stream_respond(prompt(100, 12)) as stream:
        next(stream)
        t_plain = time.perf_counter() - t0
    return rows, t_plain


class Copy:
    """Forces ``reply`` token by token after the prompt (a pure function of how many tokens it is shown)."""

    def __init__(self, reply: list[int]) -> None:
        self.reply, self.start = reply, None

    def __call__(self, tokens, logits):
        if self.start is None:
            self.start = tokens.size
        token = self.reply[(tokens.size - self.start) % len(self.reply)]
        # ``0 * logits``: the forced logits depend on the model's, so that its forward pass runs as with
        # any real processor (MLX computes lazily: without it, plain steps never ran the model, and
        # only verifying steps, which read the model's own argmax, paid for it).
        forced = mx.where(mx.arange(logits.shape[-1]) == token, 0.0, -1e9).astype(logits.dtype)[None]
        return forced + 0 * logits


def lookup_turns(lm, n: int, tokens: int, copying: bool, lookup: int | str | None):
    """``n`` sessions' turns batched, forced to copy a passage of their prompt (or not to repeat it);
    with prompt lookup inside the batch (``lookup``: its num_draft_tokens) or without speculation
    (``None``). (aggregate tok/s, tokens, accepted)."""
    rng = __import__("random").Random(7)
    texts, replies = [], []
    for i in range(n):
        passage = " ".join(WORDS[(i * 5 + k * 3) % len(WORDS)] + str(k % 7) for k in range(40))
        texts.append(f"Repeat this passage exactly: {passage}")
        ids = lm.tokenizer.encode(" " + passage, add_special_tokens=False)
        replies.append(ids if copying else [rng.randrange(300, lm.vocab_size - 300) for _ in range(len(ids))])
    got = [None] * n
    with BatchEngine(lm, max_batch=16, prefix_cache_bytes=0) as engine:
        sessions = []
        for reply in replies:
            b = ChatSession.builder(lm).generate_params(GenerateParams(max_tokens=tokens, logits_processors=[Copy(reply)]))
            sessions.append(b.speculative(None if lookup is None else SpeculativeConfig("prompt_lookup", lookup)).engine(engine).build())
        t0 = run_all(sessions, texts, got)
    wall = max(r[1][-1] for r in got) - t0  # type: ignore[index]
    accepted = sum(s.last_stats.draft_tokens_accepted for s in sessions)
    return sum(len(r[2]) for r in got) / wall, [r[2] for r in got], accepted  # type: ignore[index]


def lookup_table(lm, n: int, tokens: int, say, reps: int = 3) -> None:
    say(f"\nPart 3: prompt lookup inside the batch, {n} sessions x {tokens} tokens, replies forced (see the docstring)")
    plain, costs = verify_costs(lm, n)
    say(f"The verifying step at {n} rows, every draft accepted, against a plain step ({1000 * plain:.1f} ms): "
        + ", ".join(f"k={k} {c:.2f}x" for k, c in costs.items()))
    say("  so at most, in tokens per row and plain step's time: " + ", ".join(
        f"k={k} {(k + 1) / c:.2f}x" for k, c in costs.items()))
    say(f"draft: num_draft_tokens (auto: the adaptive policy, the default); medians of {reps} rounds, the three "
        "runs of a round in rotating order; ratio: the median of each round's lookup / no speculation")
    say(f"{'reply':>14} | draft | {'no speculation tok/s':>20} | {'lookup tok/s':>12} | {'ratio':>6} | target | "
        "accepted | same tokens")
    for copying, target in ((True, 1.5), (False, 0.95)):
        modes: list[int | str | None] = [None, "auto", 6]
        runs: dict[int | str | None, list] = {m: [] for m in modes}
        for r in range(reps):
            for m in modes[r % 3:] + modes[: r % 3]:
                runs[m].append(lookup_turns(lm, n, tokens, copying, lookup=m))
        base = median([tps for tps, _, _ in runs[None]])
        for draft in ("auto", 6):
            ratio = median([spec[0] / none[0] for spec, none in zip(runs[draft], runs[None])])
            same = all(spec[1] == runs[None][0][1] for spec in runs[draft])
            accepted = median([a for _, _, a in runs[draft]])
            say(f"{'copying' if copying else 'not repeating':>14} | {draft!s:>5} | {base:>20.1f} | "
                f"{median([tps for tps, _, _ in runs[draft]]):>12.1f} | {ratio:>5.2f}x | {target:>5.2f}x | "
                f"{accepted:>8.0f} | {same!s:>11}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sessions", default="1,2,4,8,16")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--ttft-reps", type=int, default=7)
    ap.add_argument("--max-wait", type=float, default=300.0)
    ap.add_argument("--lookup", action="store_true", help="also part 3: prompt lookup inside the batch")
    ap.add_argument("--lookup-only", action="store_true", help="only part 3")
    ap.add_argument("--lookup-sessions", type=int, default=8)
    ap.add_argument("--lookup-tokens", type=int, default=96)
    ap.add_argument("--lookup-reps", type=int, default=3, help="rounds of part 3 (medians)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "batch.txt"))
    add_quick(ap)
    args = ap.parse_args()
    if quick(args):  # every part, small; bench/results/batch.txt stays as it is
        args.sessions, args.tokens, args.ttft_reps, args.lookup = "1,2", 8, 2, True
        args.lookup_sessions, args.lookup_tokens, args.lookup_reps = 2, 16, 1
        args.out = str(Path(tempfile.mkdtemp()) / "batch.txt")
    lm = load_model()
    lines = [describe(lm), f"load    : {wait_until_quiet(args.max_wait)}"]
    print("\n".join(lines), flush=True)
    other = OtherLoad()
    # warm-up: compile kernels and fill allocator pools on both paths
    with BatchEngine(lm, max_batch=16, prefix_cache_bytes=0) as engine:
        throughput(lm, 2, 8, engine)

    def say(line: str = "") -> None:
        print(line, flush=True)
        lines.append(line)

    if args.lookup_only:
        lookup_turns(lm, 2, 8, True, 4)  # warm-up of the verifying step
        lookup_table(lm, args.lookup_sessions, args.lookup_tokens, say, args.lookup_reps)
        say(other.report())
        write(args.out, lines)
        return

    sizes = [int(x) for x in args.sessions.split(",")]
    steps = {b: forward_step(lm, b) for b in sizes}
    say("\nThe model's decode step alone (forward + argmax, plain KVCache): " + ", ".join(
        f"batch {b}: {1000 * t:.1f} ms ({b * steps[sizes[0]] / t:.1f}x the tokens/s of batch {sizes[0]})"
        for b, t in steps.items()))
    # End-to-end ceiling: N prompts prefilled one by one plus N x T decode steps at batch 1, against the
    # N prompts prefilled in one batch plus T steps at batch N (no chatkit in either).
    one = prefill(lm, [prompt(0)])
    together = {b: prefill(lm, [prompt(i) for i in range(b)]) for b in sizes}
    ceiling = {b: (b * one + b * args.tokens * steps[sizes[0]]) / (together[b] + args.tokens * steps[b]) for b in sizes}
    say(f"The model's prefill alone: one prompt {1000 * one:.1f} ms; in one batch: " + ", ".join(
        f"{b} prompts {1000 * t:.1f} ms" for b, t in together.items()))
    say("End-to-end ceiling (prefill included, " + f"{args.tokens} tokens per turn): " + ", ".join(
        f"{b} sessions {c:.2f}x" for b, c in ceiling.items()))
    say("mlx-lm's BatchGenerator alone (same prompts and processors, no chatkit), per step: " + ", ".join(
        f"batch {b}: {1000 * generator_step(lm, b, args.tokens):.1f} ms" for b in sizes))
    pairs = {b: step_paths(lm, b) for b in sizes if b > 1}
    say("The engine's decode step against BatchGenerator's, same rows and processors, alternating rounds: " + ", ".join(
        f"batch {b}: {1000 * a:.1f} ms vs {1000 * g:.1f} ms ({a / g:.2f}x)" for b, (a, g) in pairs.items()))
    say(f"\nPart 1: {args.tokens} tokens per session, greedy, EOS biased -1e9 (a logits processor per session)")
    say("speedup: aggregate tok/s, prefill included (wall time from the first start to the last token);")
    say("decode speedup: aggregate decode tok/s once the sessions decode (N x ms/token alone / ms/token batched)")
    say("mlx-lm alone: raw mlx-lm's batch_generate of the N prompts against N stream_generate calls (no chatkit)")
    say(f"{'sessions':>8} | {'sequential tok/s':>16} | {'batched tok/s':>13} | {'speedup':>7} | {'ceiling':>7} | "
        f"{'ms/token alone':>14} | {'ms/token batched':>16} | {'decode speedup':>14} | peak batch | same tokens | "
        "mlx-lm alone")
    for n in sizes:
        with BatchEngine(lm, max_batch=16, prefix_cache_bytes=0) as engine:
            r = throughput(lm, n, args.tokens, engine)
        raw = mlx_lm_alone(lm, n, args.tokens)
        say(f"{r['n']:>8} | {r['seq_tps']:>16.1f} | {r['batch_tps']:>13.1f} | {r['batch_tps'] / r['seq_tps']:>6.2f}x | "
            f"{ceiling[n]:>6.2f}x | {1000 * r['per_seq']:>14.1f} | {1000 * r['per_batch']:>16.1f} | "
            f"{n * r['per_seq'] / r['per_batch']:>13.2f}x | {r['peak']:>10} | {r['same']!s:>11} | {raw:>11.2f}x")
        if not r["same"]:
            say("  !! batched tokens differ from the sequential run")
    rows, plain = ttft(lm, args.ttft_reps)
    ck, raw = (median([r[k] for r in rows]) for k in range(2))
    pairs = median([r[0] / r[1] for r in rows])
    say(f"\nPart 2: time to first token, new session, {rows[0][3]}-token prompt of which {rows[0][2]} reused "
        f"from the engine's prefix cache ({len(rows)} sessions)")
    say(f"  chatkit + BatchEngine (prefix cache) : {1000 * ck:7.1f} ms")
    say(f"  raw mlx-lm, only the new tokens      : {1000 * raw:7.1f} ms   ratio {ck / raw:.2f}x (paired {pairs:.2f}x)")
    say(f"  chatkit alone (whole prompt, once)   : {1000 * plain:7.1f} ms")
    if args.lookup:
        lookup_table(lm, args.lookup_sessions, args.lookup_tokens, say, args.lookup_reps)
    say(other.report())
    write(args.out, lines)


def write(out: str, lines: list[str]) -> None:
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text("\n".join(lines) + "\n")
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()

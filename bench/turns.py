"""KV-cache reuse across the turns of a conversation: chatkit against three raw mlx-lm strategies.

    .venv/bin/python bench/turns.py [--turns 20] [--reps 5] [--full-reps 3] [--free-replies]

Part 1, a 20-turn ChatML conversation ("bpe" tokenizer) on the ~29M benchmark model. Each turn a
~60-token user message and a 40-token reply (39 tokens + end of turn, max_tokens=40). Per turn:

(a) chatkit      ``session.stream_respond(message)`` until the first chunk (render, tokenize, plan,
                 prefill the suffix, first token);
(b) raw append   mlx-lm ``generate_step`` fed the suffix chatkit prefilled, over a copy of the
                 cache as it was before chatkit's turn (trimmed to what chatkit reused), to its first
                 token: the limit of prefix reuse;
(c) full         ``generate_step`` over a fresh cache fed the whole prompt;
(d) strict       a raw cache plus its own token list, reused only if the prompt strictly extends
                 the list, else rebuilt from scratch (run for real, its cache carried from turn to turn).

Each of (a), (b), (d) is timed ``--reps`` times per turn, (c) ``--full-reps`` times, on independent
copies of the caches (real copies, not copy-on-write views), interleaved, (a) and (b) back to back;
the table shows medians, and "pair" the median of the per-repetition ratios a/b. All four use the
same logits processor (below), so the first token costs the same work.

The replies are scripted: a logits processor forces the tokens of an English-like reply (the
model still runs every step). A trained model's replies re-tokenize to the ids it generated; the
random model's gibberish mostly does not (``--free-replies`` runs the model's own replies, EOS
suppressed, to show what that costs).

Part 2, thinking: the same kind of conversation with the "bpe-think" tokenizer (Qwen3's template,
which drops the <think> block of earlier assistant turns). Every reply is forced to start with a
real ``<think>\\n...\\n</think>\\n\\n`` block, then the model answers 20 tokens of its own, then
ends the turn. Reports how much of each prompt chatkit reused, against the strict rule; run twice,
from an empty conversation and after a ~2,000-token system prompt (``--think-context``): with little
context (the first run), no prefix cache can reuse 95% of a prompt: each turn re-renders the last reply.

Part 3, chatkit's own work per turn before prefilling, in long conversations: rendering the template
and tokenizing, at about 2k, 8k and 32k tokens of history (``--prompt-work-only`` runs just this part).
chatkit encodes only from the last special token the new rendering shares with the previous prompt;
"full encode" is the tokenizer encoding the whole prompt, as chatkit did before.

Writes bench/out/turns.png and docs/turns.png.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import shutil
import sys
import time
from pathlib import Path

from chatkit import ChatSession, GenerateParams
from chatkit.cache.planner import common_prefix_length

import mlx.core as mx
from _common import OtherLoad, add_quick, cache_state, clone, describe, load_model, median, quick, wait_until_quiet
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

ROOT = Path(__file__).resolve().parent.parent
USER_TOKENS = 60
REPLY_TOKENS = 39  # + the end-of-turn token = 40 = max_tokens
MAX_TOKENS = 40
THINK_ANSWER_TOKENS = 20

WORDS = """the a of to and in is it you that he was for on are with as his they be at one have this
from or had by hot word but what some we can out other were all there when up use your how said an
each she which do their time if will way about many then them write would like so these her long
make thing see him two has look more day could go come did number sound no most people my over know
water than call first who may down side been now find any new work part take get place made live
where after back little only round man year came show every good me give our under name very
through just form sentence great think say help low line differ turn cause much mean before move
right boy old too same tell does set three want air well also play small end put home read hand
port large spell add even land here must big high such follow act why ask men change went light
kind off need house picture try us again animal point mother world near build self earth father
castle dragon river mountain village story garden winter morning evening letter music window""".split()


# -- text and scripted replies -------------------------------------------------------------------
def sentence_text(rng: random.Random, tokenizer, n_tokens: int, end: str) -> str:
    """English-like words whose encoding is about ``n_tokens`` long (never more)."""
    words: list[str] = []
    text = ""
    while True:
        word = rng.choice(WORDS)
        candidate = " ".join([*words, word]).capitalize() + end
        if len(tokenizer.encode(candidate, add_special_tokens=False)) > n_tokens:
            return text
        words.append(word)
        text = candidate


class Scripted:
    """A logits processor: force ``forced`` token by token, then let the model pick ``free`` tokens
    (``banned`` ids suppressed), then force ``end`` for ever. Pure MLX ops: no synchronisation."""

    def __init__(self, vocab_size: int, forced, *, free: int = 0, banned=(), end: int) -> None:
        self.forced, self.free, self.end = list(forced), free, end
        self.ids = mx.arange(vocab_size)
        bias = mx.zeros((vocab_size,))
        if banned:
            bias[mx.array(sorted(banned))] = -1e9
        self.ban = bias
        self.i = 0

    def _force(self, logits, token: int):
        return mx.where(self.ids == token, logits, -1e9)

    def __call__(self, tokens, logits):
        i, self.i = self.i, self.i + 1
        if i < len(self.forced):
            return self._force(logits, self.forced[i])
        if i < len(self.forced) + self.free:
            return logits + self.ban
        return self._force(logits, self.end)


# -- caches --------------------------------------------------------------------------------------
def offset(layers) -> int:
    return layers[0].offset if layers else 0


def first_token_time(model, ids, cache, processor) -> float:
    """Seconds for generate_step over ``cache`` fed ``ids`` to give its first token."""
    gc.collect()
    t0 = time.perf_counter()
    steps = generate_step(
        mx.array(ids, dtype=mx.uint32), model, prompt_cache=cache, logits_processors=[processor]
    )
    next(steps)
    dt = time.perf_counter() - t0
    steps.close()
    return dt


def chatkit_first_chunk(session: ChatSession, message: str):
    gc.collect()
    t0 = time.perf_counter()
    stream = session.stream_respond(message)
    next(stream)
    return time.perf_counter() - t0, stream


# -- part 1 --------------------------------------------------------------------------------------
def conversation(args) -> list[dict]:
    lm = load_model("bpe")
    tok, model = lm.tokenizer, lm.model
    vocab = len(tok)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    all_eos = sorted(int(e) for e in tok.eos_token_ids)
    rng = random.Random(20)

    def processor(reply_ids):
        if reply_ids is None:  # free replies: the model's own tokens, EOS suppressed
            return Scripted(vocab, [], free=10**9, banned=all_eos, end=eos)
        return Scripted(vocab, reply_ids, end=eos)

    session = ChatSession.builder(lm).generate_params(GenerateParams(max_tokens=MAX_TOKENS)).build()
    strict_layers, strict_tokens = None, []
    rows = []

    # Warm-up (MLX kernels, the template): a throwaway session.
    warm = ChatSession.builder(lm).generate_params(GenerateParams(max_tokens=8)).build()
    for _ in range(2):
        warm.respond(sentence_text(rng, tok, USER_TOKENS, "?"))
        first_token_time(model, list(range(100, 400)), make_prompt_cache(model), processor([1, 2]))

    for turn in range(1, args.turns + 1):
        message = sentence_text(rng, tok, USER_TOKENS, "?")
        reply_ids = None if args.free_replies else tok.encode(
            sentence_text(rng, tok, REPLY_TOKENS, "."), add_special_tokens=False
        )

        def params():
            return GenerateParams(max_tokens=MAX_TOKENS, logits_processors=[processor(reply_ids)])

        # The turn for real (untimed) on a fork: it tells the prompt, the suffix and the reply.
        pre_layers = clone(cache_state(session).layers)
        probe = session.fork()
        probe.generate_params = params()
        with probe.stream_respond(message) as stream:
            for _ in stream:
                pass
        stats = probe.last_stats
        ledger = cache_state(probe).ledger.tokens
        prompt = list(ledger[: stats.prompt_tokens])
        reused, suffix = stats.reused_tokens, list(ledger[stats.reused_tokens : stats.prompt_tokens])
        reply = list(stream.tokens)
        if reply_ids is not None:
            assert reply == [*reply_ids, eos], "the scripted reply was not produced"
        assert len(suffix) == stats.prefilled_tokens

        strict_extends = 0 < len(strict_tokens) < len(prompt) and prompt[: len(strict_tokens)] == strict_tokens
        strict_reused = len(strict_tokens) if strict_extends else 0

        def run_a():
            fork = session.fork()
            cache_state(fork).layers = clone(pre_layers)
            fork.generate_params = params()
            dt, stream = chatkit_first_chunk(fork, message)
            stream.close()
            return dt

        def run_b():
            cache = clone(pre_layers) or make_prompt_cache(model)
            excess = offset(cache) - reused
            for c in cache:
                c.trim(excess)
            return first_token_time(model, suffix, cache, processor(reply_ids))

        def run_c():
            return first_token_time(model, prompt, make_prompt_cache(model), processor(reply_ids))

        def run_d(keep=False):
            nonlocal strict_layers, strict_tokens
            if strict_extends:
                cache, fed = clone(strict_layers), prompt[len(strict_tokens):]
            else:
                cache, fed = make_prompt_cache(model), prompt
            dt = first_token_time(model, fed, cache, processor(reply_ids))
            if keep:  # carry the rule's cache on: it now holds prompt + first token; add the rest
                assert offset(cache) == len(prompt) + 1
                model(mx.array(reply[1:], dtype=mx.uint32)[None], cache=cache)
                mx.eval([c.state for c in cache])
                strict_layers, strict_tokens = cache, prompt + reply
            return dt

        # (a) and (b) always run back to back (their ratio per repetition is then little affected by
        # the machine's slower and faster moments); the order alternates.
        times = {k: [] for k in "abcd"}
        for rep in range(args.reps):
            order = [("a", run_a), ("b", run_b), ("d", run_d)] if rep % 2 == 0 else [
                ("d", run_d), ("b", run_b), ("a", run_a)]
            if rep < args.full_reps:
                order.insert(1 + rep % 2, ("c", run_c))  # never between (a) and (b)
            for k, f in order:
                times[k].append(f())
        run_d(keep=True)  # untimed: the strict rule's cache for the next turn
        session = probe

        row = dict(
            turn=turn, prompt=len(prompt), prefilled=len(suffix), strict_prefilled=len(prompt) - strict_reused,
            pair=median([a / b for a, b in zip(times["a"], times["b"])]),
            **{k: median(v) * 1e3 for k, v in times.items()},
        )
        rows.append(row)
        print(format_row(row), flush=True)
    return rows, session


HEADER = (
    f"{'turn':>4} {'prompt':>6} {'prefilled':>9} {'strict':>6} | {'(a) chatkit':>11} {'(b) append':>10} "
    f"{'(c) full':>9} {'(d) strict':>10} | {'a/b':>5} {'pair':>5} {'c/a':>6}"
)


def format_row(r: dict) -> str:
    return (
        f"{r['turn']:>4} {r['prompt']:>6} {r['prefilled']:>9} {r['strict_prefilled']:>6} | {r['a']:>11.1f} "
        f"{r['b']:>10.1f} {r['c']:>9.1f} {r['d']:>10.1f} | {r['a'] / r['b']:>5.2f} {r['pair']:>5.2f} "
        f"{r['c'] / r['a']:>6.1f}"
    )


# -- part 2 --------------------------------------------------------------------------------------
def long_instructions(rng: random.Random, tokenizer, n_tokens: int) -> str:
    """A system prompt of about ``n_tokens`` tokens (an app's instructions, a pasted document)."""
    paragraphs = [sentence_text(rng, tokenizer, 100, ".") for _ in range(max(1, round(n_tokens / 100)))]
    return "\n\n".join(paragraphs)


def thinking(args, context_tokens: int = 0) -> list[dict]:
    """The thinking conversation; with ``context_tokens``, it starts after a system prompt that long."""
    lm = load_model("bpe-think")
    tok = lm.tokenizer
    vocab = len(tok)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    added = set(range(8192, vocab))  # specials and <think>, </think>, <tool_call> ...: not in answers
    rng = random.Random(21)
    builder = ChatSession.builder(lm)
    if context_tokens:
        builder = builder.instructions(long_instructions(random.Random(22), tok, context_tokens))
    session = builder.build()
    strict_tokens: list[int] = []
    prev_ledger: tuple[int, ...] = ()
    prev_prompt = 0
    rows = []
    for turn in range(1, args.turns + 1):
        message = sentence_text(rng, tok, USER_TOKENS, "?")
        think = "<think>\n" + sentence_text(rng, tok, 16, ".") + "\n</think>\n\n"
        forced = tok.encode(think, add_special_tokens=False)
        processor = Scripted(vocab, forced, free=THINK_ANSWER_TOKENS, banned=added, end=eos)
        session.generate_params = GenerateParams(max_tokens=len(forced) + THINK_ANSWER_TOKENS + 1,
                                                 logits_processors=[processor])
        with session.stream_respond(message) as stream:
            for _ in stream:
                pass
        # The answer holds no reasoning: the stream's reasoning field has the think block's text.
        assert stream.reasoning.strip() == think.removeprefix("<think>\n").removesuffix("\n</think>\n\n").strip()
        assert "<think>" not in stream.text and "</think>" not in stream.text
        assert stream.finish_reason == "stop" and len(stream.tokens) == len(forced) + THINK_ANSWER_TOKENS + 1
        stats = session.last_stats
        ledger = cache_state(session).ledger.tokens
        prompt = list(ledger[: stats.prompt_tokens])
        bound = min(common_prefix_length(prev_ledger, prompt), len(prompt) - 1)
        extends = len(strict_tokens) < len(prompt) and prompt[: len(strict_tokens)] == strict_tokens
        rows.append(dict(turn=turn, prompt=len(prompt), reused=stats.reused_tokens, prev_prompt=prev_prompt,
                         strict=len(strict_tokens) if extends else 0, bound=bound))
        prev_prompt = len(prompt)
        strict_tokens = prompt + list(stream.tokens)
        prev_ledger = ledger
    assert "<think>" not in session.render().split("<|im_start|>assistant")[1]  # earlier turns lost it
    return rows


def report_thinking(think_rows: list[dict], turns: int, label: str) -> list[dict]:
    print(f"{'turn':>4} {'prompt':>6} {'previous prompt':>15} {'chatkit reused':>14} {'bound':>6} {'strict reused':>13}")
    for r in think_rows:
        print(f"{r['turn']:>4} {r['prompt']:>6} {r['prev_prompt']:>15} {r['reused']:>14} {r['bound']:>6} "
              f"{r['strict']:>13}")
    later = think_rows[1:]

    def avg(key, of="prompt"):
        return 100 * sum(r[key] / r[of] for r in later) / len(later)

    ck, strict, bound = avg("reused"), avg("strict"), avg("bound")
    print(f"{label}: mean over turns 2..{turns} of reused / prompt tokens: chatkit {ck:.1f}%, strict rule "
          f"{strict:.1f}%; ceiling for any prefix cache (longest common prefix with the cache) {bound:.1f}%")
    print(f"{label}: mean over turns 2..{turns} of reused / previous turn's prompt: chatkit "
          f"{avg('reused', 'prev_prompt'):.1f}%, strict rule {avg('strict', 'prev_prompt'):.1f}%")
    print(f"chatkit reused {sum(r['reused'] for r in later)} of {sum(r['bound'] for r in later)} reusable tokens")
    print(f"target chatkit >= 95% of prompt tokens: {'met' if ck >= 95 else 'NOT met'} ({ck:.1f}%, ceiling "
          f"{bound:.1f}%); strict close to 0%: {'yes' if strict < 5 else 'no'}")
    return think_rows


# -- report --------------------------------------------------------------------------------------
def plot(rows: list[dict], think_rows: list[dict], think_long: list[dict] | None, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    turns = [r["turn"] for r in rows]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.6), gridspec_kw={"width_ratios": [3, 2]})
    styles = [
        ("c", "(c) full re-prefill", "tab:red", "s"),
        ("d", "(d) strict-extension rule", "tab:orange", "^"),
        ("a", "(a) chatkit", "tab:blue", "o"),
        ("b", "(b) raw append (limit)", "tab:green", "x"),
    ]
    for key, label, color, marker in styles:
        ax.plot(turns, [r[key] for r in rows], marker=marker, color=color, label=label, ms=5)
    ax.set_yscale("log")
    ax.set_xlabel("turn")
    ax.set_ylabel("time to first token (ms, log scale, median)")
    ax.set_title("ChatML conversation: TTFT per turn")
    ax.set_xticks(turns)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()

    tt = [r["turn"] for r in think_rows]
    ax2.plot(tt, [100 * r["reused"] / r["prompt"] for r in think_rows], marker="o", color="tab:blue",
             label="chatkit")
    ax2.plot(tt, [100 * r["bound"] / r["prompt"] for r in think_rows], ls="--", color="gray",
             label="longest common prefix (bound)")
    if think_long:
        ax2.plot([r["turn"] for r in think_long], [100 * r["reused"] / r["prompt"] for r in think_long],
                 marker="o", color="tab:purple", label="chatkit, after a long system prompt")
    ax2.plot(tt, [100 * r["strict"] / r["prompt"] for r in think_rows], marker="^", color="tab:orange",
             label="strict-extension rule")
    ax2.set_xlabel("turn")
    ax2.set_ylabel("prompt tokens reused (%)")
    ax2.set_title("Qwen3 thinking template: reuse per turn")
    ax2.set_ylim(-3, 103)
    ax2.set_xticks(tt[::2])
    ax2.grid(True, alpha=0.3)
    ax2.legend(loc="center right")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--turns", type=int, default=20)
    ap.add_argument("--reps", type=int, default=5, help="timings of (a), (b), (d) per turn")
    ap.add_argument("--full-reps", type=int, default=3, help="timings of (c) per turn")
    ap.add_argument("--free-replies", action="store_true", help="the model's own replies, not scripted ones")
    ap.add_argument("--think-context", type=int, default=2000,
                    help="also run the thinking conversation after a system prompt of this many tokens (0: skip)")
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--prompt-work-only", action="store_true", help="only part 3 (render + tokenize per turn)")
    add_quick(ap)
    args = ap.parse_args()
    if quick(args):  # no plot: docs/turns.png stays as it is
        args.turns, args.reps, args.full_reps, args.think_context, args.no_plot = 3, 1, 1, 300, True
    if args.prompt_work_only:
        prompt_work(**QUICK_WORK if args.quick else {})
        return
    if args.turns < 2:
        ap.error("--turns must be at least 2 (the figures are averaged over turns 2..N)")
    t_start = time.perf_counter()

    print(describe(load_model("bpe")))
    print(wait_until_quiet())
    load = OtherLoad()
    print(f"conversation: {args.turns} turns, ~{USER_TOKENS}-token user messages, "
          f"{'the model' if args.free_replies else 'scripted'} replies of {MAX_TOKENS} tokens (max_tokens="
          f"{MAX_TOKENS}); TTFT in ms = median of {args.reps} "
          f"interleaved runs per turn ({args.full_reps} for (c)); 'pair' = median of the per-run a/b ratios")
    print()
    print(HEADER)
    rows, last_session = conversation(args)

    last = rows[-1]
    print()
    for how, key in (("ratio of the medians", None), ("median of the per-repetition ratios", "pair")):
        ratios = [r[key] if key else r["a"] / r["b"] for r in rows]
        fails = [r["turn"] for r, x in zip(rows, ratios) if x > 1.1]
        worst = max(range(len(ratios)), key=ratios.__getitem__)
        print(f"chatkit / raw append TTFT ({how}): median {median(ratios):.3f}, max {ratios[worst]:.3f} "
              f"(turn {rows[worst]['turn']}); target <= 1.10 at every turn: "
              + ("met" if not fails else f"NOT met at turns {fails}"))
    speedup = last["c"] / last["a"]
    print(f"full re-prefill / chatkit at turn {last['turn']}: {speedup:.1f}x; target >= 10x: "
          f"{'met' if speedup >= 10 else 'NOT met'}")
    print(f"strict rule / chatkit at turn {last['turn']}: {last['d'] / last['a']:.2f}x; "
          f"prefilled per turn (turns 2..{last['turn']}): chatkit "
          f"{sum(r['prefilled'] for r in rows[1:]) / (len(rows) - 1):.1f}, strict "
          f"{sum(r['strict_prefilled'] for r in rows[1:]) / (len(rows) - 1):.1f}")

    print()
    print(f"thinking template (bpe-think, Qwen3): {args.turns} turns, ~{USER_TOKENS}-token messages, replies = "
          f"forced <think> block (~20 tokens) + {THINK_ANSWER_TOKENS} model tokens + end of turn")
    think_rows = report_thinking(thinking(args), args.turns, "from an empty conversation")
    think_long = None
    if args.think_context:
        print()
        print(f"the same, after a system prompt of ~{args.think_context} tokens (an app's instructions or a "
              f"document)")
        think_long = report_thinking(thinking(args, args.think_context), args.turns,
                                     f"after a ~{args.think_context}-token system prompt")

    print()
    print("chatkit's work per turn before prefilling, as the history grows (median of 9 turns each):")
    prompt_work(**QUICK_WORK if args.quick else {})

    print(load.report())
    if not args.no_plot:
        out = ROOT / "bench" / "out" / "turns.png"
        plot(rows, think_rows, think_long, out, describe_short())
        docs = ROOT / "docs" / "turns.png"
        docs.parent.mkdir(exist_ok=True)
        shutil.copyfile(out, docs)
        print(f"\nplot: {out.relative_to(ROOT)} (copied to {docs.relative_to(ROOT)})")
    print(f"total time {time.perf_counter() - t_start:.0f} s")


QUICK_WORK = dict(sizes=(1000,), turns=2)


def prompt_work(sizes=(2000, 8000, 32000), turns: int = 9) -> None:
    """Median per-turn render and encode times as the history grows (no model runs)."""
    from chatkit import ChatMessage
    from chatkit.session.turn import Prompting
    from chatkit.text.template import ChatTemplate

    lm = load_model("bpe")
    rng = random.Random(7)
    params = GenerateParams()
    print(f"{'history':>8} {'prompt':>7} {'render':>9} {'chatkit: render + encode':>25} "
          f"{'before: render + full encode':>29}")
    for size in sizes:
        prompting = Prompting(ChatTemplate(lm.tokenizer), "You are a helpful assistant.", None)
        history: list = []
        while len(prompting.ids(history, params, add_generation_prompt=False)) < size:
            history += [ChatMessage.user(sentence_text(rng, lm.tokenizer, USER_TOKENS, "?")),
                        ChatMessage.assistant(sentence_text(rng, lm.tokenizer, MAX_TOKENS, "."))]
        prompting.ids(history, params)  # the previous turn's prompt
        render, chatkit, before = [], [], []
        for _ in range(turns):
            message = ChatMessage.user(sentence_text(rng, lm.tokenizer, USER_TOKENS, "?"))
            t0 = time.perf_counter()
            text = prompting.text([*history, message], params)
            t1 = time.perf_counter()
            ids = prompting.ids([*history, message], params)  # what a turn does
            t2 = time.perf_counter()
            whole = lm.tokenizer.encode(text, add_special_tokens=False)
            t3 = time.perf_counter()
            assert ids == whole, "incremental encoding differs from a full encode"
            render.append(t1 - t0)
            chatkit.append(t2 - t1)
            before.append((t1 - t0) + (t3 - t2))
            history += [message, ChatMessage.assistant(sentence_text(rng, lm.tokenizer, MAX_TOKENS, "."))]
        print(f"{size:>8} {len(ids):>7} {median(render) * 1e3:>7.2f}ms {median(chatkit) * 1e3:>23.2f}ms "
              f"{median(before) * 1e3:>27.2f}ms")


def describe_short() -> str:
    from _common import MODEL_CONFIG, blas, cpu_model

    blas_name = " ".join(blas().split()[:2]) if blas().startswith("OpenBLAS") else "MLX's bundled BLAS"
    return (f"qwen3 {MODEL_CONFIG['hidden_size']} hidden x {MODEL_CONFIG['num_hidden_layers']} layers, float32, "
            f"random weights; mlx-cpu {mx.__version__}, {blas_name}; {cpu_model()}, {os.cpu_count()} cores")


if __name__ == "__main__":
    sys.exit(main())

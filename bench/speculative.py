"""Standard against speculative decoding: decode tokens/s, draft acceptance, identical output.

    .venv/bin/python bench/speculative.py [--rounds 3] [--floor-rounds 2] [--tokens 128] [--lengths 1,2,...,8] [--cases abcde] [--fresh]

Every case compares fixed draft lengths with the adaptive one (``num_draft_tokens="auto"``, row
"auto"), each against standard decoding.

The target is the benchmarks' ~29M-parameter Qwen3 model (hidden 512, 8 layers); the drafts are one
layer deep (hidden 512, intermediate 256, 4/2 heads: ~5M parameters, 4.2M of them the embedding
shared in shape with the target's), about one sixth of the target. Cases:

(a) agreeing draft: fresh copies of the target and of a draft whose blocks' output projections
    (attention ``o_proj`` and MLP ``down_proj`` of every layer) are zeroed, so each model's residual
    stream is the current token's embedding; the draft gets the target's embedding matrix and final
    norm, so both compute the same logits and the draft's proposals are (all but) always accepted.
    The models still do all their usual work: only the values are special. (Greedy decoding then
    repeats one token; the attention and matmul costs do not depend on which.)
(b) random draft: the unmodified target with a random draft (another seed): the overhead floor.
(c) the bundled demo pair (``chatkit.demo``: trained chat and draft models), when its files
    exist: the same forced-length runs on an in-world prompt, then a short scripted dialogue with
    natural ends (adaptive) for the acceptance where the models know what to say.
(d) prompt lookup, copying: the benchmark model made to copy a ~150-token paragraph of its prompt
    with one word changed (a logits processor forces the script's token at each step, on every path
    alike; the model still runs every step): ``SpeculativeConfig("prompt_lookup")``, no draft model.
(e) prompt lookup, text that does not repeat: the same, forced to write a paragraph that is not in
    the prompt (English, so a few word pairs recur by chance).

Every run: one fresh turn (``session.clear()``, then a fixed ~40-token prompt; ``--fresh``: on a new
session each time, whose draft-length policy starts from what the process learned of the pair), greedy, ``--tokens``
tokens (the EOS logits biased by -1e9 so no run ends early), timed per chunk. Decode tokens/s counts
the tokens after the first round over the time after it (a speculative round yields its accepted
tokens in a burst; for standard decoding the first round is the first token): (n - m) / (t_last -
t_m), m the chunks of the first round. Standard and speculative runs alternate (A/B, then B/A) after
a warm-up; medians of ``--rounds`` rounds (``--floor-rounds`` for the slow random draft). "speedup"
is the ratio of the medians, "paired" the median of the per-round ratios (the two runs of a round
are back to back, so it is the sturdier figure on a busy machine). Every speculative run's tokens
must equal the standard run's.
"""

from __future__ import annotations

import argparse
import functools
import gc
import sys
import time

import chatkit
from chatkit import ChatSession, GenerateParams, SpeculativeConfig
from chatkit.testing import tiny_model, tiny_model_path

import mlx.core as mx
from _common import MODEL_CONFIG, OtherLoad, add_quick, describe, median, n_params, quick, wait_until_quiet
from mlx.utils import tree_flatten, tree_unflatten

DRAFT_CONFIG = dict(
    hidden_size=512,
    num_hidden_layers=1,
    intermediate_size=256,
    num_attention_heads=4,
    num_key_value_heads=2,
)
PROMPT = "Tell me a long story about a dragon who guards a castle in the mountains, and the knight who comes to talk to it."


def zero_blocks(lm) -> None:
    """Zero every layer's attention output and MLP down projection (in place)."""
    zeros = [(k, mx.zeros_like(v)) for k, v in tree_flatten(lm.model.parameters())
             if k.endswith(("o_proj.weight", "down_proj.weight"))]
    assert len(zeros) == 2 * len(lm.model.layers), [k for k, _ in zeros]
    lm.model.update(tree_unflatten(zeros))
    mx.eval(lm.model.parameters())


def share_head(target, draft) -> None:
    """Give ``draft`` the target's (tied) embedding and final norm."""
    params = dict(tree_flatten(target.model.parameters()))
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    draft.model.update(tree_unflatten([(k, mx.array(params[k])) for k in names]))
    mx.eval(draft.model.parameters())


FRESH_SESSIONS = False  # --fresh: every run on a new session (its policy starts from the pair's shared record)


def run_turn(session: ChatSession, prompt: str = PROMPT) -> tuple[list[int], float, float, float]:
    """One fresh turn: (tokens, decode tokens/s after the first round, acceptance or nan, mean draft
    length). With ``--fresh``, on a new session of ``session``'s configuration."""
    if FRESH_SESSIONS:
        session = ChatSession(session.model, session.config)
    session.clear()
    gc.collect()
    times, tokens, round_end = [], [], None
    with session.stream_respond(prompt) as stream:
        for chunk in stream:
            times.append(time.perf_counter())
            tokens.append(chunk.token)
            if round_end is None and not chunk.from_draft:
                round_end = len(tokens) - 1
    stats = session.last_stats
    assert stats.finish_reason == "length" and len(tokens) == stats.generation_tokens, stats
    m = round_end + 1
    tps = (len(tokens) - m) / (times[-1] - times[round_end])
    acc = stats.draft_tokens_accepted / stats.draft_tokens_proposed if stats.draft_tokens_proposed else float("nan")
    return tokens, tps, acc, stats.draft_length


def bench_case(name, target, configs, params, rounds, prompt=PROMPT):
    """Rows (label, std tok/s, spec tok/s, speedup, paired, acceptance, identical, draft length) for
    one target and a list of (label, SpeculativeConfig)."""
    standard = ChatSession.builder(target).generate_params(params).build()
    specs = {label: ChatSession.builder(target).generate_params(params).speculative(config).build()
             for label, config in configs}
    run = functools.partial(run_turn, prompt=prompt)
    reference, *_ = run(standard)  # warm-up (the speculative sessions with fewer tokens)
    run(standard)
    for s in specs.values():
        s.generate_params = params.copy(max_tokens=24)
        run(s)
        s.generate_params = params
    rows = []
    for label, spec in specs.items():
        std_tps, spec_tps, accs, lengths, identical = [], [], [], [], True
        for r in range(rounds):
            order = [standard, spec] if r % 2 == 0 else [spec, standard]
            for s in order:
                tokens, tps, acc, length = run(s)
                if s is standard:
                    assert tokens == reference, "standard decoding is not deterministic"
                    std_tps.append(tps)
                else:
                    identical &= tokens == reference
                    spec_tps.append(tps)
                    accs.append(acc)
                    lengths.append(length)
        a, b = median(std_tps), median(spec_tps)
        paired = median([y / x for x, y in zip(std_tps, spec_tps)])  # the two runs of one round
        rows.append((label, a, b, b / a, paired, median(accs), identical, median(lengths)))
        print(f"  {name} {label}: standard {' '.join(f'{x:.1f}' for x in std_tps)} | "
              f"speculative {' '.join(f'{x:.1f}' for x in spec_tps)} tok/s; draft length "
              f"{' '.join(f'{x:.1f}' for x in lengths)}", flush=True)
    return rows, reference


def with_auto(draft, lengths):
    """(label, config) for fixed ``lengths`` and the adaptive length."""
    return [*((str(k), SpeculativeConfig(draft, num_draft_tokens=k)) for k in lengths),
            ("auto", SpeculativeConfig(draft))]


PARAGRAPH = (
    "The old lighthouse stood at the edge of the cliff, its white paint peeling in long strips after "
    "forty winters of salt and wind. Every evening the keeper climbed the narrow stairs, counted the "
    "steps out of habit, and lit the great lamp that swept its beam across the harbour. Fishermen "
    "coming home in the dark trusted that light more than their own charts, and children in the "
    "village believed the keeper could see every boat on the sea. When the council decided to "
    "replace the lamp with an automatic beacon, the whole town came to the meeting to argue."
)
CHANGED = PARAGRAPH.replace("forty winters", "fifty winters")
FRESH = (
    "Bread dough needs patience more than skill: mix flour, water, salt and a pinch of yeast, then "
    "leave it covered overnight in a cool kitchen. By morning bubbles show through the surface and "
    "the smell turns slightly sour. Fold it gently a few times, shape a round loaf, let it rise "
    "again for an hour, and bake it hot until the crust cracks when you tap it. Cooling matters "
    "too; cutting too early leaves the crumb gummy. Most beginners rush one of these steps, and "
    "their first loaves come out flat, dense or pale, which is exactly how everyone learns."
)
COPY_PROMPT = f"Repeat this paragraph with one word changed:\n\n{PARAGRAPH}"


def scripted(target, prompt, reply, tokens):
    """GenerateParams whose logits processor makes the reply ``reply``'s tokens (then EOS-free filler)."""
    tok = target.tokenizer
    probe = ChatSession.builder(target).generate_params(GenerateParams(max_tokens=1)).build()
    probe.respond(prompt)
    start = probe.last_stats.prompt_tokens  # the processor sees the whole conversation
    script = tok.encode(reply, add_special_tokens=False)[:tokens]
    assert len(script) >= tokens, f"the scripted reply has {len(script)} tokens, fewer than {tokens}"
    vocab = target.model.args.vocab_size
    force = mx.zeros((len(script), vocab))
    force[mx.arange(len(script)), mx.array(script)] = 1e4
    mx.eval(force)

    def processor(seen, logits):
        i = seen.shape[0] - start
        return logits + force[i] if 0 <= i < len(script) else logits

    eos = sorted(int(e) for e in tok.eos_token_ids)
    return GenerateParams(max_tokens=tokens, temperature=0.0, logit_bias={e: -1e9 for e in eos},
                          logits_processors=[processor]), script


DEMO_PROMPT = "My name is Ada and I live in Lyon. What is 7 + 5?"
DEMO_DIALOGUE = [
    "Hello!",
    "My name is Ada.",
    "What is 7 + 5?",
    "Spell apple.",
    "How many letters are in banana?",
    "I live in Lyon.",
    "What is my name?",
    "Where do I live?",
]


def load_demo_pair():
    """((chat, draft), "") when the demo pair's model files are installed, else (None, why not)."""
    from chatkit import demo

    for where in (demo.path(), demo.draft_path()):
        if not (where / "config.json").exists():
            return None, f"the demo model files are not installed ({where})"
    return (chatkit.load("demo"), chatkit.load("demo-draft")), ""


def demo_dialogue(chat, draft) -> None:
    """A scripted conversation, standard and speculative (adaptive) side by side: replies and acceptance."""
    params = GenerateParams(max_tokens=64, temperature=0.0)
    standard = ChatSession.builder(chat).generate_params(params).build()
    spec = ChatSession.builder(chat).generate_params(params).speculative(SpeculativeConfig(draft)).build()
    proposed = accepted = same = 0
    t_std = t_spec = 0.0
    for prompt in DEMO_DIALOGUE:
        t0 = time.perf_counter()
        a = standard.respond(prompt)
        t1 = time.perf_counter()
        b = spec.respond(prompt)
        t_std, t_spec = t_std + t1 - t0, t_spec + time.perf_counter() - t1
        proposed += spec.last_stats.draft_tokens_proposed
        accepted += spec.last_stats.draft_tokens_accepted
        same += a == b
        print(f"    {prompt!r} -> {b!r}{'' if a == b else f' (standard: {a!r})'}")
    rate = accepted / proposed if proposed else float("nan")
    mismatches = len(DEMO_DIALOGUE) - same
    print(f"    acceptance {accepted}/{proposed} = {rate:.1%}; identical replies {same}/{len(DEMO_DIALOGUE)}; "
          f"dialogue wall time standard {t_std:.2f} s, speculative {t_spec:.2f} s ({t_std / t_spec:.2f}x, "
          "prefill included, one run)")
    return mismatches


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--floor-rounds", type=int, default=2, help="rounds of the (slow) random-draft case")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--lengths", default="1,2,3,4,5,6,7,8", help="fixed draft lengths of the agreeing draft's table")
    ap.add_argument("--max-wait", type=float, default=300.0,
                    help="seconds to wait at most for other processes to leave the CPU idle")
    ap.add_argument("--cases", default="abcde", help="which cases to run, e.g. 'c' for the demo pair only")
    ap.add_argument("--fresh", action="store_true",
                    help="every run on a new session (a fresh session's policy, from the pair's shared record)")
    add_quick(ap)
    args = ap.parse_args()
    global FRESH_SESSIONS
    FRESH_SESSIONS = args.fresh
    model_config, draft_config = ({}, {}) if quick(args) else (MODEL_CONFIG, DRAFT_CONFIG)
    if args.quick:
        args.rounds, args.floor_rounds, args.tokens, args.lengths = 1, 1, 16, "1,4"

    target = tiny_model("qwen3", "bpe", 0, **model_config)
    random_draft = tiny_model("qwen3", "bpe", 1, **draft_config)
    # Fresh copies (tiny_model's instances are shared within the process): modified below.
    zeroed_target = chatkit.load(tiny_model_path("qwen3", "bpe", 0, **model_config))
    agreeing_draft = chatkit.load(tiny_model_path("qwen3", "bpe", 2, **draft_config))
    zero_blocks(zeroed_target)
    zero_blocks(agreeing_draft)
    share_head(zeroed_target, agreeing_draft)

    print(describe(target))
    print(f"load    : {wait_until_quiet(args.max_wait)}")
    other = OtherLoad()
    tp, dp = n_params(target), n_params(random_draft)
    print(f"draft   : qwen3 {dp / 1e6:.1f}M params float32 ({', '.join(f'{k}={v}' for k, v in DRAFT_CONFIG.items())}), "
          f"{tp / dp:.1f}x smaller than the target")
    eos = sorted(int(e) for e in target.tokenizer.eos_token_ids)
    params = GenerateParams(max_tokens=args.tokens, temperature=0.0, logit_bias={e: -1e9 for e in eos})
    probe = ChatSession.builder(target).generate_params(params.copy(max_tokens=1)).build()
    probe.respond(PROMPT)
    prompt_tokens = probe.last_stats.prompt_tokens
    print(f"decode  : greedy, {args.tokens} tokens per run (EOS {eos} biased -1e9), {prompt_tokens}-token "
          f"prompt, {args.rounds} rounds ({args.floor_rounds} with the random draft) standard/speculative "
          "alternating per configuration after a warm-up" + ("; a new session every run (--fresh)" if args.fresh else ""))
    print()

    lookup = [("4", SpeculativeConfig("prompt_lookup", 4)), ("8", SpeculativeConfig("prompt_lookup", 8)),
              ("auto", SpeculativeConfig("prompt_lookup"))]
    cases = [
        ("(a) agreeing draft (blocks zeroed, shared embedding)", "a", zeroed_target,
         with_auto(agreeing_draft, [int(k) for k in args.lengths.split(",")]), params, PROMPT, args.rounds),
        ("(b) random draft (seed 1)", "b", target, with_auto(random_draft, [1, 2, 4]), params, PROMPT,
         args.floor_rounds),
    ]
    if "d" in args.cases:
        copy_params, _ = scripted(target, COPY_PROMPT, CHANGED, args.tokens)
        cases.append(("(d) prompt lookup, copying a paragraph with one word changed", "d", target, lookup,
                      copy_params, COPY_PROMPT, args.rounds))
    if "e" in args.cases:
        fresh_params, _ = scripted(target, COPY_PROMPT, FRESH, args.tokens)
        cases.append(("(e) prompt lookup, a paragraph that is not in the prompt", "e", target, lookup,
                      fresh_params, COPY_PROMPT, args.rounds))
    cases = [case for case in cases if case[1] in args.cases]
    demo_pair, demo_note = load_demo_pair() if "c" in args.cases else (None, "not asked for (--cases)")
    if demo_pair is not None:
        chat, chat_draft = demo_pair
        demo_eos = sorted(int(e) for e in chat.tokenizer.eos_token_ids)
        demo_params = GenerateParams(max_tokens=args.tokens, temperature=0.0, logit_bias={e: -1e9 for e in demo_eos})
        print(f"demo    : chat {n_params(chat) / 1e6:.2f}M params, draft {n_params(chat_draft) / 1e6:.2f}M "
              f"params (chatkit.demo); prompt {DEMO_PROMPT!r}, EOS {demo_eos} biased -1e9")
        cases.insert(2, ("(c) bundled demo pair (chatkit.demo)", "c", chat, with_auto(chat_draft, [1, 2, 4]),
                         demo_params, DEMO_PROMPT, args.rounds))
    print()
    results = {}
    for title, short, t, configs, p, prompt, rounds in cases:
        print(f"{title}: per-round decode tok/s", flush=True)
        results[short] = (title, t.tokenizer, *bench_case(short, t, configs, p, rounds, prompt))
    print()
    if demo_pair is None:
        print(f"(c) bundled demo pair: {demo_note}: skipped")
    failed = 0
    if demo_pair is not None:
        print("(c) bundled demo pair, in its own world (natural ends, no bias), adaptive draft length:")
        failed += demo_dialogue(*demo_pair)
    print()
    if not results:
        print("FAIL  nothing was measured (see --cases and the lines above)")
        return 1

    for short, (title, tokenizer, rows, reference) in results.items():
        text = tokenizer.decode(reference[:12])
        print(f"{title}; reply starts {text!r}")
        print(f"{'num_draft':>9} {'tok/s standard':>15} {'tok/s speculative':>18} {'speedup':>8} "
              f"{'paired':>7} {'acceptance':>11} {'identical':>10} {'draft length':>13}")
        for label, a, b, speedup, paired, acc, identical, length in rows:
            print(f"{label:>9} {a:15.1f} {b:18.1f} {speedup:7.2f}x {paired:6.2f}x {acc:11.1%} "
                  f"{'yes' if identical else 'NO':>10} {length:13.1f}")
        fixed = [r for r in rows if r[0] != "auto"]
        best = max(fixed, key=lambda r: r[4])
        print(f"best fixed (paired): num_draft={best[0]}, {best[4]:.2f}x (ratio of medians {best[3]:.2f}x)")
        if not all(r[6] for r in rows):
            print("FAIL: speculative tokens differ from standard tokens")
            failed += 1
        print()

    def auto(short):
        return next(r for r in results[short][2] if r[0] == "auto")

    checks = [("speculative tokens == standard tokens (every run, every case)", "yes" if not failed else "no",
               not failed)]
    if "a" in results:
        rows_a = [r for r in results["a"][2] if r[0] != "auto"]
        best_a = max(rows_a, key=lambda r: r[4])
        min_acc = min(r[5] for r in rows_a)
        checks += [
            (f"agreeing draft, best fixed paired speedup (num_draft={best_a[0]}) >= 1.8x", f"{best_a[4]:.2f}x "
             f"(ratio of medians {best_a[3]:.2f}x)", best_a[4] >= 1.8),
            ("agreeing draft, acceptance ~100% (>= 99%) at every num_draft", f"min {min_acc:.1%}", min_acc >= 0.99),
            ("agreeing draft, adaptive within 10% of the best fixed length (paired)",
             f"{auto('a')[4]:.2f}x vs {best_a[4]:.2f}x", auto("a")[4] >= 0.9 * best_a[4]),
        ]
    if "b" in results:
        checks.append(("random draft, adaptive >= 0.95x standard (paired)", f"{auto('b')[4]:.2f}x",
                       auto("b")[4] >= 0.95))
    if "c" in results:
        checks.append(("demo pair, adaptive >= 0.97x standard (paired)", f"{auto('c')[4]:.2f}x",
                       auto("c")[4] >= 0.97))
    if "d" in results:
        checks.append(("prompt lookup, copying, adaptive >= 3x standard (paired)", f"{auto('d')[4]:.2f}x",
                       auto("d")[4] >= 3.0))
    if "e" in results:
        checks.append(("prompt lookup, text that does not repeat, adaptive >= 0.97x standard (paired)",
                       f"{auto('e')[4]:.2f}x", auto("e")[4] >= 0.97))
    for what, value, ok in checks:
        print(f"{'PASS' if ok else 'FAIL'}  {what}: {value}")
    print(other.report())
    if args.quick:  # checks that the script runs and the tokens agree, not the speed targets
        return 0 if checks[0][2] else 1
    return 0 if all(ok for _, _, ok in checks) else 1


if __name__ == "__main__":
    sys.exit(main())

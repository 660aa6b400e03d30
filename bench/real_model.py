"""The real small model: SmolLM2-135M-Instruct (GGUF, converted by chatkit), next to the synthetic benchmarks.

    .venv/bin/python bench/real_model.py [--turns 20] [--reps 3]

1. variants: the file's packed weights (Q4_1, embeddings Q8_0, as MLX reads them) against the same
   weights dequantized to float32: load time, prefill and decode speed through raw mlx-lm
   (``stream_generate``, greedy, a ~170-token prompt, 48 tokens). This is what ``dequantize=None``
   decides by on a machine without Metal.
2. turns: a 20-turn conversation (real questions, the model's own greedy replies, max 32 tokens).
   Per turn, time to the first token of (a) chatkit ``stream_respond`` (on a fork over a copy of the
   cache as it was before the turn), (b) raw append: mlx-lm ``generate_step`` fed only the suffix
   chatkit prefilled, over that cache trimmed to what chatkit reused, (c) full re-prefill of the prompt.
3. restore: after the conversation, ``save_cache`` then a new session from the file to its first
   token, against a fresh session with the same history (re-prefill).
4. overhead: decode speed of chatkit's stream against ``mlx_lm.stream_generate`` (64 tokens, EOS
   banned in both, same prompt), alternating, after a warm-up.
5. first reply from a new process: ``chatkit.load(name)`` and one reply, for the demo and smollm2
   (what the README's chat command would cost).
"""

from __future__ import annotations

import argparse
import gc
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import chatkit
from chatkit import ChatSession, GenerateParams

import mlx.core as mx
from _common import OtherLoad, add_quick, cache_state, clone, cpu_model, median, quick, wait_until_quiet
from mlx_lm.generate import generate_step, stream_generate
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_logits_processors

QUESTIONS = [
    "Hi! My name is Ada and I live in Lyon.", "What is the capital of France?", "Name three fruits.",
    "What is photosynthesis?", "Give me a short tip for sleeping better.", "What is 12 + 7?",
    "Which planet is the largest?", "Write one sentence about the sea.", "What is my name?",
    "How many days are in a week?", "What colour is the sky on a clear day?", "Who wrote Hamlet?",
    "Translate 'thank you' into Spanish.", "What is the boiling point of water?", "Name a mammal that flies.",
    "Where do I live?", "What is a noun?", "Suggest a name for a cat.", "What is the opposite of hot?",
    "Say goodbye in one sentence.",
]
LONG_PROMPT = " ".join(QUESTIONS)


def variants(reps: int) -> list[str]:
    lines = ["| weights | convert (first load) | load (cached) | prefill tok/s | decode tok/s |", "|---|---|---|---|---|"]
    from chatkit.model import gguf
    from chatkit.model import names as models

    path = models.smollm2_path()
    for dequantize in (False, True):
        with tempfile.TemporaryDirectory() as cache:
            t0 = time.perf_counter()
            folder = gguf.prepare(path, dequantize=dequantize, cache_dir=cache)
            convert = time.perf_counter() - t0
            t0 = time.perf_counter()
            lm = chatkit.load(folder)
            load = time.perf_counter() - t0
        ids = lm.tokenizer.apply_chat_template([{"role": "user", "content": LONG_PROMPT}], add_generation_prompt=True)
        ban = make_logits_processors(logit_bias={int(e): -1e9 for e in lm.tokenizer.eos_token_ids})
        prefill, decode = [], []
        for _ in range(reps + 1):
            for r in stream_generate(lm.model, lm.tokenizer, ids, max_tokens=48, logits_processors=ban):
                pass
            prefill.append(r.prompt_tps)
            decode.append(r.generation_tps)
        name = "float32 (dequantize=True)" if dequantize else "packed Q4_1/Q8_0 (dequantize=False)"
        lines.append(f"| {name} | {convert:.1f} s | {load:.2f} s | {median(prefill[1:]):.0f} | {median(decode[1:]):.1f} |")
        print(lines[-1], flush=True)
        del lm
        gc.collect()
    lines.append(f"(prompt {len(ids)} tokens, 48 generated, median of {reps} after a warm-up)")
    return lines


def first_token_time(model, ids, cache) -> float:
    gc.collect()
    t0 = time.perf_counter()
    steps = generate_step(mx.array(ids, dtype=mx.uint32), model, prompt_cache=cache)
    next(steps)
    dt = time.perf_counter() - t0
    steps.close()
    return dt


def chatkit_first_chunk(session, message) -> float:
    gc.collect()
    t0 = time.perf_counter()
    stream = session.stream_respond(message)
    next(stream)
    dt = time.perf_counter() - t0
    stream.close()
    return dt


def turns(lm, n_turns: int, reps: int):
    params = GenerateParams(max_tokens=32, temperature=0.0)
    session = ChatSession.builder(lm).generate_params(params).build()
    warm = ChatSession.builder(lm).generate_params(GenerateParams(max_tokens=4)).build()
    warm.respond("Hello.")
    rows = [f"{'turn':>4} {'prompt':>6} {'prefilled':>9} | {'(a) chatkit':>11} {'(b) append':>10} {'(c) full':>9} | {'a/b':>5} {'c/a':>6}"]
    print(rows[0], flush=True)
    totals = {"a": 0.0, "b": 0.0, "c": 0.0}
    for turn, message in enumerate(QUESTIONS[:n_turns], 1):
        pre = clone(cache_state(session).layers)
        probe = session.fork()
        with probe.stream_respond(message) as stream:
            for _ in stream:
                pass
        st = probe.last_stats
        prompt = list(cache_state(probe).ledger.tokens[: st.prompt_tokens])
        suffix = prompt[st.reused_tokens:]

        def run_a():
            fork = session.fork()
            cache_state(fork).layers = clone(pre)
            return chatkit_first_chunk(fork, message)

        def run_b():
            cache = clone(pre) or make_prompt_cache(lm.model)
            excess = (cache[0].offset if cache else 0) - st.reused_tokens
            for c in cache:
                c.trim(excess)
            return first_token_time(lm.model, suffix, cache)

        a, b = [], []
        for rep in range(reps):
            for k, f in ((("a", run_a), ("b", run_b)) if rep % 2 == 0 else (("b", run_b), ("a", run_a))):
                (a if k == "a" else b).append(f())
        c = first_token_time(lm.model, prompt, make_prompt_cache(lm.model))
        ma, mb = median(a), median(b)
        totals["a"] += ma
        totals["b"] += mb
        totals["c"] += c
        rows.append(f"{turn:>4} {len(prompt):>6} {len(suffix):>9} | {ma * 1e3:>11.0f} {mb * 1e3:>10.0f} {c * 1e3:>9.0f} | {ma / mb:>5.2f} {c / ma:>6.1f}")
        print(rows[-1], flush=True)
        session = probe
    rows.append(
        f"total over {n_turns} turns: chatkit {totals['a']:.1f} s, raw append {totals['b']:.1f} s, "
        f"re-prefill {totals['c']:.1f} s (chatkit/append {totals['a'] / totals['b']:.2f}, re-prefill/chatkit {totals['c'] / totals['a']:.1f})"
    )
    print(rows[-1], flush=True)
    return rows, session


def restore(lm, session, reps: int) -> list[str]:
    message = "Thank you for the chat."
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "chat.safetensors"
        size = session.save_cache(path)
        restored, fresh = [], []
        for rep in range(reps):
            gc.collect()
            t0 = time.perf_counter()
            s = ChatSession.builder(lm).cache(path).build()
            chatkit_first_chunk(s, message)
            restored.append(time.perf_counter() - t0)
            s = ChatSession.builder(lm).generate_params(session.generate_params).history(session.history).build()
            fresh.append(chatkit_first_chunk(s, message))
    tokens = session.cache_info().tokens
    return _shown([
        f"restore: {tokens} cached tokens, file {size / 2**20:.1f} MiB: first token after restore "
        f"{median(restored) * 1e3:.0f} ms vs re-prefill {median(fresh) * 1e3:.0f} ms "
        f"({median(fresh) / median(restored):.1f}x), median of {reps}"
    ])


def _shown(lines: list[str]) -> list[str]:
    print("\n".join(lines), flush=True)
    return lines


def overhead(lm, rounds: int, n: int = 64) -> list[str]:
    eos = sorted(int(e) for e in lm.tokenizer.eos_token_ids)
    bias = {e: -1e9 for e in eos}
    message = "Tell me a long story about a dragon."
    ids = lm.tokenizer.apply_chat_template([{"role": "user", "content": message}], add_generation_prompt=True)
    ck, raw = [], []

    def run_chatkit():
        s = ChatSession.builder(lm).generate_params(GenerateParams(max_tokens=n, temperature=0.0, logit_bias=bias)).build()
        with s.stream_respond(message) as stream:
            times = [time.perf_counter() for _ in stream]
        assert len(stream.tokens) == n
        return (n - 1) / (times[-1] - times[0])

    def run_raw():
        times = [time.perf_counter() for _ in stream_generate(
            lm.model, lm.tokenizer, ids, max_tokens=n, logits_processors=make_logits_processors(logit_bias=bias))]
        return (n - 1) / (times[-1] - times[0])

    run_chatkit(), run_raw()
    for i in range(rounds):
        pair = (run_chatkit, run_raw) if i % 2 == 0 else (run_raw, run_chatkit)
        for f in pair:
            (ck if f is run_chatkit else raw).append(f())
    ratios = [a / b for a, b in zip(ck, raw)]
    return _shown([
        f"overhead: decode chatkit {median(ck):.1f} tok/s, raw mlx-lm {median(raw):.1f} tok/s, "
        f"paired chatkit/raw {median(ratios):.3f} (median of {rounds} rounds, {n} tokens each)"
    ])


def cold_start() -> list[str]:
    code = (
        "import time; t0 = time.perf_counter(); import chatkit; lm = chatkit.load({name!r}); t1 = time.perf_counter(); "
        "s = chatkit.ChatSession.builder(lm).generate_params(chatkit.GenerateParams(max_tokens=48, temperature=0.0)).build(); "
        "r = s.respond({q!r}); t2 = time.perf_counter(); "
        "print(f'{{t1 - t0:.1f}}|{{t2 - t1:.1f}}|{{s.last_stats.generation_tps:.1f}}|{{r!r}}')"
    )
    lines = ["| model | import + load | first reply | decode tok/s | reply |", "|---|---|---|---|---|"]
    for name, q in (("demo", "What is 7 + 5?"), ("smollm2", "What is the capital of France?")):
        out = subprocess.run([sys.executable, "-c", code.format(name=name, q=q)], capture_output=True, text=True, check=True)
        load, reply, tps, text = out.stdout.strip().split("|", 3)
        lines.append(f"| {name} | {load} s | {reply} s | {tps} | {q!r} -> {text} |")
        print(lines[-1], flush=True)
    return lines


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--turns", type=int, default=20)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--parts", default="12345")
    ap.add_argument("--overhead-tokens", type=int, default=64)
    ap.add_argument("--max-wait", type=float, default=300, help="seconds to wait for an idle CPU")
    add_quick(ap)
    args = ap.parse_args()
    if quick(args):  # parts 2-4 on the bundled demo model (parts 1 and 5 need SmolLM2's file)
        args.parts, args.turns, args.reps, args.overhead_tokens = "234", 3, 1, 8
    quiet = wait_until_quiet(args.max_wait)
    load = OtherLoad()
    report = [f"machine: {cpu_model()}; mlx {mx.__version__}; {quiet}"]
    if "1" in args.parts:
        report += variants(args.reps)
    lm = chatkit.load("demo") if args.quick else chatkit.load("smollm2", dequantize=True)
    if "2" in args.parts or "3" in args.parts:
        rows, session = turns(lm, args.turns, args.reps)
        report += rows
        if "3" in args.parts:
            report += restore(lm, session, args.reps)
    if "4" in args.parts:
        report += overhead(lm, 2 * args.reps + 1, args.overhead_tokens)
    if "5" in args.parts:
        report += cold_start()
    report.append(load.report())
    print("\n".join(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())

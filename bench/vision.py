"""Images in a conversation (issue 34): turn 2+ time to first token against raw append, mlx-vlm's own
multi-turn path side by side, and streaming overhead against mlx-vlm's ``stream_generate``.

    .venv/bin/python bench/vision.py [--turns 6] [--reps 7] [--tokens 64] [--tiny] [--quick]

The model is a Qwen2-VL built offline by chatkit.testing (random weights, float32): the tests' tiny vision
tower (112x112 images = 16 image tokens, M-RoPE) under a ~27M-parameter language model (``VISION_CONFIG``:
Qwen2-shaped, 512 wide, 6 layers), so that a turn's prefill is a model's work and chatkit's fixed costs
show against it as they would against a real model's (``--tiny``: the tests' 64-wide model, all overhead).

Part 1, a conversation: turn 1 shows an image, every later turn is a ~30-token text message, replies are
``--reply`` tokens (EOS banned). For each later turn, ``--reps`` interleaved runs, (a) and (b) back to back,
each on real copies of the cache as it was before the turn; the table shows medians, and "pair" the median
of the per-run a/b ratios. (a) and (b) use the same logits processor.

(a) chatkit      ``session.stream_respond(message)`` on a fork, to its first chunk (render, expand the image's
                 placeholder from the session's table, plan, positions, prefill the suffix, first token);
(b) raw append   mlx-lm ``generate_step`` fed the suffix chatkit prefilled (its ids; the image is cached) over
                 the cache chatkit reused, M-RoPE positions given: the limit of reuse (target: a <= 1.1 b);
(c) mlx-vlm      ``stream_generate`` with its ``PromptCacheState`` and ``VisionFeatureCache`` (its own
                 multi-turn path), the whole conversation's prompt and the image each turn, to its first
                 result (one run per turn: its caches go on from turn to turn).

Part 2, streaming: one turn with the image, ``--tokens`` tokens (EOS banned), seconds per token after the
first, chatkit's stream against ``mlx_vlm.stream_generate`` (target: <= 1.02x), medians over ``--reps``.
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import sys
import time

from chatkit import ChatMessage, ChatSession, GenerateParams
from chatkit.images import as_image
from chatkit.testing.vision import tiny_vision_model
from chatkit.text.images import locate

import mlx.core as mx
import numpy as np
from _common import OtherLoad, blas, cache_state, clone, cpu_model, median, wait_until_quiet
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step

# The language model of the benchmark's Qwen2-VL: ~27M float32 parameters (8.4M of them its untied
# embedding and output head); the vision tower is the tests' (2 blocks, 32 wide).
VISION_CONFIG = dict(hidden_size=512, num_hidden_layers=6, intermediate_size=1536, num_attention_heads=8,
                     num_key_value_heads=4)

WORDS = ("the picture shows a small house near a river with trees and a blue sky over the hills in the "
         "morning light while two people walk along the path").split()


def message(turn: int) -> str:
    rng = np.random.default_rng(turn)
    return " ".join(rng.choice(WORDS, 24)) + "?"


def ban(ids):
    banned = mx.array(sorted(ids))

    def processor(tokens, logits):
        logits[..., banned] = -1e9
        return logits
    return processor


def describe(lm, tiny: bool) -> str:
    params = sum(p.size for _, p in tree_flatten(lm.vision.vlm.parameters()))
    cfg = lm.config
    shape = ", ".join(f"{k}={cfg[k]}" for k in (*VISION_CONFIG, "vocab_size"))
    return "\n".join([
        f"machine : {cpu_model()}, {os.cpu_count()} cores, {platform.system()} {platform.machine()}",
        f"BLAS    : {blas()}",
        f"model   : {cfg['model_type']} {params / 1e6:.1f}M params float32 ({shape}), random weights from "
        f"chatkit.testing.vision{' (the tests tiny model)' if tiny else ''}",
    ])


def first_chunk_seconds(session, text, **options) -> float:
    """Seconds to the first chunk of a turn (the turn then runs to its end, untimed)."""
    gc.collect()
    start = time.perf_counter()
    with session.stream_respond(text, **options) as stream:
        next(stream)
        first = time.perf_counter() - start
        for _ in stream:
            pass
    return first


def chatkit_seconds(session, pre, text, processor) -> float:
    """(a): a fork over real copies of the cache before the turn, to its first chunk."""
    fork = session.fork()
    cache_state(fork).layers = clone(pre)
    fork.generate_params = fork.generate_params.copy(logits_processors=[processor])
    gc.collect()
    start = time.perf_counter()
    stream = fork.stream_respond(text)
    next(stream)
    elapsed = time.perf_counter() - start
    stream.close()
    return elapsed


def raw_append_seconds(session, pre, text, processor) -> float:
    """(b): generate_step over real copies of the cache chatkit reused, fed the suffix chatkit prefilled."""
    messages = [*session.history, ChatMessage.user(text)]
    prompting, table = session._turns.prompting(), session._state.images
    prompt = prompting.ids(messages, session.generate_params)
    spans = locate(prompt, prompting.images(messages), table.placeholder, table.ids, table.layout)
    keep = cache_state(session).preview(prompt, spans)
    vision = table.inputs(prompt, spans, keep)
    embeddings, model = vision.embeddings, vision.model
    if all(s.end <= keep for s in spans):
        embeddings = None  # text only: the model embeds the ids itself, as raw mlx-lm does
    layers = clone(pre)
    for c in layers:
        c.trim(c.offset - keep)
    mx.eval([c.state for c in layers], embeddings if embeddings is not None else [])
    gc.collect()
    start = time.perf_counter()
    steps = generate_step(mx.array(prompt[keep:], dtype=mx.uint32), model, prompt_cache=layers,
                          input_embeddings=embeddings, logits_processors=[processor], max_tokens=1)
    next(steps)
    elapsed = time.perf_counter() - start
    steps.close()
    return elapsed


def mlx_vlm_turns(lm, image, turns: int, reply: int, banned) -> list[float]:
    """mlx-vlm's own multi-turn path: the whole conversation's prompt each turn, its caches carried along."""
    from mlx_vlm.generate import stream_generate
    from mlx_vlm.generate.common import PromptCacheState
    from mlx_vlm.vision_cache import VisionFeatureCache

    state, vision = PromptCacheState(), VisionFeatureCache()
    history, times = [], []
    tokenizer = lm.vision.processor.tokenizer
    for t in range(turns):
        history.append({"role": "user", "content": message(t)} if t else
                       {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": message(t)}]})
        prompt = tokenizer.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
        gc.collect()
        start, first, text = time.perf_counter(), None, ""
        for result in stream_generate(lm.vision.vlm, lm.vision.processor, prompt, image=[image.pixels],
                                      prompt_cache_state=state, vision_cache=vision, max_tokens=reply,
                                      temperature=0.0, logits_processors=[ban(banned)]):
            first = first or time.perf_counter() - start
            text += result.text
        times.append(first or 0.0)
        history.append({"role": "assistant", "content": text})
    return times


def conversation(args, lm, image, banned) -> list[dict]:
    params = GenerateParams(max_tokens=args.reply, temperature=0.0, logits_processors=[ban(banned)])
    session = ChatSession.builder(lm).generate_params(params).build()
    first_chunk_seconds(session, message(0), images=[image])
    rows = []
    for t in range(1, args.turns):
        pre = clone(cache_state(session).layers)
        a, b = [], []
        for rep in range(args.reps):  # (a) and (b) back to back, the order alternating
            runs = [(a, chatkit_seconds), (b, raw_append_seconds)]
            for times, run in runs if rep % 2 == 0 else runs[::-1]:
                times.append(run(session, pre, message(t), ban(banned)))
        first_chunk_seconds(session, message(t))  # the conversation goes on
        stats = session.last_stats
        rows.append(dict(turn=t + 1, reused=stats.reused_tokens, fed=stats.prefilled_tokens, a=median(a) * 1e3,
                         b=median(b) * 1e3, pair=median([x / y for x, y in zip(a, b)])))
    theirs = mlx_vlm_turns(lm, image, args.turns, args.reply, banned)
    print(f"{'turn':>4} {'reused':>7} {'fed':>5} {'(a) chatkit':>11} {'(b) raw':>8} {'a/b':>5} {'pair':>5} "
          f"{'(c) mlx-vlm':>11}")
    for row, vlm_s in zip(rows, theirs[1:]):
        row["c"] = vlm_s * 1e3
        print(f"{row['turn']:>4} {row['reused']:>7} {row['fed']:>5} {row['a']:>11.2f} {row['b']:>8.2f} "
              f"{row['a'] / row['b']:>5.2f} {row['pair']:>5.2f} {row['c']:>11.2f}")
    pairs = [r["pair"] for r in rows]
    print(f"chatkit / raw append TTFT, turns 2-{args.turns} (median of per-run ratios): median {median(pairs):.3f}, "
          f"max {max(pairs):.3f}; target <= 1.10: {'met' if max(pairs) <= 1.1 else 'NOT met'}")
    return rows


def streaming(args, lm, image, banned) -> None:
    from mlx_vlm.generate import stream_generate

    params = GenerateParams(max_tokens=args.tokens, temperature=0.0, logits_processors=[ban(banned)])
    text = ChatSession.builder(lm).build().render(ChatMessage.user(message(0), images=[image]))
    ours, theirs = [], []
    for _ in range(args.reps):
        session = ChatSession.builder(lm).generate_params(params.copy()).build()
        stamps = []
        with session.stream_respond(message(0), images=[image]) as stream:
            for _ in stream:
                stamps.append(time.perf_counter())
        ours.append((stamps[-1] - stamps[0]) / max(1, session.last_stats.generation_tokens - 1))
        stamps = []
        for _ in stream_generate(lm.vision.vlm, lm.vision.processor, text, image=[image.pixels],
                                 max_tokens=args.tokens, temperature=0.0, logits_processors=[ban(banned)]):
            stamps.append(time.perf_counter())
        theirs.append((stamps[-1] - stamps[0]) / max(1, len(stamps) - 1))
    a, b = median(ours), median(theirs)
    print(f"streaming: chatkit {a * 1e3:.3f} ms/token, mlx-vlm stream_generate {b * 1e3:.3f} ms/token, "
          f"ratio {a / b:.3f} (target <= 1.02: {'met' if a / b <= 1.02 else 'NOT met'})")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--reply", type=int, default=24, help="reply tokens per turn")
    p.add_argument("--tokens", type=int, default=64, help="tokens of the streaming run")
    p.add_argument("--tiny", action="store_true", help="the tests' tiny model (64 wide): overheads only")
    p.add_argument("--quick", action="store_true", help="3 turns, 2 reps, 16 tokens: proves it runs")
    p.add_argument("--no-wait", action="store_true", help="start at once, however busy the machine is")
    args = p.parse_args(argv)
    if args.quick:
        args.turns, args.reps, args.tokens, args.reply = 3, 2, 16, 8
    lm = tiny_vision_model("qwen2_vl") if args.tiny else tiny_vision_model("qwen2_vl", **VISION_CONFIG)
    image = as_image(np.random.default_rng(0).integers(0, 255, (112, 112, 3), dtype=np.uint8))
    banned = set(lm.tokenizer.eos_token_ids)
    print(describe(lm, args.tiny))
    print("(not waiting for a quiet machine)" if args.quick or args.no_wait else wait_until_quiet())
    load = OtherLoad()
    warm = ChatSession.builder(lm).generate_params(GenerateParams(max_tokens=4)).build()  # MLX kernels, template
    warm.respond(message(9), images=[image])
    warm.respond(message(10))
    print(f"python {platform.python_version()}; a {args.turns}-turn conversation, replies of {args.reply} tokens; "
          f"TTFT in ms, medians of {args.reps} runs")
    conversation(args, lm, image, banned)
    streaming(args, lm, image, banned)
    print(load.report())
    return 0


if __name__ == "__main__":
    sys.exit(main())

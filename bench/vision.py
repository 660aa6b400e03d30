"""Images in a conversation (issue 34): turn 2+ time to first token against raw append, mlx-vlm's own
multi-turn path side by side, and streaming overhead against mlx-vlm's ``stream_generate``.

    .venv/bin/python bench/vision.py [--turns 6] [--reps 5] [--tokens 64] [--quick]

The model is chatkit.testing's tiny random-weight Qwen2-VL (M-RoPE, 112x112 images = 16 image tokens), so
the numbers show overheads (chatkit's work per turn around mlx), not a real model's costs.

Part 1, a conversation: turn 1 shows an image, every later turn is a ~30-token text message, replies are
``--reply`` tokens (EOS banned). For each later turn, medians over ``--reps`` independent copies of the state:

(a) chatkit      ``session.stream_respond(message)`` to its first chunk (render, expand the image's
                 placeholder from the session's table, plan, prefill the suffix, first token);
(b) raw append   mlx-lm ``generate_step`` fed the same suffix's embeddings over a copy of the cache chatkit
                 reused (M-RoPE positions given), to its first token: the limit of reuse (target: a <= 1.1 b);
(c) mlx-vlm      ``stream_generate`` with its ``PromptCacheState`` and ``VisionFeatureCache`` (its own
                 multi-turn path), the whole conversation's prompt and the image each turn, to its first result.

Part 2, streaming: one turn with the image, ``--tokens`` tokens (EOS banned), seconds per token after the
first, chatkit's stream against ``mlx_vlm.stream_generate`` (target: <= 1.02x), medians over ``--reps``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import chatkit  # noqa: F401  (loads OpenBLAS before mlx)
from chatkit import ChatMessage, ChatSession, GenerateParams
from chatkit.cache._mlx import copy_layer
from chatkit.images import as_image
from chatkit.testing.vision import tiny_vision_model
from chatkit.text.images import locate

import mlx.core as mx
import numpy as np
from mlx_lm.generate import generate_step

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


def first_chunk_seconds(session, text, **options) -> float:
    start = time.perf_counter()
    with session.stream_respond(text, **options) as stream:
        first = None
        for _ in stream:
            if first is None:
                first = time.perf_counter() - start
    return first if first is not None else time.perf_counter() - start


def raw_append_seconds(session, before, text) -> float:
    """generate_step over a copy of the cache chatkit reused, fed the suffix chatkit prefilled."""
    messages = [*session.history, ChatMessage.user(text)]
    prompting, table = session._prompting(), session._images
    prompt = prompting.ids(messages, session.generate_params)
    spans = locate(prompt, prompting.images(messages), table.placeholder, table.ids, table.layout)
    keep = before.preview(prompt, spans)
    embeddings, model = table.inputs(prompt, spans, keep)
    layers = [copy_layer(c) for c in before.layers]
    for c in layers:
        c.trim(c.offset - keep)
    mx.eval(embeddings, [c.state for c in layers])
    start = time.perf_counter()
    steps = generate_step(mx.array(prompt[keep:], dtype=mx.uint32), model, prompt_cache=layers,
                          input_embeddings=embeddings, max_tokens=1)
    next(steps)
    return time.perf_counter() - start


def mlx_vlm_turns(lm, image, turns: int, reply: int, banned) -> list[float]:
    """mlx-vlm's own multi-turn path: the whole conversation's prompt each turn, its caches carried along."""
    from mlx_vlm.generate import stream_generate
    from mlx_vlm.generate.common import PromptCacheState
    from mlx_vlm.vision_cache import VisionFeatureCache

    state, vision = PromptCacheState(), VisionFeatureCache()
    history, times = [], []
    template = ChatSession.builder(lm).build()
    for t in range(turns):
        history.append({"role": "user", "content": message(t)} if t else
                       {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": message(t)}]})
        prompt = template._template.tokenizer.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
        start, first, text = time.perf_counter(), None, ""
        for result in stream_generate(lm.vision.vlm, lm.vision.processor, prompt, image=[image.pixels],
                                      prompt_cache_state=state, vision_cache=vision, max_tokens=reply,
                                      temperature=0.0, logits_processors=[ban(banned)]):
            first = first or time.perf_counter() - start
            text += result.text
        times.append(first or 0.0)
        history.append({"role": "assistant", "content": text})
    return times


def conversation(args, lm, image, banned) -> None:
    params = GenerateParams(max_tokens=args.reply, temperature=0.0, logits_processors=[ban(banned)])
    session = ChatSession.builder(lm).generate_params(params).build()
    first_chunk_seconds(session, message(0), images=[image])
    rows = []
    for t in range(1, args.turns):
        before = session._conversation.cache.copy()
        ours, raw = [], []
        for _ in range(args.reps):
            probe = session.fork()
            ours.append(first_chunk_seconds(probe, message(t)))
            raw.append(raw_append_seconds(session, before, message(t)))
        first_chunk_seconds(session, message(t))  # the conversation goes on
        stats = session.last_stats
        rows.append((t + 1, stats.reused_tokens, stats.prefilled_tokens, statistics.median(ours), statistics.median(raw)))
    theirs = mlx_vlm_turns(lm, image, args.turns, args.reply, banned)
    print(f"{'turn':>4} {'reused':>7} {'fed':>5} {'chatkit ms':>11} {'raw ms':>8} {'ratio':>6} {'mlx-vlm ms':>11}")
    for (turn, reused, fed, ours_s, raw_s), vlm_s in zip(rows, theirs[1:]):
        print(f"{turn:>4} {reused:>7} {fed:>5} {ours_s * 1e3:>11.2f} {raw_s * 1e3:>8.2f} {ours_s / raw_s:>6.2f} "
              f"{vlm_s * 1e3:>11.2f}")


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
    a, b = statistics.median(ours), statistics.median(theirs)
    print(f"streaming: chatkit {a * 1e3:.3f} ms/token, mlx-vlm stream_generate {b * 1e3:.3f} ms/token, ratio {a / b:.3f}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--reply", type=int, default=24, help="reply tokens per turn")
    p.add_argument("--tokens", type=int, default=64, help="tokens of the streaming run")
    p.add_argument("--quick", action="store_true", help="3 turns, 2 reps, 16 tokens: proves it runs")
    args = p.parse_args(argv)
    if args.quick:
        args.turns, args.reps, args.tokens, args.reply = 3, 2, 16, 8
    lm = tiny_vision_model("qwen2_vl")
    image = as_image(np.random.default_rng(0).integers(0, 255, (112, 112, 3), dtype=np.uint8))
    banned = set(lm.tokenizer.eos_token_ids)
    conversation(args, lm, image, banned)
    streaming(args, lm, image, banned)
    return 0


if __name__ == "__main__":
    sys.exit(main())

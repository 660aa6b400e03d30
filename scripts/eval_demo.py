"""Evaluate chatkit's demo pair on held-out dialogues, played turn by turn through ``ChatSession``.

The dialogues come from ``train_demo.make_dialogue`` with a seed training never used. Each user
message goes to a real session (greedy); the session keeps the model's own replies in its history,
as in a real chat. Printed: exact-reply accuracy per task, recall of facts told 3+ turns earlier, the
draft's acceptance rate under speculative decoding (4 draft tokens) and whether speculative output
equals standard output, and recall across ``save_cache`` / ``.cache(path)``.

    python scripts/eval_demo.py                    # the shipped pair, 200 dialogues
    python scripts/eval_demo.py --models /tmp/chatkit-demo-quick --dialogues 50
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import chatkit  # noqa: E402  (loads OpenBLAS before MLX)
from chatkit import ChatSession, ContextWindowExceededError, GenerateParams, SpeculativeConfig  # noqa: E402

import train_demo  # noqa: E402  (the dialogue generator)

GREEDY = GenerateParams(max_tokens=48, temperature=0.0)
EVAL_STREAM = 7919  # the generator stream of held-out dialogues: training uses streams 1-4 only


def heldout(seed: int, n: int) -> list[train_demo.Dialogue]:
    rng = np.random.default_rng([seed, EVAL_STREAM])
    return [train_demo.make_dialogue(rng) for _ in range(n)]


def session(lm, system: str | None, draft=None, num_draft: int = 4) -> ChatSession:
    builder = ChatSession.builder(lm).generate_params(GREEDY)
    if system:
        builder = builder.instructions(system)
    if draft is not None:
        builder = builder.speculative(SpeculativeConfig(draft, num_draft_tokens=num_draft))
    return builder.build()


def task_key(turn: train_demo.Turn) -> str:
    if turn.task == "recall":
        return "recall (told 3+ turns earlier)" if turn.distance >= 3 else "recall (told 1-2 turns earlier)"
    return turn.task


def play(lm, draft, dialogues, num_draft: int, show: int) -> dict:
    hits: dict[str, list[bool]] = defaultdict(list)
    proposed = accepted = same = compared = turns = 0
    gen_tokens = {"standard": 0, "speculative": 0}
    gen_time = {"standard": 0.0, "speculative": 0.0}
    shown = full = 0
    for d in dialogues:
        plain = session(lm, d.system)
        spec = session(lm, d.system, draft, num_draft) if draft is not None else None
        for k, turn in enumerate(d.turns):
            t = time.perf_counter()
            try:
                reply = plain.respond(turn.user)
            except ContextWindowExceededError:  # long-winded replies filled the window: the rest are misses
                full += 1
                for rest in d.turns[k:]:
                    hits[task_key(rest)].append(False)
                turns += len(d.turns) - k
                break
            gen_time["standard"] += time.perf_counter() - t
            gen_tokens["standard"] += plain.last_stats.generation_tokens
            ok = reply == turn.reply
            hits[task_key(turn)].append(ok)
            turns += 1
            if not ok and shown < show:
                shown += 1
                print(f"  miss [{task_key(turn)}] {turn.user!r}: got {reply!r}, expected {turn.reply!r}")
            if spec is not None:
                t = time.perf_counter()
                spec_reply = spec.respond(turn.user)
                gen_time["speculative"] += time.perf_counter() - t
                gen_tokens["speculative"] += spec.last_stats.generation_tokens
                same += spec_reply == reply
                compared += 1
                proposed += spec.last_stats.draft_tokens_proposed
                accepted += spec.last_stats.draft_tokens_accepted
    return dict(hits=hits, turns=turns, same=same, proposed=proposed, accepted=accepted,
                gen_tokens=gen_tokens, gen_time=gen_time, full=full, compared=compared)


def draft_alone(draft, dialogues) -> float:
    """The draft's own exact-reply accuracy (for information)."""
    ok = n = 0
    for d in dialogues:
        s = session(draft, d.system)
        for turn in d.turns:
            try:
                ok += s.respond(turn.user) == turn.reply
            except ContextWindowExceededError:
                n += 1
                break
            n += 1
    return ok / max(n, 1)


def save_restore(lm, seed: int, n: int) -> tuple[int, int]:
    """Tell a fact, chat three more turns, save the cache, restore it into a new session, ask."""
    rng = np.random.default_rng([seed, EVAL_STREAM + 1])
    ok = 0
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(n):
            kind = str(rng.choice(["name", "city", "colour", "pet", "age"]))
            fv = train_demo.fact_value(rng, kind)
            first = session(lm, None)
            tell = str(rng.choice(train_demo.TELL[kind])).format(**fv)
            chat = [make(rng).user for make in (train_demo.arithmetic, train_demo.spelling, train_demo.counting)]
            ask = str(rng.choice(train_demo.ASK[kind])).format(**fv)
            path = Path(tmp) / f"conversation-{i}.safetensors"
            try:
                for message in (tell, *chat):
                    first.respond(message)
                first.save_cache(path)
                restored = ChatSession.builder(lm).cache(path).build()
                reply = restored.respond(ask)
            except ContextWindowExceededError:
                continue  # long-winded replies filled the window: a miss
            info = restored.last_stats
            expected = train_demo.ASK_REPLY[kind].format(**fv)
            ok += reply == expected
            if i == 0:
                print(f"  example: restored {len(restored.history) // 2 - 1} earlier turns, reused "
                      f"{info.reused_tokens}/{info.prompt_tokens} prompt tokens from the file; "
                      f"{reply!r} (expected {expected!r})")
    return ok, n


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", type=Path, default=None, help="a folder with chat/ and draft/ (default: the shipped pair)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--dialogues", type=int, default=200)
    p.add_argument("--num-draft", type=int, default=4)
    p.add_argument("--no-speculative", action="store_true")
    p.add_argument("--restores", type=int, default=50)
    p.add_argument("--show-misses", type=int, default=10)
    args = p.parse_args(argv)

    if args.models is None:
        lm, draft = chatkit.load("demo"), chatkit.load("demo-draft")
    else:
        lm, draft = chatkit.load(str(args.models / "chat")), chatkit.load(str(args.models / "draft"))
    if args.no_speculative:
        draft = None
    dialogues = heldout(args.seed, args.dialogues)
    print(f"{len(dialogues)} held-out dialogues, {sum(len(d.turns) for d in dialogues)} turns (seed {args.seed})")
    t0 = time.perf_counter()
    r = play(lm, draft, dialogues, args.num_draft, args.show_misses)
    hits = r["hits"]
    print("\nexact replies per task:")
    for key in sorted(hits):
        print(f"  {key:34s} {np.mean(hits[key]):7.1%}  ({sum(hits[key])}/{len(hits[key])})")
    answers = [ok for key in hits for ok in hits[key]]
    print(f"  {'all replies':34s} {np.mean(answers):7.1%}  ({sum(answers)}/{len(answers)})  target >= 90%")
    recall = hits.get("recall (told 3+ turns earlier)", [])
    rate = f"{np.mean(recall):7.1%}" if recall else "    n/a"
    print(f"  {'recall of facts told 3+ turns ago':34s} {rate}  target >= 95%")
    if r["full"]:
        print(f"  the context window filled up in {r['full']} dialogues (their remaining turns count as misses)")
    gt, gs = r["gen_tokens"], r["gen_time"]
    if draft is not None:
        rate = r["accepted"] / max(r["proposed"], 1)
        print(f"\nspeculative decoding ({args.num_draft} draft tokens):")
        print(f"  draft acceptance {rate:.1%} ({r['accepted']}/{r['proposed']})  target >= 70%")
        print(f"  speculative greedy == standard greedy: {r['same']}/{r['compared']} replies")
        print(f"  turn time (prefill + decode): standard {gt['standard'] / gs['standard']:.0f} tok/s, "
              f"speculative {gt['speculative'] / gs['speculative']:.0f} tok/s")
        print(f"  draft alone, exact replies: {draft_alone(draft, dialogues[:50]):.1%} (first 50 dialogues)")
    if args.restores:
        print("\nrecall across save_cache / ChatSession.builder(lm).cache(path):")
        ok, n = save_restore(lm, args.seed, args.restores)
        print(f"  {ok}/{n} facts recalled after restore ({ok / n:.0%})")
    print(f"\n({(time.perf_counter() - t0) / 60:.1f} min)")


if __name__ == "__main__":
    main()

"""Evaluate a demo pair on held-out dialogues, played turn by turn through ``ChatSession``.

The dialogues come from ``train_demo.make_dialogue`` in the held-out world (``train_demo.HELDOUT``:
names, cities, colours, pets and phrasings from lists training never sees, plus made-up names) with a
seed training never used. Each user message goes to a real session (greedy) with the demo's
``calculate`` tool when the dialogue has tools (the tool loop runs it), and ``output=`` for the JSON
form questions; the session keeps the model's own replies in its history, as in a real chat.
Printed: per task the share of exact replies (over the turns that fit the model's context window; the
turns after it filled up are counted apart, and as misses in another column), recall of stated
facts and "I don't know" when not told (also per held-out question), tool-call correctness and
final arithmetic answers (operands up to 4 digits), the draft's acceptance rate under speculative
decoding and its speed against standard decoding, and recall across ``save_cache`` / ``.cache(path)``.

    python scripts/eval_demo.py --models chatkit/demo/models      # the shipped pair, 200 dialogues
    python scripts/eval_demo.py --models /tmp/demo --no-speculative       # another pair, the chat model only
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import chatkit  # noqa: E402  (loads OpenBLAS before MLX)
from chatkit import ChatKitError, ChatSession, ContextWindowExceededError, GenerateParams, SpeculativeConfig  # noqa: E402

import train_demo  # noqa: E402  (the dialogue generator)

GREEDY = GenerateParams(max_tokens=64, temperature=0.0)
EVAL_STREAM = 7919  # the generator stream of held-out dialogues: training uses streams 1-4 only
TARGETS = {"recall": 0.95, "untold": 0.95, "tool call (operands <= 4 digits)": 0.95,
           "arithmetic answer (operands <= 4 digits)": 0.95}


def heldout(seed: int, n: int) -> list[train_demo.Dialogue]:
    rng = np.random.default_rng([seed, EVAL_STREAM])
    return [train_demo.make_dialogue(rng, train_demo.HELDOUT) for _ in range(n)]


def session(lm, d: train_demo.Dialogue, draft=None, num_draft: int = 4) -> ChatSession:
    builder = ChatSession.builder(lm).generate_params(GREEDY)
    if d.system:
        builder = builder.instructions(d.system)
    if d.tools:
        builder = builder.tools(chatkit.demo.tools())
    if draft is not None:
        builder = builder.speculative(SpeculativeConfig(draft, num_draft_tokens=num_draft))
    return builder.build()


def small_operands(expression: str) -> bool:
    return max(len(n.split(".")[0]) for n in re.findall(r"[0-9.]+", expression)) <= 4


def ask(s: ChatSession, turn: train_demo.Turn) -> tuple[str, list[str]]:
    """The reply to ``turn`` (a guided turn: its JSON text) and the expressions of the tool calls made."""
    before = len(s.history)
    if turn.schema is not None:
        s.respond(turn.user.split("\n\n")[0], output=turn.schema)
        reply = s.history[-1].content
    else:
        reply = s.respond(turn.user)
    calls = [str(c.arguments.get("expression")) for m in s.history[before:] for c in m.tool_calls]
    return reply, calls


def score(turn: train_demo.Turn, reply: str, calls: list[str], hits: dict[str, list[bool]]) -> bool:
    """Record the turn's results under its keys; True when the whole turn is right."""
    ok = reply == turn.answer
    if turn.task == "arithmetic" and turn.expression is not None:
        small = " (operands <= 4 digits)" if small_operands(turn.expression) else " (5-digit operands)"
        hits["tool call" + small].append(calls == [turn.expression])
        hits["arithmetic answer" + small].append(ok)
    elif turn.task == "recall":
        hits["recall"].append(ok)
        hits[f"recall, asked {turn.phrasing!r}"].append(ok)
        hits["recall (told 3+ turns earlier)" if turn.distance >= 3 else "recall (told 1-2 turns earlier)"].append(ok)
    elif turn.task == "untold":
        hits["untold"].append(ok)
        hits[f"untold, asked {turn.phrasing!r}"].append(ok)
    elif turn.task == "guided":
        hits["guided (JSON form)"].append(ok)
    else:
        hits[turn.task].append(ok)
    return ok


def play(lm, draft, dialogues, num_draft: int, show: int) -> dict:
    hits: dict[str, list[bool]] = defaultdict(list)
    past: dict[str, list[bool]] = defaultdict(list)  # turns after the context window filled up
    proposed = accepted = same = compared = 0
    gen_tokens = {"standard": 0, "speculative": 0}
    gen_time = {"standard": 0.0, "speculative": 0.0}
    shown = 0
    full: list[int] = []  # the dialogues that filled the context window
    for i, d in enumerate(dialogues):
        plain = session(lm, d)
        spec = session(lm, d, draft, num_draft) if draft is not None else None
        for k, turn in enumerate(d.turns):
            t = time.perf_counter()
            try:
                reply, calls = ask(plain, turn)
            except ContextWindowExceededError:  # the rest of the dialogue does not fit: not played
                full.append(i)
                for rest in d.turns[k:]:
                    score(rest, "", [], past)
                break
            except ChatKitError as exc:  # e.g. a guided reply cut short: a miss
                reply, calls = f"<{type(exc).__name__}>", []
                plain.undo()
            gen_time["standard"] += time.perf_counter() - t
            gen_tokens["standard"] += plain.last_stats.generation_tokens
            if not score(turn, reply, calls, hits) and shown < show:
                shown += 1
                print(f"  miss [{turn.task}] {turn.user.splitlines()[0]!r}: got {reply!r} (calls {calls}), expected {turn.answer!r}")
            if spec is not None:
                t = time.perf_counter()
                try:
                    spec_reply, _ = ask(spec, turn)
                except ChatKitError as exc:
                    spec_reply = f"<{type(exc).__name__}>"
                    spec.undo()
                gen_time["speculative"] += time.perf_counter() - t
                gen_tokens["speculative"] += spec.last_stats.generation_tokens
                same += spec_reply == reply
                compared += 1
                proposed += spec.last_stats.draft_tokens_proposed
                accepted += spec.last_stats.draft_tokens_accepted
    return dict(hits=hits, past=past, same=same, proposed=proposed, accepted=accepted, gen_tokens=gen_tokens,
                gen_time=gen_time, full=full, compared=compared)


def expected_tokens(lm, d: train_demo.Dialogue) -> int:
    """The tokens of dialogue ``d`` with its expected replies, as the demo's template renders it."""
    text, _ = train_demo.render(d.messages(), d.tools)
    return len(lm.tokenizer.encode(text, add_special_tokens=False))


def draft_alone(draft, dialogues) -> float:
    """The draft's own exact-reply accuracy (for information)."""
    ok = n = 0
    for d in dialogues:
        s = session(draft, d)
        for turn in d.turns:
            try:
                ok += ask(s, turn)[0] == turn.answer
            except ContextWindowExceededError:
                n += 1
                break
            except ChatKitError:
                s.undo()
            n += 1
    return ok / max(n, 1)


def save_restore(lm, seed: int, n: int) -> tuple[int, int]:
    """Tell a fact, chat three more turns, save the cache, restore it into a new session, ask."""
    rng = np.random.default_rng([seed, EVAL_STREAM + 1])
    world = train_demo.HELDOUT
    ok = 0
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(n):
            kind = str(rng.choice(list(train_demo.TELL_REPLY)))
            fv = train_demo.fact_value(rng, world, kind)
            first = ChatSession.builder(lm).generate_params(GREEDY).tools(chatkit.demo.tools()).build()
            tell = str(rng.choice(world.tell[kind])).format(**fv)
            chat = [train_demo.arithmetic(rng, world, True).user, train_demo.spelling(rng).user, train_demo.counting(rng).user]
            ask_text = str(rng.choice(world.ask[kind])).format(**fv)
            path = Path(tmp) / f"conversation-{i}.safetensors"
            try:
                for message in (tell, *chat):
                    first.respond(message)
                first.save_cache(path)
                restored = ChatSession.builder(lm).cache(path).tools(chatkit.demo.tools()).build()
                reply = restored.respond(ask_text)
            except ContextWindowExceededError:
                continue  # long-winded replies filled the window: a miss
            info = restored.last_stats
            expected = train_demo.ASK_REPLY[kind].format(**fv)
            ok += reply == expected
            if i == 0:
                print(f"  example: restored {len(restored.history)} messages, reused "
                      f"{info.reused_tokens}/{info.prompt_tokens} prompt tokens from the file; "
                      f"{reply!r} (expected {expected!r})")
    return ok, n


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", type=Path, required=True, help="a folder with chat/ and draft/")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--dialogues", type=int, default=200)
    p.add_argument("--num-draft", type=int, default=4)
    p.add_argument("--no-speculative", action="store_true")
    p.add_argument("--restores", type=int, default=50)
    p.add_argument("--show-misses", type=int, default=10)
    args = p.parse_args(argv)

    lm, draft = chatkit.load(str(args.models / "chat")), chatkit.load(str(args.models / "draft"))
    if args.no_speculative:
        draft = None
    dialogues = heldout(args.seed, args.dialogues)
    print(f"{len(dialogues)} held-out dialogues, {sum(len(d.turns) for d in dialogues)} turns (seed {args.seed}); "
          f"model context {lm.context_length} tokens")
    t0 = time.perf_counter()
    r = play(lm, draft, dialogues, args.num_draft, args.show_misses)
    hits, past = r["hits"], r["past"]
    print("\n| held-out task | exact | count | turns past the window | exact, those counted as misses | target |\n"
          "|---|---|---|---|---|---|")
    keys = hits.keys() | past.keys()
    asked = sorted(k for k in keys if ", asked " in k)  # recall and untold per question: a table of their own
    for key in sorted(keys - set(asked)):
        target = f">= {TARGETS[key]:.0%}" if key in TARGETS else ""
        played, n_past = hits[key], len(past[key])
        exact = f"{np.mean(played):.1%}" if played else "-"
        print(f"| {key} | {exact} | {sum(played)}/{len(played)} | {n_past} | "
              f"{sum(played) / (len(played) + n_past):.1%} | {target} |")
    print("\n| recall / untold, by held-out question | exact | count |\n|---|---|---|")
    for key in (k for k in asked if hits[k]):
        print(f"| {key} | {np.mean(hits[key]):.1%} | {sum(hits[key])}/{len(hits[key])} |")
    if r["full"]:
        window = lm.context_length
        longer = [i for i, d in enumerate(dialogues) if expected_tokens(lm, d) >= window]
        print(f"\nthe context window ({window} tokens) filled up in {len(r['full'])} dialogues: their remaining turns "
              f"were not played (the 'turns past the window' column). {len(longer)} of the {len(dialogues)} dialogues "
              f"are longer than the window with the expected replies themselves ({len(set(longer) & set(r['full']))} "
              f"of those filled it up).")
    gt, gs = r["gen_tokens"], r["gen_time"]
    if draft is not None:
        rate = r["accepted"] / max(r["proposed"], 1)
        standard, speculative = gt["standard"] / gs["standard"], gt["speculative"] / gs["speculative"]
        print(f"\nspeculative decoding ({args.num_draft} draft tokens):")
        print(f"| draft acceptance | speculative == standard | standard tok/s | speculative tok/s | speed-up |\n"
              f"|---|---|---|---|---|\n| {rate:.1%} ({r['accepted']}/{r['proposed']}) | {r['same']}/{r['compared']} "
              f"replies | {standard:.0f} | {speculative:.0f} | {speculative / standard:.2f}x |")
        print(f"(tok/s: generated tokens over turn time, prefill included; --draft is "
              f"{'faster' if speculative > standard else 'slower'} here)")
        print(f"draft alone, exact replies: {draft_alone(draft, dialogues[:30]):.1%} (first 30 dialogues)")
    if args.restores:
        print("\nrecall across save_cache / ChatSession.builder(lm).cache(path):")
        ok, n = save_restore(lm, args.seed, args.restores)
        print(f"  {ok}/{n} facts recalled after restore ({ok / n:.0%})")
    print(f"\n({(time.perf_counter() - t0) / 60:.1f} min)")


if __name__ == "__main__":
    main()

"""Evaluate SmolLM2-135M-Instruct with and without chatkit's tools adapter on held-out dialogues, played turn
by turn through ``ChatSession`` (the method of ``scripts/eval_demo.py``).

The dialogues come from ``train_smollm2_adapter.make_dialogue`` in the held-out world (``HELDOUT``: names,
cities, pets, jobs, colours and phrasings training never sees, made-up names) with a seed stream training
never uses. Each session is greedy, has the demo's ``calculate`` tool (the tool loop runs it) and keeps the
model's own replies in its history. Both models are loaded with ``tool_parser_type="json_tools"``, so
the base model's ``<tool_call>`` blocks are read as calls too. Scored per turn:

* arithmetic: the tool call (one ``calculate`` call whose expression has the right value; operands up to
  4 digits) and the answer (the final reply contains the result), and both;
* recall: the reply contains the fact the user told (case-insensitive); also on its own for a fact told
  the turn before (the plainest recall);
* untold: the reply says it does not know ("don't know", "do not know", "haven't told", ...).

    python scripts/eval_smollm2_adapter.py --dialogues 60 | tee scripts/logs/eval_smollm2_adapter.log
    python scripts/eval_smollm2_adapter.py --adapter /tmp/run/00050_adapters.safetensors --no-base --dialogues 20
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import chatkit  # noqa: E402  (loads OpenBLAS before MLX)
from chatkit import ChatKitError, ChatSession, GenerateParams  # noqa: E402
from chatkit.demo import calculate  # noqa: E402

import train_smollm2_adapter as gen  # noqa: E402  (the dialogue generator)

GREEDY = GenerateParams(max_tokens=48, temperature=0.0)
EVAL_STREAM = 7919  # training uses streams 1, 2 and 9 only
UNKNOWN = re.compile(r"don'?t know|do not know|haven'?t told|have not told|didn'?t tell|did not tell|not sure|no idea")
TARGETS = {"tool call and answer": 0.95, "recall": 0.90, "untold": 0.90}


def heldout(seed: int, n: int) -> list[gen.Dialogue]:
    rng = np.random.default_rng([seed, EVAL_STREAM])
    return [gen.make_dialogue(rng, gen.HELDOUT) for _ in range(n)]


def right_call(calls: list, expected: str) -> bool:
    if len(calls) != 1 or calls[0].name != "calculate":
        return False
    try:
        return calculate(str(calls[0].arguments.get("expression"))) == expected
    except ChatKitError:
        return False


def score(turn: gen.Turn, reply: str, calls: list, hits: dict[str, list[bool]], before: gen.Turn | None = None) -> bool | None:
    """Record the turn's results; True/False for a scored turn, None for one that is not scored. A recall
    of the fact told the turn ``before`` also counts on its own row (the plainest recall)."""
    if turn.task == "arithmetic":
        call, answer = right_call(calls, turn.expected), turn.expected in reply
        hits["tool call"].append(call)
        hits["answer"].append(answer)
        hits["tool call and answer"].append(call and answer)
        return call and answer
    if turn.task == "recall":
        ok = turn.expected.lower() in reply.lower() and not calls
        hits["recall"].append(ok)
        if before is not None and before.task == "tell" and before.expected == turn.expected:
            hits["recall, told the turn before"].append(ok)
        return ok
    if turn.task == "untold":
        ok = bool(UNKNOWN.search(reply.lower())) and not calls
        hits["untold"].append(ok)
        return ok
    return None


def play(lm, adapter, dialogues: list[gen.Dialogue], show: int) -> dict[str, list[bool]]:
    hits: dict[str, list[bool]] = defaultdict(list)
    shown = 0
    for d in dialogues:
        builder = ChatSession.builder(lm).generate_params(GREEDY).tools(chatkit.demo.tools())
        s = (builder.adapter(adapter) if adapter is not None else builder).build()
        for i, turn in enumerate(d.turns):
            before = len(s.history)
            try:
                reply = s.respond(turn.user)
            except ChatKitError as exc:  # a broken call, a tool loop that does not end: a miss
                reply = f"<{type(exc).__name__}: {exc}>"
                s.undo()
            calls = [c for m in s.history[before:] for c in m.tool_calls]
            if score(turn, reply, calls, hits, d.turns[i - 1] if i else None) is False and shown < show:
                shown += 1
                print(f"  miss [{turn.task}] {turn.user!r}: got {reply!r} "
                      f"(calls {[(c.name, dict(c.arguments)) for c in calls]}), expected {turn.expected or 'not known'!r}")
    return hits


def adapter_folder(path: Path) -> tuple[Path, Path | None]:
    """An adapter folder for ``path`` (a folder, or a checkpoint file beside its adapter_config.json)."""
    if path.is_dir():
        return path, None
    tmp = Path(tempfile.mkdtemp(prefix="smollm2-adapter-"))
    shutil.copy(path.parent / "adapter_config.json", tmp / "adapter_config.json")
    shutil.copy(path, tmp / "adapters.safetensors")
    return tmp, tmp


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--adapter", type=Path, default=None,
                   help="an adapter folder or checkpoint file (default: the one chatkit ships)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--dialogues", type=int, default=60)
    p.add_argument("--no-base", action="store_true", help="evaluate the adapted model only")
    p.add_argument("--base-only", action="store_true", help="evaluate the base model only")
    p.add_argument("--show-misses", type=int, default=8)
    args = p.parse_args(argv)

    lm = chatkit.load("smollm2", **gen.TOOL_PARSER)
    folder, tmp = (None, None) if args.base_only else adapter_folder(args.adapter or chatkit.demo.smollm2_adapter_path())
    adapter = None if folder is None else chatkit.load_adapter(folder)
    dialogues = heldout(args.seed, args.dialogues)
    print(f"{len(dialogues)} held-out dialogues, {sum(len(d.turns) for d in dialogues)} turns (seed {args.seed}); "
          f"adapter {'-' if adapter is None else args.adapter or 'shipped'}")
    results = {}
    runs = ([] if args.no_base else [("base", None)]) + ([] if args.base_only else [("base + adapter", adapter)])
    for label, a in runs:
        t0 = time.perf_counter()
        print(f"\n{label}:")
        results[label] = play(lm, a, dialogues, args.show_misses)
        print(f"  ({(time.perf_counter() - t0) / 60:.1f} min)", flush=True)
    if tmp is not None:
        shutil.rmtree(tmp)
    keys = ["tool call", "answer", "tool call and answer", "recall", "recall, told the turn before", "untold"]
    print("\n| held-out task | " + " | ".join(results) + " | target |\n|---|" + "---|" * (len(results) + 1))
    for key in keys:
        cells = [f"{np.mean(h[key]):.0%} ({sum(h[key])}/{len(h[key])})" if h[key] else "-" for h in results.values()]
        target = f">= {TARGETS[key]:.0%}" if key in TARGETS else ""
        print(f"| {key} | " + " | ".join(cells) + f" | {target} |")


if __name__ == "__main__":
    main()

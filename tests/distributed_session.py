"""One multi-turn session, run by tests/test_distributed.py on every rank of ``mlx.launch`` or in one process.

    python tests/distributed_session.py ARCH STRATEGY OUT_DIR [hang|die]

STRATEGY is tensor, pipeline or none (one process, no sharding). Each rank writes the greedy tokens of
every turn (with reuse, a stream closed early by rank 0 only, a stop string, a sampled turn whose
seed differs per rank, undo, regenerate, fork, save then restore) to OUT_DIR/tokens.rank<r>.json. With ``hang`` or ``die`` as the fourth argument, rank 1
stops answering (SIGSTOP) or dies (SIGKILL) in the middle of the second turn.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import chatkit
from chatkit import ChatSession, GenerateParams
from chatkit.testing import tiny_model_path


def run(arch: str, strategy: str, out: Path, fault: str | None) -> None:
    path = tiny_model_path(arch=arch, tokenizer="bpe", seed=0)
    lm = chatkit.load(path, distributed=None if strategy == "none" else strategy, distributed_timeout=10.0 if fault else 300.0)
    group = lm.distributed
    rank = group.rank if group is not None else 0
    turns: list[dict] = []

    def record(name: str, session: ChatSession, stream) -> None:
        stats = session.last_stats
        turns.append({"turn": name, "tokens": stream.tokens, "text": stream.text,
                      "reused": stats.reused_tokens if stats else None, "finish": stream.finish_reason})

    def turn(session: ChatSession, name: str, prompt: str, *, stop_after: int | None = None) -> None:
        with session.stream_respond(prompt) as stream:
            for i, _ in enumerate(stream):
                if fault and name == "second" and i == 2 and rank == 1:
                    os.kill(os.getpid(), signal.SIGSTOP if fault == "hang" else signal.SIGKILL)
                if stop_after is not None and i + 1 >= stop_after and rank == 0:
                    break  # only rank 0's user stops: the other ranks' streams end at the same token
        record(name, session, stream)

    session = (ChatSession.builder(lm).instructions("Answer briefly.")
               .generate_params(GenerateParams(max_tokens=12, temperature=0.0)).build())
    turn(session, "first", "Hello there, who are you?")
    turn(session, "second", "Tell me more about it.")
    turn(session, "closed early", "And then what happened?", stop_after=3)
    turn(session, "reuse", "Why is that so?")
    session.generate_params = GenerateParams(max_tokens=12, temperature=0.0, stop=["e"])
    turn(session, "stop string", "Say something else.")
    # Sampled, with a seed that differs per rank on purpose: rank 0's tokens are what every rank uses.
    session.generate_params = GenerateParams(max_tokens=12, temperature=1.0, seed=7 + rank)
    turn(session, "sampled", "Pick a random word.")
    session.generate_params = GenerateParams(max_tokens=12, temperature=0.0)
    session.undo()
    with session.stream_regenerate() as stream:
        for _ in stream:
            pass
    record("regenerate", session, stream)
    branch = session.fork()
    turn(branch, "fork", "A question on the branch.")
    saved = out / "chat.safetensors"
    session.save_cache(saved)
    again = ChatSession.builder(lm).cache(saved).build()
    turn(again, "restored", "After the restore, go on.")
    session.restore_cache(saved)
    turn(session, "restored in place", "And once more.")
    (out / f"tokens.rank{rank}.json").write_text(json.dumps(turns))
    if group is not None and group.sharded:
        (out / f"restore-failures.rank{rank}.json").write_text(json.dumps(restore_failures(lm, session, out, rank)))


def restore_failures(lm, session: ChatSession, out: Path, rank: int) -> dict[str, str]:
    """Restores that fail on rank 1 only: every rank must raise (the class name and message are kept)."""
    saved, mine = out / "chat.safetensors", out / f"chat.rank{rank}.safetensors"
    found = {}

    def attempt(name: str) -> None:
        try:
            ChatSession.builder(lm).cache(saved).build()
            found[name] = "restored"
        except chatkit.ChatKitError as exc:
            found[name] = f"{type(exc).__name__}: {exc}"

    if rank == 1:
        mine.rename(mine.with_suffix(".away"))  # rank 1's file is missing
    attempt("missing on rank 1")
    if rank == 1:
        mine.with_suffix(".away").rename(mine)
    session.save_cache(out / "later.safetensors")  # one more save, of a longer conversation
    if rank == 1:
        (out / "later.rank1.safetensors").replace(mine)  # rank 1's file is of another save
    attempt("another save on rank 1")
    return found


if __name__ == "__main__":
    run(sys.argv[1], sys.argv[2], Path(sys.argv[3]), sys.argv[4] if len(sys.argv) > 4 else None)

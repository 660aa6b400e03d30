"""The ``chatkit`` command: a streaming chat REPL and ``inspect``. The only module that prints."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from typing import Any, Callable, Sequence

from .errors import ChatKitError, ContextWindowExceededError, DistributedError

HELP = """commands:
  /save FILE     save the conversation and its cache
  /load FILE     continue a saved conversation
  /undo          drop the last exchange
  /retry         answer the last message again
  /clear         forget the conversation
  /system TEXT   set the system prompt (/system alone removes it)
  /stats         what the last turn cost and what the cache holds
  /help          this help
  /quit          leave (or Ctrl-D); Ctrl-C stops a reply"""


class Repl:
    """The chat loop; ``out`` and ``err`` are where it prints (a terminal, or a test's buffers)."""

    def __init__(self, args: argparse.Namespace, out: Any = sys.stdout, err: Any = sys.stderr) -> None:
        self.args, self.out, self.err = args, out, err
        self.lm = _load_model(args.model, distributed=args.distributed, distributed_timeout=args.distributed_timeout)
        group = self.lm.distributed
        self.group = group if group is not None and group.sharded else None  # ranks in lockstep
        if self.group is not None and not self.group.leader:
            self.out = open(os.devnull, "w")  # noqa: SIM115  rank 0 prints the conversation
        self.draft = _load_model(args.draft, draft=True) if args.draft else None
        self.session = self._build(resume=args.resume)

    def _build(self, resume: str | None = None, instructions: str | None = None):
        from .params import GenerateParams
        from .session import ChatSession
        from .speculative import SpeculativeConfig

        a = self.args
        builder = ChatSession.builder(self.lm).prefill_progress(self._progress)
        if resume:
            builder = builder.cache(resume)
        else:
            builder = builder.generate_params(GenerateParams(max_tokens=a.max_tokens, temperature=a.temp))
            if instructions or a.system:
                builder = builder.instructions(instructions or a.system)
        if a.max_kv_size:
            builder = builder.max_kv_size(a.max_kv_size)
        if a.kv_bits:
            builder = builder.kv_bits(a.kv_bits, group_size=a.kv_group_size)
        if self.draft is not None:
            builder = builder.speculative(SpeculativeConfig(self.draft, num_draft_tokens=a.num_draft))
        return builder.build()

    def _progress(self, done: int, total: int) -> None:
        if total >= 256:  # only long prompts are worth a progress line
            end = "\n" if done >= total else ""
            print(f"\r[prefill {done}/{total} tokens]", end=end, file=self.err, flush=True)

    def say(self, text: str = "", end: str = "\n") -> None:
        print(text, end=end, file=self.out, flush=True)

    def error(self, exc: BaseException) -> None:
        if self.group is not None and not self.group.leader and not isinstance(exc, DistributedError):
            return  # the ranks run the same calls: rank 0 reports the error
        detail = str(exc) if isinstance(exc, ChatKitError) else f"{type(exc).__name__}: {exc}"
        if isinstance(exc, ContextWindowExceededError):
            detail += " Here: /clear starts over, /undo drops the last exchange."
        print(f"error: {detail}", file=self.err, flush=True)

    def run(self, read: Callable[[str], str] = input) -> int:
        interactive = sys.stdin.isatty()
        if interactive:
            self.say(f"chatkit: chatting with {self.args.model or 'the demo model'}. /help for commands, Ctrl-D to quit.")
        while True:
            try:
                line = self.read_line(read, "> " if interactive else "")
            except EOFError:
                break
            except KeyboardInterrupt:
                self.say()
                continue
            line = line.strip()
            if not line:
                continue
            try:
                if line.startswith("/"):
                    if self.command(line) is False:
                        break
                else:
                    self.reply(lambda: self.session.stream_respond(line))
                    self.autosave()
            except KeyboardInterrupt:  # before a reply started streaming: nothing was sent
                self.say(" [stopped]")
            except DistributedError:
                raise  # a rank died or hung: this rank cannot go on alone
            except Exception as exc:  # one clear line, never a traceback; the session goes on
                self.error(exc)
        self.autosave()
        return 0

    def read_line(self, read: Callable[[str], str], prompt: str) -> str:
        """The next input line; over a sharded model rank 0 reads it and every rank gets it."""
        if self.group is None:
            return read(prompt)
        from .engine.distributed import broadcast_text

        line: str | None = None
        if self.group.leader:
            try:
                line = read(prompt)
            except EOFError:
                line = None
        line = broadcast_text(self.group, line)
        if line is None:
            raise EOFError
        return line

    def reply(self, start: Callable[[], Any]) -> None:
        """Stream a reply; Ctrl-C stops it after the token being computed and keeps what came."""
        stopped = threading.Event()
        # Ctrl-C only sets a flag while a reply streams: a KeyboardInterrupt inside MLX work would
        # abandon the turn instead of committing it.
        previous = signal.signal(signal.SIGINT, lambda *_: stopped.set())
        try:
            with start() as stream:
                for chunk in stream:
                    self.say(chunk.text, end="")
                    if stopped.is_set():
                        break
        finally:
            signal.signal(signal.SIGINT, previous)
        self.say(" [stopped]" if stopped.is_set() else "")

    def autosave(self) -> None:
        if self.args.save and self.session.cache_info().tokens:
            try:
                self.session.save_cache(self.args.save)
            except ChatKitError as exc:
                self.error(exc)

    def command(self, line: str) -> bool | None:
        name, _, rest = line.partition(" ")
        rest = rest.strip()
        s = self.session
        if name in ("/quit", "/exit"):
            return False
        if name == "/help":
            self.say(HELP)
        elif name == "/save":
            size = s.save_cache(_need(rest, "/save FILE"))
            self.say(f"saved {s.cache_info().tokens} tokens, {len(s.history)} messages to {rest} ({size:,} bytes)")
        elif name == "/load":
            self.session = self._build(resume=_need(rest, "/load FILE"))
            self.say(f"loaded {rest}: {len(self.session.history)} messages, {self.session.cache_info().tokens} tokens cached")
        elif name == "/undo":
            dropped = s.undo()
            self.say(f"undone: {dropped[0].content!r}")
        elif name == "/retry":
            self.reply(s.stream_regenerate)
            self.autosave()
        elif name == "/clear":
            s.clear()
            self.say("cleared")
        elif name == "/system":
            s.instructions = rest or None
            self.say(f"system prompt {'set' if rest else 'removed'}")
        elif name == "/stats":
            self.say(_stats(s))
        else:
            self.say(f"unknown command {name}; /help lists them")
        return None


def _need(value: str, usage: str) -> str:
    if not value:
        raise ChatKitError(f"usage: {usage}")
    return value


def _stats(session: Any) -> str:
    info, st = session.cache_info(), session.last_stats
    lines = [f"cache: {info.tokens} tokens, {info.nbytes:,} bytes, layers {', '.join(sorted(set(info.layer_classes)))}"]
    if st is not None:
        lines.append(
            f"last turn: prompt {st.prompt_tokens} tokens ({st.reused_tokens} reused, {st.prefilled_tokens} prefilled "
            f"at {st.prompt_tps:.0f} tok/s), {st.generation_tokens} generated at {st.generation_tps:.1f} tok/s, "
            f"peak memory {st.peak_memory_bytes / 2**20:.0f} MiB, finish: {st.finish_reason}"
        )
        if st.draft_tokens_proposed:
            lines.append(f"draft: {st.draft_tokens_accepted}/{st.draft_tokens_proposed} proposed tokens accepted")
    return "\n".join(lines)


def _load_model(name: str | None, draft: bool = False, **options: Any):
    from .loading import load

    name = name or "demo"
    return load("demo-draft" if draft and name == "demo" else name, **options)


def inspect(path: str, out: Any = sys.stdout) -> int:
    from .cache.store import inspect as inspect_file

    info = inspect_file(path)
    lines = [
        f"file: {info.path} ({info.file_bytes:,} bytes, {info.tensor_bytes:,} of tensors)",
        f"kind: {info.kind}" + (f", format {info.format_version}" if info.format_version else ""),
        f"layers: {len(info.layer_classes)} ({', '.join(sorted(set(info.layer_classes)))})",
    ]
    if info.kind == "chatkit":
        lines += [
            f"tokens: {info.tokens}" + (f" ({info.opaque_tokens} opaque)" if info.opaque_tokens else ""),
            f"turns: {info.turns}, messages: {len(info.messages)}, saved at {info.saved_at}",
            f"instructions: {info.instructions!r}",
            "model fingerprint: " + json.dumps(dict(info.fingerprint or {})),
        ]
        for m in info.messages[-6:]:
            text = m.get("content", "").replace("\n", " ")
            lines.append(f"  {m.get('role')}: {text[:70]}{'...' if len(text) > 70 else ''}")
    else:
        lines.append("a raw mlx-lm prompt cache: no transcript or fingerprint")
    print("\n".join(lines), file=out)
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="chatkit", description="Chat with a local model through chatkit.")
    commands = p.add_subparsers(dest="command")
    chat = commands.add_parser("chat", help="a streaming chat in the terminal (the default)")
    chat.add_argument("--model", help="Hugging Face repo id, local folder, or 'demo' (the default)")
    chat.add_argument("--draft", help="a draft model for speculative decoding (id, folder, or 'demo')")
    chat.add_argument("--num-draft", type=int, default=4, help="draft tokens per step (default 4)")
    chat.add_argument("--system", help="the system prompt")
    chat.add_argument("--resume", metavar="FILE", help="continue a conversation saved with /save or --save")
    chat.add_argument("--save", metavar="FILE", help="save the conversation to FILE after every turn")
    chat.add_argument("--temp", type=float, default=0.0, help="sampling temperature (0: greedy)")
    chat.add_argument("--max-tokens", type=int, default=256, help="longest reply in tokens")
    chat.add_argument("--max-kv-size", type=int, help="keep at most this many tokens in the KV cache")
    chat.add_argument("--kv-bits", type=int, help="quantize the KV cache to this many bits")
    chat.add_argument("--kv-group-size", type=int, default=64,
                      help="values per quantization group with --kv-bits: 32, 64 (default) or 128")
    chat.add_argument("--distributed", choices=("tensor", "pipeline", "auto"),
                      help="shard the model over the ranks mlx.launch started (docs/distributed.md)")
    chat.add_argument("--distributed-timeout", type=float, default=120.0, metavar="SECONDS",
                      help="how long a rank waits for the others in one step before stopping (default 120)")
    insp = commands.add_parser("inspect", help="show what a saved conversation holds")
    insp.add_argument("file")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0].startswith("-") and argv[0] not in ("-h", "--help"):
        argv = ["chat", *argv]
    args = parser().parse_args(argv)
    try:
        if args.command == "inspect":
            return inspect(args.file)
        return Repl(args).run()
    except ChatKitError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())

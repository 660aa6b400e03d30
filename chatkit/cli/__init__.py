"""The ``chatkit`` command: ``chatkit chat`` (a streaming REPL, the default) and ``chatkit inspect FILE``.

The only package of chatkit that prints. ``args`` holds the flags and their rules, ``terminal`` line
editing and Ctrl-C, ``repl`` the chat loop and its slash commands, ``inspect_cmd`` the inspect command.
"""

from __future__ import annotations

import sys
from typing import Sequence

from ..errors import ChatKitError
from .args import UsageError, check_combination, parser
from .inspect_cmd import inspect
from .repl import Repl


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code (0 ok, 1 an error, 2 a usage error, 130 Ctrl-C)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0].startswith("-") and argv[0] not in ("-h", "--help", "--version"):
        argv = ["chat", *argv]
    p = parser()
    args = p.parse_args(argv)
    if args.command is None:
        args = p.parse_args(["chat"])
    try:
        if args.command == "inspect":
            return inspect(args.file, show_all=args.all, model=args.model)
        check_combination(args)
        return Repl(args).run()
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except ChatKitError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except Exception as exc:  # a defect below us still ends in one line, not a traceback
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


__all__ = ["Repl", "inspect", "main", "parser"]

"""The ``chatkit`` command: ``chatkit chat`` (a streaming REPL, the default), ``chatkit inspect FILE``,
``chatkit models`` and ``chatkit serve`` (``chatkit.server``).

The only package of chatkit that prints. ``args`` holds the flags and their rules
(those that pick and run a model shared by chat and serve), ``terminal`` line editing and Ctrl-C, ``repl``
the chat loop and its slash commands, ``inspect_cmd`` the inspect command, ``serve`` the serve command
(its flags; ``chatkit.server`` does the serving).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from ..errors import ChatKitError
from .args import UsageError, check_combination, parser
from .inspect_cmd import inspect
from .repl import Repl


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code (0 ok, 1 an error, 2 a usage error, 130 Ctrl-C)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["serve"]:  # the OpenAI-compatible server: its own parser (serve.py)
        return _serve(argv[1:])
    if not argv or argv[0].startswith("-") and argv[0] not in ("-h", "--help", "--version"):
        argv = ["chat", *argv]
    p = parser()
    args = p.parse_args(argv)
    if args.command is None:
        args = p.parse_args(["chat"])
    try:
        if args.command == "inspect":
            return inspect(args.file, show_all=args.all, model=args.model)
        if args.command == "models":
            return list_models()
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


def _serve(argv: Sequence[str]) -> int:
    try:
        from .serve import main as serve
    except ImportError as exc:  # the server extra is not installed
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return serve(argv)


def list_models(out: Any = None) -> int:
    """``chatkit models``: one line per model that ``--model NAME`` accepts."""
    from ..model.names import list_models as found

    out = out or sys.stdout
    for e in found():
        size = f"{e.size / 2**20:,.0f} MiB" if e.size else ""
        print(f"{e.name:<48} {e.kind:<22} {size:>10}  {e.path or ''}".rstrip(), file=out)
    return 0


__all__ = ["Repl", "inspect", "list_models", "main", "parser"]

"""``chatkit serve``: the flags (those that pick and run a model are ``chatkit chat``'s: args.py), checked
before anything loads; then the model is loaded and ``chatkit.server`` serves it until Ctrl-C."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from typing import NoReturn

from ..decode.speculative import SpeculativeConfig
from ..errors import ChatKitError
from ..params import GenerateParams
from ..server.run import serve
from ..server.state import ServerConfig
from .args import (
    UsageError,
    add_context_flag,
    add_model_flags,
    add_sampling_flags,
    context_policy,
    load_draft,
    load_model,
)

SERVE_MAX_TOKENS = 512  # a reply's length when neither --max-tokens nor the request sets one
LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")


class _Parser(argparse.ArgumentParser):
    """A bad flag is a ``UsageError``: one ``error:`` line and exit code 1, as ``chatkit serve``'s other
    refusals (``chatkit chat`` exits 2 on a usage error; tests pin serve's 1)."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (chatkit serve --help lists the flags)")


def parser() -> argparse.ArgumentParser:
    """``chatkit serve [flags]``."""
    p = _Parser(prog="chatkit serve", description="Serve a model over an OpenAI-compatible HTTP API.")
    add_model_flags(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8080, help="port (default 8080)")
    p.add_argument("--store", metavar="DIR", help="keep conversations and responses in DIR across restarts")
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on every request")
    p.add_argument("--max-cache-mb", type=int, default=2048,
                   help="KV cache memory for all conversations; beyond it caches go to disk (default 2048)")
    p.add_argument("--max-conversations", type=int, default=256, help="conversations kept (default 256)")
    p.add_argument("--parallel", type=int, default=None, help="requests generating at once (default 2; N with --batch N)")
    p.add_argument("--batch", type=int, default=0, metavar="N",
                   help="decode up to N concurrent requests together on one batch engine (more throughput "
                        "for many clients, some latency for one; default: off)")
    p.add_argument("--queue", type=int, default=32, help="requests waiting beyond those; more get 503 (default 32)")
    add_sampling_flags(p, max_tokens=SERVE_MAX_TOKENS, otherwise="for requests that set none")
    add_context_flag(p)
    p.add_argument("--log-level", default="info", help="uvicorn's log level (default info)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """``chatkit serve ...``: check the flags, load the model(s) and serve until Ctrl-C. Returns 1 (after
    one ``error:`` line) when a flag cannot work or a model does not load."""
    try:
        args = parser().parse_args(argv)
        config = server_config(args)
        lm = load_model(args.model)
        draft = load_draft(args.draft)
        if draft is not None:
            config.speculative = SpeculativeConfig(draft, num_draft_tokens=args.num_draft)
    except ChatKitError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if args.host not in LOCAL_HOSTS and not args.api_key:
        print(f"warning: serving on {args.host} without --api-key: anyone who can reach it can use it.",
              file=sys.stderr)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s: %(message)s")
    serve(lm, config, host=args.host, port=args.port, log_level=args.log_level)
    return 0


def server_config(args: argparse.Namespace) -> ServerConfig:
    """The server's settings from the flags (without the draft, which needs loading); ``UsageError``
    naming the flags when they cannot work together."""
    max_tokens = SERVE_MAX_TOKENS if args.max_tokens is None else args.max_tokens
    defaults = GenerateParams(max_tokens=max_tokens, temperature=0.0 if args.temp is None else args.temp)
    defaults.validate()
    if args.batch and args.parallel not in (None, args.batch):
        raise UsageError(f"--batch {args.batch} already lets {args.batch} requests generate at once: "
                         f"leave out --parallel {args.parallel} (or give both the same number).")
    parallel = args.batch or (2 if args.parallel is None else args.parallel)  # a batch's size is how many generate at once
    if parallel < 1 or args.queue < 0 or args.max_cache_mb < 0 or args.max_conversations < 1 or args.batch < 0:
        raise UsageError("--parallel and --max-conversations must be >= 1, --queue, --max-cache-mb and "
                         "--batch >= 0.")
    return ServerConfig(
        model_id=args.model or "demo", store=args.store, max_cache_bytes=args.max_cache_mb * 2**20,
        max_conversations=args.max_conversations, parallel=parallel, queue=args.queue,
        api_key=args.api_key, defaults=defaults, batch=args.batch > 0, context_policy=context_policy(args.context_policy),
    )


__all__ = ["main", "parser", "server_config"]

"""``chatkit serve``: the flags (those that pick and run a model are ``chatkit chat``'s: args.py), checked
before anything loads; then the model is loaded and ``chatkit.server`` serves it until Ctrl-C."""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import socket
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

from ..decode.speculative import SpeculativeConfig
from ..errors import ChatKitError, ModelLoadError
from ..model.adapters import Adapter
from ..model.loaded import LoadedModel
from ..params import GenerateParams
from ..server.models import check_adapter_name
from ..server.run import serve
from ..server.state import ServerConfig
from .args import (
    UsageError,
    add_context_flag,
    add_model_flags,
    add_prompt_cache_flags,
    add_sampling_flags,
    byte_size,
    context_policy,
    load_draft,
    load_model,
    prompt_cache,
)

SERVE_MAX_TOKENS = 512  # a reply's length when neither --max-tokens nor the request sets one


LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")  # uvicorn's


class _Parser(argparse.ArgumentParser):
    """A bad flag is a ``UsageError``: one ``error:`` line and exit status 2, as every other flag that
    cannot work (and as ``chatkit chat``)."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (chatkit serve --help lists the flags)")


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number; use 1 to 65535") from None
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a port number; use 1 to 65535")
    return value


def parser() -> argparse.ArgumentParser:
    """``chatkit serve [flags]``."""
    p = _Parser(prog="chatkit serve", description="Serve a model over an OpenAI-compatible HTTP API.")
    add_model_flags(p)
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default 127.0.0.1: this machine only); any other than a loopback "
                        "address needs --api-key (or --allow-unauthenticated)")
    p.add_argument("--port", type=_port, default=8080, help="port, 1 to 65535 (default 8080)")
    p.add_argument("--store", metavar="DIR",
                   help="keep conversations and responses in DIR (created if missing) across restarts; each "
                        "conversation's cache is written there behind its turn")
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on every request")
    p.add_argument("--allow-unauthenticated", action="store_true",
                   help="serve a --host other than loopback without --api-key: anyone who can reach it can use it")
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
    add_prompt_cache_flags(p, folder="DIR/prompt-cache with --store DIR, else RAM only")
    p.add_argument("--max-kv-bytes", type=byte_size, metavar="SIZE",
                   help="a memory budget for each conversation's KV cache (e.g. 2GB): its window becomes the tokens "
                        "that fit, and the context policy works at that window")
    p.add_argument("--adapter", action="append", default=[], metavar="NAME=PATH",
                   help="serve an mlx-lm LoRA/DoRA adapter folder over the model as the model id MODEL:NAME "
                        "(MODEL: the --model id that /v1/models lists); requests select it with their model "
                        "field, the base model with MODEL. Repeat for more; one copy of the weights serves all")
    p.add_argument("--log-level", default="info", type=str.lower, choices=LOG_LEVELS,
                   help=f"uvicorn's log level: {', '.join(LOG_LEVELS)} (default info)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """``chatkit serve ...``: check the flags, load the model(s) and serve until Ctrl-C. After one
    ``error:`` line, returns 2 when a flag cannot work (checked before anything loads) and 1 when a
    model does not load."""
    try:
        args = parser().parse_args(argv)
        config = server_config(args)
    except ChatKitError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        lm = load_model(args.model)
        config.adapters = load_adapters(lm, config.adapters)
        draft = load_draft(args.draft)
        if draft is not None:
            config.speculative = SpeculativeConfig(draft, num_draft_tokens=args.num_draft)
    except ChatKitError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if not is_loopback(args.host) and not args.api_key:
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
    if args.model is not None and not args.model.strip():
        raise UsageError("--model '' names no model: give a model id or folder, or leave --model out to serve the demo.")
    check_exposure(args.host, args.api_key, args.allow_unauthenticated)
    args.host = check_host(args.host, args.port)
    store = check_store(args.store) if args.store is not None else None
    return ServerConfig(
        model_id=args.model or "demo", store=store,
        max_cache_bytes=args.max_cache_mb * 2**20,
        max_conversations=args.max_conversations, parallel=parallel, queue=args.queue,
        api_key=args.api_key, defaults=defaults, batch=args.batch > 0, context_policy=context_policy(args.context_policy),
        adapters=adapter_flags(args.adapter),
        max_kv_bytes=args.max_kv_bytes, prompt_cache=prompt_cache(args, Path(store) / "prompt-cache" if store is not None else None),
    )


def adapter_flags(values: Sequence[str]) -> dict[str, str]:
    """The ``--adapter NAME=PATH`` flags as {name: folder}, checked before anything loads (that each
    folder fits the model is checked once it is loaded: :func:`load_adapters`)."""
    found: dict[str, str] = {}
    for value in values:
        name, sep, path = value.partition("=")
        where = f"--adapter {value}"
        if not sep or not name or not path:
            raise UsageError(f"{where}: give NAME=PATH, e.g. --adapter tools=./adapters (clients then send "
                             "model 'MODEL:tools').")
        try:
            check_adapter_name(name)
        except ChatKitError as exc:
            raise UsageError(f"{where}: {exc}") from None
        if name in found:
            raise UsageError(f"{where}: the name {name!r} is given twice; give each adapter its own name.")
        if not Path(os.path.expanduser(path)).is_dir():
            raise UsageError(f"{where}: no folder {path!r}; give the adapter folder mlx_lm.lora wrote "
                             "(with adapter_config.json and adapters.safetensors).")
        found[name] = path
    return found


def load_adapters(lm: LoadedModel, paths: Mapping[str, Any]) -> dict[str, Adapter]:
    """Each ``--adapter`` folder read and checked against ``lm``; ``ModelLoadError`` naming the flag."""
    adapters = {}
    for name, path in paths.items():
        try:
            adapters[name] = lm.adapter(path)
        except ModelLoadError as exc:
            raise ModelLoadError(f"--adapter {name}={path}: {exc}") from None
    return adapters


def is_loopback(host: str) -> bool:
    """Whether ``host`` is this machine only: ``localhost`` or a loopback address (127.x, ::1)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a name: it may resolve to any address
        return False


def check_host(host: str, port: int) -> str:
    """``host`` as the server binds it (``[::1]``, an IPv6 address in brackets as URLs write it, is ``::1``);
    ``UsageError`` for a name that resolves to no address (found before the model loads)."""
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        socket.getaddrinfo(bare, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as exc:
        raise UsageError(f"--host {host}: not an address of this machine ({getattr(exc, 'strerror', None) or exc}); "
                         "use an IP address such as 127.0.0.1 or ::1, or a host name that resolves.") from None
    return bare


def check_exposure(host: str, api_key: str | None, allow_unauthenticated: bool) -> None:
    """``UsageError`` for an empty key, and for a non-loopback ``host`` without a key unless allowed."""
    if api_key is not None and (not api_key.strip() or api_key != api_key.strip()):
        raise UsageError("--api-key: give a key without spaces at its ends (clients send 'Authorization: Bearer KEY').")
    if not api_key and not allow_unauthenticated and not is_loopback(host):
        raise UsageError(
            f"--host {host} lets other machines reach the server, and without --api-key anyone who can reach it "
            "could use it: add --api-key KEY (clients then send 'Authorization: Bearer KEY'), or "
            "--allow-unauthenticated if that network is trusted.")


def check_store(path: str) -> str:
    """The ``--store`` folder, created if missing; ``UsageError`` when it cannot hold the store."""
    folder = Path(os.path.expanduser(path))
    where = f"--store {path}"
    if folder.exists() and not folder.is_dir():
        raise UsageError(f"{where}: that is a file; give a folder (it is created if missing).")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"{where}: the folder cannot be created ({exc.strerror or exc}); pick another.") from None
    if not os.access(folder, os.W_OK | os.X_OK):
        raise UsageError(f"{where}: cannot write in that folder; pick one you can write to.")
    for part in ("caches", "responses"):
        inside = folder / part
        if inside.exists() and not (inside.is_dir() and os.access(inside, os.W_OK | os.X_OK)):
            raise UsageError(f"{where}: the store keeps a folder {str(inside)!r} it can write, and that is "
                             f"{'not writable' if inside.is_dir() else 'a file'}: fix it or pick another folder.")
    return str(folder)


__all__ = ["adapter_flags", "check_exposure", "check_host", "check_store", "is_loopback", "load_adapters", "main", "parser",
           "server_config"]

"""Running the app: on uvicorn in a background thread (:func:`start`), or in front (``chatkit serve``)."""

from __future__ import annotations

import argparse
import logging
import socket
import sys
import threading
from collections.abc import Sequence

import uvicorn
from starlette.applications import Starlette

from ..decode.batch import BatchEngine
from ..errors import ChatKitError
from ..model.loaded import LoadedModel
from ..params import GenerateParams
from .app import ServerConfig, create_app

STARTUP_WAIT = 60.0  # seconds


class RunningServer:
    """A server started by :func:`start`: ``url`` (e.g. ``http://127.0.0.1:51234/v1``) and ``stop()``."""

    def __init__(self, server: uvicorn.Server, thread: threading.Thread, host: str, port: int,
                 app: Starlette) -> None:
        self._server, self._thread, self._app = server, thread, app
        self.host, self.port = host, port
        self.url = f"http://{host}:{port}/v1"

    @property
    def engine(self) -> BatchEngine | None:
        """The ``chatkit.BatchEngine`` decoding concurrent requests together (``None`` without ``batch``)."""
        return getattr(self._app.state, "engine", None)

    def stop(self) -> None:
        """Shut down (conversations are saved when the server has a store) and wait for it."""
        self._server.should_exit = True
        self._thread.join()

    def __enter__(self) -> RunningServer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def start(lm: LoadedModel, config: ServerConfig | None = None, *, host: str = "127.0.0.1",
          port: int = 0) -> RunningServer:
    """Serve ``lm`` on ``host:port`` (port 0: any free one) from a background thread; returns once
    it accepts connections."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    app = create_app(lm, config)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="chatkit-serve", daemon=True)
    thread.start()
    while not server.started:
        thread.join(0.01)
        if not thread.is_alive():
            raise ChatKitError(f"The server on {host}:{port} did not start: see the log above.")
    return RunningServer(server, thread, host, sock.getsockname()[1], app)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="chatkit serve",
                                description="Serve a model over an OpenAI-compatible HTTP API.")
    p.add_argument("--model", default="demo", help="Hugging Face repo id, local folder, or 'demo' (the default)")
    p.add_argument("--draft", help="a draft model for speculative decoding (id, folder, or 'demo')")
    p.add_argument("--num-draft", default="auto",
                   help="draft tokens per step, or 'auto' to tune it from the acceptance (default auto)")
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
    p.add_argument("--max-tokens", type=int, default=512, help="reply length when a request sets none")
    p.add_argument("--temp", type=float, default=0.0, help="temperature when a request sets none (default 0)")
    p.add_argument("--log-level", default="info", help="uvicorn's log level (default info)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """``chatkit serve ...``: load the model(s) and serve until Ctrl-C."""
    args = parser().parse_args(argv)
    try:
        from ..decode.speculative import SpeculativeConfig
        from ..model.load import load

        lm = load(args.model)
        speculative = None
        if args.draft:
            draft = load("demo-draft" if args.draft == "demo" and args.model == "demo" else args.draft)
            num_draft: int | str = args.num_draft
            if num_draft != "auto":
                try:
                    num_draft = int(num_draft)
                except ValueError:
                    raise ChatKitError(f"--num-draft {args.num_draft!r}: give a number of tokens or 'auto'.") from None
            speculative = SpeculativeConfig(draft, num_draft_tokens=num_draft)
        defaults = GenerateParams(max_tokens=args.max_tokens, temperature=args.temp)
        defaults.validate()
        if args.batch and args.parallel not in (None, args.batch):
            raise ChatKitError(f"--batch {args.batch} already lets {args.batch} requests generate at once: "
                               f"leave out --parallel {args.parallel} (or give both the same number).")
        parallel = args.batch or (2 if args.parallel is None else args.parallel)  # a batch's size is how many generate at once
        if parallel < 1 or args.queue < 0 or args.max_cache_mb < 0 or args.max_conversations < 1 or args.batch < 0:
            raise ChatKitError("--parallel and --max-conversations must be >= 1, --queue, --max-cache-mb and "
                               "--batch >= 0.")
        config = ServerConfig(
            model_id=args.model, store=args.store, max_cache_bytes=args.max_cache_mb * 2**20,
            max_conversations=args.max_conversations, parallel=parallel, queue=args.queue,
            api_key=args.api_key, defaults=defaults, speculative=speculative, batch=args.batch > 0,
        )
    except ChatKitError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.api_key:
        print(f"warning: serving on {args.host} without --api-key: anyone who can reach it can use it.",
              file=sys.stderr)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s: %(message)s")
    uvicorn.run(create_app(lm, config), host=args.host, port=args.port, log_level=args.log_level)
    return 0


__all__ = ["RunningServer", "main", "parser", "start"]

"""Running the app on uvicorn: in a background thread (:func:`start`), or in front (:func:`serve`, which
``chatkit serve`` calls once it has read its flags: chatkit/cli/serve.py)."""

from __future__ import annotations

import gc
import socket
import threading

import uvicorn
from starlette.applications import Starlette

from ..decode.batch import BatchEngine
from ..errors import ChatKitError
from ..model.loaded import LoadedModel
from .app import create_app
from .state import ServerConfig


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


def serve(lm: LoadedModel, config: ServerConfig, *, host: str = "127.0.0.1", port: int = 8080,
          log_level: str = "info") -> None:
    """Serve ``lm`` on ``host:port`` in this thread until interrupted (``chatkit serve``); at the end the
    conversations are saved when ``config.store`` is set.

    The process is the server's own, so what it has loaded (the model, its tokenizer, the libraries:
    ~10^5 objects) is moved out of the garbage collector's reach (``gc.freeze()``): a full collection
    over them takes tens of milliseconds, which would land in some request's time to first token.
    uvicorn parses HTTP with ``httptools`` and runs ``uvloop`` when they are installed (the server extra
    brings them)."""
    app = create_app(lm, config)
    gc.collect()
    gc.freeze()
    uvicorn.run(app, host=host, port=port, log_level=log_level)


__all__ = ["RunningServer", "serve", "start"]

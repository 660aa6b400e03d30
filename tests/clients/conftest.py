"""The clients tier: a real ``chatkit serve`` process on 127.0.0.1, driven by the clients people use
(the official ``openai`` and ``anthropic`` SDKs, a headless browser). One process per test module."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Served:
    """A ``chatkit serve`` process: ``url`` is the server's root (``/v1`` is under it)."""

    args: Sequence[str]
    store: Path
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 120.0) -> Served:
        env = {**os.environ, "HF_HUB_OFFLINE": "1"}
        cmd = [sys.executable, "-m", "chatkit", "serve", "--port", str(self.port), "--store", str(self.store),
               "--log-level", "warning", *self.args]
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/v1/models", timeout=5).status_code < 500:
                    return self
            except httpx.TransportError:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"chatkit serve exited: {self.proc.communicate()[1]}") from None
                time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"chatkit serve did not start within {timeout:.0f} s")

    def stop(self) -> str:
        """Ctrl-C, as a user stops it (the store is written); returns what it printed to stderr."""
        if self.proc is None:
            return ""
        self.proc.send_signal(signal.SIGINT)
        try:
            _, err = self.proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            _, err = self.proc.communicate()
        code, self.proc = self.proc.returncode, None
        assert code == 0, err
        return err

    def restart(self) -> Served:
        self.stop()
        return self.start()


@pytest.fixture(scope="module")
def serve_process(tmp_path_factory) -> Iterator[type[Served]]:
    """``serve_process(args)`` starts a server (stopped at the end of the module)."""
    started: list[Served] = []

    def make(args: Sequence[str] = (), store: Path | None = None) -> Served:
        served = Served(list(args), store or tmp_path_factory.mktemp("store")).start()
        started.append(served)
        return served

    yield make  # type: ignore[misc]
    for served in started:
        if served.proc is not None:
            served.stop()


@pytest.fixture(scope="module")
def demo_server(serve_process) -> Served:
    """The bundled demo model behind ``chatkit serve`` (deterministic replies, the ``calculate`` tool)."""
    return serve_process(["--max-tokens", "24"])

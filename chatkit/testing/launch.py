"""Two ranks on one machine, as the tests and benchmarks of sharded sessions start them."""

from __future__ import annotations

import socket
import sys

# mlx.launch without its console script (the same entry point), so the venv's Python runs it.
LAUNCH = [sys.executable, "-c", "import sys; from mlx._distributed_utils.launch import main; sys.exit(main())"]


def free_ring_port() -> int:
    """A port p with p and p + 1 free on 127.0.0.1 (mlx.launch's ring backend takes one port per rank)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        try:
            with socket.socket() as t:
                t.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
    raise RuntimeError("no two consecutive free ports on 127.0.0.1")


def ring_launch(port: int | None = None) -> list[str]:
    """The ``mlx.launch -n 2 --backend ring -p PORT`` command line (before ``--`` and the program)."""
    return [*LAUNCH, "-n", "2", "--backend", "ring", "-p", str(port if port is not None else free_ring_port())]

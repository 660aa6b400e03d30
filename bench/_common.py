"""Shared bits of the benchmarks: the model they run on and a description of the machine."""

from __future__ import annotations

import ctypes
import os
import platform
import statistics
import sys
import time
from importlib import metadata

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import chatkit  # noqa: E402  (first: it loads OpenBLAS before MLX)
import chatkit._blas  # noqa: E402

import mlx.core as mx  # noqa: E402

# A Qwen3-shaped model of ~29M float32 parameters (4.2M of them the tied 8,201-token embedding).
MODEL_CONFIG = dict(
    hidden_size=512,
    num_hidden_layers=8,
    intermediate_size=1536,
    num_attention_heads=8,
    num_key_value_heads=4,
)


# --quick (every script has it): the tests' tiny model, no waiting for a quiet CPU, a few rounds. It checks
# that a script runs end to end in seconds (tests/test_bench.py runs them all); its numbers mean nothing.
QUICK = False


def add_quick(ap) -> None:
    """Give an ``argparse.ArgumentParser`` the ``--quick`` flag (read it back with :func:`quick`)."""
    ap.add_argument("--quick", action="store_true",
                    help="seconds on the tests' tiny model: checks the script end to end (numbers mean nothing)")


def quick(args) -> bool:
    """Switch to quick mode when ``args.quick``; returns it."""
    global QUICK
    QUICK = bool(getattr(args, "quick", False))
    return QUICK


def load_model(tokenizer: str = "bpe", seed: int = 0):
    from chatkit.testing import tiny_model

    return tiny_model("qwen3", tokenizer, seed, **({} if QUICK else MODEL_CONFIG))


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def blas() -> str:
    path = chatkit._blas.BLAS
    if path is None:
        return "MLX's bundled BLAS (chatkit did not load OpenBLAS)"
    try:
        get_config = ctypes.CDLL(path).openblas_get_config
        get_config.restype = ctypes.c_char_p
        return f"{get_config().decode()} ({path}, loaded by chatkit._blas)"
    except (OSError, AttributeError):
        return f"{path} (loaded by chatkit._blas)"


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "-"


def n_params(lm) -> int:
    from mlx_lm.utils import get_total_parameters

    return get_total_parameters(lm.model)


def describe(lm) -> str:
    """A few lines on the machine, the libraries and the model."""
    params = n_params(lm)
    cfg = lm.config
    shape = ", ".join(
        f"{k}={cfg[k]}"
        for k in ("hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "vocab_size")
    )
    return "\n".join([
        f"machine : {cpu_model()}, {os.cpu_count()} cores, {platform.system()} {platform.machine()}, "
        f"Python {platform.python_version()}",
        f"mlx     : mlx {mx.__version__} (mlx-cpu {_version('mlx-cpu')}), mlx-lm {_version('mlx-lm')}, "
        f"chatkit {_version('chatkit')}",
        f"BLAS    : {blas()}",
        f"model   : {cfg['model_type']} {params / 1e6:.1f}M params float32 ({shape}), "
        + ("random weights from chatkit.testing.tiny_model" if "chatkit-testing" in lm.source
           else f"trained weights from {lm.source}"),
    ])


def median(xs) -> float:
    return statistics.median(xs)


def _cpu_times() -> tuple[int, int]:
    with open("/proc/stat") as f:
        values = [int(v) for v in f.readline().split()[1:]]
    idle = values[3] + values[4]  # idle + iowait
    return sum(values) - idle, sum(values)


def cpu_busy(seconds: float = 1.0) -> float:
    """Fraction of all cores busy over ``seconds`` (Linux; 0.0 elsewhere)."""
    try:
        b0, t0 = _cpu_times()
        time.sleep(seconds)
        b1, t1 = _cpu_times()
    except OSError:
        return 0.0
    return (b1 - b0) / max(t1 - t0, 1)


def wait_until_quiet(max_wait: float = 300.0, threshold: float = 0.15) -> str:
    """Wait (up to ``max_wait`` s) until the other processes leave the CPU mostly idle: on a 2-core
    machine anything else running skews every number. Returns a line for the report."""
    if QUICK:
        return "(--quick: not waiting for a quiet CPU)"
    start = time.time()
    busy = cpu_busy()
    while busy > threshold and time.time() - start < max_wait:
        print(f"(CPU {busy:.0%} busy with other processes: waiting for it to quiet down)", file=sys.stderr)
        time.sleep(5)
        busy = cpu_busy()
    note = f"CPU busy before start: {busy:.0%}"
    if busy > threshold:
        note += f" (still busy after {max_wait:.0f} s of waiting: numbers are skewed)"
    return note


class OtherLoad:
    """CPU time used by *other* processes while the benchmark ran, as a share of all cores:
    whatever it is above a few percent, the numbers of this run are skewed."""

    def __init__(self) -> None:
        self._start = self._sample()

    @staticmethod
    def _sample():
        try:
            busy, _ = _cpu_times()
        except OSError:
            busy = 0
        t = os.times()
        return busy / os.sysconf("SC_CLK_TCK"), t.user + t.system, time.time()

    def report(self) -> str:
        busy1, mine1, wall1 = self._sample()
        busy0, mine0, wall0 = self._start
        others = max(0.0, (busy1 - busy0) - (mine1 - mine0)) / max((wall1 - wall0) * (os.cpu_count() or 1), 1e-9)
        return f"CPU used by other processes during the run: {others:.0%} of the machine"


def clone(layers):
    """Real copies of mlx-lm cache layers (own buffers, evaluated), so that writing to a copy never
    first copies the original's memory (``chatkit.cache.state.copy_layer`` shares it until a write)."""
    from mlx.utils import tree_map

    if layers is None:
        return None
    out = []
    for c in layers:
        state = tree_map(lambda x: (x + 0) if isinstance(x, mx.array) else x, c.state)
        out.append(type(c).from_state(state))
    mx.eval([c.state for c in out])
    return out


def cache_state(session):
    """The benchmarks' seam into a session's cache state (layers, ledger): the one place they reach
    past the public API, to hand raw mlx-lm the very cache chatkit holds."""
    return session._state.conversation.cache

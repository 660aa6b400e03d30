"""Use the system's OpenBLAS for MLX's CPU build on Linux, when it is installed.

The mlx-cpu wheel links a slow reference BLAS; loading OpenBLAS globally before MLX makes MLX's
float32 matmuls resolve to it (several times faster, same results). Set CHATKIT_OPENBLAS=0 to opt out,
or CHATKIT_OPENBLAS=/path/to/libopenblas.so to name the library.
"""

from __future__ import annotations

import ctypes
import os
import sys
import warnings

_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
)


def use_system_openblas() -> str | None:
    """Load OpenBLAS globally if MLX is not imported yet; returns the library loaded, if any.

    Once MLX is loaded its BLAS symbols are bound and loading OpenBLAS changes nothing (measured:
    a 1024x1024 float32 matmul stays at ~380 ms instead of ~11 ms), so then warn once instead.
    """
    setting = os.environ.get("CHATKIT_OPENBLAS", "")
    if not sys.platform.startswith("linux") or setting == "0":
        return None
    candidates = [p for p in ([setting] if setting else []) + list(_CANDIDATES) if os.path.exists(p)]
    if "mlx.core" in sys.modules:
        if candidates and "openblas" not in os.environ.get("LD_PRELOAD", ""):
            warnings.warn(
                "mlx was imported before chatkit, so MLX keeps its slow bundled BLAS (float32 matmuls "
                "about 30x slower on this CPU). Import chatkit before mlx and mlx_lm, or run with "
                f"LD_PRELOAD={candidates[0]}; CHATKIT_OPENBLAS=0 turns this off.",
                RuntimeWarning,
                stacklevel=2,
            )
        return None
    for path in candidates:
        try:
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            return path
        except OSError:
            continue
    return None


BLAS = use_system_openblas()

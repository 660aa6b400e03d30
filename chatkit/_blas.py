"""Use the system's OpenBLAS for MLX's CPU build on Linux, when it is installed.

The mlx-cpu wheel links a slow reference BLAS; loading OpenBLAS globally before MLX makes MLX's
float32 matmuls resolve to it (several times faster, same results). Set CHATKIT_OPENBLAS=0 to opt out,
or CHATKIT_OPENBLAS=/path/to/libopenblas.so to name the library.
"""

from __future__ import annotations

import ctypes
import os
import sys

_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
)


def use_system_openblas() -> str | None:
    """Load OpenBLAS globally if MLX is not imported yet; returns the library loaded, if any."""
    setting = os.environ.get("CHATKIT_OPENBLAS", "")
    if not sys.platform.startswith("linux") or setting == "0" or "mlx.core" in sys.modules:
        return None
    for path in ([setting] if setting else []) + list(_CANDIDATES):
        if os.path.exists(path):
            try:
                ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
                return path
            except OSError:
                continue
    return None


BLAS = use_system_openblas()

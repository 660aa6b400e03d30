"""Where chatkit keeps files it makes for itself (converted GGUF models, the fetched SmolLM2 file)."""

from __future__ import annotations

import os
import sys
from pathlib import Path


def user_cache_dir() -> Path:
    """``$CHATKIT_CACHE_DIR``, else the platform's user cache folder plus ``chatkit``."""
    if os.environ.get("CHATKIT_CACHE_DIR"):
        return Path(os.environ["CHATKIT_CACHE_DIR"]).expanduser()
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Caches" / "chatkit"
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "chatkit"


__all__ = ["user_cache_dir"]

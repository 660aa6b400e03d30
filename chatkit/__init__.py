"""chatkit: stateful chat sessions with local language models, built on MLX and mlx-lm."""

from . import _blas  # noqa: F401  (must run before mlx is imported)
from .cache.state import CacheInfo, CacheOptions
from .errors import (
    CacheFileError,
    ChatKitError,
    ContextWindowExceededError,
    IncompatibleCacheError,
    IncompatibleDraftError,
    InvalidMessageError,
    InvalidParamsError,
    ModelLoadError,
    NoCacheAvailableError,
    NothingToUndoError,
    SessionBusyError,
    SpeculativeCacheRestoreError,
    TemplateError,
)
from .loading import LoadedModel, load
from .messages import ChatMessage, Role
from .params import GenerateParams
from .builder import ChatSessionBuilder
from .cache.store import CacheFileInfo
from .cache.store import inspect as inspect_cache
from .aio import AsyncResponseStream
from .pool import SessionPool
from .session import ChatSession
from .speculative import SpeculativeConfig
from .stream import ResponseStream, StreamChunk, TurnStats
from . import demo  # chatkit.demo.load(): the bundled pair, loaded only when asked for

__version__ = "0.1.0"

__all__ = [
    "AsyncResponseStream",
    "CacheFileError",
    "CacheFileInfo",
    "CacheInfo",
    "CacheOptions",
    "ChatKitError",
    "ChatMessage",
    "ChatSession",
    "ChatSessionBuilder",
    "ContextWindowExceededError",
    "GenerateParams",
    "IncompatibleCacheError",
    "IncompatibleDraftError",
    "InvalidMessageError",
    "InvalidParamsError",
    "LoadedModel",
    "ModelLoadError",
    "NoCacheAvailableError",
    "NothingToUndoError",
    "ResponseStream",
    "Role",
    "SessionBusyError",
    "SessionPool",
    "SpeculativeCacheRestoreError",
    "SpeculativeConfig",
    "StreamChunk",
    "TemplateError",
    "TurnStats",
    "inspect_cache",
    "load",
]

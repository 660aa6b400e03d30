"""chatkit: stateful chat sessions with local language models, built on MLX and mlx-lm."""

from . import _blas  # noqa: F401  (must run before mlx is imported)
from .cache.state import CacheInfo, CacheOptions
from .errors import (
    ChatKitError,
    ContextWindowExceededError,
    InvalidMessageError,
    InvalidParamsError,
    ModelLoadError,
    NoCacheAvailableError,
    NothingToUndoError,
    SessionBusyError,
    TemplateError,
)
from .loading import LoadedModel, load
from .messages import ChatMessage, Role
from .params import GenerateParams
from .session import ChatSession, ChatSessionBuilder
from .stream import ResponseStream, StreamChunk, TurnStats

__version__ = "0.1.0"

__all__ = [
    "CacheInfo",
    "CacheOptions",
    "ChatKitError",
    "ChatMessage",
    "ChatSession",
    "ChatSessionBuilder",
    "ContextWindowExceededError",
    "GenerateParams",
    "InvalidMessageError",
    "InvalidParamsError",
    "LoadedModel",
    "ModelLoadError",
    "NoCacheAvailableError",
    "NothingToUndoError",
    "ResponseStream",
    "Role",
    "SessionBusyError",
    "StreamChunk",
    "TemplateError",
    "TurnStats",
    "load",
]

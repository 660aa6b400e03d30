"""chatkit: stateful chat sessions with local language models, built on MLX and mlx-lm.

The whole public API is here (``chatkit.X``); submodules are implementation::

    lm = chatkit.load(path_or_repo_or_"demo")          -> LoadedModel  (distributed="tensor": sharded, lockstep)
    session = ChatSession.builder(lm)...build()         -> ChatSession        (ChatSessionBuilder)
    session.respond(prompt) / .stream_respond(prompt)   -> str / ResponseStream of StreamChunk
                                                        (with tools: ToolLoopStream, every round)
    session.arespond / .astream_respond                 -> async: str / AsyncResponseStream
    session.undo() .regenerate() .fork() .clear()       editing the conversation
    ContextPolicy.rolling() / .summarize()              conversations longer than the window (builder.context_policy)
    session.save_cache(path); builder.cache(path)       persistence (inspect_cache -> CacheFileInfo)
    ChatMessage, Role, ToolCall                         messages (reasoning and tool calls apart)
    GenerateParams, CacheOptions, SpeculativeConfig     settings;  TurnStats, CacheInfo: what it cost
    SessionConfig                                       a session's settings, one frozen value (session.config)
    SessionPool                                         many sessions over one model, a memory budget
    BatchEngine(lm, max_batch=16); builder.engine(e)    concurrent sessions' turns decoded together
    PromptCache(folder, ram_bytes=, disk_bytes=)        KV blocks shared by every session (builder.prompt_cache)
    load_adapter(path) / lm.adapter(path) -> Adapter    LoRA/DoRA per session: builder.adapter(a), lm.fuse(a)
    ChatKitError and its subclasses                     every error chatkit raises (see chatkit.errors)

``chatkit.demo`` locates the bundled demo models; ``chatkit.testing`` builds offline test models.
"""

from . import (
    _blas,  # noqa: F401  (must run before mlx is imported)
    demo,  # noqa: F401  (chatkit.demo.path() after a plain import)
)
from ._version import __version__ as __version__
from .cache.file import CacheFileInfo
from .cache.prompt import PromptCache, PromptCacheUsage
from .cache.state import CacheInfo, CacheOptions
from .decode.batch import BatchEngine
from .decode.speculative import SpeculativeConfig
from .errors import (
    CacheError,
    CacheFileError,
    ChatKitError,
    ContextWindowExceededError,
    DistributedError,
    IncompatibleCacheError,
    IncompatibleDraftError,
    IncompleteOutputError,
    InvalidMessageError,
    InvalidOutputSpecError,
    InvalidParamsError,
    MCPServerError,
    MissingDependencyError,
    ModelLoadError,
    NoCacheAvailableError,
    NothingToRegenerateError,
    NothingToUndoError,
    OutputValidationError,
    SessionBusyError,
    SpeculativeCacheRestoreError,
    SummaryError,
    TemplateError,
    ToolExecutionError,
    ToolLoopLimitError,
)
from .messages import ChatMessage, Role, ToolCall
from .model.adapters import Adapter, load_adapter
from .model.load import load
from .model.loaded import LoadedModel
from .params import GenerateParams
from .session.aio import AsyncResponseStream
from .session.builder import ChatSessionBuilder
from .session.config import SessionConfig
from .session.context import ContextPolicy
from .session.pool import SessionPool
from .session.results import StreamChunk, TurnStats
from .session.saved import inspect as inspect_cache
from .session.session import ChatSession
from .session.streams import ResponseStream
from .session.tool_loop import ToolLoopStream
from .tools.mcp import MCPServer

__all__ = [
    "Adapter",
    "AsyncResponseStream",
    "BatchEngine",
    "CacheError",
    "CacheFileError",
    "CacheFileInfo",
    "CacheInfo",
    "CacheOptions",
    "ChatKitError",
    "ChatMessage",
    "ChatSession",
    "ChatSessionBuilder",
    "ContextPolicy",
    "ContextWindowExceededError",
    "DistributedError",
    "GenerateParams",
    "IncompatibleCacheError",
    "IncompatibleDraftError",
    "IncompleteOutputError",
    "InvalidMessageError",
    "InvalidOutputSpecError",
    "InvalidParamsError",
    "LoadedModel",
    "MCPServer",
    "MCPServerError",
    "MissingDependencyError",
    "ModelLoadError",
    "NoCacheAvailableError",
    "NothingToRegenerateError",
    "NothingToUndoError",
    "OutputValidationError",
    "PromptCache",
    "PromptCacheUsage",
    "ResponseStream",
    "Role",
    "SessionBusyError",
    "SessionConfig",
    "SessionPool",
    "SpeculativeCacheRestoreError",
    "SummaryError",
    "SpeculativeConfig",
    "StreamChunk",
    "TemplateError",
    "ToolCall",
    "ToolExecutionError",
    "ToolLoopLimitError",
    "ToolLoopStream",
    "TurnStats",
    "inspect_cache",
    "load",
    "load_adapter",
]

"""chatkit's exceptions: one base, ``ChatKitError``, and subclasses a caller can act on.

::

    ChatKitError
    ├── ModelLoadError                 a model or tokenizer could not be loaded
    ├── TemplateError                  the chat template is missing or failed to render
    ├── InvalidMessageError            a message, prompt or role is not valid        (also ValueError)
    ├── InvalidParamsError             settings out of range or inconsistent         (also ValueError)
    │   └── SpeculativeCacheRestoreError   a draft model together with a restored cache
    ├── IncompatibleDraftError         the draft model cannot serve the target model
    ├── MissingDependencyError         an optional extra is not installed            (also ImportError)
    ├── SessionBusyError               a turn is in progress: close its stream first
    ├── ContextWindowExceededError     the prompt does not fit the model's context window
    ├── SummaryError                   a context policy's summarizer failed or wrote no text
    ├── NothingToUndoError             no exchange to undo
    ├── NothingToRegenerateError       no reply to answer again
    ├── ToolLoopLimitError             the model kept calling tools past max_tool_rounds
    ├── ToolExecutionError             a tool call failed and the session raises instead of telling the model
    ├── MCPServerError                 an MCP server did not start, exited or stopped answering
    ├── DistributedError               a rank of a sharded model died, hung or drifted apart
    ├── CacheError                     about a KV cache
    │   ├── NoCacheAvailableError      there is no cache (yet) to save
    │   ├── CacheFileError             a cache file is missing, unreadable or corrupt
    │   └── IncompatibleCacheError     a saved cache belongs to another model or tokenizer
    ├── InvalidOutputSpecError         a guided output spec is unsupported or does not compile (also ValueError)
    ├── IncompleteOutputError          a guided reply ended before its value was complete
    └── OutputValidationError          a guided value matched its schema but its type's validators refused it

A refused call changes nothing: the session is as it was before the call.
"""

from __future__ import annotations


class ChatKitError(Exception):
    """Base class of every error chatkit raises on purpose."""


class ModelLoadError(ChatKitError):
    """A model or tokenizer could not be loaded from the given path or repo id."""


class TemplateError(ChatKitError):
    """The chat template is missing or failed to render the conversation."""


class InvalidMessageError(ChatKitError, ValueError):
    """A message, prompt or role is not valid (empty prompt, unknown role, wrong type)."""


class InvalidParamsError(ChatKitError, ValueError):
    """Generation parameters or builder options are out of range or inconsistent."""


class SpeculativeCacheRestoreError(InvalidParamsError):
    """Speculative decoding with a draft model was asked for together with a restored cache."""


class IncompatibleDraftError(ChatKitError):
    """The draft model does not share the target model's tokenizer, or its cache cannot rewind."""


class SessionBusyError(ChatKitError):
    """The session already has a turn in progress; close its stream first."""


class ContextWindowExceededError(ChatKitError):
    """The prompt does not fit the model's context window."""

    def __init__(self, message: str, *, prompt_tokens: int, context_length: int) -> None:
        super().__init__(message)
        self.prompt_tokens = prompt_tokens
        self.context_length = context_length


class SummaryError(ChatKitError):
    """A ``ContextPolicy.summarize`` summarizer failed or wrote no text: the turn did not start."""


class NothingToUndoError(ChatKitError):
    """There is no exchange to undo: the history does not end with a reply."""


class NothingToRegenerateError(ChatKitError):
    """There is no reply to regenerate: the history does not end with a reply."""


class ToolLoopLimitError(ChatKitError):
    """The model still called tools after ``max_tool_rounds`` rounds; the history keeps every round."""


class ToolExecutionError(ChatKitError):
    """A tool call could not run (unknown tool, bad arguments, the tool raised) and the session was built
    with ``builder.tools(..., errors="raise")``; ``call`` is the ``ToolCall``."""

    def __init__(self, message: str, call: object) -> None:
        super().__init__(message)
        self.call = call


class MCPServerError(ChatKitError):
    """An MCP server (``chatkit.MCPServer``) did not start, exited, or stopped answering; the message names
    it and what to do. The session stays usable: in the tool loop the call's result tells the model."""


class DistributedError(ChatKitError):
    """A rank of a model sharded with ``mx.distributed`` died, hung, or ran another turn than rank 0.

    ``rank`` is the rank that raised; ``peer`` the rank that failed, when it is known.
    """

    def __init__(self, message: str, *, rank: int, peer: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank
        self.peer = peer


class CacheError(ChatKitError):
    """Base class of the errors about a KV cache: missing, unreadable, or not this model's."""


class NoCacheAvailableError(CacheError):
    """There is no KV cache yet (no turn has run, or it was cleared or released)."""


class CacheFileError(CacheError):
    """A saved cache file is missing, unreadable, corrupt or of an unknown format."""


class IncompatibleCacheError(CacheError):
    """A saved cache belongs to another model or tokenizer than the one it is restored into."""


class InvalidOutputSpecError(ChatKitError, ValueError):
    """A guided-output spec (type, JSON Schema, regex or grammar) is unsupported or does not compile."""


class IncompleteOutputError(ChatKitError):
    """Guided generation ended (``max_tokens``, a stop) before the value was complete.

    ``text`` is the constrained text produced so far; ``partial`` the partial object parsed from it.
    """

    def __init__(self, message: str, *, text: str, partial: object = None) -> None:
        super().__init__(message)
        self.text = text
        self.partial = partial


class MissingDependencyError(ChatKitError, ImportError):
    """An optional dependency (an extra such as ``chatkit[testing]``) is not installed."""


class OutputValidationError(ChatKitError):
    """A guided reply matched the schema but the type's own validators rejected it (``text`` has it)."""

    def __init__(self, message: str, *, text: str) -> None:
        super().__init__(message)
        self.text = text

__all__ = [
    "CacheError",
    "CacheFileError",
    "ChatKitError",
    "ContextWindowExceededError",
    "DistributedError",
    "IncompatibleCacheError",
    "IncompatibleDraftError",
    "IncompleteOutputError",
    "InvalidMessageError",
    "InvalidOutputSpecError",
    "InvalidParamsError",
    "MCPServerError",
    "MissingDependencyError",
    "ModelLoadError",
    "NoCacheAvailableError",
    "NothingToRegenerateError",
    "NothingToUndoError",
    "OutputValidationError",
    "SessionBusyError",
    "SpeculativeCacheRestoreError",
    "SummaryError",
    "TemplateError",
    "ToolExecutionError",
    "ToolLoopLimitError",
]

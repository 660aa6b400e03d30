"""chatkit's exceptions: one base, ``ChatKitError``, and a few subclasses a caller can act on."""

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


class SessionBusyError(ChatKitError):
    """The session already has a turn in progress; close its stream first."""


class ContextWindowExceededError(ChatKitError):
    """The prompt does not fit the model's context window."""

    def __init__(self, message: str, *, prompt_tokens: int, context_length: int) -> None:
        super().__init__(message)
        self.prompt_tokens = prompt_tokens
        self.context_length = context_length


class NothingToUndoError(ChatKitError):
    """There is no exchange to undo or no user message to answer again."""


class NoCacheAvailableError(ChatKitError):
    """There is no KV cache yet (no turn has run, or it was cleared or released)."""


class CacheFileError(ChatKitError):
    """A saved cache file is missing, unreadable, corrupt or of an unknown format."""


class IncompatibleCacheError(ChatKitError):
    """A saved cache belongs to another model or tokenizer than the one it is restored into."""




class MissingDependencyError(ChatKitError, ImportError):
    """An optional dependency (an extra such as ``chatkit[testing]``) is not installed."""


class IncompatibleDraftError(ChatKitError):
    """The draft model does not share the target model's tokenizer, or its cache cannot rewind."""


class SpeculativeCacheRestoreError(ChatKitError):
    """Speculative decoding was asked for together with a restored cache."""


__all__ = [
    "ChatKitError",
    "ModelLoadError",
    "TemplateError",
    "InvalidMessageError",
    "InvalidParamsError",
    "SessionBusyError",
    "ContextWindowExceededError",
    "NothingToUndoError",
    "NoCacheAvailableError",
    "CacheFileError",
    "IncompatibleCacheError",
    "IncompatibleDraftError",
    "MissingDependencyError",
    "SpeculativeCacheRestoreError",
]

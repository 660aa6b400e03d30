"""What ``chatkit chat --resume FILE`` reads from a saved file besides its cache: its transcript and
settings, its context policy; and a damaged file's error worded for the command line."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..errors import CacheFileError, ChatKitError
from .args import UsageError, context_policy


def unreadable_as_file_error(action: Callable[[], Any], path: str) -> Any:
    """``action()``; an error that is not chatkit's (a file whose metadata has the wrong types) becomes
    a ``CacheFileError`` naming the file."""
    try:
        return action()
    except ChatKitError:
        raise
    except Exception as exc:
        raise CacheFileError(
            f"{path!r} could not be restored ({type(exc).__name__}: {exc}): it is damaged or not a chatkit "
            "file; start a new conversation, or restore another file."
        ) from exc


def from_transcript(builder: Any, path: str, keep_instructions: bool) -> Any:
    """``builder`` with the saved file's transcript and settings, without its cache."""
    from ..session.saved import SavedConversation, inspect

    info = inspect(path)
    if info.kind != "chatkit":
        raise UsageError(f"--resume {path}: a raw mlx-lm cache has no conversation to continue with --draft; drop --draft.")
    saved = SavedConversation.of(info)
    builder = builder.history(saved.messages)
    if keep_instructions and saved.instructions is not None:
        builder = builder.instructions(saved.instructions)
    if saved.generate_params is not None:
        builder = builder.generate_params(saved.generate_params)
    return builder


def saved_policy(path: str) -> Any:
    """The context policy a saved file was made with (the chat's default for a file without one)."""
    from ..session.saved import SavedConversation, inspect

    info = inspect(path)
    saved = SavedConversation.of(info).context.policy if info.kind == "chatkit" else None
    return saved if saved is not None else context_policy(None)


__all__ = ["from_transcript", "saved_policy", "unreadable_as_file_error"]

"""Writing a file atomically: a temporary file in the same folder, fsync, rename, fsync the folder.

A save holds a lock on its temporary file while it writes, so the leftovers of a killed save can be
told apart from a save still running and removed (:func:`remove_stale_temps`). Every problem is a
``CacheFileError`` saying what to do; an earlier file at the path is intact after any failure.
"""

from __future__ import annotations

import errno
import hashlib
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import CacheFileError

try:  # POSIX: a temporary file is locked while it is written, so a stale one can be told apart
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

TEMP_SUFFIX = ".tmp.safetensors"


def write(target: Path, where: str, write_to: Callable[[str], None]) -> int:
    """Write ``target`` through ``write_to(temporary_path)`` atomically; returns the file's size."""
    folder = target.parent
    prefix = _temp_prefix(target)
    remove_stale_temps(folder, prefix)
    try:
        fd, tmp = tempfile.mkstemp(prefix=prefix, suffix=TEMP_SUFFIX, dir=folder)
    except OSError as exc:
        raise CacheFileError(write_problem(where, folder, exc)) from exc
    try:
        if fcntl is not None:
            fcntl.flock(fd, fcntl.LOCK_EX)  # released by the OS if this process dies: then it is stale
        write_to(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, target)
        sync_folder(folder)
    except BaseException as exc:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(exc, (OSError, RuntimeError, ValueError)):
            raise CacheFileError(write_problem(where, folder, exc)) from exc
        raise
    finally:
        os.close(fd)
    try:
        return target.stat().st_size
    except OSError as exc:  # e.g. the folder was removed right after the rename
        raise CacheFileError(write_problem(where, folder, exc)) from exc


def remove_stale_temps(folder: str | os.PathLike[str], prefix: str = ".") -> list[str]:
    """Delete the temporary files of saves that were killed before they finished; returns their names.

    A save holds a lock on its temporary file while it writes, so files of saves still running (in
    this or another process) are left alone. Errors are ignored: this only tidies up.
    """
    if fcntl is None:
        return []
    removed = []
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return []
    for entry in entries:
        if not (entry.name.startswith(prefix) and entry.name.endswith(TEMP_SUFFIX)):
            continue
        try:
            if not entry.is_file(follow_symlinks=False):
                continue
            fd = os.open(entry.path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.unlink(entry.path)
            removed.append(entry.name)
        except OSError:
            pass  # locked: a save is writing it
        finally:
            os.close(fd)
    return removed


def save_target(path: Any) -> Path:
    """The file a save writes: checked before anything is written, a symlink followed."""
    text = path_text(path)
    where = repr(text)
    if text.endswith(("/", os.sep)):
        raise CacheFileError(
            f"{where} ends with a path separator, so it names a folder: give a file path such as "
            f"{text}chat.safetensors."
        )
    target = Path(os.path.expanduser(text))
    name = target.name  # the name readers will open, also when it is a link
    try:
        if target.is_symlink():
            target = Path(os.path.realpath(target))  # replace the file the link points to, keep the link
            where = f"{where} (a link to {str(target)!r})"
        if target.is_dir():
            raise CacheFileError(f"{where} is a folder: give a file path such as chat.safetensors.")
        if target.exists() and not target.is_file():
            raise CacheFileError(
                f"{where} exists and is not a regular file (a device, pipe or socket): "
                "chatkit only replaces regular files; save to another path."
            )
        if not name.endswith(".safetensors"):
            raise CacheFileError(
                f"{where}: a cache file's name must end in .safetensors (mlx-lm and MLX read it by "
                f"its extension): save to {name}.safetensors instead."
            )
        folder = target.parent
        if not folder.exists():
            raise CacheFileError(
                f"Cannot save to {where}: the folder {str(folder)!r} does not exist. "
                "Create it first (e.g. mkdir -p) or save elsewhere."
            )
        if not folder.is_dir():
            raise CacheFileError(
                f"Cannot save to {where}: {str(folder)!r} is a file, not a folder. Save elsewhere."
            )
    except OSError as exc:
        raise CacheFileError(write_problem(where, target.parent, exc)) from exc
    return target


def path_text(path: Any) -> str:
    try:
        text = os.fspath(path)
    except TypeError:
        raise CacheFileError(f"A cache file path is a str or os.PathLike, got {type(path).__name__}.") from None
    if isinstance(text, bytes):
        text = os.fsdecode(text)
    if not text:
        raise CacheFileError("The cache file path is empty: give a path such as chat.safetensors.")
    if "\x00" in text:
        raise CacheFileError(f"{text!r} contains a NUL character, which no file name can hold: fix the path.")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:  # a lone surrogate, or bytes of another encoding (os.fsdecode)
        raise CacheFileError(
            f"{text!r} is not a UTF-8 path (it holds {text[exc.start]!r} at position {exc.start}): MLX reads "
            "and writes cache files only by UTF-8 names. Rename the file or use another path."
        ) from None
    return text


def _temp_prefix(target: Path) -> str:
    name = target.name
    if len(os.fsencode(name)) > 100:  # keep the temporary name within the file system's limit
        name = hashlib.sha256(os.fsencode(name)).hexdigest()[:16]
    return f".{name}."


def write_problem(where: str, folder: Path, exc: BaseException) -> str:
    """What went wrong writing ``where``, and what to do about it."""
    code = getattr(exc, "errno", None)
    hints = {
        errno.ENOENT: f"the folder {str(folder)!r} does not exist (any more): create it or save elsewhere",
        errno.ENOTDIR: "a part of the path is a file, not a folder: save elsewhere",
        errno.EACCES: f"no permission to write in {str(folder)!r}: save elsewhere or change its permissions",
        errno.EPERM: f"no permission to write in {str(folder)!r}: save elsewhere or change its permissions",
        errno.EROFS: f"{str(folder)!r} is on a read-only file system: save elsewhere",
        errno.ENAMETOOLONG: "the file name is too long for the file system: use a shorter name",
        errno.ENOSPC: "the disk is full: free some space or save elsewhere",
        errno.EDQUOT: "the disk quota is exceeded: free some space or save elsewhere",
    }
    reason = (hints.get(code) if isinstance(code, int) else None) or (getattr(exc, "strerror", None) or str(exc))
    return f"Could not write {where}: {reason}. Any earlier file there is intact."


def sync_folder(folder: Path) -> None:
    """A change of ``folder``'s entries (a file written, renamed or removed) made durable, where the
    platform can sync a folder."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return  # not supported on this platform
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


__all__ = ["TEMP_SUFFIX", "path_text", "remove_stale_temps", "save_target", "sync_folder", "write", "write_problem"]

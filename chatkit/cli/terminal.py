"""The terminal side of the REPL: reading lines (prompt_toolkit when stdin is a terminal) and Ctrl-C
while MLX works."""

from __future__ import annotations

import os
import select
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

try:  # POSIX only; elsewhere Ctrl-C falls back to a signal handler
    import termios
except ImportError:  # pragma: no cover
    termios = None  # type: ignore[assignment]

HISTORY_ENV = "CHATKIT_HISTORY_FILE"


def history_path() -> Path | None:
    """Where the REPL keeps its input history: ``$CHATKIT_HISTORY_FILE`` (empty: nowhere), else
    ``history`` in the user's data folder (``$XDG_DATA_HOME/chatkit`` on Linux)."""
    override = os.environ.get(HISTORY_ENV)
    if override is not None:
        return Path(os.path.expanduser(override)) if override else None
    import platformdirs

    return platformdirs.user_data_path("chatkit") / "history"


def line_reader(interactive: bool, prompt: str = "you> ") -> Callable[[str], str]:
    """A function returning the next line (``EOFError`` at the end, ``KeyboardInterrupt`` on Ctrl-C).

    ``interactive`` (stdin and stdout are a terminal): prompt_toolkit, with line editing, the history
    file, Ctrl-R and multi-line paste; ``default`` pre-fills the line, and one that ends with ``"\n"``
    is taken as typed (a line typed ahead, Enter included). Otherwise, or without
    prompt_toolkit: plain ``input`` (piped input).
    """
    if interactive:
        try:
            return _prompt_toolkit_reader(prompt)
        except ImportError:
            pass

    def plain(default: str = "") -> str:
        if default.endswith("\n"):  # a whole line typed ahead (ReplyKeys.take_typed)
            print(prompt + default if interactive else "", end="")
            return default[:-1]
        previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C here: KeyboardInterrupt
        try:
            return input(prompt if interactive else "")
        except EOFError:
            if interactive:
                print()  # Ctrl-D: leave the shell's prompt on a line of its own
            raise
        finally:
            signal.signal(signal.SIGINT, previous)

    return plain


def _prompt_toolkit_reader(prompt: str) -> Callable[[str], str]:
    from prompt_toolkit import PromptSession
    from prompt_toolkit.history import FileHistory, InMemoryHistory
    from prompt_toolkit.key_binding import KeyBindings

    path = history_path()
    history: Any = InMemoryHistory()
    if path is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.touch(exist_ok=True)
            history = FileHistory(str(path))
        except OSError as exc:
            print(f"note: no history file ({exc}); set {HISTORY_ENV} to a writable path.", file=sys.stderr)
    keys = KeyBindings()

    @keys.add("escape", "enter")
    def _newline(event: Any) -> None:  # Esc (or Alt) + Enter: a new line inside the message
        event.current_buffer.insert_text("\n")

    # Enter sends the line; pasted text (bracketed paste) keeps its newlines and is sent as one message.
    session: Any = PromptSession(history=history, key_bindings=keys, enable_history_search=False,
                                 output=_output_without_cpr())

    def read(default: str = "") -> str:
        previous = signal.signal(signal.SIGINT, signal.default_int_handler)
        try:  # a line typed ahead with its Enter (ReplyKeys.take_typed) is shown and taken as it is
            return session.prompt(prompt, default=default.rstrip("\n"), accept_default=default.endswith("\n"))
        finally:
            signal.signal(signal.SIGINT, previous)

    return read


def _output_without_cpr() -> Any:
    """prompt_toolkit's terminal output, told not to ask the terminal where the cursor is (a CPR,
    ``ESC [6n``). A terminal that never answers (some emulators, pexpect, a serial console) made
    each line wait for the answer, then print a warning, and a line typed meanwhile was held; the
    REPL draws no menus below the prompt, so it never needs the answer (as PROMPT_TOOLKIT_NO_CPR=1)."""
    from prompt_toolkit.output import create_output

    output = create_output()
    if hasattr(output, "enable_cpr"):  # a VT100 terminal (Windows consoles are asked otherwise)
        output.enable_cpr = False
    return output


class ReplyKeys:
    """Ctrl-C while MLX works: recorded in :attr:`pressed`, never raised inside MLX.

    Why not a signal handler alone: the terminal sends SIGINT to the whole foreground process group,
    and MLX's CPU backend compiles kernels by running ``g++`` in a child process the first time a
    fused function runs (the first reply). SIGINT kills that compiler, MLX then fails to load the
    missing library ("Could not load C++ shared library") and the turn is lost. So while MLX works
    the terminal does not turn Ctrl-C into a signal (ISIG off): a thread reads the key from the
    terminal instead, and no child of this process ever sees it. Between reading a line and that
    switch, and for a SIGINT sent by other means (``kill -INT``), :meth:`installed`'s handler sets
    the flag. Other keys typed meanwhile are kept for the next prompt, and a line ended with Enter is
    read there as if typed at it (type-ahead, as a terminal in its usual mode keeps it).
    """

    def __init__(self) -> None:
        self.pressed = threading.Event()
        self.typed = ""
        self._fd = _terminal_fd()
        self._depth = 0  # a command that streams a reply (/retry) enters twice

    @contextmanager
    def installed(self) -> Iterator[ReplyKeys]:
        """For the REPL's lifetime: SIGINT sets :attr:`pressed` instead of raising ``KeyboardInterrupt``
        (reading a line restores the default; see :func:`line_reader`)."""
        previous = signal.signal(signal.SIGINT, lambda *_: self.pressed.set())
        try:
            yield self
        finally:
            signal.signal(signal.SIGINT, previous)

    @contextmanager
    def active(self) -> Iterator[ReplyKeys]:
        """Watch the terminal for Ctrl-C while the block runs (MLX work: a reply, a load, a save)."""
        fd = self._fd
        if self._depth or fd is None or not _in_foreground(fd):
            yield self
            return
        self._depth += 1
        saved, stop, watcher = None, threading.Event(), None
        try:
            saved = termios.tcgetattr(fd)
            mode = list(saved)
            mode[3] &= ~(termios.ISIG | termios.ICANON | termios.ECHO)
            mode[6] = list(mode[6])
            mode[6][termios.VMIN], mode[6][termios.VTIME] = 1, 0
            termios.tcsetattr(fd, termios.TCSANOW, mode)
            watcher = threading.Thread(target=self._watch, args=(fd, saved, stop), daemon=True)
            watcher.start()
        except (termios.error, OSError):
            saved = None
        try:
            yield self
        finally:
            stop.set()
            if watcher is not None:
                watcher.join()
            if saved is not None:
                termios.tcsetattr(fd, termios.TCSANOW, saved)
            self._depth -= 1

    def _watch(self, fd: int, saved: list[Any], stop: threading.Event) -> None:
        intr = saved[6][termios.VINTR]
        intr = intr if isinstance(intr, bytes) else bytes([intr])
        while not stop.is_set():
            try:
                ready, _, _ = select.select([fd], [], [], 0.05)
                data = os.read(fd, 1024) if ready else b""
            except OSError:
                return
            if intr in data:
                self.pressed.set()
                data = data.replace(intr, b"")
            text = data.decode("utf-8", "ignore")
            if text and "\x1b" not in text:  # keep plain typing and Enter; drop escape sequences (arrows...)
                self.typed += "".join(c if c.isprintable() else "\n" for c in text if c.isprintable() or c in "\r\n")

    def take_typed(self) -> str:
        """What was typed during the last replies, for the next prompt: a line with its Enter (ending in
        ``"\n"``: the prompt takes it as typed; the rest waits for the prompt after), or text to pre-fill it."""
        line, end, self.typed = self.typed.partition("\n")
        return line + end


def _terminal_fd() -> int | None:
    """The terminal Ctrl-C comes from: stdin, or the controlling terminal when input is piped;
    ``None`` without one."""
    if termios is None:
        return None
    try:
        return sys.stdin.fileno() if sys.stdin.isatty() else os.open("/dev/tty", os.O_RDWR | os.O_NOCTTY)
    except (AttributeError, ValueError, OSError):
        return None


def _in_foreground(fd: int | None) -> bool:
    """Whether this process may change the terminal's mode (from the background it would be stopped)."""
    try:
        return fd is not None and os.tcgetpgrp(fd) == os.getpgrp()
    except OSError:
        return False


__all__ = ["ReplyKeys", "history_path", "line_reader"]

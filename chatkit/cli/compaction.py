"""The REPL and the context window: the notice of a turn that compacted, ``/context``, and the next
compaction prepared while the user types (``session.prepare_compaction()`` on a thread of its own,
waited for before the REPL does anything else with the session)."""

from __future__ import annotations

import threading
from typing import Any

POLICIES = {
    "error": "error (a message past the window is refused)",
    "rolling": "rolling (the oldest exchanges leave what the model sees)",
    "summarize": "summarize (the oldest exchanges leave what the model sees, folded into a summary)",
}


def compaction_notice(stats: Any, dropped: int) -> str | None:
    """The line saying that a turn compacted (``dropped``: messages it took out of what the model sees),
    or ``None`` when it did not."""
    if dropped <= 0 and (stats is None or not stats.compacted):
        return None
    line = f"· context compacted: dropped {dropped} earlier message{'s' if dropped != 1 else ''}"
    if stats is not None and stats.compacted:
        line += f" ({stats.dropped_tokens} tokens)"
        if stats.summary_tokens:
            line += f", summary {stats.summary_tokens} tokens"
    return line + "; /context shows what the model sees"


def context_report(session: Any) -> str:
    """What ``/context`` says: the window and the tokens in use, the policy, what was dropped, the summary."""
    from ..messages import Role
    from ..session.context import SUMMARY_HEADER

    window, used = session.context_window, session.token_count
    share = f" ({used / window:.0%})" if window else ""
    lines = [f"context: {used} of {window or 'an unknown number of'} tokens in use{share}",
             f"policy: {POLICIES.get(session.context_policy.mode, session.context_policy.mode)}"]
    history, dropped = session.history, len(session.dropped_messages)
    if dropped:
        lines.append(f"dropped: {dropped} of {len(history)} messages are no longer shown to the model "
                     "(the conversation keeps them: /save saves them)")
    else:
        lines.append(f"dropped: nothing; the model sees all {len(history)} messages")
    context = session.context
    system = context[0].content if context and context[0].role is Role.SYSTEM else ""
    if SUMMARY_HEADER in system:
        lines.append(f"summary: {system.split(SUMMARY_HEADER, 1)[1].strip()}")
    return "\n".join(lines)


class Preparation:
    """The next compaction, prepared on a thread between turns; :meth:`wait` before using the session
    again returns the error it met (a ``ChatKitError``, or any other), if any."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def start(self, session: Any) -> None:
        self.wait()

        def run() -> None:
            import mlx.core as mx

            try:
                session.prepare_compaction()
            except Exception as exc:  # said before the next turn, which then compacts by itself
                self._error = exc
            finally:
                mx.clear_streams()  # MLX wants a thread's streams destroyed before the thread ends

        self._thread = threading.Thread(target=run, name="chatkit-prepare", daemon=False)
        self._thread.start()

    def wait(self) -> BaseException | None:
        """Until the preparation (if any) has ended; the error it met."""
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()
        error, self._error = self._error, None
        return error


__all__ = ["Preparation", "compaction_notice", "context_report"]

"""Conversations that outlive the context window: what the model sees of a long history.

A :class:`ContextPolicy` says what a turn does when its prompt plus the reply's room would not fit the
window: ``error()`` (the default: nothing is dropped silently), ``rolling()`` (drop the oldest whole
exchanges, after the first ``keep_first``, down to ``low_water`` of the window) or ``summarize()`` (the
same, the dropped exchanges folded into a running summary shown with the instructions). The history
keeps every message; a :class:`Window` says which of them the model sees. An exchange is a prompt
with everything that answers it (reasoning, tool calls, tool results): a call is never cut from its result.

Dropping down to a low-water mark, not just under the window, makes the re-prefill it costs rare: the
cache keeps everything before the first dropped message and the turns after it append again.
"""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from ..errors import ContextWindowExceededError, InvalidParamsError, SummaryError
from ..messages import ChatMessage, Role

MODES = ("error", "rolling", "summarize")
SUMMARY_HEADER = "Summary of the earlier conversation:"
SUMMARY_PROMPT = (
    "Write down, as a short list, every fact the user told about themselves (names, places, numbers, "
    "preferences) and anything that was decided."
)

Render = Callable[["Window", Sequence[ChatMessage]], list[int]]  # a window over messages -> prompt ids
Summarize = Callable[[str | None, Sequence[ChatMessage]], "str | None"]  # (so far, dropped) -> new (None: none)
SUMMARY_TIMEOUT = 120.0  # seconds a summarizer callable may take before the policy's fallback applies


@dataclass(frozen=True)
class ContextPolicy:
    """What happens when a conversation outgrows the context window. Build one with :meth:`error`,
    :meth:`rolling` or :meth:`summarize`; give it to ``builder.context_policy(...)`` or assign
    ``session.context_policy``."""

    mode: str = "error"
    low_water: float = 0.5
    keep_first: int = 0
    reserve: int | None = None
    summarizer: Any = None
    prompt: str | None = None
    high_water: float = 0.8
    fallback: str = "rolling"
    summary_timeout: float = SUMMARY_TIMEOUT
    shift: bool = False

    @classmethod
    def error(cls) -> ContextPolicy:
        """A prompt that does not fit raises ``ContextWindowExceededError`` (nothing is dropped)."""
        return cls("error")

    @classmethod
    def rolling(cls, low_water: float = 0.5, keep_first: int = 0, reserve: int | None = None, *,
                high_water: float = 0.8, shift: bool = False) -> ContextPolicy:
        """When the prompt plus the reply's room (``max_tokens``, or ``reserve`` tokens) would not fit, the
        oldest whole exchanges after the first ``keep_first`` leave what the model sees, until the prompt
        takes at most ``low_water`` of the window. The history keeps them. Past ``high_water`` the next
        compaction can be prepared between turns (``session.prepare_compaction()``). ``shift=True``: the
        dropped exchanges leave the KV cache itself (the kept keys re-rotated to their new positions), so
        the turn prefills only its new message; inexact by nature (see docs/context.md)."""
        return cls("rolling", low_water, keep_first, reserve, high_water=high_water, shift=shift).checked()

    @classmethod
    def summarize(
        cls, low_water: float = 0.5, summarizer: Any = None, prompt: str | None = None, *, keep_first: int = 0,
        reserve: int | None = None, high_water: float = 0.8, fallback: str = "rolling",
        summary_timeout: float = SUMMARY_TIMEOUT,
    ) -> ContextPolicy:
        """As :meth:`rolling`, but the dropped exchanges are folded into a running summary shown to the
        model after the instructions. ``summarizer``: ``None`` (the session's own model writes it), another
        ``chatkit.LoadedModel``, or a callable ``list[ChatMessage] -> str``; ``prompt``: what the model is
        asked (default :data:`SUMMARY_PROMPT`). Past ``high_water`` of the window the next compaction can be
        prepared between turns (``session.prepare_compaction()``); a turn that comes while it is being
        prepared waits for it (``fallback="wait"``) or drops without a new summary (``"rolling"``). A
        summarizer callable that has not returned after ``summary_timeout`` seconds is abandoned: with
        ``"rolling"`` the exchanges drop without a new summary, with ``"wait"`` the turn raises ``SummaryError``."""
        return cls("summarize", low_water, keep_first, reserve, summarizer, prompt, high_water, fallback,
                   summary_timeout).checked()

    def room(self, max_tokens: int) -> int:
        """The tokens a reply needs after its prompt: ``reserve``, else the reply's ``max_tokens``."""
        return self.reserve if self.reserve is not None else max_tokens

    def checked(self) -> ContextPolicy:
        """This policy, or ``InvalidParamsError`` saying which setting is wrong."""
        if self.mode not in MODES:
            raise InvalidParamsError(f"context policy mode {self.mode!r}: use one of {MODES}.")
        for name, value in (("low_water", self.low_water), ("high_water", self.high_water)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1:
                raise InvalidParamsError(f"{name}={value!r}: use a fraction of the window between 0 and 1 (e.g. 0.5).")
        if self.high_water <= self.low_water:
            raise InvalidParamsError(f"high_water={self.high_water} must be above low_water={self.low_water}.")
        if isinstance(self.keep_first, bool) or not isinstance(self.keep_first, int) or self.keep_first < 0:
            raise InvalidParamsError(f"keep_first={self.keep_first!r}: use an int >= 0 (exchanges always kept).")
        if self.reserve is not None and (isinstance(self.reserve, bool) or not isinstance(self.reserve, int)
                                         or self.reserve < 1):
            raise InvalidParamsError(f"reserve={self.reserve!r}: use None (max_tokens) or an int >= 1 (tokens).")
        if not isinstance(self.shift, bool) or self.shift and self.mode != "rolling":
            raise InvalidParamsError(f"shift={self.shift!r}: a bool, True only with ContextPolicy.rolling().")
        if self.fallback not in ("rolling", "wait"):
            raise InvalidParamsError(f"fallback={self.fallback!r}: use 'rolling' or 'wait'.")
        if isinstance(self.summary_timeout, bool) or not isinstance(self.summary_timeout, (int, float)) \
                or not 0 < self.summary_timeout < math.inf:
            raise InvalidParamsError(f"summary_timeout={self.summary_timeout!r}: use a number of seconds > 0.")
        if self.prompt is not None and (not isinstance(self.prompt, str) or not self.prompt.strip()):
            raise InvalidParamsError("prompt= is the summarizer's instruction: a non-empty str, or None.")
        if self.summarizer is not None and not callable(self.summarizer) and not hasattr(self.summarizer, "tokenizer"):
            raise InvalidParamsError("summarizer= takes None, a chatkit.load(...) result or a callable(messages) -> str.")
        return self

    def to_dict(self) -> dict[str, Any]:
        """The policy as JSON (a summarizer object is not saved: a restored session summarizes with its model)."""
        return {"mode": self.mode, "low_water": self.low_water, "keep_first": self.keep_first, "reserve": self.reserve,
                "prompt": self.prompt, "high_water": self.high_water, "fallback": self.fallback,
                "summary_timeout": self.summary_timeout, **({"shift": True} if self.shift else {})}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ContextPolicy:
        """The policy :meth:`to_dict` wrote; ``InvalidParamsError`` for anything else."""
        if not isinstance(data, Mapping):
            raise InvalidParamsError(f"ContextPolicy.from_dict takes a dict (ContextPolicy.to_dict()), got "
                                     f"{type(data).__name__}.")
        known = {k: data[k] for k in ("mode", "low_water", "keep_first", "reserve", "prompt", "high_water", "fallback",
                                      "summary_timeout", "shift") if k in data}
        return cls(**known).checked()


@dataclass(frozen=True)
class Window:
    """Which messages of a history the model sees: the first ``head`` and those from ``start`` on, after
    the instructions and the ``summary`` of what lies between (``None``: no summary)."""

    head: int = 0
    start: int = 0
    summary: str | None = None

    def visible(self, messages: Sequence[ChatMessage]) -> list[ChatMessage]:
        if self.start <= self.head:
            return list(messages)
        return [*messages[: self.head], *messages[self.start :]]

    def dropped(self, messages: Sequence[ChatMessage]) -> list[ChatMessage]:
        return list(messages[self.head : self.start])

    def to_dict(self) -> dict[str, Any]:
        return {"head": self.head, "start": self.start, "summary": self.summary}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], messages: int) -> Window:
        """A saved window over a history of ``messages`` messages; ``InvalidParamsError`` if it cannot be one."""
        head, start, summary = data.get("head"), data.get("start"), data.get("summary")
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (head, start)) or not (
            0 <= head <= start <= messages  # type: ignore[operator]
        ) or not (summary is None or isinstance(summary, str)):
            raise InvalidParamsError(f"not a window over {messages} messages: {dict(data)!r}")
        return cls(head, start, summary)  # type: ignore[arg-type]


@dataclass(frozen=True)
class Fit:
    """What a turn's prompt is after its policy: the window, the prompt ids, and what compacting did."""

    window: Window
    prompt: list[int]
    compacted: bool = False
    dropped_tokens: int = 0
    summary_tokens: int = 0


def exchange_starts(messages: Sequence[ChatMessage]) -> list[int]:
    """Where each exchange of ``messages`` starts: every message that is not a reply or a tool result."""
    return [i for i, m in enumerate(messages) if m.role not in (Role.ASSISTANT, Role.TOOL)]


def window_size(context_length: int | None, max_kv_size: int | None) -> int | None:
    """The window a policy fits prompts into: the model's, or a rotating cache's if smaller."""
    sizes = [s for s in (context_length, max_kv_size) if s is not None]
    return min(sizes) if sizes else None


@dataclass(frozen=True)
class Fitter:
    """Fits one turn's prompt into the window under a policy (see :func:`fit`)."""

    policy: ContextPolicy
    size: int | None  # the window in tokens (None: unknown, nothing to fit)
    render: Render
    count: Callable[[str], int]  # tokens of a text (a summary's)
    summarize: Summarize | None = None

    def fit(self, window: Window, base: Sequence[ChatMessage], message: ChatMessage, *, room: int,
            opaque: int = 0, prepared: Window | None = None) -> Fit:
        """The prompt of ``message`` after ``base`` seen through ``window``, compacted when the policy says
        (through ``prepared``, a compaction made ahead, when it fits): ``ContextWindowExceededError`` when
        even the instructions and the current exchange do not fit."""
        messages = [*base, message]
        prompt = self.render(window, messages)
        if self.size is None or self.policy.mode == "error":
            return Fit(window, prompt)
        room = min(room, math.floor(self.size * (1 - self.policy.low_water)))
        if opaque + len(prompt) + room <= self.size:
            return Fit(window, prompt)
        if prepared is not None:
            ready = self.render(prepared, messages)
            if opaque + len(ready) + room <= self.size:
                new = prepared.summary if prepared.summary != window.summary else None
                return Fit(prepared, ready, True, max(0, len(prompt) - len(ready)), self.count(new) if new else 0)
        return self._compact(window, messages, prompt, room, opaque)

    def ahead(self, window: Window, messages: Sequence[ChatMessage], opaque: int = 0, room: int = 0) -> Window | None:
        """The window the next compaction will use, chosen now (its summary written): ``None`` while the
        context and the next reply's ``room`` are under the policy's high-water mark (counting the room:
        with a small window, one more turn could otherwise cross it before anything was prepared)."""
        if self.size is None or self.policy.mode == "error":
            return None
        if opaque + len(self.render(window, messages)) + room < self.size * self.policy.high_water:
            return None
        nxt = ChatMessage.user(" ")  # the next prompt, unknown yet: it starts an exchange
        return self._compact(window, [*messages, nxt], self.render(window, [*messages, nxt]), 0, opaque).window

    def _compact(self, window: Window, messages: list[ChatMessage], before: list[int], room: int, opaque: int) -> Fit:
        head, starts = self._candidates(window, messages)
        target = math.floor(self.size * self.policy.low_water) - self._summary_budget() - opaque  # type: ignore[operator]
        chosen = _first_fitting(starts, lambda s: len(self.render(replace(window, head=head, start=s), messages)) <= target)
        if chosen is None:  # dropping everything droppable does not reach the low-water mark: maybe the window
            chosen = starts[-1] if starts else max(window.start, head)
        summary = window.summary
        if self.policy.mode == "summarize" and self.summarize is not None and chosen > max(window.start, head):
            written = self.summarize(window.summary, messages[max(window.start, head) : chosen])
            summary = window.summary if written is None else written  # None: timed out, dropped without a new one
        new, prompt = self._within(Window(head, chosen, summary), messages, [s for s in starts if s > chosen], opaque)
        if new.visible(messages) == window.visible(messages) and new.summary == window.summary:
            return Fit(window, before)  # nothing could be dropped, and it fits: the reply gets less room
        summary_tokens = self.count(summary) if summary and summary != window.summary else 0
        return Fit(new, prompt, compacted=True, dropped_tokens=max(0, len(before) - len(prompt)),
                   summary_tokens=summary_tokens)

    def _within(self, window: Window, messages: list[ChatMessage], later: list[int], opaque: int) -> tuple[Window, list[int]]:
        """``window`` and its prompt, or (a summary longer than its budget) a later start that fits the
        window; ``ContextWindowExceededError`` when none does."""
        for start in [window.start, *later]:
            candidate = replace(window, start=start)
            prompt = self.render(candidate, messages)
            if opaque + len(prompt) < self.size:  # type: ignore[operator]
                return candidate, prompt
        needed = opaque + len(prompt)
        summary = f" and a summary of {self.count(window.summary)} tokens" if window.summary else ""
        raise ContextWindowExceededError(
            f"Even with the older exchanges dropped, the prompt is {needed} tokens and the context window "
            f"{self.size}: the instructions{summary}, the kept exchanges and this message must fit. Shorten them, "
            f"keep fewer exchanges (keep_first), or write shorter summaries (at most {self._summary_budget()} "
            "tokens).", prompt_tokens=needed, context_length=self.size,  # type: ignore[arg-type]
        )

    def _candidates(self, window: Window, messages: list[ChatMessage]) -> tuple[int, list[int]]:
        """(the kept head's end, the exchange starts a new window may begin at: after what is dropped
        already, up to the current exchange's start, which is never dropped)."""
        starts = exchange_starts(messages)
        head = starts[self.policy.keep_first] if self.policy.keep_first < len(starts) else len(messages)
        current = starts[-1] if starts else 0
        begin = max(window.start, head)
        return head, [s for s in starts if begin < s <= current]

    def _summary_budget(self) -> int:
        """Tokens a new summary may take (kept free under the low-water mark)."""
        if self.policy.mode != "summarize" or self.size is None:
            return 0
        return summary_tokens(self.size)


def summary_tokens(size: int) -> int:
    """The longest summary, in tokens, for a window of ``size``: an eighth of it, 32 to 256."""
    return max(32, min(256, size // 8))


def _first_fitting(starts: Sequence[int], fits: Callable[[int], bool]) -> int | None:
    """The earliest start (fewest exchanges dropped) that fits; binary search, as dropping more never grows
    the prompt."""
    lo, hi, found = 0, len(starts) - 1, None
    while lo <= hi:
        mid = (lo + hi) // 2
        if fits(starts[mid]):
            found, hi = starts[mid], mid - 1
        else:
            lo = mid + 1
    return found


SummarySession = Callable[[Any, "str | None", Sequence[ChatMessage], int], Any]  # (model, instructions, history, max_tokens)


def summarizer_for(policy: ContextPolicy, lm: Any, size: int | None, new_session: SummarySession) -> Summarize | None:
    """How ``policy`` writes its summaries: its callable (given the summary so far as a system message,
    then the dropped messages), or a model (``lm`` when it names none) asked its prompt in a fresh
    session over the dropped messages (``new_session`` builds it)."""
    if policy.mode != "summarize" or size is None:
        return None
    given = policy.summarizer
    if given is not None and not hasattr(given, "tokenizer"):  # a callable
        def call(previous: str | None, dropped: Sequence[ChatMessage]) -> str | None:
            shown = [ChatMessage.system(f"{SUMMARY_HEADER}\n{previous}")] if previous else []
            return _timed(lambda: _summary_text(lambda: given([*shown, *dropped])), policy)
        return call
    model = given if given is not None else lm

    def ask(previous: str | None, dropped: Sequence[ChatMessage]) -> str:
        # One user message holding the transcript, then the request: small models summarize a transcript
        # they are shown far better than a chat they are in (measured on SmolLM2-135M).
        session = new_session(model, None, [], summary_tokens(size))
        ask_for = f"\n\n{policy.prompt or SUMMARY_PROMPT}"
        room = (session.context_window or 2**31) - summary_tokens(size) - session.count_tokens(ask_for)
        request = fitted_transcript(previous, dropped, room, session.count_tokens) + ask_for
        return _summary_text(lambda: session.respond(request))
    return ask


def fitted_transcript(previous: str | None, messages: Sequence[ChatMessage], room: int,
                      count: Callable[[str], int]) -> str:
    """:func:`transcript`, its oldest messages left out (then the summary so far cut from its start)
    until it takes at most ``room`` tokens: a long history compacted at once (a conversation restored
    or sent whole) would not fit the summarizing session's own window."""
    low, high = 0, len(messages)  # the fewest messages left out: a binary search (fewer never grow it)
    while low < high:
        mid = (low + high) // 2
        low, high = (low, mid) if count(transcript(previous, messages[mid:])) <= room else (mid + 1, high)
    if low < len(messages) or count(transcript(previous, [])) <= room:
        return transcript(previous, messages[low:])
    kept = previous or ""
    while kept and count(transcript(kept, [])) > room:
        kept = kept[len(kept) // 4 or 1:]  # a quarter at a time: the newest part stays
    return transcript(kept or None, [])


def transcript(previous: str | None, messages: Sequence[ChatMessage]) -> str:
    """The summary so far and ``messages`` as plain text, one line per message."""
    lines = [f"Summary so far: {previous}"] if previous else []
    for m in messages:
        if m.role is Role.TOOL:
            lines.append(f"Tool {m.name or ''}: {m.content}".replace("Tool : ", "Tool: "))
            continue
        text = m.content
        if m.tool_calls:
            calls = ", ".join(f"{c.name}({json.dumps(c.arguments, ensure_ascii=False)})" for c in m.tool_calls)
            text = f"{text} [called {calls}]".strip()
        lines.append(f"{m.role.value.capitalize()}: {text}")
    return "\n".join(lines)


def _summary_text(write: Callable[[], Any]) -> str:
    """What a summarizer wrote, as text: ``SummaryError`` when it failed or wrote no text."""
    try:
        text = write()
    except Exception as exc:
        raise SummaryError(f"The context policy's summarizer failed ({type(exc).__name__}: {exc}): nothing changed. "
                           "Fix the summarizer, or use ContextPolicy.rolling().") from exc
    if not isinstance(text, str) or not text.strip():
        raise SummaryError(f"The context policy's summarizer returned {type(text).__name__} {text!r:.60}, not text: "
                           "return a non-empty str.")
    return text.strip()


def _timed(write: Callable[[], str], policy: ContextPolicy) -> str | None:
    """``write()`` on a thread of its own, waited for ``policy.summary_timeout`` seconds; then abandoned (a
    callable cannot be stopped): ``None`` (drop without a new summary) or, with ``fallback="wait"``, ``SummaryError``."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["text"] = write()
        except BaseException as exc:  # handed to the waiting turn
            box["error"] = exc

    thread = threading.Thread(target=run, name=f"{threading.current_thread().name}/summarizer", daemon=True)  # whose
    thread.start()
    thread.join(policy.summary_timeout)
    if thread.is_alive():
        if policy.fallback == "rolling":
            return None
        raise SummaryError(f"The context policy's summarizer did not return within {policy.summary_timeout} s "
                           "(summary_timeout): nothing changed. Fix the summarizer, or raise summary_timeout.")
    if "error" in box:
        raise box["error"]
    return str(box["text"])


def system_text(instructions: str | None, summary: str | None) -> str | None:
    """The system prompt the model sees: the instructions, then the summary (if any) under its header."""
    if summary is None:
        return instructions
    part = f"{SUMMARY_HEADER}\n{summary}"
    return part if instructions is None else f"{instructions}\n\n{part}"


__all__ = [
    "SUMMARY_HEADER", "SUMMARY_PROMPT", "ContextPolicy", "Fit", "Fitter", "Window", "exchange_starts", "summarizer_for",
    "fitted_transcript", "summary_tokens", "system_text", "transcript", "window_size",
]

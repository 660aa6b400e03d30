"""Splitting a reply's text into its kinds (:class:`PieceKind`): the answer, reasoning and tool calls.

The markers come from what mlx-lm knows about the tokenizer (``TokenizerWrapper.has_thinking`` /
``think_start`` / ``think_end``, ``has_tool_calling`` / ``tool_call_start`` / ``tool_call_end`` /
``tool_parser``, a chat-template module's ``response_transitions``), and the text is cut by mlx-lm's
``TextStateMachine``, which holds back whatever may be the start of a marker: markers never reach
the text, also when one is split across tokens. The stream's stop strings live in the same machine
(a transition to ``None`` ends the reply).

The segmenter starts in the state the prompt left: a generation prompt that ends inside ``<think>``
(QwQ, DeepSeek-R1, ...) makes the reply start in reasoning.
"""

from __future__ import annotations

import hashlib
import json
import weakref
from array import array
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

from mlx_lm.generate import TextStateMachine

from ..errors import InvalidMessageError
from ..messages import ToolCall, new_tool_call_id
from . import formats


class PieceKind(str, Enum):
    """What a piece of a reply is, from the text layer to the server: one name per kind. A ``str``, so
    comparing with ``"text"``, ``"reasoning"``, ``"tool_call"`` or ``"tool_result"`` and JSON keep working."""

    TEXT = "text"
    """The answer."""
    REASONING = "reasoning"
    TOOL_CALL = "tool_call"
    TOOL_RESULT = "tool_result"
    """A tool's result, streamed by a tool loop (never from the model)."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


# mlx-lm's TextStateMachine names its states ("tool" is its name for a call; the formats and the
# tokenizer's response_transitions use those names): mapped to a kind here, once.
_KIND = {"normal": PieceKind.TEXT, "reasoning": PieceKind.REASONING, "tool": PieceKind.TOOL_CALL}


@dataclass(frozen=True)
class Piece:
    """Text of one kind; a completed call carries its ``ToolCall`` (with the call's text so far)."""

    kind: PieceKind
    text: str
    tool_call: ToolCall | None = None


def transitions(tokenizer: Any, stop: Sequence[str] = ()) -> dict[str, list[tuple[str, str | None]]]:
    """The state machine's transitions for this tokenizer, as mlx-lm's ``make_text_state_machine``
    builds them, except that stop strings end the reply (mlx-lm strips them and goes on): written out
    here because that function returns a built machine whose edges cannot be changed."""
    edges: dict[str, list[tuple[str, str | None]]] = {"normal": []}
    if getattr(tokenizer, "has_thinking", False):
        edges["normal"].append((tokenizer.think_start, "reasoning"))
        edges["reasoning"] = [(tokenizer.think_end, "normal")]
    if getattr(tokenizer, "has_tool_calling", False):
        response = dict(getattr(tokenizer, "response_transitions", None) or {})
        if not any(dst == "tool" for e in response.values() for _, dst in e):
            edges["normal"].append((tokenizer.tool_call_start, "tool"))
        if "reasoning" in edges:
            edges["reasoning"].append((tokenizer.tool_call_start, "tool"))
        edges["tool"] = [(tokenizer.tool_call_end, "normal")] if tokenizer.tool_call_end else []
    for marker in getattr(tokenizer, "structural_markers", None) or ():
        edges["normal"].append((marker, "normal"))
    for state, extra in (getattr(tokenizer, "response_transitions", None) or {}).items():
        edges.setdefault(state, []).extend(extra)
    fmt = reply_format(tokenizer)
    if fmt is not None:  # a format mlx-lm does not know (chatkit/text/formats/)
        for state, extra in fmt.transitions.items():
            edges.setdefault(state, []).extend(extra)
    edges["normal"].extend(_orphan_closers(tokenizer, edges))
    for state in list(edges):
        edges[state].extend((s, None) for s in stop)
    return edges


def _orphan_closers(tokenizer: Any, edges: dict[str, list[tuple[str, str | None]]]) -> list[tuple[str, str]]:
    """A closing marker met in the answer, with no block open (``</think>`` or ``</tool_call>`` alone, as
    weak models write them), is dropped like any marker: markers never reach the text."""
    opening = {marker for marker, _ in edges["normal"]}
    closers = (getattr(tokenizer, "think_end", None), getattr(tokenizer, "tool_call_end", None))
    return [(c, "normal") for c in dict.fromkeys(closers) if isinstance(c, str) and c and c not in opening]


def initial_state(tokenizer: Any, prompt: Sequence[int]) -> str:
    """``"reasoning"`` when the prompt ends inside an open think block, else ``"normal"`` (or the
    chat-template module's own initial state), as mlx-lm's server decides."""
    state = "normal"
    if getattr(tokenizer, "has_thinking", False) and prompt:
        ids = list(prompt)
        if tokenizer.rfind_think_start(ids) > tokenizer.rfind_think_end(ids):
            state = "reasoning"
    fmt = reply_format(tokenizer)
    if fmt is not None and fmt.initial_state != "normal":
        state = fmt.initial_state
    return getattr(tokenizer, "response_initial_state", None) or state


_FORMATS: weakref.WeakKeyDictionary[Any, formats.Format | None] = weakref.WeakKeyDictionary()


def reply_format(tokenizer: Any) -> formats.Format | None:
    """chatkit's own description of the tokenizer's reply format, when mlx-lm has no tool format for it
    (detected once per tokenizer, from its special tokens)."""
    if tokenizer is None or getattr(tokenizer, "has_tool_calling", False):
        return None
    try:
        return _FORMATS[tokenizer]
    except (KeyError, TypeError):
        pass
    get_vocab = getattr(tokenizer, "get_vocab", None)
    fmt = formats.detect(get_vocab()) if callable(get_vocab) else None
    try:
        _FORMATS[tokenizer] = fmt
    except TypeError:  # not weak-referenceable: detect again next time
        pass
    return fmt


class Segmenter:
    """Feeds decoded text through the state machine; hands out :class:`Piece` s and keeps the reply's
    answer, reasoning and tool calls apart. One per turn."""

    def __init__(
        self,
        tokenizer: Any,
        *,
        stop: Sequence[str] = (),
        prompt: Sequence[int] = (),
        tools: Sequence[Any] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        edges = transitions(tokenizer, stop)
        self._machine = TextStateMachine(edges)
        self._state = self._machine.make_state(initial_state(tokenizer, prompt))
        self._markers = tuple(m for e in edges.values() for m, dst in e if dst is not None)
        fmt = reply_format(tokenizer)
        self._parser: Callable[..., Any] | None = fmt.parse if fmt is not None else getattr(tokenizer, "tool_parser", None)
        self._hidden = fmt.hidden if fmt is not None else frozenset()
        # A format whose calls may come without a marker (Llama 3's bare JSON): the reply's first text is
        # held back until it shows whether the whole reply is a call.
        self._bare = fmt.bare_call if fmt is not None and self.state == "normal" else None
        self._lead = ""
        self._tools = list(tools) if tools else None
        # Tool-call ids follow from the prompt: reproducible, and the same on every rank of a sharded model.
        self._id_basis = hashlib.sha256(array("q", prompt).tobytes()).hexdigest()
        self._call_text = ""
        self.text = ""
        self.reasoning = ""
        self.tool_calls: list[ToolCall] = []
        self.stopped = False  # a stop string ended the reply
        self._entered_reasoning = self.state == "reasoning"

    def reply(self) -> tuple[str, str | None]:
        """(answer, reasoning) as a reply is committed. When the reply had reasoning or tool calls, the
        newlines next to their markers are template glue, not text (templates write ``</think>\n\n`` and
        ``\n<tool_call>`` themselves): they are stripped so the template renders the reply back as the
        model wrote it, and the next turn reuses the cache past it. A plain reply stays exact."""
        reasoning = self.reasoning.strip("\n") if self._entered_reasoning else None  # None: it did not reason
        if self._entered_reasoning or self.tool_calls:
            return self.text.strip("\n"), reasoning
        return self.text, None

    @property
    def state(self) -> str | None:
        """The machine's state: ``"normal"``, ``"reasoning"``, ``"tool"`` ...; ``None`` after a stop string."""
        return self._state[0]

    @property
    def kind(self) -> PieceKind | None:
        """The kind of the text the machine is in (``None`` after a stop string)."""
        state = self._state[0]
        return None if state is None else _KIND.get(state, PieceKind.TEXT)

    def feed(self, new: str, *, final: bool = False) -> list[Piece]:
        """The pieces ``new`` text completes; ``final`` at the end of the reply (held-back text that is
        not the start of a marker is let out, an unfinished tool call is read as it is)."""
        if self.stopped:
            return []
        if self._bare is not None:
            self._lead += new
            is_call = self._bare(self._lead, final)
            if is_call is None:
                return [Piece(PieceKind.TEXT, "")]
            new, self._lead, self._bare = self._lead, "", None
            if is_call:
                self._state = self._machine.make_state("tool")
        self._state, segments = TextStateMachine.split(self._state, new)
        if self._state[0] is None:
            self.stopped = True
            segments = segments[:-1]
        elif final:
            self._state, rest, _ = TextStateMachine.flush(self._state)
            if rest and not any(m.startswith(rest) for m in self._markers):
                segments.append((self._state[0], rest))
        pieces: list[Piece] = []
        for i, (state, text) in enumerate(segments):
            if state in self._hidden:
                continue  # control text between messages (a harmony header)
            kind = _KIND.get(state or "normal", PieceKind.TEXT)
            closes_call = kind is PieceKind.TOOL_CALL and (i < len(segments) - 1 or final or self.stopped)
            piece = self._take(kind, text, closes_call)
            if piece.text or piece.tool_call is not None:
                pieces.append(piece)
        return pieces or [Piece(_KIND.get(self._state[0] or "normal", PieceKind.TEXT), "")]

    def _take(self, kind: PieceKind, text: str, closes_call: bool) -> Piece:
        if kind is PieceKind.REASONING:
            self._entered_reasoning = True
            self.reasoning += text
        elif kind is PieceKind.TOOL_CALL:
            self._call_text += text
            if closes_call:
                calls = parse_tool_calls(self._parser, self._call_text, self._tools,
                                         id_basis=f"{self._id_basis}:{len(self.tool_calls)}")
                self._call_text = ""
                self.tool_calls.extend(calls)
                return Piece(kind, text, calls[-1] if calls else None)
        else:
            self.text += text
        return Piece(kind, text)


def parse_tool_calls(parser: Callable[..., Any] | None, text: str, tools: Sequence[Any] | None,
                     id_basis: str | None = None) -> list[ToolCall]:
    """The calls in one tool-call segment, read with mlx-lm's parser for the format. A segment that
    cannot be read becomes one ``ToolCall`` with ``error`` set (the loop tells the model). Ids the
    format does not give are derived from ``id_basis`` and the text (random without a basis)."""

    def new_id(i: int) -> str:
        return new_tool_call_id(None if id_basis is None else f"{id_basis}:{i}:{text}")

    if not text.strip():
        return []
    if parser is None:
        return [ToolCall(new_id(0), "", {}, error="This model's tool-call format is not known to chatkit.", text=text)]
    try:
        parsed = parser(text, tools)
    except Exception as exc:  # each format's parser raises its own errors (json, ValueError, ...)
        return [ToolCall(new_id(0), _guess_name(text), {}, error=f"The tool call is not valid: {exc}. It was: {text.strip()}",
                         text=text)]

    def unread(index: int, call_id: str, name: str, error: str) -> ToolCall:
        try:
            return ToolCall(call_id, name, {}, error=error, text=text)
        except InvalidMessageError:  # an id or name spelt with a lone surrogate ("\ud800" in the JSON)
            return ToolCall(new_id(index), "", {}, error=error, text=text)

    calls = []
    for index, item in enumerate(parsed if isinstance(parsed, list) else [parsed]):
        name = item.get("name") if isinstance(item, dict) else None
        arguments = item.get("arguments", {}) if isinstance(item, dict) else None
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except (json.JSONDecodeError, RecursionError):
                arguments = None
        call_id = str((item.get("id") if isinstance(item, dict) else None) or new_id(index))
        if not isinstance(name, str) or not name or not isinstance(arguments, dict):
            error = f'A tool call needs {{"name": ..., "arguments": {{...}}}}; it was: {text.strip()}'
            calls.append(unread(index, call_id, name if isinstance(name, str) else "", error))
            continue
        try:
            calls.append(ToolCall(call_id, name, arguments))
        except InvalidMessageError as exc:  # arguments no tokenizer takes: told to the model like bad JSON
            calls.append(unread(index, call_id, name, f"The tool call is not valid: {exc} It was: {text.strip()}"))
    return calls


def written_calls(tokenizer: Any, calls: Sequence[Mapping[str, Any]]) -> str | None:
    """``calls`` (``{"name", "arguments"}``) written in the tokenizer's own tool-call format, as its parser
    reads them back (for templates that cannot render calls: a model then sees past calls as it writes
    them); ``None`` when chatkit cannot write that format (marked JSON calls are what it writes)."""
    start, end = getattr(tokenizer, "tool_call_start", None), getattr(tokenizer, "tool_call_end", None)
    parser = getattr(tokenizer, "tool_parser", None)
    if not (getattr(tokenizer, "has_tool_calling", False) and start and end and parser is not None):
        return None
    blocks = []
    for call in calls:
        body = json.dumps({"name": call["name"], "arguments": call["arguments"]}, ensure_ascii=False)
        read = parse_tool_calls(parser, body, None)
        if [(c.name, c.arguments, c.error) for c in read] != [(call["name"], call["arguments"], None)]:
            return None  # the parser reads another format: do not teach the model one it cannot use
        blocks.append(f"{start}\n{body}\n{end}")
    return "\n".join(blocks)


def _guess_name(text: str) -> str:
    """The ``"name"`` of a call whose JSON is broken, when it can still be read (for the error message)."""
    start = text.find('"name"')
    if start < 0:
        return ""
    rest = text[start + 6 :].lstrip(" :")
    if rest.startswith('"') and '"' in rest[1:]:
        return rest[1 : rest.index('"', 1)]
    return ""


__all__ = [
    "Piece",
    "PieceKind",
    "Segmenter",
    "initial_state",
    "parse_tool_calls",
    "transitions",
    "written_calls",
]

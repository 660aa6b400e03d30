"""``strict_tools``: tool calls constrained to the tools' schemas; the rest of the reply stays free.

    grammar = tool_call_grammar(lm.tokenizer, session.tools)   # InvalidOutputSpecError up front
    strict = ToolCallConstraint(grammar, lm.tokenizer)          # one per reply: an mlx-lm logits processor
    # generate_step(prompt, model, logits_processors=[..., strict])

Text and reasoning are not masked. Once the reply writes its format's start marker (``<tool_call>``
for Qwen / Hermes JSON tools), an llguidance matcher takes over: the call must be
``{"name": <one of the tools>, "arguments": <that tool's parameters>}`` (strict: closed objects, the
separators the chat templates write, no free whitespace) and then the end marker. After a call the
reply may only open another call (constrained the same way; newlines between) or end, as llama.cpp's
tool grammars have it and as templates render a reply (its text first, then its calls). Formats whose
call runs to the end of the reply (Llama 3's ``<|python_tag|>``, Granite's ``<|tool_call|>``) end there.

This is llama.cpp's lazy grammar, done as a switch: the grammar is compiled once per tool set
(llguidance's ``%json`` inside a Lark rule), and a matcher exists only inside a call, so free text costs
nothing. Written here rather than with llguidance's ``StructTag`` (a whole-reply grammar with lazy
triggers) because that one masks every free token, refuses special tokens in free text (``<think>``
markers, other specials) and cannot keep a marker's *text* out of a JSON string. chatkit reads a reply
by its text (``chatkit.text.reply``), so the marker texts are watched byte by byte
(``chatkit.guided.marker_watch``):

* free text may not write the start marker in the middle of a token (its text would open a call whose
  first bytes the grammar never saw); writing it at a token's end (the marker token, or its pieces)
  opens the call;
* inside a call, the end marker's text (and a stop string) may only appear where the grammar ends the
  call, never inside a JSON string, where it would cut the call short.

Like :class:`~chatkit.guided.Constraint`, the processor follows the tokens it is shown (rolling back
when a speculative run shows fewer or other tokens), so speculative decoding gives the same tokens.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import llguidance
import mlx.core as mx
import numpy as np

from ..cache.planner import common_prefix_length
from ..errors import ChatKitError, InvalidOutputSpecError
from ..text.reply import reply_format
from .marker_watch import token_table
from .spec import output_spec
from .tokenizer import llg_tokenizer

# The separators HF chat templates write (``tojson`` is ``json.dumps``): the model writes a call as its
# template renders it back, so the model sees its own format and the next turn's prompt matches it.
CALL_JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class CallShape:
    """How one format writes its tool calls: the markers around a call (``end`` ``None``: the call runs
    to the end of the reply), the call object's name and arguments keys, whether the calls are one JSON
    array, the text between the markers and the JSON (``glue``), and properties written before the name."""

    start: str
    end: str | None
    name_key: str = "name"
    arguments_key: str = "arguments"
    array: bool = False
    glue: str = ""
    before: Mapping[str, Any] = field(default_factory=dict)


# chatkit's formats (chatkit/text/formats/) whose calls are JSON; harmony and DeepSeek write the name
# outside the JSON and are refused.
SHAPES: dict[str, CallShape] = {
    "llama3": CallShape("<|python_tag|>", None, arguments_key="parameters"),
    "granite": CallShape("<|tool_call|>", None, array=True),
    "command_r": CallShape(
        "<|START_ACTION|>", "<|END_ACTION|>", name_key="tool_name", arguments_key="parameters", array=True,
        before={"tool_call_id": {"type": "string", "pattern": "^[0-9]{1,3}$"}},
    ),
}


@dataclass(frozen=True, eq=False)
class ToolCallGrammar:
    """The compiled constraint of one tool set over one tokenizer's format (see :func:`tool_call_grammar`)."""

    format: str
    shape: CallShape
    grammar: str  # llguidance's grammar of one call, from the text after the start marker to its end
    tools: tuple[str, ...]
    single: bool = False  # at most one call per reply (OpenAI's parallel_tool_calls=false)


def call_shape(tokenizer: Any) -> tuple[str, CallShape]:
    """(format name, shape) of the tokenizer's tool calls; ``InvalidOutputSpecError`` when strict tool
    calls are not available for it."""
    supported = ("Qwen / Hermes <tool_call> JSON, Llama 3 <|python_tag|>, Granite <|tool_call|> and "
                 "Command R <|START_ACTION|>")
    parser = getattr(tokenizer, "tool_parser", None)
    if getattr(tokenizer, "has_tool_calling", False):
        module = getattr(parser, "__module__", "") or ""
        name = module.rsplit(".", 1)[-1] or "unknown"
        start, end = tokenizer.tool_call_start, tokenizer.tool_call_end
        if name == "json_tools" and start and end:
            return name, CallShape(start, end, glue="\n")
    else:
        fmt = reply_format(tokenizer)
        name = fmt.name if fmt is not None else ""
        if name in SHAPES:
            return name, SHAPES[name]
        if fmt is None:
            raise InvalidOutputSpecError(
                "strict_tools needs the model's tool-call format, and this tokenizer has none that chatkit knows "
                f"(strict calls work for {supported}). Drop strict_tools=True."
            )
    raise InvalidOutputSpecError(
        f"strict_tools cannot constrain this model's tool-call format ({name}); it works for {supported}. "
        "Drop strict_tools=True: calls are still checked against the schemas, and a bad one is told to the model."
    )


def tool_call_grammar(tokenizer: Any, tools: Sequence[Mapping[str, Any]], *, single: bool = False) -> ToolCallGrammar:
    """Compile the strict tool-call grammar of ``tools`` (OpenAI-style schema dicts, as
    ``session.tools`` gives them) for ``tokenizer``'s format; ``single``: a reply makes at most one
    call (the reply ends after it). Raises ``InvalidOutputSpecError`` for a
    format that cannot be constrained, or a tool whose parameters schema is invalid or uses what
    guided generation cannot enforce."""
    fmt, shape = call_shape(tokenizer)
    calls, names, defs = [], [], {}
    for i, tool in enumerate(tools):
        function = tool.get("function", tool)
        name = function["name"]
        parameters = function.get("parameters") or {"type": "object"}
        try:
            arguments = output_spec(dict(parameters)).schema
            assert arguments is not None
            arguments, own = _hoist_definitions(arguments, f"t{i}_")
        except InvalidOutputSpecError as e:
            raise InvalidOutputSpecError(f"Tool {name!r}: its parameters schema cannot be enforced: {e}") from e
        defs.update(own)
        properties = {**shape.before, shape.name_key: {"const": name}, shape.arguments_key: arguments}
        calls.append({"type": "object", "properties": properties, "required": list(properties),
                      "additionalProperties": False})
        names.append(name)
    if not calls:
        raise InvalidOutputSpecError("strict_tools needs at least one tool: give tools, or drop strict_tools=True.")
    one = calls[0] if len(calls) == 1 else {"anyOf": calls}
    schema = {"type": "array", "items": one, "minItems": 1, **({"maxItems": 1} if single else {})} if shape.array else dict(one)
    schema["x-guidance"] = CALL_JSON_OPTIONS
    if defs:
        schema["$defs"] = defs
    llt = llg_tokenizer(tokenizer)
    glue = json.dumps(shape.glue) if shape.glue else ""
    end = "" if shape.end is None else _marker(tokenizer, llt, shape.end)
    lark = f"%llguidance {{}}\nstart: {glue} call {glue} {end}\ncall: %json {json.dumps(schema)}\n"
    grammar = llguidance.LLMatcher.grammar_from_lark(lark)
    matcher = llguidance.LLMatcher(llt, grammar, log_level=0)
    if matcher.is_error():
        raise InvalidOutputSpecError(f"The tools' call grammar does not compile: {matcher.get_error().strip()}. Fix the tool schemas.")
    return ToolCallGrammar(fmt, shape, grammar, tuple(names), single)


def _hoist_definitions(schema: dict[str, Any], prefix: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """``schema`` without its ``$defs`` / ``definitions`` (refs renamed ``#/$defs/<prefix><name>``), and
    those definitions: a tool's parameters go inside the call's schema, where ``#/$defs/...`` would
    point at the call's root, so their definitions move there."""
    defs = {**schema.get("definitions", {}), **schema.get("$defs", {})}

    def walk(node: Any) -> Any:
        if isinstance(node, list):
            return [walk(v) for v in node]
        if not isinstance(node, dict):
            return node
        out = {}
        for key, value in node.items():
            if key == "$ref" and isinstance(value, str):
                for root in ("#/$defs/", "#/definitions/"):
                    if value.startswith(root) and value[len(root):].split("/")[0] in defs:
                        value = "#/$defs/" + prefix + value[len(root):]
                        break
                else:
                    raise InvalidOutputSpecError(
                        f"$ref {value!r} points outside the schema's own $defs, which a tool call cannot embed: "
                        "put the definitions under $defs."
                    )
            out[key] = walk(value)
        return out

    body = walk({k: v for k, v in schema.items() if k not in ("$defs", "definitions")})
    return body, {prefix + name: walk(d) for name, d in defs.items()}


def _marker(tokenizer: Any, llt: llguidance.LLTokenizer, text: str) -> str:
    """The end marker in Lark: its token when it is one special token (llguidance keeps those out of
    text), else its text."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) == 1 and llt.is_special_token(ids[0]):
        return f"<[{ids[0]}]>"
    return json.dumps(text)


# -- the processor -------------------------------------------------------------------------------------

# Free text / inside a call / after a call: only another call or the end / after the last call: only the end /
# a reply that must call (``required``) before its first call: only the start of a call.
FREE, CALL, AFTER, END, OPEN = "free", "call", "after", "end", "open"
GLUE_NEWLINES = 2  # newlines a reply may write between two calls (templates write one)


@dataclass(frozen=True)
class _At:
    """The state after a reply token: the phase, each watch's KMP state, where the current call began,
    the text written since the last call ended."""

    phase: str
    states: tuple[int, ...]
    call_start: int = -1
    after: bytes = b""


class ToolCallConstraint:
    """An mlx-lm logits processor for one reply (one per turn; not thread-safe): free text, and tool
    calls that match ``grammar`` (see the module docstring). ``stop`` are the turn's stop strings, kept
    out of a call as its end marker is. ``required``: the reply is calls only, opening with one
    (OpenAI's ``tool_choice="required"``; no free text or reasoning before it)."""

    def __init__(self, grammar: ToolCallGrammar, tokenizer: Any, *, stop: Sequence[str] = (), overlap: bool = True,
                 required: bool = False) -> None:
        self.grammar = grammar
        self._llt = llg_tokenizer(tokenizer)
        self._table = token_table(tokenizer)
        shape = grammar.shape
        self._start_watch = self._table.watch(shape.start)
        # Inside a call, what would end the tool segment early: the end marker, a stop string.
        self._inside = [self._table.watch(t) for t in ([shape.end] if shape.end else []) + [s for s in stop if s]]
        self._watches = [self._start_watch, *self._inside]
        self._eos = frozenset(int(t) for t in self._llt.eos_tokens)
        self._overlap = overlap
        self._tokens: list[int] = []
        self._at: list[_At] = [_At(OPEN if required else FREE, tuple(0 for _ in self._watches))]
        self._matcher: llguidance.LLMatcher | None = None
        self._matcher_start = -1  # the call_start the matcher belongs to
        self._consumed = 0
        self._start: int | None = None  # the processor's prompt length (from its first call)
        self._bitmask = np.full((self._llt.vocab_size + 31) // 32, -1, dtype=np.int32)
        start = shape.start.encode("utf-8")
        self._glue_words = tuple(b"\n" * n + start for n in range(GLUE_NEWLINES + 1))
        self.mask_seconds = 0.0  # CPU time spent computing masks inside calls (for benchmarks)

    @property
    def tokens(self) -> list[int]:
        """The reply's tokens so far."""
        return list(self._tokens)

    @property
    def in_call(self) -> bool:
        """Whether the reply is inside a tool call (constrained)."""
        return self._at[-1].phase == CALL

    @property
    def calls(self) -> int:
        """How many calls the reply has opened so far."""
        return sum(1 for a, b in zip(self._at, self._at[1:]) if a.phase != CALL and b.phase == CALL)

    # -- moving ---------------------------------------------------------------------------------

    def advance(self, token: int) -> None:
        """Take the next reply token; ``ChatKitError`` for a token the constraint refuses (the token
        source did not apply its mask)."""
        token = int(token)
        at = self._at[-1]
        data = self._table.bytes[token] if token < len(self._table.bytes) else b""
        moved = [w.advance(k, data) for w, k in zip(self._watches, at.states, strict=True)]
        states = tuple(k for k, _ in moved)
        phase, call_start, after = at.phase, at.call_start, b""
        if phase == FREE:
            hit = moved[0][1]
            if hit >= 0:
                if hit != len(data):
                    self._refuse(token, f"writes {self.grammar.shape.start!r} inside a token")
                phase, call_start = CALL, len(self._tokens) + 1
        elif phase in (AFTER, OPEN):
            if phase == OPEN and token in self._eos:
                self._refuse(token, "ends a reply that must call a tool")
            if token not in self._eos or at.after.strip(b"\n"):
                after = at.after + data
                if after in self._glue_words:
                    phase, call_start, after = CALL, len(self._tokens) + 1, b""
                elif not any(w.startswith(after) for w in self._glue_words):
                    self._refuse(token, "follows a call with other than another call or the end")
        elif phase == CALL:
            matcher = self._matcher_for(call_start)
            if token in self._eos or not matcher.consume_token(token):
                self._matcher = None  # an llguidance matcher stays in its error state: rebuilt on use
                self._refuse(token, "breaks the tool-call grammar")
            self._consumed += 1
            if matcher.is_stopped():
                phase = AFTER if self.grammar.shape.end and not self.grammar.single else END
        elif token not in self._eos:
            self._refuse(token, "follows a call that runs to the end of the reply")
        self._tokens.append(token)
        self._at.append(_At(phase, states, call_start, after))

    def _refuse(self, token: int, what: str) -> None:
        raise ChatKitError(
            f"Token {token} {what}, which strict_tools refuses: apply the constraint to every step "
            "(pass it as a logits processor)."
        )

    def _matcher_for(self, call_start: int) -> llguidance.LLMatcher:
        """The matcher of the call that began at ``call_start``, holding exactly the call's tokens so far."""
        want = len(self._tokens) - call_start
        if self._matcher is not None and self._matcher_start == call_start and self._consumed >= want:
            if self._consumed > want:
                self._matcher.rollback(self._consumed - want)
                self._consumed = want
            return self._matcher
        self._matcher = llguidance.LLMatcher(self._llt, self.grammar.grammar, log_level=0)
        self._matcher_start, self._consumed = call_start, 0
        for t in self._tokens[call_start:]:
            self._matcher.consume_token(t)
            self._consumed += 1
        return self._matcher

    def rollback(self, n: int) -> None:
        """Forget the last ``n`` reply tokens."""
        n = min(n, len(self._tokens))
        if n > 0:
            del self._tokens[len(self._tokens) - n :]
            del self._at[len(self._at) - n :]

    def sync(self, tokens: Sequence[int]) -> None:
        """Bring the state to exactly the reply ``tokens`` (roll back past the common prefix, advance)."""
        tokens = [int(t) for t in tokens]
        n = len(self._tokens)
        if len(tokens) >= n and tokens[:n] == self._tokens:
            common = n
        else:
            common = common_prefix_length(self._tokens, tokens)
        self.rollback(n - common)
        for t in tokens[common:]:
            self.advance(t)

    # -- masking --------------------------------------------------------------------------------

    def allowed(self, vocab_size: int) -> np.ndarray | None:
        """The tokens allowed next as a bool array of ``vocab_size``, or ``None`` when every token is
        (free text that cannot misplace a marker: the usual case, at no cost)."""
        at = self._at[-1]
        if at.phase == FREE:
            banned = self._start_watch.misplaced(at.states[0])
            if not banned:
                return None
            allowed = np.ones(vocab_size, dtype=bool)
            allowed[[t for t in banned if t < vocab_size]] = False
            return allowed
        allowed = np.zeros(vocab_size, dtype=bool)
        if at.phase == END or (at.phase == AFTER and not at.after.strip(b"\n")):
            allowed[[t for t in self._eos if t < vocab_size]] = True
        if at.phase == END:
            return allowed
        if at.phase in (AFTER, OPEN):
            allowed[[t for t in self._glue_tokens(at.after) if t < vocab_size]] = True
            return allowed
        t0 = time.perf_counter()
        matcher = self._matcher_for(at.call_start)
        matcher.unsafe_compute_mask_ptr(self._bitmask.ctypes.data, self._bitmask.nbytes)
        if matcher.is_error():
            raise InvalidOutputSpecError(
                f"The tool-call grammar failed while generating: {matcher.get_error().strip().splitlines()[0]}. "
                "Simplify the tool schemas."
            )
        bits = np.unpackbits(self._bitmask.view(np.uint8), bitorder="little").view(bool)
        n = min(bits.size, vocab_size)
        allowed[:n] = bits[:n]
        banned = [t for w, k in zip(self._inside, at.states[1:], strict=True) for t in w.completing(k)
                  if t < vocab_size and allowed[t] and not self._closes(t)]
        if banned and len(banned) < allowed.sum():
            allowed[banned] = False
        # else the grammar's own text holds a stop string (e.g. stop="\n"): the stop ends the reply there.
        self.mask_seconds += time.perf_counter() - t0
        return allowed

    def _glue_tokens(self, after: bytes) -> list[int]:
        """The tokens that continue ``after`` (the text since a call ended) towards the next call:
        newlines, then the start marker, the marker's last byte at a token's end."""
        return self._table.continuing(self._glue_words, after)

    def _closes(self, token: int) -> bool:
        """Whether ``token`` (allowed by the grammar) ends the call."""
        matcher = self._matcher
        assert matcher is not None
        if not matcher.consume_token(token):
            self._matcher = None  # in its error state: rebuilt on use
            return False
        stopped = matcher.is_stopped()
        matcher.rollback(1)
        return stopped

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        """mlx-lm logits processor: ``tokens`` are the prompt (first call), then the prompt and the reply."""
        if self._start is None:
            self._start = tokens.size
        self.sync(tokens[self._start :].tolist())  # type: ignore[arg-type]
        at = self._at[-1]
        if at.phase == FREE and not self._start_watch.misplaced(at.states[0]):
            return logits  # free text: nothing to mask, nothing to wait for
        if self._overlap:
            mx.async_eval(logits)  # the forward pass runs while the mask is computed on the CPU
        allowed = self.allowed(logits.shape[-1])
        if allowed is None:
            return logits
        return mx.where(mx.array(allowed), logits, mx.array(-mx.inf, dtype=logits.dtype))


__all__ = ["CALL_JSON_OPTIONS", "CallShape", "SHAPES", "ToolCallConstraint", "ToolCallGrammar", "call_shape", "tool_call_grammar"]

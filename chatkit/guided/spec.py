"""Output specs: a Python type, a JSON Schema, a regex or a Lark grammar -> a compiled llguidance
grammar, plus the conversion of the final text to the Python value.

Bounded by default: JSON is compact (no free whitespace) and objects that declare ``properties`` are
closed (``additionalProperties: false``) unless the schema says otherwise, as OpenAI's strict
structured outputs are. A weak model given llguidance's defaults (flexible whitespace, open objects)
spends its tokens on spaces and invented keys and rarely finishes.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import typing
from collections.abc import Mapping
from functools import lru_cache
from typing import Any, Literal

import llguidance
import numpy as np
from pydantic import TypeAdapter, ValidationError
from pydantic.errors import PydanticUserError

from ..errors import IncompleteOutputError, InvalidOutputSpecError, OutputValidationError
from ..messages import check_text
from .partial import partial_json

Kind = Literal["json", "regex", "grammar"]

# Compact separators, no whitespace between tokens; a schema's own "x-guidance" overrides these.
JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False}


@dataclasses.dataclass(frozen=True, eq=False)
class OutputSpec:
    """What a guided reply must be: ``kind`` (json / regex / grammar), the llguidance ``grammar``,
    the strict JSON ``schema`` (json kinds), and ``source`` (what was given)."""

    kind: Kind
    grammar: str
    source: Any
    schema: dict[str, Any] | None = None
    adapter: TypeAdapter | None = None  # a Python type's validator; None: plain JSON or text

    @property
    def name(self) -> str:
        """A short name for the value (the type's name, the schema's title, or ``kind``)."""
        if self.adapter is not None:
            return getattr(self.source, "__name__", None) or str(self.source)
        if self.schema is not None and isinstance(self.schema.get("title"), str):
            return self.schema["title"]
        return self.kind

    def parse(self, text: str, *, complete: bool | None = None) -> Any:
        """The value of a finished reply: a validated instance of the type, the parsed JSON of a
        schema, or the text itself (regex, grammar).

        ``complete`` is whether the grammar accepted the text (a constraint knows:
        ``constraint.is_accepting()``); ``None`` checks it by parsing. Raises
        ``IncompleteOutputError`` for text that is not a complete value, ``OutputValidationError``
        when the type's own validators (beyond the JSON Schema) reject it.
        """
        if complete is False:
            raise _incomplete(self, text)
        if self.kind != "json":
            if complete is None and not matches(self, text):
                raise _incomplete(self, text)
            return text
        try:
            data = json.loads(text)
        except ValueError:
            raise _incomplete(self, text) from None
        if self.adapter is None:
            if complete is None and not matches(self, text):
                raise _incomplete(self, text)
            return data
        try:
            return self.adapter.validate_json(text)
        except ValidationError as e:
            raise OutputValidationError(
                f"The reply is valid JSON for the {self.name} schema but {self.name} rejected it: "
                f"{e.errors()[0].get('msg', e)}. Validators beyond the JSON Schema cannot be enforced "
                "while generating: express the rule in the schema (e.g. Field(ge=..., pattern=...)).",
                text=text,
            ) from e

    def partial(self, text: str) -> Any:
        """The latest partial value of ``text`` so far: for JSON, the parsed object with its complete
        fields (JSON-typed) and the rest missing (``None`` before anything is complete); otherwise
        the text itself."""
        return partial_json(text) if self.kind == "json" else text


def output_spec(
    output: Any = None,
    *,
    regex: str | None = None,
    grammar: str | None = None,
) -> OutputSpec:
    """Compile one of ``output`` (a pydantic model, dataclass, TypedDict, ``Literal[...]``,
    ``enum.Enum``, ``int``/``float``/``bool``/``str``, ``list[...]`` of these, or a JSON Schema
    dict), ``regex`` or ``grammar`` (Lark, as llguidance reads it) into an :class:`OutputSpec`.

    Raises ``InvalidOutputSpecError`` for an unsupported type, an invalid schema, a regex or grammar
    that does not compile, or one that accepts only the empty string or nothing.
    """
    given = [name for name, v in (("output", output), ("regex", regex), ("grammar", grammar)) if v is not None]
    if len(given) != 1:
        raise InvalidOutputSpecError(
            "Give exactly one of output= (a type or a JSON Schema dict), regex= or grammar=; "
            f"got {', '.join(given) or 'none'}."
        )
    if regex is not None:
        if not isinstance(regex, str):
            raise InvalidOutputSpecError(f"regex= must be a str, got {type(regex).__name__}.")
        check_text("regex=", regex, InvalidOutputSpecError)
        spec = OutputSpec("regex", llguidance.LLMatcher.grammar_from_regex(regex), regex)
    elif grammar is not None:
        if not isinstance(grammar, str):
            raise InvalidOutputSpecError(f"grammar= must be Lark grammar text, got {type(grammar).__name__}.")
        check_text("grammar=", grammar, InvalidOutputSpecError)
        spec = OutputSpec("grammar", llguidance.LLMatcher.grammar_from_lark(grammar), grammar)
    elif isinstance(output, Mapping):
        _check_depth(output)
        schema = strict_schema(_plain_json(output))
        spec = OutputSpec("json", _json_grammar(schema), output, schema)
    else:
        adapter = _adapter(output)
        try:
            raw = adapter.json_schema()
        except PydanticUserError as e:
            raise InvalidOutputSpecError(f"No JSON Schema for output={output!r}: {e}. {_SUPPORTED}") from e
        _check_depth(raw)
        schema = strict_schema(raw)
        spec = OutputSpec("json", _json_grammar(schema), output, schema, adapter)
    _check_grammar(spec)
    return spec


_SUPPORTED = (
    "Use a pydantic model, a dataclass, a TypedDict, Literal[...], an Enum, int, float, bool, str, "
    "list[...] of these, or a JSON Schema dict."
)


def _adapter(output: Any) -> TypeAdapter:
    if isinstance(output, (str, bytes)):
        raise InvalidOutputSpecError(
            f"output={output!r} is a string: pass a type or a JSON Schema dict, or regex=/grammar= for text."
        )
    if not (isinstance(output, type) or typing.get_origin(output) is not None):
        raise InvalidOutputSpecError(f"output={output!r} is not a type. {_SUPPORTED}")
    output = _typeddict_for_pydantic(output)
    try:
        return TypeAdapter(output)
    except (PydanticUserError, TypeError, AssertionError) as e:  # pydantic asserts on some types (Literal[()])
        raise InvalidOutputSpecError(f"Unsupported output type {output!r}: {e}. {_SUPPORTED}") from e


def _typeddict_for_pydantic(tp: Any) -> Any:
    """``typing.TypedDict`` as ``typing_extensions.TypedDict``: pydantic refuses the former before
    Python 3.12, and apps write the former. Keys keep their required / optional status."""
    import sys

    import typing_extensions

    if sys.version_info >= (3, 12) or not typing.is_typeddict(tp) or typing_extensions.is_typeddict is None:
        return tp
    if type(tp).__module__ == "typing_extensions":
        return tp
    hints = typing.get_type_hints(tp, include_extras=True)
    fields = {
        k: (v if k in tp.__required_keys__ else typing_extensions.NotRequired[v]) for k, v in hints.items()
    }
    return typing_extensions.TypedDict(tp.__name__, fields, total=True)  # type: ignore[operator]


MAX_DEPTH = 100  # JSON objects and arrays nested in a schema; llguidance's parser stops near 120


def _check_depth(schema: Any) -> None:
    """``InvalidOutputSpecError`` for a schema nested deeper than ``MAX_DEPTH`` (checked without
    recursion: copying or encoding a schema 3,000 deep raises ``RecursionError``)."""
    stack = [(schema, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise InvalidOutputSpecError(
                f"The JSON Schema is nested more than {MAX_DEPTH} levels deep (objects and arrays): guided "
                "generation cannot serve it. Flatten it, or name repeated parts under $defs and $ref them."
            )
        children = node.values() if isinstance(node, Mapping) else node if isinstance(node, (list, tuple)) else ()
        stack.extend((c, depth + 1) for c in children if isinstance(c, (Mapping, list, tuple)))


def _plain_json(schema: Mapping[str, Any]) -> dict[str, Any]:
    try:
        return json.loads(json.dumps(schema))
    except (TypeError, ValueError) as e:
        raise InvalidOutputSpecError(f"The JSON Schema is not JSON data: {e}. Pass plain dicts, lists and scalars.") from e


# Keywords whose value is one schema, a list of schemas, or a map of names to schemas.
_ONE = ("items", "additionalItems", "contains", "not", "if", "then", "else", "unevaluatedItems",
        "propertyNames", "additionalProperties", "unevaluatedProperties")
_MANY = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def strict_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``schema`` where every object schema that declares ``properties`` and says nothing
    of other keys (``additionalProperties``, ``patternProperties``, ``unevaluatedProperties``)
    gets ``additionalProperties: false``. An object schema without ``properties`` stays open."""

    def walk(node: Any) -> Any:
        if not isinstance(node, dict):
            return node
        node = dict(node)
        for key in _ONE:
            if isinstance(node.get(key), dict):
                node[key] = walk(node[key])
        for key in _MANY:
            if isinstance(node.get(key), list):
                node[key] = [walk(s) for s in node[key]]
        for key in _MAP:
            if isinstance(node.get(key), dict):
                node[key] = {name: walk(s) for name, s in node[key].items()}
        if isinstance(node.get("properties"), dict) and not any(
            k in node for k in ("additionalProperties", "patternProperties", "unevaluatedProperties")
        ):
            node["additionalProperties"] = False
        return node

    return walk(copy.deepcopy(schema))


def _json_grammar(schema: dict[str, Any]) -> str:
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)  # type: ignore[arg-type]
    except ValueError as e:
        raise InvalidOutputSpecError(f"Invalid JSON Schema: {e}. Fix the schema.") from e


def _check_grammar(spec: OutputSpec) -> None:
    what = {"json": "JSON Schema", "regex": "regex", "grammar": "Lark grammar"}[spec.kind]
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(spec.grammar)
    if is_error:
        raise InvalidOutputSpecError(f"The {what} does not compile: {messages[0].strip()}. Fix the {what}.")
    if messages:  # e.g. unimplemented keywords (uniqueItems): the constraint would not enforce them
        raise InvalidOutputSpecError(
            f"The {what} uses what guided generation cannot enforce: {'; '.join(m.strip() for m in messages)}. "
            "Remove it from the schema (or use a type without it)."
        )
    matcher = llguidance.LLMatcher(_byte_tokenizer(), spec.grammar, log_level=0)
    if matcher.is_error():
        raise InvalidOutputSpecError(f"The {what} does not compile: {matcher.get_error().strip()}. Fix the {what}.")
    mask = _mask(matcher)
    if not mask[:256].any():  # no first byte: nothing but the empty string (or nothing at all)
        accepts = "only the empty string" if matcher.is_accepting() else "nothing"
        raise InvalidOutputSpecError(
            f"The {what} accepts {accepts}: a reply could not contain anything. Give one that matches some text."
        )
    _walk(matcher, mask, what)


PROBE_BYTES = 256  # how far _walk follows a grammar before a turn (about 5 ms)


def _walk(matcher: llguidance.LLMatcher, mask: np.ndarray, what: str) -> None:
    """Follow the grammar along its lowest allowed byte for up to ``PROBE_BYTES`` bytes.

    llguidance builds its lexer and parser states as a reply goes, so a grammar too large for its
    limits (``a{1000000}``: "too many expressions constructed"; a Lark rule repeated 100,000 times:
    "too many items") compiles, then fails at the first token of the reply. Walking a few bytes here
    finds those before the turn (a limit met later in a reply fails that turn with the same advice)."""
    for _ in range(PROBE_BYTES):
        allowed = np.flatnonzero(mask[:256])
        if allowed.size == 0 or matcher.is_stopped():
            return
        matcher.consume_token(int(allowed[0]))
        if not matcher.is_error():
            mask = _mask(matcher)
        if matcher.is_error():
            raise InvalidOutputSpecError(beyond_matcher(what, matcher.get_error()))


def beyond_matcher(what: str, error: str) -> str:
    """The message for a grammar that compiled but exceeds the matcher's limits (``error``: llguidance's)."""
    first = error.strip().splitlines()[0] if error.strip() else "no detail"
    return (
        f"The {what} is more than guided generation (llguidance) can serve: {first}. Simplify it: smaller "
        "repetition counts ({n}), fewer alternatives or nested parts."
    )


def _mask(matcher: llguidance.LLMatcher) -> np.ndarray:
    return np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")


def matches(spec: OutputSpec, text: str) -> bool:
    """Whether ``text`` is a complete match of ``spec``'s grammar (byte by byte, model-independent)."""
    matcher = llguidance.LLMatcher(_byte_tokenizer(), spec.grammar, log_level=0)
    return matcher.consume_tokens(list(text.encode("utf-8"))) and matcher.is_accepting()


class _Bytes:
    """A tokenizer whose tokens are the 256 bytes (and an end token): checks grammars without a model."""

    eos_token_id = 256
    bos_token_id = None
    tokens = [bytes([i]) for i in range(256)] + [b"<end>"]

    def __call__(self, text: bytes) -> list[int]:
        return list(text)


@lru_cache(maxsize=1)
def _byte_tokenizer() -> llguidance.LLTokenizer:
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Bytes()))


def _incomplete(spec: OutputSpec, text: str) -> IncompleteOutputError:
    return IncompleteOutputError(
        f"The reply ended before a complete {spec.name} ({len(text)} characters so far): raise max_tokens, "
        "or ask for a smaller value. The partial text is in .text.",
        text=text,
        partial=spec.partial(text),
    )


__all__ = ["JSON_OPTIONS", "MAX_DEPTH", "Kind", "OutputSpec", "beyond_matcher", "matches", "output_spec", "strict_schema"]

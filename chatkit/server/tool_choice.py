"""OpenAI's ``tool_choice`` and ``parallel_tool_calls``: read from a request, and held to with the strict
tool-call grammar (``chatkit.guided.call_grammar``).

``"auto"`` (the default) lets the model decide; ``"none"`` keeps it from starting a call (a logit bias,
``state``); ``"required"`` and a named function (``{"type": "function", "function": {"name": ...}}``, on
``/v1/responses`` ``{"type": "function", "name": ...}``) make the reply open with a call (of that
function), and be calls only. ``parallel_tool_calls: false`` ends the reply after its first call. Both
need a model whose call format chatkit can constrain (and the guided extra); elsewhere they are a 400.
The forced calls follow the tools' schemas, as ``strict: true`` ones do.
"""

from __future__ import annotations

import json
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

from ..errors import ChatKitError
from ..params import LogitsProcessor
from .errors import BadRequestError

CHOICES = ("auto", "none", "required")
COMPILED_LIMIT = 32  # tool sets whose grammar is kept compiled (a client sends the same tools each turn)
# tokenizer -> (its tools as JSON, parallel) -> their grammar; used on the event loop's thread only
_compiled: weakref.WeakKeyDictionary[Any, dict[tuple[str, bool], Any]] = weakref.WeakKeyDictionary()


def read_choice(body: Mapping[str, Any], names: Sequence[str], *, flat: bool) -> tuple[str, str | None, bool]:
    """(choice, the forced function's name or ``None``, parallel calls allowed) of a request whose tools
    are ``names``; a named function's choice is ``"required"`` with its name."""
    choice = body.get("tool_choice")
    choice = "auto" if choice is None else choice
    name = None
    if isinstance(choice, Mapping):
        if choice.get("type") != "function":
            raise BadRequestError(f"tool_choice: only function tools can be chosen, got {choice.get('type')!r}.",
                                  param="tool_choice")
        inner = choice if flat else choice.get("function")
        name = inner.get("name") if isinstance(inner, Mapping) else None
        if not isinstance(name, str) or not name:
            shape = '{"type": "function", "name": ...}' if flat else '{"type": "function", "function": {"name": ...}}'
            raise BadRequestError(f"tool_choice: a named choice is {shape}.", param="tool_choice")
        if name not in names:
            raise BadRequestError(f"tool_choice: {name!r} is not one of the request's tools ({list(names)}).",
                                  param="tool_choice")
        choice = "required"
    elif choice not in CHOICES:
        raise BadRequestError(f"tool_choice {choice!r}: send 'auto', 'none', 'required' or a named function.",
                              param="tool_choice")
    elif choice == "required" and not names:
        raise BadRequestError("tool_choice 'required' needs tools: send the tools the model must call.",
                              param="tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise BadRequestError("parallel_tool_calls must be true or false.", param="parallel_tool_calls")
    return choice, name, parallel is not False


def call_constraint(tokenizer: Any, tools: Sequence[Mapping[str, Any]] | None, choice: str, name: str | None,
                    parallel: bool, stop: Sequence[str]) -> LogitsProcessor | None:
    """The logits processor that holds a reply to ``choice`` / ``parallel`` (``None`` when nothing
    needs holding); ``BadRequestError`` (param ``tool_choice`` or ``parallel_tool_calls``) when the
    call format of ``tokenizer`` (the model's, or its adapter's: ``with_tool_parser``) cannot be constrained."""
    required = choice == "required"
    if not tools or (not required and parallel):
        return None
    param = "tool_choice" if required else "parallel_tool_calls"
    try:
        from ..guided.call_grammar import ToolCallConstraint, call_shape, tool_call_grammar  # the guided extra
    except ImportError:
        raise BadRequestError(f"{param}: holding the model to it needs guided generation, which this chatkit "
                              "does not have installed: its administrator can add it with pip install \"chatkit[guided]\"; "
                              "or leave it out.", param=param) from None
    what = ("tool_choice " + (repr(name) if name else repr(choice))) if required else "parallel_tool_calls=false"
    try:
        call_shape(tokenizer)
    except ChatKitError:
        raise BadRequestError(f"{what}: chatkit holds the model to it with a grammar of its tool calls, and has none "
                              "for this model's call format: leave it out (the model then decides).", param=param) from None
    chosen = [t for t in tools if name is None or t["function"]["name"] == name]
    compiled = _compiled.setdefault(tokenizer, {})
    key = (json.dumps(chosen, sort_keys=True, default=str), parallel)
    grammar = compiled.pop(key, None)
    if grammar is None:
        try:
            grammar = tool_call_grammar(tokenizer, chosen, single=not parallel)
        except ChatKitError as exc:
            raise BadRequestError(f"{what}: {exc}", param=param) from exc
        while len(compiled) >= COMPILED_LIMIT:
            del compiled[next(iter(compiled))]  # the least recently used
    compiled[key] = grammar  # now the most recently used
    return ToolCallConstraint(grammar, tokenizer, stop=stop, required=required)


__all__ = ["CHOICES", "call_constraint", "read_choice"]

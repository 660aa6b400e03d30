"""Tools: Python callables (sync or async) or OpenAI-style JSON schema dicts, and calling them.

A callable's schema comes from its signature, type hints and docstring through transformers'
``get_json_schema`` (the same function ``apply_chat_template(tools=[fn])`` uses). A call's arguments
are checked against the schema before the function runs, which runs on a thread of its own with a
timeout (``run.py``); whatever goes wrong (an unknown tool, arguments that do not fit, the function
raising or timing out) becomes text the model reads as the tool's result, unless the session was
asked to raise.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import InvalidMessageError, InvalidParamsError, ToolExecutionError
from ..images import Image, as_image
from ..messages import ChatMessage, ToolCall, check_json
from .check import check_parameters
from .run import Stopped, TimedOut, ToolRun


class ToolReportedError(Exception):
    """Raised by a tool function whose tool reported an error (an MCP result with ``isError``): its text
    is the call's result, as ``Error: <text>``."""


class ToolSource:
    """What stands for several tools in a tools list (``chatkit.MCPServer``): ``tools(timeout)`` lists them
    (``timeout``: seconds, ``None``: the source's default)."""

    def tools(self, timeout: float | None = None) -> list[Tool]:
        raise NotImplementedError


@dataclass(frozen=True)
class ToolOutput:
    """What a tool returned that a str cannot hold (an MCP result): its ``text`` and its ``images``, each
    ``(data, mime_type)`` as the tool sent it (encoded bytes). A tool message shows the images to a
    vision-language model; for any other model, and for an image that cannot be read, it holds a note."""

    text: str
    images: tuple[tuple[bytes, str], ...] = ()

    def __post_init__(self) -> None:
        images = tuple(self.images) if isinstance(self.images, (list, tuple)) else None
        if not isinstance(self.text, str) or images is None or not all(
                isinstance(i, (list, tuple)) and len(i) == 2 and isinstance(i[0], bytes) and isinstance(i[1], str)
                for i in images):
            raise InvalidParamsError("ToolOutput(text, images) takes a str and a list of (bytes, mime type) pairs, "
                                     "e.g. ToolOutput('a chart', [(png_bytes, 'image/png')]).")
        object.__setattr__(self, "images", tuple((bytes(d), m) for d, m in images))

    def read(self, images: bool) -> tuple[tuple[Image, ...], str]:
        """The images the tool message shows (decoded as a user's are: PNG, JPEG, WebP or GIF, within the size
        limits; none unless ``images``) and its text: ``text`` and a note for each image it does not show."""
        shown: list[Image] = []
        notes: list[str] = []
        for data, mime in self.images:
            if not images:
                notes.append(f"[the tool returned an image ({mime}, {len(data)} bytes), which this chat cannot show the model]")
                continue
            try:
                shown.append(as_image(data))
            except InvalidMessageError as exc:  # the server's bad image: the model reads why, the turn goes on
                notes.append(f"[the tool returned an image ({mime}, {len(data)} bytes) that could not be shown: {exc}]")
        return tuple(shown), "\n\n".join([self.text] * bool(self.text) + notes)


@dataclass(frozen=True)
class Tool:
    """One tool: its JSON schema (``{"type": "function", "function": {...}}``) and, when chatkit may
    call it, the function."""

    schema: dict[str, Any]
    function: Callable[..., Any] | None = None

    @property
    def name(self) -> str:
        return str(self.schema["function"]["name"])


def as_tool(item: Tool | Callable[..., Any] | Mapping[str, Any]) -> Tool:
    """A ``Tool`` from a callable or a schema dict (``{"type": "function", "function": {...}}`` or the
    bare ``{"name", "description", "parameters"}``); ``InvalidParamsError`` for anything else."""
    if isinstance(item, Tool):
        if item.function is not None and not callable(item.function):
            raise InvalidParamsError(f"Tool.function must be callable or None, got {type(item.function).__name__}.")
        return Tool(as_tool(item.schema).schema, item.function)  # its schema checked as a dict's
    if isinstance(item, Mapping):
        function = item.get("function", item)
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str) or not function["name"]:
            raise InvalidParamsError(
                'A tool schema needs a name: {"type": "function", "function": {"name": ..., "parameters": {...}}}.'
            )
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, Mapping):
            raise InvalidParamsError(
                f"Tool {function['name']!r}: parameters must be a JSON schema dict, got {type(parameters).__name__}."
            )
        return Tool(_json_ready({"type": "function", "function": dict(function)}))
    if callable(item):
        from transformers.utils import get_json_schema  # imported on use: transformers is slow to import

        try:
            schema = get_json_schema(item)
        except Exception as exc:  # transformers' DocstringParsingException / TypeHintParsingException
            name = getattr(item, "__name__", repr(item))
            raise InvalidParamsError(
                f"Cannot make a tool schema from {name}: {exc} Give it type hints and a docstring with an "
                "Args: section (one line per parameter), or pass its JSON schema dict instead."
            ) from exc
        return Tool(_json_ready(schema), item)
    raise InvalidParamsError(f"A tool is a Python function or a JSON schema dict, got {type(item).__name__}.")


def _json_ready(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema``, checked to be JSON text a tokenizer takes (the template renders it into the prompt)
    and to hold parameters a call's arguments can be checked against (``check.check_parameters``)."""
    name = schema["function"]["name"]
    parameters = schema["function"].get("parameters")
    if parameters is not None:
        check_parameters(name, parameters)  # first: it bounds the depth json.dumps would recurse into
    check_json(f"The schema of tool {name!r}", schema, InvalidParamsError)
    return schema


def as_tools(items: Sequence[Any] | None, timeout: float | None = None) -> list[Tool] | None:
    """``as_tool`` over a list (``None`` for no tools), an ``MCPServer`` standing for its tools (listed
    within ``timeout`` seconds, ``None``: the server's default); names must be unique."""
    if items is None:
        return None
    if isinstance(items, (str, bytes, Mapping)) or callable(items) or not isinstance(items, Iterable):
        raise InvalidParamsError("tools takes a list of functions, JSON schema dicts or MCPServer s.")
    tools: list[Tool] = []
    for item in items:
        tools.extend(item.tools(timeout) if isinstance(item, ToolSource) else [as_tool(item)])
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        twice = sorted({n for n in names if names.count(n) > 1})
        raise InvalidParamsError(f"Tool names must be unique, got {names}: {', '.join(map(repr, twice))} given twice "
                                 "(rename a function, or leave out a tool or an MCP server that has the same name).")
    return tools


def call_tool(
    tools: Sequence[Tool],
    call: ToolCall,
    *,
    raise_errors: bool = False,
    timeout: float | None = None,
    stop: threading.Event | None = None,
    images: bool = False,
) -> ChatMessage:
    """Run ``call`` and return the tool message answering it (``tool_call_id`` and ``name`` set); a
    ``ToolOutput``'s images are the message's with ``images`` (a vision-language model), else notes.

    Errors become the message's text, so the model can correct itself; with ``raise_errors`` they raise
    ``ToolExecutionError`` instead. The tool runs on a thread of its own (``chatkit.tools.run``): after
    ``timeout`` seconds the call fails; once ``stop`` is set the wait ends and the call is answered as
    stopped (never raised: nothing failed). Either way an async tool is cancelled and a sync one is
    left running on its thread, its result dropped."""

    def answer(text: str) -> ChatMessage:
        return ChatMessage.tool(text, name=call.name or None, tool_call_id=call.id)

    def fail(text: str, cause: BaseException | None = None, hint: str = "") -> ChatMessage:
        if raise_errors:
            raise ToolExecutionError(f"{text} (raised because the session's tools were set with errors='raise'){hint}", call) from cause
        return answer(f"Error: {text}")

    if call.error is not None:
        return fail(call.error)
    tool = next((t for t in tools if t.name == call.name), None)
    if tool is None or tool.function is None:
        known = ", ".join(t.name for t in tools if t.function is not None) or "none"
        return fail(f"There is no tool named {call.name!r}; the tools are: {known}.")
    problem = check_arguments(tool.schema, call.arguments)
    if problem is not None:
        return fail(f"Invalid arguments for {call.name}: {problem}")
    run = ToolRun(tool.function, call.arguments, call.name)
    left = "was cancelled" if run.is_async else "was left running"
    try:
        result = run.result(timeout, stop)
    except TimedOut:
        return fail(f"{call.name} did not return within {timeout:g} s and {left}.", None,
                    ": give the builder a larger tool_timeout (None: no limit), or make the tool faster.")
    except Stopped:
        return stopped(call, f"{call.name} was stopped before it returned ({left}): the reply was closed.")
    except ToolReportedError as exc:  # the tool's own report (an MCP isError result): its text alone
        return fail(f"{call.name}: {exc}", exc)
    except Exception as exc:  # the tool's own failure is the model's to read
        return fail(f"{call.name} raised {type(exc).__name__}: {exc}", exc)
    except asyncio.CancelledError as exc:  # an async tool cancelled by something of its own
        return fail(f"{call.name} was cancelled.", exc)
    if isinstance(result, str):
        return answer(result)
    if isinstance(result, ToolOutput):
        shown, text = result.read(images)
        return ChatMessage.tool(text, name=call.name or None, tool_call_id=call.id, images=shown)
    try:
        return answer(json.dumps(result, ensure_ascii=False, default=str))
    except (TypeError, ValueError, RecursionError) as exc:  # e.g. dict keys that are tuples, a cycle
        return fail(f"{call.name} returned a {type(result).__name__} that is not JSON ({exc}): return a str "
                    "or JSON-ready data.", exc)


def stopped(call: ToolCall, why: str = "not run: the reply was closed first.") -> ChatMessage:
    """The tool message answering a call that a stopped loop did not finish (so that no call is left
    without its result in the history)."""
    return ChatMessage.tool(f"Error: {why}", name=call.name or None, tool_call_id=call.id)


def check_arguments(schema: Mapping[str, Any], arguments: Mapping[str, Any]) -> str | None:
    """Why ``arguments`` do not fit the tool's parameters schema, or ``None`` when they do."""
    parameters = schema.get("function", {}).get("parameters") or {"type": "object"}
    try:
        import jsonschema
        from referencing import Registry
    except ImportError:  # the `tools` extra is not installed: check the required keys only
        missing = [k for k in parameters.get("required", []) if k not in arguments]
        return f"missing required arguments {missing}." if missing else None
    # An empty registry: a $ref outside the schema is never fetched (as_tool refused those already).
    validator = jsonschema.Draft202012Validator(parameters, registry=Registry())
    try:
        errors = sorted(validator.iter_errors(dict(arguments)), key=lambda e: [str(p) for p in e.path])
    except Exception as exc:  # a schema changed after as_tool checked it: the call fails, the turn goes on
        return f"the tool's parameters schema cannot be checked ({type(exc).__name__}: {exc}): fix the schema."
    if not errors:
        return None
    first = errors[0]
    where = "/".join(str(p) for p in first.path)
    return f"{where + ': ' if where else ''}{first.message}."


__all__ = ["Tool", "ToolOutput", "ToolReportedError", "ToolSource", "as_tool", "as_tools", "call_tool", "check_arguments", "stopped"]

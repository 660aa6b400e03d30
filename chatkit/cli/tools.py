"""``--tools MODULE:FUNCTION`` and ``--tools MODULE``: the user's tools, imported and checked before
anything loads, and joined to the tools a model comes with (the demo's ``calculate``).

A bare ``MODULE`` means what ``from MODULE import *`` would bring, limited to functions: the names in
its ``__all__`` if it has one, else every function it defines whose name does not start with ``_``.
Modules are found in the current folder first, as ``python -m`` finds them."""

from __future__ import annotations

import importlib
import inspect
import os
import shlex
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from types import ModuleType
from typing import Any

from ..errors import ChatKitError
from ..tools.mcp import MCPServer
from ..tools.schema import Tool, as_tool
from .args import UsageError


def import_tools(specs: Sequence[str]) -> list[Tool]:
    """The tools ``--tools`` names, in order; ``UsageError`` naming the flag for one that cannot be
    imported, names no function, cannot be made a tool, or shares its name with another."""
    tools: list[Tool] = []
    with _cwd_on_path():
        for spec in specs:
            for function in _functions(spec):
                tool = _as_tool(spec, function)
                if any(t.name == tool.name for t in tools):
                    raise UsageError(f"--tools {spec}: a tool named {tool.name!r} is already given by another "
                                     "--tools; each tool needs its own name.")
                tools.append(tool)
    return tools


def join_tools(builtin: Sequence[Any], user: Sequence[Tool], owner: str = "the demo model") -> list[Tool]:
    """``builtin`` (a model's own tools) then ``user``'s; ``UsageError`` when a name is taken twice."""
    own = [as_tool(t) for t in builtin]
    taken = {t.name for t in own}
    for tool in user:
        if tool.name in taken:
            raise UsageError(f"--tools: {owner} already has a tool named {tool.name!r}; rename yours "
                             "(the function, or its schema's name).")
    return [*own, *user]


@contextmanager
def _cwd_on_path() -> Iterator[None]:
    """The current folder first on ``sys.path`` while the tools are imported (as ``python -m`` has it)."""
    cwd = os.getcwd()
    added = cwd not in sys.path and "" not in sys.path
    if added:
        sys.path.insert(0, cwd)
    try:
        yield
    finally:
        if added and cwd in sys.path:
            sys.path.remove(cwd)


def _functions(spec: str) -> list[Any]:
    module_name, colon, name = spec.partition(":")
    if not module_name.strip() or colon and not name.strip():
        raise UsageError(f"--tools {spec!r}: use MODULE:FUNCTION (one function) or MODULE (its public functions).")
    module = _import(spec, module_name)
    if colon:
        try:
            return [getattr(module, name)]
        except AttributeError:
            raise UsageError(f"--tools {spec}: module {module_name!r} has no {name!r}; use MODULE:FUNCTION with a "
                             "function the module defines.") from None
    return _public_functions(spec, module)


def _import(spec: str, module_name: str) -> ModuleType:
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise UsageError(f"--tools {spec}: cannot import it ({exc}); use MODULE:FUNCTION with a module in the "
                         "current folder or an installed one.") from exc
    except Exception as exc:  # the module itself fails: a SyntaxError, an error it raises on import...
        raise UsageError(f"--tools {spec}: importing {module_name!r} failed ({type(exc).__name__}: {exc}); "
                         "fix the module (python -c 'import ...' shows where).") from exc


def _public_functions(spec: str, module: ModuleType) -> list[Any]:
    """A bare module's tools: the functions in its ``__all__``, else the public functions it defines."""
    listed = getattr(module, "__all__", None)
    if listed is not None:
        items = [(n, getattr(module, n, None)) for n in listed]
        bad = [n for n, f in items if not callable(f)]
        if bad:
            raise UsageError(f"--tools {spec}: its __all__ lists {', '.join(bad)}, which are not functions; "
                             f"name the tools one by one instead (--tools {spec}:FUNCTION).")
        functions = [f for _, f in items]
    else:
        functions = [f for n, f in vars(module).items()
                     if not n.startswith("_") and inspect.isfunction(f) and f.__module__ == module.__name__]
    if not functions:
        raise UsageError(f"--tools {spec}: the module {'lists no function in __all__' if listed is not None else 'defines no public function'}; "
                         f"define one (a name not starting with _), or name it: --tools {spec}:FUNCTION.")
    return functions


def _as_tool(spec: str, function: Any) -> Tool:
    bare = ":" not in spec
    try:
        return as_tool(function)
    except ChatKitError as exc:
        hint = (" A bare module makes a tool of each public function: start helpers' names with _ or list the "
                "tools in __all__.") if bare else ""
        raise UsageError(f"--tools {spec}: {exc}{hint}") from exc


def mcp_servers(specs: Sequence[str], resume: str | None = None) -> list[MCPServer]:
    """The servers ``--mcp`` names (a URL, or a command line, shlex-split), then those a resumed file
    recorded that no ``--mcp`` gives again; ``UsageError`` naming the flag for one that cannot be used.
    Nothing starts here: a server starts when its tools are listed."""
    servers: list[MCPServer] = []
    for spec in specs:
        try:
            servers.append(MCPServer(url=spec) if spec.startswith(("http://", "https://"))
                           else MCPServer(command=shlex.split(spec)))
        except (ValueError, ChatKitError) as exc:
            raise UsageError(f"--mcp {spec!r}: {exc}") from exc
    if resume is not None:
        from ..session.saved import inspect as inspect_cache

        given = [s.to_dict() for s in servers]
        servers += [MCPServer.from_dict(r) for r in inspect_cache(resume).mcp_servers if dict(r) not in given]
    return servers


def tools_report(tools: Sequence[Tool]) -> str:
    """What ``/tools`` prints: each tool, its first description line and where it comes from."""
    if not tools:
        return "no tools (give some with --tools MODULE:FUNCTION or --mcp \"COMMAND ARGS\" / --mcp URL)"
    lines = []
    for tool in tools:
        server = getattr(tool.function, "mcp_server", None)
        source = f"MCP {server.name}" if isinstance(server, MCPServer) else "Python"
        about = (tool.schema["function"].get("description") or "").strip().split("\n")[0]
        lines.append(f"  {tool.name:<16} {about}  [{source}]")
    return "tools:\n" + "\n".join(lines)


__all__ = ["import_tools", "join_tools", "mcp_servers", "tools_report"]

"""Tools for a session: schemas from Python callables or dicts, calling them (``schema.py``), and how a
session uses them (``options.py``). The automatic tool loop is a session's: ``chatkit.session.tool_loop``."""

from .options import DEFAULT_MAX_TOOL_ROUNDS, ToolOptions
from .schema import Tool, as_tool, as_tools, call_tool, check_arguments

__all__ = [
    "DEFAULT_MAX_TOOL_ROUNDS",
    "Tool",
    "ToolOptions",
    "as_tool",
    "as_tools",
    "call_tool",
    "check_arguments",
]

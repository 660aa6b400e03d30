"""Tools for a session: schemas from Python callables or dicts (``schema.py``) and the automatic tool
loop (``loop.py``)."""

from .loop import DEFAULT_MAX_TOOL_ROUNDS, ToolLoopStream, ToolOptions, pending_calls
from .schema import Tool, as_tool, as_tools, call_tool, check_arguments

__all__ = [
    "DEFAULT_MAX_TOOL_ROUNDS",
    "Tool",
    "ToolLoopStream",
    "ToolOptions",
    "as_tool",
    "as_tools",
    "call_tool",
    "check_arguments",
    "pending_calls",
]

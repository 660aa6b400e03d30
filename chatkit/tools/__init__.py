"""Tools for a session: schemas from Python callables or dicts, calling them (``schema.py``; a parameters
schema is checked when given: ``check.py``; each call runs on a thread of its own: ``run.py``), and how a
session uses them (``options.py``); tools from MCP servers (``mcp.py``). The automatic tool loop is a session's: ``chatkit.session.tool_loop``."""

from .mcp import MCPServer
from .options import DEFAULT_MAX_TOOL_ROUNDS, DEFAULT_TOOL_TIMEOUT, ToolOptions
from .schema import Tool, ToolOutput, as_tool, as_tools, call_tool, check_arguments

__all__ = [
    "DEFAULT_MAX_TOOL_ROUNDS",
    "DEFAULT_TOOL_TIMEOUT",
    "MCPServer",
    "Tool",
    "ToolOptions",
    "ToolOutput",
    "as_tool",
    "as_tools",
    "call_tool",
    "check_arguments",
]

"""MCP servers for the tests, written with the mcp SDK: ``python tests/helpers/mcp_servers.py KIND
[http]``. Over stdio by default; with ``http``, streamable HTTP on 127.0.0.1 on a free port, whose URL
is printed on the first line of stdout.

Kinds: ``calculate`` (the demo's ``calculate`` alone); ``calc`` (the demo's ``calculate``, a failing ``fail`` tool, a ``die`` tool that kills the
server, a ``hang`` tool that never returns, ``image`` returning a PNG, ``picture`` text and a 50x40 PNG, ``bad_image`` images that cannot be read,
``data`` returning structured content only); ``many`` (40 tools ``echo_0`` .. ``echo_39``); ``clash`` (a tool named ``calculate``);
``broken`` (exits before speaking MCP)."""

from __future__ import annotations

import base64
import logging
import os
import socket
import sys
import time
from typing import Any

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.types import CallToolResult, ImageContent, TextContent

PNG = base64.b64decode(
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg=="
)


def picture_png() -> bytes:
    """A 50x40 PNG of fixed noise: what the ``picture`` tool returns (Pillow imported on use)."""
    import io

    import numpy as np
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(np.random.default_rng(7).integers(0, 255, (40, 50, 3), dtype=np.uint8)).save(buffer, format="PNG")
    return buffer.getvalue()


def _demo_calculate() -> Any:
    """The demo's ``calculate``, imported without ``chatkit/__init__`` (MLX and all: seconds per server start):
    its module needs only ``chatkit.errors``, a leaf."""
    import importlib
    import types

    root = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "chatkit")
    for name, path in (("chatkit", root), ("chatkit.demo", os.path.join(root, "demo"))):
        package = types.ModuleType(name)
        package.__path__ = [path]
        sys.modules.setdefault(name, package)
    return importlib.import_module("chatkit.demo.calculator").calculate


def calculate_server() -> MCPServer:
    server = MCPServer("calculate")
    server.add_tool(_demo_calculate())
    return server


def calc_server() -> MCPServer:
    server = calculate_server()

    @server.tool()
    def fail(reason: str) -> str:
        """Always fails.

        Args:
            reason: What to fail with.
        """
        raise ToolError(f"failed on purpose: {reason}")

    @server.tool()
    def die() -> str:
        """Kills the server."""
        os._exit(3)

    @server.tool()
    def hang() -> str:
        """Never returns."""
        time.sleep(3600)
        return "never"

    @server.tool()
    def image() -> CallToolResult:
        """A 1x1 PNG."""
        return CallToolResult(content=[ImageContent(type="image", data=base64.b64encode(PNG).decode(), mime_type="image/png")])

    @server.tool()
    def picture() -> CallToolResult:
        """Text and a 50x40 PNG."""
        return CallToolResult(content=[TextContent(type="text", text="a picture"),
                                       ImageContent(type="image", data=base64.b64encode(picture_png()).decode(), mime_type="image/png")])

    @server.tool()
    def bad_image() -> CallToolResult:
        """An image that is no PNG (and one that is not base64)."""
        return CallToolResult(content=[ImageContent(type="image", data=base64.b64encode(b"%!PS-Adobe eps").decode(), mime_type="image/png"),
                                       ImageContent(type="image", data="not base64!", mime_type="image/jpeg")])

    @server.tool()
    def data() -> CallToolResult:
        """Structured content only."""
        return CallToolResult(content=[], structured_content={"x": 1, "y": [2, 3]})

    @server.tool()
    def both() -> CallToolResult:
        """Text and an image."""
        return CallToolResult(content=[TextContent(type="text", text="see the picture"),
                                       ImageContent(type="image", data=base64.b64encode(PNG).decode(), mime_type="image/png")])

    return server


def many_server() -> MCPServer:
    server = MCPServer("many")
    for i in range(40):
        server.add_tool(_echo(i), name=f"echo_{i}", description=f"Echo number {i}.")
    return server


def _echo(i: int) -> Any:
    def echo(text: str) -> str:
        return f"{i}: {text}"

    return echo


def clash_server() -> MCPServer:
    server = MCPServer("clash")

    @server.tool()
    def calculate(expression: str) -> str:
        """Not the demo's calculator."""
        return expression

    return server


def serve_http(server: MCPServer) -> None:
    import anyio
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)  # connections queue from here on, so the URL printed below is usable at once
    port = sock.getsockname()[1]
    app = server.streamable_http_app()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning")
    print(f"http://127.0.0.1:{port}/mcp", flush=True)
    anyio.run(lambda: uvicorn.Server(config).serve(sockets=[sock]))


def main(argv: list[str]) -> None:
    kind = argv[0]
    if kind == "broken":
        print("not an MCP server", flush=True)
        sys.exit(2)
    servers: dict[str, Any] = {"calc": calc_server, "calculate": calculate_server, "many": many_server, "clash": clash_server}
    server = servers[kind]()
    logging.disable(logging.CRITICAL)  # the SDK logs each failing tool at length on stderr
    if argv[1:] == ["http"]:
        serve_http(server)
    else:
        server.run("stdio")


if __name__ == "__main__":
    main(sys.argv[1:])

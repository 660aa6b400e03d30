"""Tools from MCP (Model Context Protocol) servers: ``MCPServer`` over stdio or streamable HTTP.

The ``mcp`` SDK's client is async (anyio). Each ``MCPServer`` runs one ``mcp.ClientSession`` on an event
loop of its own, on a daemon thread, started on first use and shared by every session (and fork) that
has its tools. Its tools are ``Tool`` s whose function is async: the tool loop runs it as any async tool
(``chatkit.tools.run``), and it awaits the call on the server's loop (``asyncio.wrap_future``), so a
timeout or a stop cancels the request. A call returns a ``ToolOutput`` (text, and images as sent), from which
the tool loop makes the tool message (images shown to a vision-language model). A connection that breaks (the server exited, stopped
answering) fails the call with ``MCPServerError`` and is reopened by the next call.
"""

from __future__ import annotations

import asyncio
import atexit
import base64
import binascii
import concurrent.futures
import importlib.util
import json
import os
import sys
import threading
import weakref
from collections.abc import Callable, Coroutine, Mapping, Sequence
from contextlib import AsyncExitStack
from typing import Any

from ..errors import InvalidParamsError, MCPServerError, MissingDependencyError
from .schema import Tool, ToolOutput, ToolReportedError, ToolSource, as_tool

DEFAULT_START_TIMEOUT = 30.0  # seconds to start a server and list its tools when no tool timeout is given
CLOSE_TIMEOUT = 5.0  # seconds close() waits for the connection (and a stdio server's process) to end
_LIVE: weakref.WeakSet[MCPServer] = weakref.WeakSet()


class MCPServer(ToolSource):
    """An MCP server whose tools a session can use: ``MCPServer(command=["uvx", "some-server"], env=None)``
    starts it as a subprocess speaking over stdio; ``MCPServer(url="http://127.0.0.1:8000/mcp",
    headers=None)`` connects to a streamable HTTP server. Pass it to ``builder.tools([...])`` beside Python
    functions; its tools (names, descriptions, input schemas) join the session's.

    One connection per object, opened on first use (when its tools are listed), shared by every session
    using it; ``close()`` ends it (a stdio server's process too), as does leaving a ``with`` block or the
    interpreter's exit. A server that does not start, exits, or stops answering raises ``MCPServerError``
    (in the tool loop the call's result says so, and the turn goes on); the next call connects again.
    Needs the ``mcp`` extra: ``pip install 'chatkit[mcp]'``.
    """

    def __init__(self, command: Sequence[str] | None = None, *, env: Mapping[str, str] | None = None,
                 url: str | None = None, headers: Mapping[str, str] | None = None) -> None:
        _check_spec(command, env, url, headers)
        if importlib.util.find_spec("mcp") is None:
            raise MissingDependencyError("MCPServer needs the mcp extra: pip install 'chatkit[mcp]'.")
        self.command = None if command is None else tuple(command)
        self.url = url
        self._env, self._headers = dict(env or {}), dict(headers or {})
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready: asyncio.Future[Any] | None = None  # the session, once connected
        self._closing: asyncio.Event | None = None
        self._task: asyncio.Future[None] | None = None

    @property
    def name(self) -> str:
        """The command line or the URL (never the env or the headers)."""
        return " ".join(self.command) if self.command is not None else str(self.url)

    def to_dict(self) -> dict[str, Any]:
        """What a saved conversation records: ``{"command": [...]}`` or ``{"url": ...}`` (no secrets)."""
        return {"command": list(self.command)} if self.command is not None else {"url": self.url}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> MCPServer:
        """The server ``to_dict`` recorded (without its env or headers: give those again if it needs them)."""
        if not isinstance(data, Mapping) or ("command" in data) == ("url" in data):
            raise InvalidParamsError(f"An MCP server record is {{'command': [...]}} or {{'url': ...}}, got {data!r:.80}.")
        return cls(command=data["command"]) if "command" in data else cls(url=data["url"])

    def __repr__(self) -> str:
        return f"MCPServer({'command' if self.command is not None else 'url'}={self.name!r})"

    def __enter__(self) -> MCPServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the public, blocking API --------------------------------------------------------------------
    def tools(self, timeout: float | None = None) -> list[Tool]:
        """The server's tools as chatkit ``Tool`` s (connecting first), each schema checked as a dict's;
        ``MCPServerError`` when it does not answer within ``timeout`` seconds (``None``: 30)."""
        listed = self._run(self._list(), timeout or DEFAULT_START_TIMEOUT, "list its tools")
        return [self._tool(t) for t in listed]

    def call_tool(self, name: str, arguments: Mapping[str, Any] | None = None,
                  timeout: float | None = DEFAULT_START_TIMEOUT) -> str:
        """Call tool ``name`` and return its result as text (an image as a note: ``result_text``);
        ``ToolReportedError`` for a result the tool marked as an error, ``MCPServerError`` for a server that fails."""
        output = self._run(self._call(name, dict(arguments or {})), timeout, f"run {name}")
        return output.read(images=False)[1]

    def close(self) -> None:
        """End the connection (a stdio server's process exits); using the server again reconnects."""
        with self._lock:
            loop, self._loop = self._loop, None
        if loop is None:
            return
        future = asyncio.run_coroutine_threadsafe(self._disconnect(), loop)
        try:
            future.result(CLOSE_TIMEOUT)
        except Exception:  # noqa: S110  a connection that will not close is left to the loop's end
            pass
        loop.call_soon_threadsafe(loop.stop)

    # -- the event loop -------------------------------------------------------------------------------
    def _ensure_loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                threading.Thread(target=_run_loop, args=(loop,), name=f"chatkit-mcp-{self.name[:40]}", daemon=True).start()
                self._loop = loop
                _LIVE.add(self)
            return self._loop

    def _run(self, coroutine: Coroutine[Any, Any, Any], timeout: float | None, what: str) -> Any:
        future = asyncio.run_coroutine_threadsafe(coroutine, self._ensure_loop())
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:  # the builtin TimeoutError from Python 3.11, not before
            future.cancel()
            raise self._hung(what, timeout) from None

    async def acall(self, name: str, arguments: dict[str, Any]) -> str:
        """``call_tool`` for a coroutine on any event loop: awaits the call on the server's loop (a
        cancellation, e.g. a timeout, cancels the request)."""
        return (await self.aoutput(name, arguments)).read(images=False)[1]

    async def aoutput(self, name: str, arguments: dict[str, Any]) -> ToolOutput:
        """``acall``'s result as a ``ToolOutput`` (its images as the server sent them): what the session's
        tool loop gets, so that a vision-language model sees the images."""
        future = asyncio.run_coroutine_threadsafe(self._call(name, arguments), self._ensure_loop())
        return await asyncio.wrap_future(future)

    def _hung(self, what: str, timeout: float | None) -> MCPServerError:
        return MCPServerError(f"The MCP server {self.name!r} did not {what} within {timeout:g} s: check that it "
                              "runs and answers (or give the session a larger tool_timeout).")

    # -- on the server's loop -------------------------------------------------------------------------
    async def _connected(self) -> Any:
        """The session, connecting first when there is none (concurrent calls share one start)."""
        if self._ready is None:
            self._ready = asyncio.get_running_loop().create_future()
            self._closing = asyncio.Event()
            self._task = asyncio.ensure_future(self._serve(self._ready, self._closing))
        ready = self._ready
        try:
            return await asyncio.shield(ready)
        except MCPServerError:
            if self._ready is ready:  # the next call tries again
                self._ready = None
            raise

    async def _serve(self, ready: asyncio.Future[Any], closing: asyncio.Event) -> None:
        """The connection's whole life in one task (anyio's scopes are entered and left in the same task)."""
        from mcp import ClientSession

        try:
            async with AsyncExitStack() as stack:
                read, write = await stack.enter_async_context(self._transport())
                session = await stack.enter_async_context(ClientSession(read, write))
                await session.initialize()
                ready.set_result(session)
                await closing.wait()
        except Exception as exc:  # the SDK's and the OS's errors alike: the server could not be reached
            if not ready.done():
                ready.set_exception(MCPServerError(f"The MCP server {self.name!r} did not start: "
                                                   f"{_reason(exc)}. Check the {self._what()}."))
        finally:
            if not ready.done():
                ready.set_exception(MCPServerError(f"The MCP server {self.name!r} was closed while starting."))
            if self._ready is ready:  # a connection that ended by itself: the next call opens a new one
                self._ready = None

    def _transport(self) -> Any:
        if self.command is not None:
            from mcp.client.stdio import StdioServerParameters, stdio_client

            params = StdioServerParameters(command=self.command[0], args=list(self.command[1:]), env=self._env or None)
            return stdio_client(params, errlog=_errlog())
        from mcp.client.streamable_http import streamable_http_client
        from mcp.shared._httpx_utils import create_mcp_http_client

        return streamable_http_client(str(self.url), http_client=create_mcp_http_client(headers=self._headers or None))

    def _what(self) -> str:
        return "command (it must start an MCP server speaking over stdio)" if self.command is not None else "URL (a streamable HTTP MCP endpoint, e.g. http://host:port/mcp)"

    async def _disconnect(self) -> None:
        closing, task = self._closing, self._task
        self._ready = self._closing = self._task = None
        if closing is not None:
            closing.set()
        if task is not None:
            try:
                await asyncio.wait_for(task, CLOSE_TIMEOUT)
            except (asyncio.TimeoutError, asyncio.CancelledError, Exception):  # noqa: S110  closing anyway
                pass

    async def _list(self) -> list[Any]:
        session = await self._connected()
        tools: list[Any] = []
        cursor = None
        while True:
            result = await self._request(session.list_tools(params=_page(cursor)), "list its tools")
            tools.extend(result.tools)
            cursor = result.next_cursor
            if not cursor:
                return tools

    async def _call(self, name: str, arguments: dict[str, Any]) -> ToolOutput:
        session = await self._connected()
        result = await self._request(session.call_tool(name, arguments), f"run {name}")
        output = result_output(result)
        if result.is_error:
            raise ToolReportedError(output.read(images=False)[1] or f"{name} failed (the MCP server gave no reason).")
        return output

    async def _request(self, request: Coroutine[Any, Any, Any], what: str) -> Any:
        """``request``'s result; a protocol error from the server is the tool's, anything else breaks the
        connection (the next call opens a new one)."""
        from mcp.shared.exceptions import MCPError
        from mcp.types import CONNECTION_CLOSED

        try:
            return await request
        except MCPError as exc:
            if exc.code != CONNECTION_CLOSED:
                raise ToolReportedError(exc.message) from None
            await self._disconnect()
            raise MCPServerError(f"The MCP server {self.name!r} closed the connection while asked to {what} (it "
                                 "exited or failed; the next call starts it again).") from exc
        except Exception as exc:  # the transport: a closed stream, a dead process, a refused connection
            await self._disconnect()
            raise MCPServerError(f"The MCP server {self.name!r} failed to {what}: {_reason(exc)} (it may have "
                                 "exited; the next call starts it again).") from exc

    def _tool(self, listed: Any) -> Tool:
        schema = {"name": listed.name, "description": listed.description or listed.title or "",
                  "parameters": listed.input_schema or {"type": "object"}}
        checked = as_tool(schema).schema
        return Tool(checked, _tool_function(self, listed.name))


def _tool_function(server: MCPServer, name: str) -> Callable[..., Any]:
    async def call(**arguments: Any) -> ToolOutput:
        return await server.aoutput(name, arguments)

    call.__name__ = call.__qualname__ = name
    call.mcp_server = server  # type: ignore[attr-defined]  # what a saved conversation records
    return call


def result_output(result: Any) -> ToolOutput:
    """An MCP ``CallToolResult`` as a ``ToolOutput``: its text parts (blank-line separated), else its
    structured content as JSON; its images as they came (the tool message shows them to a vision-language
    model, else notes them); an audio part is a short note (chatkit's models hear nothing)."""
    texts: list[str] = []
    notes: list[str] = []
    images: list[tuple[bytes, str]] = []
    for part in result.content:
        kind = getattr(part, "type", "")
        if kind == "text":
            texts.append(part.text)
        elif kind == "image":
            images.append((_b64(part.data), str(part.mime_type)))
        elif kind == "audio":
            notes.append(f"[the tool returned some audio ({part.mime_type}, {len(_b64(part.data))} bytes), "
                         "which this chat cannot show the model]")
        elif kind == "resource":
            resource = part.resource
            texts.append(getattr(resource, "text", None) or f"[a resource: {resource.uri}]")
        elif kind == "resource_link":
            texts.append(f"[a resource: {part.uri}]")
    if not texts and result.structured_content is not None:
        texts.append(json.dumps(result.structured_content, ensure_ascii=False))
    return ToolOutput("\n\n".join(texts + notes), tuple(images))


def result_text(result: Any) -> str:
    """The text of an MCP ``CallToolResult`` for a model that reads no images (``result_output``'s, each
    image a short note)."""
    return result_output(result).read(images=False)[1]


def _b64(data: Any) -> bytes:
    """Base64 ``data`` decoded; empty when it is not base64 (the image is then noted as unreadable)."""
    try:
        return base64.b64decode(data, validate=True) if isinstance(data, str) else b""
    except (binascii.Error, ValueError):
        return b""


def mcp_servers(tools: Sequence[Tool] | None) -> list[dict[str, Any]]:
    """The records (``MCPServer.to_dict``) of the MCP servers that supplied ``tools``, each once, in order."""
    records: list[dict[str, Any]] = []
    for tool in tools or ():
        server = getattr(tool.function, "mcp_server", None)
        if isinstance(server, MCPServer) and server.to_dict() not in records:
            records.append(server.to_dict())
    return records


def _check_spec(command: Any, env: Any, url: Any, headers: Any) -> None:
    if (command is None) == (url is None):
        raise InvalidParamsError("MCPServer takes command=[...] (a server over stdio) or url=... (streamable HTTP), one of them.")
    if command is not None:
        if isinstance(command, (str, bytes)) or not command or not all(isinstance(c, str) and c for c in command):
            raise InvalidParamsError(f"MCPServer(command={command!r}): give the command line as a list of strings, "
                                     "e.g. ['python', 'server.py'] (shlex.split a string).")
        if headers is not None:
            raise InvalidParamsError("MCPServer: headers go with url=...; a stdio server takes env=... instead.")
    if url is not None:
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise InvalidParamsError(f"MCPServer(url={url!r}): give an http:// or https:// URL (e.g. http://127.0.0.1:8000/mcp).")
        if env is not None:
            raise InvalidParamsError("MCPServer: env goes with command=[...]; an HTTP server takes headers=... instead.")
    for label, mapping in (("env", env), ("headers", headers)):
        if mapping is not None and (not isinstance(mapping, Mapping)
                                    or not all(isinstance(k, str) and isinstance(v, str) for k, v in mapping.items())):
            raise InvalidParamsError(f"MCPServer({label}=...): give a dict of strings to strings.")


def _page(cursor: str | None) -> Any:
    if cursor is None:
        return None
    from mcp.types import PaginatedRequestParams

    return PaginatedRequestParams(cursor=cursor)


def _reason(exc: BaseException) -> str:
    inner = getattr(exc, "exceptions", None)  # an anyio ExceptionGroup: its first error says what happened
    if inner:
        return _reason(inner[0])
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _errlog() -> Any:
    """Where a stdio server's stderr goes: ours when it is a real file, else nowhere (e.g. under pytest)."""
    try:
        sys.stderr.fileno()
        return sys.stderr
    except (AttributeError, ValueError, OSError):
        return open(os.devnull, "w")  # noqa: SIM115  the process holds it


def _run_loop(loop: asyncio.AbstractEventLoop) -> None:
    asyncio.set_event_loop(loop)
    try:
        loop.run_forever()
    finally:
        loop.close()


@atexit.register
def _close_all() -> None:
    for server in list(_LIVE):
        server.close()


__all__ = ["MCPServer", "mcp_servers", "result_output", "result_text"]

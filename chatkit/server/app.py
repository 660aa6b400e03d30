"""The HTTP face: a Starlette app serving OpenAI's APIs and Anthropic's Messages API over chatkit's
pooled sessions (``SessionIndex``).

One handler module per API (``chat_completions``, ``responses``, ``messages``), each handler a function
of the shared ``ServerState`` and the request; this module lists the routes (and serves the small ones:
models, ``/health``, ``/metrics``) and wraps every handler with the API key check, the mapping of errors to
JSON (OpenAI's shape; Anthropic's on ``ANTHROPIC_ROUTES``, whose clients may also send the key as
``x-api-key``) and the request count of ``/metrics``. Another API is one more module and one more route.
"""

from __future__ import annotations

import hmac
import logging
import re
import time
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import BaseRoute, Route

from ..errors import ChatKitError
from ..images import images_refused
from ..model.loaded import LoadedModel
from . import anthropic_wire, chat_completions, conversations, messages, page, response_items, responses, trace
from .errors import UnauthorizedError, UnknownModelError, error_body
from .lease import Lease
from .metrics import CONTENT_TYPE, prompt_cache_series
from .state import Handler, ServerConfig, ServerState

log = logging.getLogger("chatkit.server")


def served_models(state: ServerState) -> list[dict[str, Any]]:
    """The models this server answers for, as OpenAI model objects: the one it was started with, then
    ``<id>:<name>`` for each of its adapters."""
    return state.models.listing(state.started)


async def models(state: ServerState, request: Request) -> Response:
    """``GET /v1/models``: the models this server serves."""
    return JSONResponse({"object": "list", "data": served_models(state)})


async def model(state: ServerState, request: Request) -> Response:
    """``GET /v1/models/{id}``: one served model; 404 for any other id."""
    mid = request.path_params["mid"]
    for found in served_models(state):
        if found["id"] == mid:
            return JSONResponse(found)
    raise UnknownModelError(f"This server does not serve a model {mid!r}: GET /v1/models lists the ones it serves.")


async def health(state: ServerState, request: Request) -> Response:
    """``GET /health``: 200 while the server runs (no API key needed, no work done)."""
    return JSONResponse({"status": "ok", "model": state.config.model_id, "uptime_seconds": round(time.time() - state.started)})


async def metrics(state: ServerState, request: Request) -> Response:
    """``GET /metrics``: Prometheus' text format (see ``metrics``), the gauges read now."""
    held = state.sessions.footprint()
    gauges = {
        "chatkit_sessions_pooled": ("Conversations the server holds as pooled sessions.", held["sessions"]),
        "chatkit_kv_cache_memory_bytes": ("Bytes of the pooled sessions' KV caches in memory.", held["memory_bytes"]),
        "chatkit_kv_cache_disk_bytes": ("Bytes of the KV cache files on disk.", held["disk_bytes"]),
        "chatkit_responses_stored": ("Responses stored for previous_response_id.", len(state.responses)),
    }
    counters, cache_gauges = prompt_cache_series(state.prompt_cache.usage() if state.prompt_cache is not None else None)
    return PlainTextResponse(state.metrics.render({**gauges, **cache_gauges}, counters), media_type=CONTENT_TYPE)


ROUTES: list[tuple[str, str, Handler]] = [  # (method, path under /v1, handler); each is also served without /v1
    ("GET", "/models", models),
    ("GET", "/models/{mid:path}", model),
    ("POST", "/chat/completions", chat_completions.create),
    ("POST", "/responses", responses.create),
    ("GET", "/responses/{rid}", responses.retrieve),
    ("DELETE", "/responses/{rid}", response_items.delete),
    ("GET", "/responses/{rid}/input_items", response_items.input_items),
    ("GET", "/conversations", conversations.list_all),  # chatkit's own: the stored conversations
    ("GET", "/conversations/{rid}", conversations.retrieve),
]
ANTHROPIC_ROUTES: list[tuple[str, str, Handler]] = [  # errors in Anthropic's shape; the key also as x-api-key
    ("POST", "/messages", messages.create),
    ("POST", "/messages/count_tokens", messages.count_tokens),
]
ROOT_ROUTES: list[tuple[str, str, Handler]] = [  # served at the root only; /health needs no API key
    ("GET", "/health", health),
    ("GET", "/metrics", metrics),
]
OPEN = {health}
NO_IMAGES = "This model reads no images: load a vision-language model to send images."  # the handlers that need no API key


def create_app(lm: LoadedModel, config: ServerConfig | None = None) -> Starlette:
    """The ASGI app serving ``lm``; run it with uvicorn (``chatkit serve``) or :func:`chatkit.server.start`."""
    state = ServerState(lm, config or ServerConfig())
    routes: list[BaseRoute] = [Route(path, _endpoint(state, handler, method, path), methods=[method])
                               for method, path, handler in ROOT_ROUTES]
    routes += [Route(prefix + path, _endpoint(state, handler, method, prefix + path, anthropic=face is ANTHROPIC_ROUTES),
                     methods=[method])
               for face in (ROUTES, ANTHROPIC_ROUTES) for prefix in ("/v1", "") for method, path, handler in face]
    routes += page.routes()  # the chat page at /, without the API key check: it holds no secret
    return Starlette(routes=routes, lifespan=state.lifespan, exception_handlers={HTTPException: _http_error})


def _endpoint(state: ServerState, handler: Handler, method: str, route: str, *,
              anthropic: bool = False) -> Callable[[Request], Awaitable[Response]]:
    """``handler`` as a Starlette endpoint: the API key checked first, any error an OpenAI-style reply
    (``anthropic``: Anthropic-style, and the key may come as ``x-api-key``), the request counted (by
    ``route``, its path template) in ``state.metrics``."""
    shown = re.sub(r":\w+}", "}", route)  # /v1/models/{mid}, not {mid:path}
    async def endpoint(request: Request) -> Response:
        traced = trace.begin(request)  # None unless the client asked (X-Chatkit-Trace)
        with state.leases() as opened:
            try:
                if handler not in OPEN:
                    _authorize(request, state.config.api_key, anthropic)
                if state.lm.vision is None:  # a text model: no image is decoded at all
                    with images_refused(NO_IMAGES):
                        response = await handler(state, request)
                else:
                    response = await handler(state, request)
            except Exception as exc:
                await state.settle_all(opened)  # a turn opened before the failure: its slot back
                response = _error(exc, anthropic)
        state.metrics.observe_request(method, shown, response.status_code)
        response = response if traced is None else trace.attach(traced, response)
        return _Settling(response, state, opened) if opened and isinstance(response, StreamingResponse) else response
    return endpoint


class _Settling(Response):
    """A streamed turn's response that settles its turns when it ends, also when its body never ran (a
    client gone before it started: Starlette then never iterates the handler's generator). It marks a
    turn ``delivered`` once a send went out after some of its reply was handed to the handler: a turn
    stopped before that (the client went away first) is discarded, not committed (``Lease.keep_when_stopped``)."""

    def __init__(self, inner: Response, state: ServerState, leases: list[Lease]) -> None:
        self.inner, self.state, self.leases = inner, state, leases
        self.status_code, self.background = inner.status_code, None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        async def sending(message: Any) -> None:  # a piece of a reply handed out before a send went out with it
            shown = [lease for lease in self.leases if lease.stream.shown]
            await send(message)
            for lease in shown:
                lease.delivered = True

        try:
            await self.inner(scope, receive, sending)
        finally:
            await self.state.settle_all(self.leases)


def _authorize(request: Request, api_key: str | None, x_api_key: bool = False) -> None:
    if api_key is None:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer":
        token = request.headers.get("x-api-key", "") if x_api_key else ""
    if not token or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
        header = "'x-api-key: <key>' (or 'Authorization: Bearer <key>')" if x_api_key else "'Authorization: Bearer <key>'"
        raise UnauthorizedError(f"Missing or wrong API key: send the header {header} "
                                "with the key the server was started with (--api-key).")


def _error(exc: Exception, anthropic: bool = False) -> JSONResponse:
    status, body = anthropic_wire.error_body(exc) if anthropic else error_body(exc)
    if not isinstance(exc, ChatKitError):
        log.exception("unexpected error while serving a request", exc_info=exc)
    headers = {"Retry-After": "1"} if status == 503 else None
    return JSONResponse(body, status_code=status, headers=headers)


async def _http_error(request: Request, exc: Exception) -> Response:
    status = getattr(exc, "status_code", 500)
    detail = getattr(exc, "detail", "") or "error"
    kind = "not_found_error" if status == 404 else "invalid_request_error"
    path = request.url.path
    if any(path == p or path.startswith(p + "/") for p in ("/v1/messages", "/messages")):  # Anthropic's shape
        return JSONResponse({"type": "error", "error": {"type": kind, "message": f"{detail}: {request.method} {path}"}},
                            status_code=status)
    return JSONResponse({"error": {"message": f"{detail}: {request.method} {request.url.path}", "type": kind,
                                   "param": None, "code": None}}, status_code=status)


__all__ = ["ANTHROPIC_ROUTES", "ROOT_ROUTES", "ROUTES", "ServerConfig", "create_app"]

"""The HTTP face: a Starlette app serving OpenAI's APIs and Anthropic's Messages API over chatkit's
pooled sessions (``SessionIndex``).

One handler module per API (``chat_completions``, ``responses``, ``messages``), each handler a function
of the shared ``ServerState`` and the request; this module lists the routes and wraps every handler with
the API key check and the mapping of errors to JSON (OpenAI's shape; Anthropic's on ``ANTHROPIC_ROUTES``,
whose clients may also send the key as ``x-api-key``). Another API is one more module and one more route.
"""

from __future__ import annotations

import hmac
import logging
import time
from collections.abc import Awaitable, Callable

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..errors import ChatKitError
from ..model.loaded import LoadedModel
from . import anthropic_wire, chat_completions, messages, responses
from .errors import UnauthorizedError, error_body
from .state import Handler, ServerConfig, ServerState

log = logging.getLogger("chatkit.server")


async def models(state: ServerState, request: Request) -> Response:
    """The one model this server serves."""
    return JSONResponse({"object": "list", "data": [
        {"id": state.config.model_id, "object": "model", "created": int(time.time()), "owned_by": "chatkit"}]})


ROUTES: list[tuple[str, str, Handler]] = [  # (method, path under /v1, handler); each is also served without /v1
    ("GET", "/models", models),
    ("POST", "/chat/completions", chat_completions.create),
    ("POST", "/responses", responses.create),
    ("GET", "/responses/{rid}", responses.retrieve),
]
ANTHROPIC_ROUTES: list[tuple[str, str, Handler]] = [  # errors in Anthropic's shape; the key also as x-api-key
    ("POST", "/messages", messages.create),
    ("POST", "/messages/count_tokens", messages.count_tokens),
]


def create_app(lm: LoadedModel, config: ServerConfig | None = None) -> Starlette:
    """The ASGI app serving ``lm``; run it with uvicorn (``chatkit serve``) or :func:`chatkit.server.start`."""
    state = ServerState(lm, config or ServerConfig())
    routes = [Route(prefix + path, _endpoint(state, handler, anthropic=face is ANTHROPIC_ROUTES), methods=[method])
              for face in (ROUTES, ANTHROPIC_ROUTES) for prefix in ("/v1", "") for method, path, handler in face]
    return Starlette(routes=routes, lifespan=state.lifespan, exception_handlers={HTTPException: _http_error})


def _endpoint(state: ServerState, handler: Handler, *, anthropic: bool = False) -> Callable[[Request], Awaitable[Response]]:
    """``handler`` as a Starlette endpoint: the API key checked first, any error an OpenAI-style reply
    (``anthropic``: Anthropic-style, and the key may come as ``x-api-key``)."""
    async def endpoint(request: Request) -> Response:
        try:
            _authorize(request, state.config.api_key, anthropic)
            return await handler(state, request)
        except Exception as exc:
            return _error(exc, anthropic)
    return endpoint


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
    return JSONResponse({"error": {"message": f"{detail}: {request.method} {request.url.path}", "type": kind,
                                   "param": None, "code": None}}, status_code=status)


__all__ = ["ANTHROPIC_ROUTES", "ROUTES", "ServerConfig", "create_app"]

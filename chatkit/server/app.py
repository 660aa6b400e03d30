"""The HTTP face: a Starlette app serving OpenAI's APIs over chatkit's pooled sessions (``SessionIndex``).

One handler module per API (``chat_completions``, ``responses``), each handler a function of the shared
``ServerState`` and the request; this module lists the routes and wraps every handler with the API key
check and the mapping of errors to OpenAI-style JSON. Another API is one more module and one more route.
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
from starlette.routing import BaseRoute, Route

from ..errors import ChatKitError
from ..model.loaded import LoadedModel
from . import chat_completions, conversations, page, responses
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
    ("GET", "/conversations", conversations.list_all),  # chatkit's own: the stored conversations
    ("GET", "/conversations/{rid}", conversations.retrieve),
]


def create_app(lm: LoadedModel, config: ServerConfig | None = None) -> Starlette:
    """The ASGI app serving ``lm``; run it with uvicorn (``chatkit serve``) or :func:`chatkit.server.start`."""
    state = ServerState(lm, config or ServerConfig())
    routes: list[BaseRoute] = [Route(prefix + path, _endpoint(state, handler), methods=[method])
                               for prefix in ("/v1", "") for method, path, handler in ROUTES]
    routes += page.routes()  # the chat page at /, without the API key check: it holds no secret
    return Starlette(routes=routes, lifespan=state.lifespan, exception_handlers={HTTPException: _http_error})


def _endpoint(state: ServerState, handler: Handler) -> Callable[[Request], Awaitable[Response]]:
    """``handler`` as a Starlette endpoint: the API key checked first, any error an OpenAI-style reply."""
    async def endpoint(request: Request) -> Response:
        try:
            _authorize(request, state.config.api_key)
            return await handler(state, request)
        except Exception as exc:
            return _error(exc)
    return endpoint


def _authorize(request: Request, api_key: str | None) -> None:
    if api_key is None:
        return
    given = request.headers.get("authorization", "")
    scheme, _, token = given.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
        raise UnauthorizedError("Missing or wrong API key: send the header 'Authorization: Bearer <key>' "
                                "with the key the server was started with (--api-key).")


def _error(exc: Exception) -> JSONResponse:
    status, body = error_body(exc)
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


__all__ = ["ROUTES", "ServerConfig", "create_app"]

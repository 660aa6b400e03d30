"""``chatkit serve``: an OpenAI-compatible HTTP server whose conversations live on as chatkit sessions.

    app = create_app(lm, ServerConfig(...))      an ASGI app (Starlette): /v1/chat/completions,
                                                 /v1/responses (+ /{id}, /{id}/input_items),
                                                 /v1/models (+ /{id}), /v1/messages, /v1/conversations,
                                                 /health, /metrics, and the chat page at /
    server = start(lm, config)                   the app on uvicorn in a background thread (tests,
    server.url ... server.stop()                 notebooks, the README); ``chatkit serve`` runs it in front

One module per job: ``app`` (``create_app`` and its route table), a handler module per API
(``chat_completions``, ``responses``, ``response_items``: deleting and listing a stored response's
items, ``messages``: Anthropic's, ``conversations``: the stored ones, listed), ``page`` (the chat page and
its files in ``static/``), ``metrics`` (``/metrics``' counters), ``body`` (a request body checked whole before it is read),
``wire`` (what both APIs read: messages, tools, sampling parameters), ``models`` (the served model
and its adapters: what a request's ``model`` selects), ``state`` (``ServerConfig`` and what every
handler shares), ``session_index`` (conversations as pooled sessions; ``manifest``: their list on disk), ``write_behind``
(each conversation's cache written behind its turn), ``response_store`` (stored responses), ``trace``
(a request's stage times, when it asks with ``X-Chatkit-Trace``),
``errors`` (HTTP statuses), ``run`` (uvicorn). The flags of ``chatkit serve`` are the command line's:
chatkit/cli/serve.py.

Needs the ``server`` extra (starlette, uvicorn).
"""

from __future__ import annotations

try:
    import starlette  # noqa: F401
    import uvicorn  # noqa: F401
except ImportError as e:  # an optional extra: say how to get it
    raise ImportError(f"chatkit.server needs the server extra: pip install 'chatkit[server]' ({e}).") from e

from .app import create_app
from .errors import BadRequestError, OverloadedError, UnauthorizedError, UnknownResponseError
from .run import RunningServer, start
from .state import ServerConfig

__all__ = [
    "BadRequestError",
    "OverloadedError",
    "RunningServer",
    "ServerConfig",
    "UnauthorizedError",
    "UnknownResponseError",
    "create_app",
    "start",
]

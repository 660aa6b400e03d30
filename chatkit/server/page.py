"""The chat page at ``/``: plain HTML, CSS and JavaScript shipped in ``chatkit/server/static`` (no
build step), talking to this server's own Responses API and ``GET /v1/conversations``. The page holds
no secret, so it is served without the API key check; when the server has ``--api-key`` the page asks
for the key and sends it with its API calls."""

from __future__ import annotations

from pathlib import Path

from starlette.requests import Request
from starlette.responses import FileResponse, Response
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles

STATIC = Path(__file__).resolve().parent / "static"


async def index(request: Request) -> Response:
    """The page itself."""
    return FileResponse(STATIC / "index.html", media_type="text/html; charset=utf-8",
                        headers={"Cache-Control": "no-cache"})


def routes() -> list[BaseRoute]:
    """``/`` (the page) and ``/static/...`` (its script and style sheet)."""
    return [Route("/", index, methods=["GET"]), Mount("/static", StaticFiles(directory=STATIC), name="static")]


__all__ = ["STATIC", "index", "routes"]

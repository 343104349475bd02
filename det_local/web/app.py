"""The dashboard's application: /api/ (jsonapi.py), the pages (pages.py), the static files,
behind the guard (guard.py) and headers that keep a page's content from being run or framed."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from det_local.web import (
    cluster,
    commands,
    compare,
    curvesapi,
    hparams,
    jsonapi,
    models,
    pages,
    usage,
)
from det_local.web.guard import STANDALONE_HINT, App, Guard, Message, Receive, Scope, Send
from det_local.web.staticmem import StaticFiles

STATIC_DIR = Path(__file__).resolve().parent / "static"

# No inline script runs (page data is JSON in a non-executed block); nothing loads from
# elsewhere; no page can frame this one; no address (with its ?token=) leaks as a referrer.
HEADERS = [
    (
        b"content-security-policy",
        b"default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
        b"img-src 'self' data:; frame-ancestors 'none'; base-uri 'none'; form-action 'self'",
    ),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
    (b"x-frame-options", b"DENY"),
]


class SecurityHeaders:
    def __init__(self, app: App) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), *HEADERS]
            await send(message)

        await self.app(scope, receive, with_headers)


async def _not_found(request: Request, exc: Exception) -> Response:
    status = exc.status_code if isinstance(exc, HTTPException) else 500
    if status == 405:
        from det_local.web.responses import json_response

        return json_response({"error": "the dashboard is read-only: only GET is answered"}, 405)
    return pages.not_found(request)  # type: ignore[no-any-return]


def create_app(
    *,
    token: str,
    loopback_only: bool = True,
    port: int | None = None,
    hint: str = STANDALONE_HINT,
    on_start: Callable[[], None] | None = None,
) -> App:
    """The ASGI application: every request must carry `token` (guard.py); loopback_only: only
    requests to a loopback Host name are answered; port: the one it listens on (the name of
    the cookie older det-locals set, expired at login); hint: how a refused user gets the
    token; on_start: run in the event loop before the first request (serve.py bounds the
    worker threads there)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        if on_start is not None:
            on_start()
        yield

    # read now, as whoever builds the app (root, before a dashboard drops to its user)
    static = StaticFiles(STATIC_DIR)

    def service_worker(request: Request) -> Response:
        """/sw.js: the service worker that carries the login (guard.py), served at the root
        so that its scope is the whole origin."""
        return static.response("sw.js", request)

    def static_file(request: Request) -> Response:
        return static.response(request.path_params["path"], request)

    app = Starlette(
        lifespan=lifespan,
        routes=[
            # before /api/'s catch-all (jsonapi.routes() ends with it)
            *curvesapi.ROUTES,
            *compare.ROUTES,
            *hparams.ROUTES,
            *cluster.ROUTES,
            *commands.ROUTES,
            *usage.ROUTES,
            *models.ROUTES,
            *jsonapi.routes(),
            *pages.ROUTES,
            Route("/sw.js", service_worker),
            Route("/static/{path:path}", static_file, name="static"),
        ],
        exception_handlers={404: _not_found, 405: _not_found},
    )
    guard = Guard(app, token=token, loopback_only=loopback_only, port=port, hint=hint)
    return SecurityHeaders(guard)

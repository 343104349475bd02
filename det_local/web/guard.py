"""Who may read the dashboard: an ASGI middleware in front of every route.

Every request carries the dashboard's access token, on the loopback too (another user of this
machine can reach a loopback port as well as its owner can). The token is made fresh at each
start and shown only to whoever started the dashboard (its terminal; the daemon's dashboard:
a file, docs/system-mode.md "Dashboard"). A request offers it as

- the header `Authorization: Bearer TOKEN` or `X-Det-Local-Token: TOKEN` (scripts, curl; the
  browser's service worker sends the latter);
- the query `?token=TOKEN`: the login address. A page asked for this way answers with the
  login page (`LOGIN_PAGE`: no data, one script, static/login.js), which keeps the token in
  this origin's Cache Storage and registers the service worker static/sw.js (served as /sw.js)
  that adds the header to this origin's own requests, then opens the address without the
  token; an /api/ route answers at once (a script's one request).

No cookie carries it: a browser sends a host's cookies to every port of that host, so any
local user's server on another 127.0.0.1 port (a TensorBoard, a notebook, a page squatting
this port while it restarts) would receive it and could replay it. Cache Storage and service
workers are kept apart by origin (scheme, host and port), and the worker adds the token only
to requests for its own origin. A cookie of an older det-local (`det_local_token_<port>`) is
not accepted, and the login page expires it.

Compared in constant time. Without it: 401 and one line (a page asked for by a browser: the
same line in a page that runs static/login.js, which retries once through the worker after a
reload that bypassed it). On a loopback bind, requests whose Host header names anything but
the loopback are refused first (403: a web page elsewhere cannot reach the port through DNS
rebinding). `PUBLIC` (the worker, the login script, the style sheet: code shipped with
det-local, no data) is served without the token.
"""

from __future__ import annotations

import hmac
import html
import ipaddress
import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any
from urllib.parse import parse_qsl

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

COOKIE = "det_local_token"  # older det-locals' cookie (expired by the login page)
HEADER = "x-det-local-token"
PUBLIC = frozenset({"/sw.js", "/static/login.js", "/static/dashboard.css"})
LOOPBACK_NAMES = ("localhost", "localhost.")
STANDALONE_HINT = "open the address `det-local dashboard` printed at start (it ends ?token=...)"


def cookie_name(port: int | None) -> str:
    """The cookie older det-locals set for the dashboard on `port` (expired at login)."""
    return f"{COOKIE}_{port}" if port else COOKIE


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 or localhost."""
    if host.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def host_name(header: str) -> str:
    """The name in a Host header, without its port ("[::1]:8080" -> "::1")."""
    if header.startswith("["):
        return header[1 : header.find("]")] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


class Guard:
    """Answers 401 or 403 (one line of JSON; a browser's page: that line in a page) to what
    the module docstring does not let through. loopback_only: the dashboard listens on the
    loopback (the Host check applies); hint: how a refused user gets the token (one clause)."""

    def __init__(
        self,
        app: App,
        *,
        token: str,
        loopback_only: bool = True,
        port: int | None = None,
        hint: str = STANDALONE_HINT,
    ) -> None:
        if not token:
            raise ValueError("the dashboard's guard needs a token")
        self.app = app
        self.token = token.encode()
        self.loopback_only = loopback_only
        self.cookie = cookie_name(port)
        self.hint = hint

    def valid(self, offered: str) -> bool:
        return bool(offered) and hmac.compare_digest(offered.encode(), self.token)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if self.loopback_only and not is_loopback(host_name(headers.get("host", ""))):
            await deny(send, 403, "this dashboard answers only requests to localhost")
            return
        if scope["path"] in PUBLIC and scope.get("method") in ("GET", "HEAD"):
            await self.app(scope, receive, send)
            return
        query = parse_qsl(scope.get("query_string", b"").decode("latin-1"), keep_blank_values=True)
        from_query = next((v for k, v in query if k == "token"), "")
        offered = [headers.get(HEADER, ""), _bearer(headers.get("authorization", ""))]
        if self.valid(from_query):
            if scope["path"].startswith("/api/"):
                await self.app(scope, receive, send)
                return
            await self._login(send)
            return
        if not any(self.valid(o) for o in offered):
            why = "a wrong access token" if (from_query or any(offered)) else "no access token"
            line = f"this dashboard needs its access token ({why}): {self.hint}"
            if "text/html" in headers.get("accept", ""):  # a browser's page: it may retry
                await shell(send, 401, line, mode="retry")
                return
            await deny(send, 401, line)
            return
        await self.app(scope, receive, send)

    async def _login(self, send: Send) -> None:
        """The login address: the login page (login.js keeps the token and opens the address
        without it); older det-locals' cookie expired."""
        expire = tuple(
            (b"set-cookie", f"{name}=; Max-Age=0; Path=/; HttpOnly; SameSite=Strict".encode())
            for name in dict.fromkeys((self.cookie, COOKIE))
        )
        await shell(send, 200, "logging in...", mode="store", extra=expire)


LOGIN_PAGE = (
    '<!doctype html><html lang="en"><head><meta charset="utf-8">'
    '<link rel="icon" href="data:,"><title>det-local dashboard</title>'
    '<link rel="stylesheet" href="/static/dashboard.css">'
    '<script src="/static/login.js" defer></script></head>'
    '<body><main id="login" data-mode="{mode}"><p id="login-status">{line}</p></main></body></html>'
)


async def shell(
    send: Send, status: int, line: str, *, mode: str, extra: tuple[tuple[bytes, bytes], ...] = ()
) -> None:
    """A page with no data but `line` and static/login.js (mode "store": keep the token of
    the address; "retry": a refused page, retried once through the service worker)."""
    body = LOGIN_PAGE.format(mode=mode, line=html.escape(line)).encode()
    await _answer(send, status, b"text/html; charset=utf-8", body, extra)


async def _answer(
    send: Send, status: int, kind: bytes, body: bytes, extra: tuple[tuple[bytes, bytes], ...] = ()
) -> None:
    """One whole answer that no cache keeps."""
    headers = [
        (b"content-type", kind),
        (b"content-length", str(len(body)).encode()),
        (b"cache-control", b"no-store"),
        *extra,
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _bearer(value: str) -> str:
    scheme, _, rest = value.partition(" ")
    return rest.strip() if scheme.lower() == "bearer" else ""


async def deny(send: Send, status: int, message: str) -> None:
    """A refusal: `status` and {"error": "one line"}."""
    body = json.dumps({"error": message}).encode() + b"\n"
    await _answer(send, status, b"application/json", body)

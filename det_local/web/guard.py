"""Who may read the dashboard: an ASGI middleware in front of every route.

- Loopback (the default, 127.0.0.1): only requests whose Host header names the loopback are
  answered (a web page elsewhere cannot reach it through DNS rebinding); no token.
- Any other address: every request carries the access token printed at start, as the header
  `Authorization: Bearer TOKEN`, `X-Det-Local-Token: TOKEN`, the query `?token=TOKEN`, or the
  cookie a page opened with ?token= sets (so its scripts' requests carry it). Compared in
  constant time.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
from collections.abc import Awaitable, Callable, MutableMapping
from http.cookies import SimpleCookie
from typing import Any
from urllib.parse import parse_qs

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

COOKIE = "det_local_token"
LOOPBACK_NAMES = ("localhost", "localhost.")


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
    """Answers 403 (one line of JSON) to what the module docstring does not let through."""

    def __init__(self, app: App, *, token: str | None) -> None:
        self.app = app
        self.token = token

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if self.token is None:
            if not is_loopback(host_name(headers.get("host", ""))):
                await _deny(send, "this dashboard answers only requests to localhost")
                return
            await self.app(scope, receive, send)
            return
        query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
        from_query = (query.get("token") or [""])[0]
        offered = [
            from_query,
            headers.get("x-det-local-token", ""),
            _bearer(headers.get("authorization", "")),
            _cookie(headers.get("cookie", "")),
        ]
        if not any(o and hmac.compare_digest(o.encode(), self.token.encode()) for o in offered):
            await _deny(
                send,
                "the dashboard needs its access token (printed by `det-local dashboard` at "
                "start): open the address with ?token=TOKEN",
            )
            return
        if from_query and hmac.compare_digest(from_query.encode(), self.token.encode()):
            await self.app(scope, receive, _setting_cookie(send, self.token))
            return
        await self.app(scope, receive, send)


def _bearer(value: str) -> str:
    scheme, _, rest = value.partition(" ")
    return rest.strip() if scheme.lower() == "bearer" else ""


def _cookie(value: str) -> str:
    jar: SimpleCookie = SimpleCookie()
    try:
        jar.load(value)
    except Exception:  # a malformed Cookie header: no token in it
        return ""
    morsel = jar.get(COOKIE)
    return morsel.value if morsel else ""


def _setting_cookie(send: Send, token: str) -> Send:
    async def wrapped(message: Message) -> None:
        if message["type"] == "http.response.start":
            cookie = f"{COOKIE}={token}; Path=/; HttpOnly; SameSite=Strict"
            message["headers"] = [*message.get("headers", []), (b"set-cookie", cookie.encode())]
        await send(message)

    return wrapped


async def _deny(send: Send, message: str) -> None:
    body = json.dumps({"error": message}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": 403,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})

"""Who may read the dashboard: an ASGI middleware in front of every route.

Every request carries the dashboard's access token, on the loopback too (another user of this
machine can reach a loopback port as well as its owner can). The token is made fresh at each
start and shown only to whoever started the dashboard (its terminal; the daemon's dashboard:
a file, docs/system-mode.md "Dashboard"). A request offers it as

- the header `Authorization: Bearer TOKEN` or `X-Det-Local-Token: TOKEN` (scripts, curl);
- the query `?token=TOKEN`: the login address. A page asked for this way answers with an
  HttpOnly, SameSite=Strict cookie holding the token and a redirect to the same address
  without it (so the token leaves the address bar and the history); an /api/ route answers
  at once (with the cookie too);
- that cookie (named after the port: two dashboards of one host keep theirs apart).

Compared in constant time. Without it: 401 and one line. On a loopback bind, requests whose
Host header names anything but the loopback are refused first (403: a web page elsewhere cannot
reach the port through DNS rebinding).
"""

from __future__ import annotations

import hmac
import ipaddress
import json
from collections.abc import Awaitable, Callable, MutableMapping
from http.cookies import SimpleCookie
from typing import Any
from urllib.parse import parse_qsl, quote, urlencode

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

COOKIE = "det_local_token"
LOOPBACK_NAMES = ("localhost", "localhost.")
STANDALONE_HINT = "open the address `det-local dashboard` printed at start (it ends ?token=...)"


def cookie_name(port: int | None) -> str:
    """The cookie of the dashboard on `port` (cookies are not kept apart by port)."""
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
    """Answers 401 or 403 (one line of JSON) to what the module docstring does not let
    through. loopback_only: the dashboard listens on the loopback (the Host check applies);
    hint: how a refused user gets the token (one clause)."""

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
        query = parse_qsl(scope.get("query_string", b"").decode("latin-1"), keep_blank_values=True)
        from_query = next((v for k, v in query if k == "token"), "")
        offered = [
            headers.get("x-det-local-token", ""),
            _bearer(headers.get("authorization", "")),
            _cookie(headers.get("cookie", ""), self.cookie),
        ]
        if self.valid(from_query):
            if scope["path"].startswith("/api/"):
                await self.app(scope, receive, self._setting_cookie(send))
                return
            rest = urlencode([(k, v) for k, v in query if k != "token"])
            await self._login(send, clean_path(scope["path"]) + (f"?{rest}" if rest else ""))
            return
        if not any(self.valid(o) for o in offered):
            why = "a wrong access token" if (from_query or any(offered)) else "no access token"
            await deny(send, 401, f"this dashboard needs its access token ({why}): {self.hint}")
            return
        await self.app(scope, receive, send)

    def _cookie_header(self) -> tuple[bytes, bytes]:
        value = f"{self.cookie}={self.token.decode()}; Path=/; HttpOnly; SameSite=Strict"
        return (b"set-cookie", value.encode())

    def _setting_cookie(self, send: Send) -> Send:
        async def wrapped(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), self._cookie_header()]
            await send(message)

        return wrapped

    async def _login(self, send: Send, clean: str) -> None:
        """The login address: the cookie, and a redirect to the address without the token."""
        await send(
            {
                "type": "http.response.start",
                "status": 303,
                "headers": [
                    (b"location", clean.encode("latin-1", errors="replace")),
                    (b"content-length", b"0"),
                    (b"cache-control", b"no-store"),
                    self._cookie_header(),
                ],
            }
        )
        await send({"type": "http.response.body", "body": b""})


def clean_path(path: str) -> str:
    """A path to redirect to on this host only ("//elsewhere" or "/\\elsewhere" would leave
    it), percent-encoded again."""
    return "/" + quote(path.lstrip("/\\"), safe="/:@!$&'()*+,;=-._~")


def _bearer(value: str) -> str:
    scheme, _, rest = value.partition(" ")
    return rest.strip() if scheme.lower() == "bearer" else ""


def _cookie(value: str, name: str) -> str:
    jar: SimpleCookie = SimpleCookie()
    try:
        jar.load(value)
    except Exception:  # a malformed Cookie header: no token in it
        return ""
    morsel = jar.get(name)
    return morsel.value if morsel else ""


async def deny(send: Send, status: int, message: str) -> None:
    """A refusal: `status` and {"error": "one line"}."""
    body = json.dumps({"error": message}).encode() + b"\n"
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"cache-control", b"no-store"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})

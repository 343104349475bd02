"""What every route shares: JSON bodies (NaN as null, as --json prints), one-line errors, and
reading ids and numbers from the request with a clear message when they are not numbers."""

from __future__ import annotations

import functools
import json
import sys
import traceback
from collections.abc import Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from det_local.errors import DetLocalError, NotFoundError
from det_local.store.records import json_safe


class BadRequest(DetLocalError):
    """A request the dashboard cannot read (an id or a number that is none)."""


def json_response(value: Any, status: int = 200) -> Response:
    body = json.dumps(json_safe(value), separators=(",", ":"))
    return Response(body, status_code=status, media_type="application/json")


def error_status(err: DetLocalError) -> int:
    """404 for an unknown id, 403 for what this dashboard's user may not read (a private
    trial log), else 400."""
    from det_local.client.attach import LogsPrivate

    if isinstance(err, NotFoundError):
        return 404
    return 403 if isinstance(err, LogsPrivate) else 400


def json_errors(endpoint: Callable[[Request], Response]) -> Callable[[Request], Response]:
    """A DetLocalError becomes {"error": "one line"} with 404 (unknown id) or 400; anything
    else 500 with one line (its traceback goes to the dashboard's stderr)."""

    @functools.wraps(endpoint)
    def wrapped(request: Request) -> Response:
        try:
            return endpoint(request)
        except DetLocalError as err:
            return json_response({"error": str(err)}, error_status(err))
        except Exception as err:
            traceback.print_exc(file=sys.stderr)
            return json_response({"error": unexpected(err)}, 500)

    return wrapped


def unexpected(err: Exception) -> str:
    return (
        f"unexpected {type(err).__name__}: {err} (the dashboard's output has the traceback; "
        "report it)"
    )


MAX_ID = (1 << 63) - 1  # SQLite's largest integer: no row has a larger id


def as_id(raw: str, kind: str) -> int:
    """An id as the store keeps them: NotFoundError (404) for anything else (not a number, or
    a number no row can have)."""
    raw = str(raw)
    if not (raw.isascii() and raw.isdigit()):
        raise NotFoundError(f"{kind} {raw!r} not found: {kind} ids are whole numbers")
    if len(raw) > 19 or int(raw) > MAX_ID:
        raise NotFoundError(f"{kind} {raw[:40]} not found: no {kind} id is that large")
    return int(raw)


def path_id(request: Request, name: str) -> int:
    """An id from the path: 404 (as an unknown id) when it is not one."""
    return as_id(request.path_params[name], name.removesuffix("_id"))


def query_int(request: Request, name: str, default: int | None = None) -> int | None:
    raw = request.query_params.get(name)
    if raw is None or raw == "":
        return default
    text = raw.strip()
    digits = text.removeprefix("-")
    if not (digits.isascii() and digits.isdigit()):
        raise BadRequest(f"?{name}={raw[:40]!r} is not a whole number")
    if text.startswith("-"):
        raise BadRequest(f"?{name}={raw[:40]!r} must be 0 or more")
    if len(digits) > 19 or int(digits) > MAX_ID:
        raise BadRequest(f"?{name}={raw[:40]} is too large (at most {MAX_ID})")
    return int(digits)


def query_flag(request: Request, name: str) -> bool:
    return request.query_params.get(name, "").lower() in ("1", "true", "yes")

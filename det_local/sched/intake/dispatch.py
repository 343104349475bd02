"""Request dispatch: a spool request's answer, from the handler its ``op`` names.

`sched/intake/handlers.py` holds one handler per request type (``HANDLERS``, keyed by op);
`sched/intake/lifecycle/` those about results after the fact (trial kill, deletions, models). Here a
request is turned into its answer: ``{"value": ...}``, or ``{"error": one line}`` for an
unknown op, a refused or malformed request or a handler's error. An error of the machine rather
than of the request (a full disk, a locked database) is raised instead: the request stays in
the spool and is tried again (`sched/intake/spoolserver.py`); so is ``errors.Pending`` (a check
that must not wait on the loop: the request is applied again when it has ended).
"""

from __future__ import annotations

import errno
import sqlite3
from typing import Any

from det_local.errors import DetLocalError, Pending
from det_local.sched.intake import lifecycle
from det_local.sched.intake.handlers import HANDLERS, Controls
from det_local.sched.intake.spool import Request


def transient(err: BaseException) -> bool:
    """An error of the machine, not of the request (a full disk, a locked database): trying
    the request again later can succeed."""
    if isinstance(err, sqlite3.OperationalError):
        return True
    return isinstance(err, OSError) and err.errno in (
        errno.ENOSPC,
        errno.EDQUOT,
        errno.EIO,
        errno.ENOMEM,
        errno.EMFILE,
        errno.ENFILE,
    )


def apply_request(controls: Controls, req: Request) -> dict[str, Any]:
    handler = HANDLERS.get(req.op) or lifecycle.HANDLERS.get(req.op)
    if handler is None:
        return {"error": f"unknown request '{req.op}' in {req.path.name}"}
    try:
        return {"value": handler(controls, req)}
    except Pending:
        raise  # not an answer: the request is applied again once what it waits for has ended
    except DetLocalError as err:
        return {"error": str(err)}
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        return {"error": f"request {req.path.name} ({req.op}) is malformed: {err!r}"}
    except Exception as err:
        if transient(err):
            raise  # a full disk...: the request stays in the spool and is tried again
        return {"error": f"request {req.path.name} ({req.op}) failed: {err!r}"}

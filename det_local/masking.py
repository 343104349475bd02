"""Secret-looking option values hidden: the one rule for every place a command line is shown to
someone other than its owner (`cmd list`, the dashboard, the daemon's log).

An option whose name looks secret (token, password, secret, api key, credential) has its value
replaced by ``***``: ``--password=abc`` and ``--password abc`` alike. ``hide_secrets`` works on
an argv; ``hide_secrets_in_line`` on a command line as one string (a job's name defaults to its
argv joined by spaces), token by token, keeping the spacing.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

HIDDEN = "***"
_SECRET = re.compile(r"token|password|passwd|secret|api[-_]?key|credential", re.IGNORECASE)
_SPACE = re.compile(r"(\s+)")


def hide_secrets(argv: Sequence[str] | None) -> list[str] | None:
    """argv with the value of every option whose name looks secret (token, password, secret,
    api key, credential) replaced by ***: `--token=abc` and `--token abc` alike."""
    if argv is None:
        return None
    out: list[str] = []
    hide_next = False
    for arg in argv:
        if hide_next:
            out.append(HIDDEN)
            hide_next = False
            continue
        name, eq, _ = arg.partition("=")
        secret = arg.startswith("-") and _SECRET.search(name) is not None
        if secret and eq:
            out.append(f"{name}={HIDDEN}")
        else:
            out.append(arg)
            hide_next = secret and not eq
    return out


def hide_secrets_in_line(line: str) -> str:
    """A command line (argv joined by spaces, as a job's default name is) with the same values
    hidden as `hide_secrets` hides in the argv."""
    parts = _SPACE.split(line)  # words at even indexes, the spaces between them at odd ones
    words = hide_secrets(parts[0::2]) or []
    parts[0::2] = words
    return "".join(parts)

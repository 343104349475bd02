"""What every command shares: the --json/--debug conventions and one-line errors."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import typer

from det_local.errors import DetLocalError

DEBUG_ENV = "DET_LOCAL_DEBUG"


def run_cli(app: typer.Typer) -> int:
    """Run the typer app; a DetLocalError becomes one line on stderr (traceback with --debug)."""
    argv = sys.argv[1:]
    if "--debug" in argv:
        argv.remove("--debug")
        os.environ[DEBUG_ENV] = "1"
    try:
        rc = app(args=argv, prog_name="det-local", standalone_mode=False)
    except DetLocalError as err:
        if os.environ.get(DEBUG_ENV):
            raise
        if str(err):
            print(f"error: {err}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:
        return 130
    except Exception as err:
        # click's (or typer's bundled click's) usage errors, Exit and Abort, by shape: typer may
        # ship its own copy of click, so isinstance checks against `click` can miss them.
        name = type(err).__name__
        if name == "Exit":
            return int(getattr(err, "exit_code", 0) or 0)
        if name == "Abort":
            return 130
        if hasattr(err, "show") and isinstance(getattr(err, "exit_code", None), int):
            err.show()
            return int(getattr(err, "exit_code", 1))
        if os.environ.get(DEBUG_ENV):
            raise
        print(
            f"error: unexpected {name}: {err} (run again with --debug for the "
            "traceback and report it)",
            file=sys.stderr,
        )
        return 1
    return rc if isinstance(rc, int) else 0


def print_json(value: Any) -> None:
    from det_local.store.records import json_safe

    print(json.dumps(json_safe(value), indent=2, sort_keys=False))


def table(headers: list[str], rows: list[list[Any]]) -> str:
    """A plain aligned text table (no colours: it is read by people and grep alike)."""
    cells = [[("" if c is None else str(c)) for c in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in cells:
        for i, c in enumerate(row):
            widths[i] = max(widths[i], len(c))
    line = " | ".join(h.ljust(w) for h, w in zip(headers, widths, strict=False))
    sep = "-+-".join("-" * w for w in widths)
    body = [
        " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=False)).rstrip() for row in cells
    ]
    return "\n".join([line.rstrip(), sep, *body])

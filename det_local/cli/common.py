"""What every command shares: the --json/--debug conventions and one-line errors."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Collection, Sequence
from typing import TYPE_CHECKING, Any

from det_local.errors import DetLocalError

if TYPE_CHECKING:
    import typer

DEBUG_ENV = "DET_LOCAL_DEBUG"


def run_cli(app: typer.Typer) -> int:
    """Run the typer app; a DetLocalError becomes one line on stderr (traceback with --debug)."""
    argv = sys.argv[1:]
    if "--debug" in argv:
        argv.remove("--debug")
        os.environ[DEBUG_ENV] = "1"
    from det_local.cli import safeout

    safeout.install()  # writes never block nor raise: Ctrl-C and SIGTERM always work
    if os.environ.get("_DET_LOCAL_COMPLETE"):  # a shell asks for completions
        from typer.completion import completion_init

        completion_init()  # typer's completion classes, which its scripts speak to
    return guarded(lambda: app(args=argv, prog_name="det-local", standalone_mode=False))


def guarded(call: Callable[[], Any]) -> int:
    """Run a command (typer's app, or a fast path's body: `cli/start/fast.py`); its exit
    status, errors as one line (`run_cli`)."""
    try:
        rc = call()
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
        if name == "NoArgsIsHelpError":  # a group called without a command: its help
            err.show()  # type: ignore[attr-defined]
            return int(getattr(err, "exit_code", 2))
        if hasattr(err, "show") and isinstance(getattr(err, "exit_code", None), int):
            usage_line(err)
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


def usage_line(err: Any) -> None:
    """A usage error (unknown command or option, missing argument) as one line on stderr:
    `det-local experiment: no command 'lst'; did you mean 'list'?`."""
    ctx = getattr(err, "ctx", None)
    where = ctx.command_path if ctx is not None else "det-local"
    message = err.format_message() if hasattr(err, "format_message") else str(err)
    if message.startswith("no command"):  # names the closest command, or where the list is
        print(f"{where}: {message}", file=sys.stderr)
        return
    print(f"{where}: {message} (`{where} -h` for help)", file=sys.stderr)


def print_json(value: Any) -> None:
    import json

    from det_local.store.records import json_safe

    print(json.dumps(json_safe(value), indent=2, sort_keys=False))


def table(
    headers: list[str],
    rows: list[list[Any]],
    *,
    flex: Collection[str] | None = None,
    optional: Sequence[str] = (),
) -> str:
    """A table that fits the terminal (det_local/tables.py): plain aligned text with " | "
    between cells when stdout is not a terminal (100 columns unless COLUMNS says otherwise),
    rich with colours on one. flex: headers of the columns that may shrink (default: the wide
    ones); optional: headers of columns dropped, first ones first, when shrinking is not
    enough."""
    from det_local.tables import table as fitted

    return fitted(headers, rows, flex=flex, optional=optional)

"""The `det-local` script: help from the cache (`cli/helpcache.py`, no typer import), else the
typer app of `cli/main.py`."""

from __future__ import annotations

import sys


def main() -> None:
    from det_local.cli import helpcache

    argv = sys.argv[1:]
    rc = helpcache.answer(argv)
    if rc is not None:
        sys.exit(rc)
    from det_local.cli.main import app, run_cli

    if helpcache.eligible(argv):
        sys.exit(helpcache.make(argv, lambda: run_cli(app)))
    sys.exit(run_cli(app))


if __name__ == "__main__":
    main()

"""The `det-local` script: the hot commands' plain forms without typer (`cli/start/fast.py`), help
from the cache (`cli/start/helpcache.py`), else the typer app of `cli/main.py`."""

from __future__ import annotations

import sys

# the groups of fast.py's commands, aliases too
HOT_GROUPS = ("cmd", "command", "job", "j", "trial", "t", "daemon")


def main() -> None:
    argv = sys.argv[1:]
    if argv and argv[0] in HOT_GROUPS and argv[-1] not in ("-h", "--help"):  # help: the cache
        from det_local.cli.start import fast

        rc = fast.run(argv)
        if rc is not None:
            sys.exit(rc)
    from det_local.cli.start import helpcache

    rc = helpcache.answer(argv)
    if rc is not None:
        sys.exit(rc)
    from det_local.cli.main import app, run_cli

    if helpcache.eligible(argv):
        sys.exit(helpcache.make(argv, lambda: run_cli(app)))
    sys.exit(run_cli(app))


if __name__ == "__main__":
    main()

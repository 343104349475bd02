"""The hot commands without typer: `cmd run [OPTIONS] -- COMMAND...`, `job list`, `trial logs ID`,
`daemon status` (each with its options).

A shell loop of `det-local cmd run` and a terminal watching `job list` pay typer's import
(~50 ms of CPU on a 2-core machine, most of what these commands cost) for parsing a few
options. This module parses the plain forms of these commands itself and calls the same bodies
the typer commands call (`cli/hot.py`); anything else (`-h`, an unknown or repeated option, a
value or an id that is not plainly an integer, a value that looks like an option, `cmd run
--follow`, `job list --cluster`, `--debug`, no `--` before the command's own words, shell
completion) is declined, and typer parses it as before. `tests/cli/test_cli_fast.py` runs both
over one argv table: what this module takes, typer takes the same way.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from det_local.priority import DEFAULT_PRIORITY


@dataclass(frozen=True)
class Opt:
    field: str
    kind: str  # "flag", "int", "text" or "texts" (repeatable, a list)


@dataclass(frozen=True)
class Hot:
    groups: tuple[str, ...]  # the group's name and its aliases
    names: tuple[str, ...]  # the command's name and its aliases
    options: dict[str, Opt]
    defaults: dict[str, Any]
    rest: bool  # the command's own words follow a `--`
    body: str  # the function of cli/hot.py
    ids: tuple[str, ...] = ()  # its positional arguments, integers (ids), in order


CMD_RUN = Hot(
    groups=("cmd", "command"),
    names=("run",),
    options={
        "--slots": Opt("slots", "int"),
        "--priority": Opt("priority", "int"),
        "-p": Opt("priority", "int"),
        "--name": Opt("name", "text"),
        "--pool": Opt("pool", "text"),
        "--anywhere": Opt("anywhere", "flag"),
        "--config": Opt("config", "texts"),
    },
    defaults={
        "slots": 1,
        "priority": DEFAULT_PRIORITY,
        "name": None,
        "follow": False,
        "pool": None,
        "anywhere": False,
        "config": None,
    },
    rest=True,
    body="cmd_run",
)
JOB_LIST = Hot(
    groups=("job", "j"),
    names=("list", "ls"),
    options={
        "--all": Opt("show_all", "flag"),
        "-a": Opt("show_all", "flag"),
        "--limit": Opt("limit", "int"),
        "--json": Opt("as_json", "flag"),
    },
    defaults={"show_all": False, "limit": None, "as_json": False},
    rest=False,
    body="job_list",
)
TRIAL_LOGS = Hot(
    groups=("trial", "t"),
    names=("logs",),
    options={
        "--follow": Opt("follow", "flag"),
        "-f": Opt("follow", "flag"),
        "--rank": Opt("rank", "int"),
        "--tail": Opt("tail", "int"),
    },
    defaults={"follow": False, "rank": None, "tail": None},
    rest=False,
    body="trial_logs",
    ids=("trial_id",),
)
DAEMON_STATUS = Hot(
    groups=("daemon",),
    names=("status",),
    options={"--json": Opt("as_json", "flag")},
    defaults={"as_json": False},
    rest=False,
    body="daemon_status",
)
HOT = (CMD_RUN, JOB_LIST, TRIAL_LOGS, DAEMON_STATUS)


def parse(argv: list[str]) -> tuple[str, dict[str, Any]] | None:
    """(the body's name, its keyword arguments), or None: typer parses this argv."""
    if len(argv) < 2 or "--debug" in argv or os.environ.get("_DET_LOCAL_COMPLETE"):
        return None
    for hot in HOT:
        if argv[0] in hot.groups and argv[1] in hot.names:
            kwargs = _options(hot, argv[2:])
            return None if kwargs is None else (hot.body, kwargs)
    return None


def _options(hot: Hot, words: list[str]) -> dict[str, Any] | None:
    kwargs = dict(hot.defaults)
    seen: set[str] = set()
    ids = list(hot.ids)
    i = 0
    while i < len(words):
        word = words[i]
        if word == "--" and hot.rest:
            kwargs["args"] = words[i + 1 :]  # as click hands them on: after the `--`
            return kwargs
        if not word.startswith("-"):  # a positional argument (between options too, as click)
            if not (ids and word.isascii() and word.isdigit()):
                return None
            kwargs[ids.pop(0)] = int(word)
            i += 1
            continue
        name, eq, attached = word.partition("=")
        opt = hot.options.get(name if name.startswith("--") else word)
        if opt is None or (opt.field in seen and opt.kind != "texts"):
            return None
        seen.add(opt.field)
        if opt.kind == "flag":
            if eq:
                return None
            kwargs[opt.field] = True
            i += 1
            continue
        if eq:
            value, i = attached, i + 1
        elif i + 1 < len(words):
            value, i = words[i + 1], i + 2
        else:
            return None
        if value.startswith("-") or value == "":
            return None
        if opt.kind == "int":
            if not (value.isascii() and value.isdigit()):
                return None
            kwargs[opt.field] = int(value)
        elif opt.kind == "texts":
            kwargs[opt.field] = [*(kwargs[opt.field] or []), value]
        else:
            kwargs[opt.field] = value
    return None if hot.rest or ids else kwargs


def run(argv: list[str]) -> int | None:
    """Run argv's command here if it is a hot one in a plain form: its exit status; else None."""
    parsed = parse(argv)
    if parsed is None:
        return None
    body_name, kwargs = parsed
    from det_local.cli import hot, safeout
    from det_local.cli.common import guarded

    safeout.install()  # as run_cli does
    body: Callable[..., Any] = getattr(hot, body_name)
    return guarded(lambda: body(**kwargs))

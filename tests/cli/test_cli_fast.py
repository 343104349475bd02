"""The hot commands' fast path (`cli/start/fast.py`) agrees with typer (issue 37): over one argv
table, whatever the fast path takes, typer parses into the same call of the same body
(`cli/hot.py`); what it declines, typer parses as always. And the `det-local` script still does
what the command does: the same output, exit status and errors."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
import typer

import det_local.cli.main
from det_local.cli import hot
from det_local.cli.start import entry, fast
from det_local.priority import DEFAULT_PRIORITY
from tests.support.world import Env

TAKEN = [
    ["cmd", "run", "--", "true"],
    ["cmd", "run", "--", "python3", "-c", "print(1)", "--slots", "3", "--", "x"],
    ["command", "run", "--slots", "2", "--", "sleep", "1"],
    ["cmd", "run", "--slots=2", "-p", "7", "--name", "eval", "--", "true"],
    ["cmd", "run", "--priority", "99", "--pool", "gpu", "--anywhere", "--", "true"],
    ["cmd", "run", "--config", "idle_timeout=30m", "--config", "a=b", "--", "true"],
    ["cmd", "run", "--name=with space", "--", "a b"],
    ["cmd", "run", "--slots", "0", "--"],
    ["cmd", "run", "--slots", "007", "--", "--json"],
    ["job", "list"],
    ["j", "ls", "-a"],
    ["job", "list", "--all", "--json", "--limit", "5"],
    ["job", "ls", "--limit=0"],
    ["trial", "logs", "3"],
    ["t", "logs", "--tail", "5", "12"],
    ["trial", "logs", "7", "-f", "--rank", "1", "--tail=0"],
    ["trial", "logs", "0012", "--follow"],
    ["daemon", "status"],
    ["daemon", "status", "--json"],
]
DECLINED = [
    ["cmd", "run", "true"],  # no `--`: click's rules for words and options mixed
    ["cmd", "run", "--slots", "2", "true"],
    ["cmd", "run", "-f", "--", "true"],  # follow: the embedded engine
    ["cmd", "run", "--follow", "--", "true"],
    ["cmd", "run", "--slots", "-1", "--", "true"],
    ["cmd", "run", "--slots", "two", "--", "true"],
    ["cmd", "run", "--slots", "+2", "--", "true"],
    ["cmd", "run", "--slots", "2", "--slots", "3", "--", "true"],
    ["cmd", "run", "-p5", "--", "true"],
    ["cmd", "run", "-p=5", "--", "true"],
    ["cmd", "run", "--anywhere=1", "--", "true"],
    ["cmd", "run", "--name", "--", "true"],
    ["cmd", "run", "--slots"],
    ["cmd", "run", "--sl", "2", "--", "true"],
    ["cmd", "run", "--unknown", "--", "true"],
    ["cmd", "run", "-h"],
    ["cmd", "run", "--", "true", "--debug"],
    ["job", "list", "--cluster"],
    ["job", "list", "--limit", "-1"],
    ["job", "list", "--limit"],
    ["job", "list", "-aa"],
    ["job", "list", "--all", "--all"],
    ["job", "list", "extra"],
    ["job", "list", "--"],
    ["job", "lst"],
    ["jobs", "list"],
    ["--version"],
    ["cmd"],
    ["trial", "logs"],  # the id is missing: typer says so
    ["trial", "logs", "3", "4"],
    ["trial", "logs", "x3"],
    ["trial", "logs", "-3"],
    ["trial", "logs", "3", "--rank", "-1"],
    ["trial", "logs", "--", "3"],
    ["trial", "logs", "3", "-f", "-f"],
    ["daemon", "status", "--json", "extra"],
    ["daemon", "stop"],
]


def _typer_call(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> Any:
    """(body, kwargs) typer calls for argv, or the exception's class name."""
    calls: list[tuple[str, dict[str, Any]]] = []
    keys = {
        "cmd_run": ["args", "slots", "priority", "name", "follow", "pool", "anywhere", "config"],
        "job_list": ["show_all", "limit", "as_json"],
        "trial_logs": ["trial_id", "follow", "rank", "tail"],
        "daemon_status": ["as_json"],
    }
    for body in keys:

        def record(*a: Any, _body: str = body) -> None:
            calls.append((_body, dict(zip(keys[_body], a, strict=True))))

        monkeypatch.setattr(hot, body, record)
    command = typer.main.get_command(det_local.cli.main.app)
    try:
        command.main(list(argv), prog_name="det-local", standalone_mode=False)
    except Exception as err:  # usage errors, Exit (help)
        return type(err).__name__
    return calls[0] if calls else None


@pytest.mark.parametrize("argv", TAKEN, ids=" ".join)
def test_fast_path_takes_argv_as_typer_does(
    argv: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    ours = fast.parse(argv)
    assert ours is not None, "the fast path should take this one"
    assert _typer_call(argv, monkeypatch) == ours


@pytest.mark.parametrize("argv", DECLINED, ids=" ".join)
def test_fast_path_declines_what_it_does_not_know(argv: list[str]) -> None:
    assert fast.parse(argv) is None


def test_fast_path_defaults_are_the_commands() -> None:
    assert fast.CMD_RUN.defaults["priority"] == DEFAULT_PRIORITY
    assert set(entry.HOT_GROUPS) == {g for hot in fast.HOT for g in hot.groups}


def _script(dl: Env, *args: str, entry: bool) -> tuple[int, str, str]:
    module = "det_local.cli.start.entry" if entry else "det_local.cli.main"
    p = subprocess.run(
        [sys.executable, "-m", module, *args],
        env=dl.env,
        cwd=dl.tmp,
        capture_output=True,
        text=True,
        timeout=60,
    )
    return p.returncode, p.stdout, p.stderr


def test_fast_commands_answer_as_typers(dl: Env) -> None:
    """No daemon: `cmd run` queues offline and says so; `job list` shows the queue; errors
    (a refused submission) are the same one line and status."""
    for fast_path in (True, False):  # the fast path, then typer; the same words each time
        n = 1 if fast_path else 2
        rc, out, err = _script(dl, "cmd", "run", "--name", f"c{n}", "--", "true", entry=fast_path)
        assert rc == 0 and out == f"Queued command {n}\n", err
        assert err.startswith(f"det-local: no daemon is running for {dl.home}; command {n} ")
    fast_list = _script(dl, "job", "list", "--all", entry=True)
    typer_list = _script(dl, "job", "list", "--all", entry=False)
    assert fast_list == typer_list and "c1" in fast_list[1] and "c2" in fast_list[1]
    assert _script(dl, "j", "ls", "--json", entry=True) == _script(
        dl, "j", "ls", "--json", entry=False
    )
    bad = ["cmd", "run", "--config", "idle_timeout=soon", "--", "true"]
    fast_err = _script(dl, *bad, entry=True)
    assert fast_err == _script(dl, *bad, entry=False)
    assert fast_err[0] != 0 and fast_err[2].startswith("error: ") and fast_err[2].count("\n") == 1
    assert len(dl.jobs()) == 2
    # no daemon: status says so, exit 3; an unknown trial's logs: one line and its status
    for argv in (["daemon", "status"], ["daemon", "status", "--json"], ["trial", "logs", "99"]):
        fast_answer = _script(dl, *argv, entry=True)
        assert fast_answer == _script(dl, *argv, entry=False)
        assert fast_answer[0] != 0 or argv[-1] == "--json", fast_answer
    assert _script(dl, "daemon", "status", entry=True)[0] == 3

"""The CLI's start (issue 37): help from a cache that is never stale, and command groups that load
only when invoked; the answers are the same as typer's, byte for byte."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import det_local
from tests.support.world import Env

PACKAGE = Path(det_local.__file__).parent

# pure help: answered from the cache once made; each as typer answers it
HELP_ARGVS = [
    [],
    ["-h"],
    ["--help"],
    ["job", "-h"],
    ["cmd", "run", "--help"],
    ["e", "ls", "-h"],
    ["experiment", "continue", "-h"],
    ["cluster", "node", "-h"],
    ["job", "lst", "-h"],  # an unknown command: its one line, status 2
    ["experimnt", "-h"],
]


def _run(module: str, argv: list[str], env: dict[str, str]) -> tuple[int, str, str, set[str]]:
    """(status, stdout, stderr, modules imported) of `python -m MODULE ARGV`."""
    p = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", module, *argv],
        env=env,
        cwd=env["DET_LOCAL_HOME"].rsplit("/", 1)[0],  # not the checkout: PYTHONPATH decides
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = p.stderr.splitlines()
    modules = {ln.rsplit("|", 1)[-1].strip() for ln in lines if ln.startswith("import time:")}
    err = "".join(f"{ln}\n" for ln in lines if not ln.startswith("import time:"))
    return p.returncode, p.stdout, err, modules


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    return {
        **os.environ,
        "XDG_CACHE_HOME": str(tmp_path / "cache"),
        "DET_LOCAL_HOME": str(tmp_path / "home"),
        "COLUMNS": "100",
    }


@pytest.mark.parametrize("argv", HELP_ARGVS, ids=lambda a: " ".join(a) or "(none)")
def test_help_from_the_cache_is_typers(argv: list[str], env: dict[str, str]) -> None:
    typer_rc, typer_out, typer_err, _ = _run("det_local.cli.main", argv, env)
    assert typer_out or typer_err
    made = _run("det_local.cli.start.entry", argv, env)  # made by typer, kept
    kept = _run("det_local.cli.start.entry", argv, env)  # from the cache
    assert "typer" in made[3]
    assert "typer" not in kept[3], "the second help should not import typer"
    for got in (made, kept):
        assert got[:3] == (typer_rc, typer_out, typer_err)


def test_help_cache_depends_on_the_terminal_width(env: dict[str, str]) -> None:
    wide = _run("det_local.cli.start.entry", ["cmd", "run", "-h"], env)
    narrow_env = {**env, "COLUMNS": "60"}
    narrow = _run("det_local.cli.start.entry", ["cmd", "run", "-h"], narrow_env)
    typer_narrow = _run("det_local.cli.main", ["cmd", "run", "-h"], narrow_env)
    assert narrow[:3] == typer_narrow[:3]
    assert narrow[1] != wide[1]


def test_help_cache_is_made_again_after_the_code_changes(
    tmp_path: Path, env: dict[str, str]
) -> None:
    """An editable change (or an upgrade: the same files replaced) is seen at the next help."""
    copy = tmp_path / "src"
    shutil.copytree(PACKAGE, copy / "det_local", ignore=shutil.ignore_patterns("__pycache__"))
    env = {**env, "PYTHONPATH": str(copy)}
    first = _run("det_local.cli.start.entry", ["job", "-h"], env)
    assert "The job queue." in first[1]
    assert "typer" not in _run("det_local.cli.start.entry", ["job", "-h"], env)[3]  # kept

    job = copy / "det_local" / "cli" / "job.py"
    job.write_text(job.read_text().replace('help="The job queue."', 'help="The queue, anew."'))
    changed = _run("det_local.cli.start.entry", ["job", "-h"], env)
    assert "The queue, anew." in changed[1] and "The job queue." not in changed[1]
    assert "typer" in changed[3]  # made again by typer
    again = _run("det_local.cli.start.entry", ["job", "-h"], env)
    assert again[:3] == changed[:3] and "typer" not in again[3]

    # a module the help does not show but was loaded for it (the top group's) counts too
    group = copy / "det_local" / "cli" / "group.py"
    group.write_text(group.read_text() + "\n# changed\n")
    assert "typer" in _run("det_local.cli.start.entry", ["job", "-h"], env)[3]


def test_help_cache_others_can_write_is_not_used(tmp_path: Path, env: dict[str, str]) -> None:
    made = _run("det_local.cli.start.entry", ["-h"], env)
    (cache,) = (tmp_path / "cache" / "det-local").glob("help-*")
    assert cache.stat().st_mode & 0o777 == 0o600
    cache.chmod(0o666)
    again = _run("det_local.cli.start.entry", ["-h"], env)
    assert "typer" in again[3] and again[:3] == made[:3]
    cache.chmod(0o600)
    assert "typer" not in _run("det_local.cli.start.entry", ["-h"], env)[3]
    cache.parent.chmod(0o777)  # a directory others may write: neither read nor written
    before = cache.stat()
    again = _run("det_local.cli.start.entry", ["-h"], env)
    assert "typer" in again[3] and again[:3] == made[:3]
    assert cache.stat().st_mtime_ns == before.st_mtime_ns


def test_commands_load_only_their_group(dl: Env, env: dict[str, str]) -> None:
    env = {**env, **dl.env}
    rc, out, err, modules = _run("det_local.cli.main", ["job", "list"], env)
    assert rc == 0, err
    assert "det_local.cli.job" in modules
    others = {"det_local.cli.experiment", "det_local.cli.trial", "det_local.cli.cmd"}
    assert not others & modules
    # `cmd run` to a daemon writes a request and reads the answer: no store, no tables
    dl.daemon_start()
    rc, out, err, modules = _run("det_local.cli.main", ["cmd", "run", "--", "true"], env)
    assert (rc, out) == (0, "Queued command 1\n"), err
    assert "det_local.cli.cmd" in modules
    assert not {"det_local.store.db", "det_local.cli.job", "det_local.tables"} & modules
    assert dl.wait_job(1).exit_code == 0

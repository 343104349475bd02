"""The fixtures every folder of the suite shares (the helpers they are made of live in
tests/support/; a folder's own conftest.py holds what only that folder needs).

Every test gets its own DET_LOCAL_HOME (through the environment, so the CLI subprocesses and
anything the test opens in-process agree on it): `det_home` (autouse), `dl` (the test's
det-local world: `tests.support.world.Env`), `storage` (a working directory for in-process
trainers); real Unix users: `accounts` and `shared` (`tests.support.users`).

Tests are marked by the folder they live in (README.md, "How tests are laid out"): web/browser/
`browser`, federation/netns/ `netns`, slurm/ `slurm`, so that `-m "not browser"` and the like
pick by kind.
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from tests.support.paths import TESTS
from tests.support.reach import restore_leftovers
from tests.support.torchext import clear_stale_locks
from tests.support.users import ADMIN_GROUP, Shared, create_accounts, remove_accounts
from tests.support.world import TRIAL_VARS, Env, gone, kill_home_processes

# Tests interrupt CLI processes with SIGINT (Ctrl-C) and SIGQUIT. A shell without job control
# starts background commands with both ignored, an ignored signal stays ignored across exec, and
# Python then never raises KeyboardInterrupt: restore the defaults so that what the tests send
# arrives however the suite was started.
for _sig, _handler in (
    (signal.SIGINT, signal.default_int_handler),
    (signal.SIGQUIT, signal.SIG_DFL),
):
    if signal.getsignal(_sig) == signal.SIG_IGN:
        signal.signal(_sig, _handler)

# folder (from tests/) -> the marker each of its tests gets (registered in pyproject.toml)
FOLDER_MARKERS = {
    ("web", "browser"): "browser",
    ("federation", "netns"): "netns",
    ("slurm",): "slurm",
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        parts = item.path.relative_to(TESTS).parts if item.path.is_relative_to(TESTS) else ()
        for folder, marker in FOLDER_MARKERS.items():
            if parts[: len(folder)] == folder:
                item.add_marker(marker)


@pytest.fixture
def storage(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """For in-process trainers: run in a small working directory (checkpoints copy it to
    code/); checkpoints go to the returned directory."""
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    return tmp_path / "checkpoints"


@pytest.fixture(autouse=True)
def det_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh DET_LOCAL_HOME for every test (also seen by in-process code)."""
    home = tmp_path / "home"
    monkeypatch.setenv("DET_LOCAL_HOME", str(home))
    # trials print no metric lines (many tests compare a trial's output exactly);
    # tests/cli/test_cli_live_metrics.py turns them back on
    monkeypatch.setenv("DET_LOCAL_METRIC_LINES", "0")
    for var in TRIAL_VARS:
        monkeypatch.delenv(var, raising=False)
    clear_stale_locks()  # DeepSpeed's JIT build lock of a process an earlier test killed
    return home


@pytest.fixture
def dl(det_home: Path, tmp_path: Path) -> Iterator[Env]:
    """The test's det-local world; background CLI processes and their trials are cleaned up."""
    env = {k: v for k, v in os.environ.items() if k not in TRIAL_VARS}
    env["DET_LOCAL_HOME"] = str(det_home)
    env["PYTHONUNBUFFERED"] = "1"
    world = Env(det_home, tmp_path, env)
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    yield world
    # Anything a test left running (its own CLI processes, their trials) is stopped here.
    for child in psutil.Process().children(recursive=True):
        if child.pid not in before:
            try:
                child.kill()
            except psutil.NoSuchProcess:
                pass
    kill_home_processes(det_home)
    for pidfile in tmp_path.rglob("*.pid"):
        try:
            pid = int(pidfile.read_text().split()[0])
        except (ValueError, IndexError, OSError):
            continue
        if not gone(pid) and _is_descendant_trial(pid, tmp_path):
            os.kill(pid, signal.SIGKILL)


def _is_descendant_trial(pid: int, tmp_path: Path) -> bool:
    """Only processes whose command line points into this test's directory are ours to kill."""
    try:
        return any(str(tmp_path) in a for a in psutil.Process(pid).cmdline()) or any(
            str(tmp_path) in v for v in psutil.Process(pid).environ().values()
        )
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


@pytest.fixture(scope="session")
def accounts() -> Iterator[None]:
    """The test accounts (tests.support.users: A, B, ADMIN in ADMIN_GROUP), made once for the
    session (useradd/userdel cost ~1 s a module; no test changes them) and removed at its end,
    even on failure. Directory modes a killed run opened for them are put back first
    (`tests.support.reach`)."""
    restore_leftovers()
    try:
        create_accounts()
        yield
    finally:
        remove_accounts()


@pytest.fixture
def shared(dl: Env, accounts: None, request: pytest.FixtureRequest) -> Iterator[Shared]:
    """A root daemon on a home every user can reach, with admin_group set (2 CPU slots; a
    test marked ``cpu_slots(n)`` gets n)."""
    mark = request.node.get_closest_marker("cpu_slots")
    cpu_slots = str(mark.args[0]) if mark is not None else "2"
    base = Path(tempfile.mkdtemp(prefix="det-local-mu-", dir="/tmp"))
    os.chmod(base, 0o755)
    out = base / "out"
    out.mkdir()
    os.chmod(out, 0o1777)
    (out / "order").touch()  # every user's jobs append to it
    os.chmod(out / "order", 0o666)
    home = base / "home"
    dl.home = home
    dl.env["DET_LOCAL_HOME"] = str(home)
    try:
        dl.daemon_start(
            {"admin_group": ADMIN_GROUP, "scheduler": {"preemption_timeout": 1}},
            DET_LOCAL_FAKE_GPUS="0",
            DET_LOCAL_CPU_SLOTS=cpu_slots,
        )
        yield Shared(dl, home, out)
    finally:
        kill_home_processes(home)
        shutil.rmtree(base, ignore_errors=True)

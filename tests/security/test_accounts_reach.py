"""The test accounts the suite submits work as reach a Python wherever its venv lies
(`tests/support/reach.py`).

* A venv made by `python3 -m venv` under a private (0700) directory links its interpreter to
  the system's: a test account can start it only while `python_reachable` holds it open, and
  the private directories are 0700 again afterwards, also after a holder killed with -9.
* A directory that refuses chmod (here a read-only mount) and a file the account cannot read
  are each named in one line that says what to do.

Each test keeps its own holders' state (`reach.STATE`), apart from the suite's other holders.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import reach
from tests.support.paths import REPO
from tests.support.users import A

SYSTEM_PYTHON = "/usr/bin/python3"

pytestmark = [
    pytest.mark.skipif(
        os.geteuid() != 0 or shutil.which("useradd") is None, reason="needs root and useradd"
    ),
    pytest.mark.skipif(not os.access(SYSTEM_PYTHON, os.X_OK), reason=f"no {SYSTEM_PYTHON}"),
]


@pytest.fixture
def private(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, accounts: None) -> Iterator[Path]:
    """A private (0700) directory holding a private home (0700)."""
    monkeypatch.setattr(reach, "STATE", tmp_path / "reach.state")
    base = Path(tempfile.mkdtemp(prefix="det-local-reach-", dir="/tmp"))
    try:
        assert base.stat().st_mode & 0o777 == 0o700
        (base / "home").mkdir(mode=0o700)
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


def venv(where: Path) -> Path:
    """`python3 -m venv` (no pip: nothing to install): its python links to the system's."""
    subprocess.run(
        [SYSTEM_PYTHON, "-m", "venv", "--without-pip", str(where)], check=True, timeout=120
    )
    python = where / "bin" / "python3"
    assert os.path.realpath(python).startswith("/usr/")
    return python


def as_account(python: Path) -> subprocess.CompletedProcess[str]:
    """`python -c 'import sys'` started by A (through sh: it says why it cannot)."""
    return subprocess.run(
        ["/bin/sh", "-c", 'exec "$0" -c "import sys; print(sys.prefix)"', str(python)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd="/",
        env={"PATH": "/usr/bin:/bin"},
        user=A,
        group=pwd.getpwnam(A).pw_gid,
        extra_groups=[],
    )


def modes(*paths: Path) -> list[int]:
    return [p.stat().st_mode & 0o7777 for p in paths]


def test_a_venv_in_a_private_home_runs_as_a_test_account_while_held(private: Path) -> None:
    home = private / "home"
    python = venv(home / "c" / ".venv")
    denied = as_account(python)
    assert denied.returncode != 0 and "Permission denied" in denied.stderr, denied

    with reach.python_reachable(str(python), paths=(), imports="sys"):
        ran = as_account(python)
        assert (ran.returncode, ran.stdout.strip()) == (0, str(home / "c" / ".venv")), ran
        assert modes(private, home) == [0o701, 0o701]
    assert modes(private, home) == [0o700, 0o700]
    assert as_account(python).returncode != 0
    assert reach.STATE.read_text() and '"count": 0' in reach.STATE.read_text()


HOLD = (
    "import sys, time\n"
    "from pathlib import Path\n"
    "from tests.support import reach\n"
    "reach.STATE = Path(sys.argv[1])\n"
    "with reach.python_reachable(sys.argv[2], paths=(), imports='sys'):\n"
    "    print('held', flush=True)\n"
    "    time.sleep(600)\n"
)


def test_what_a_holder_killed_with_9_opened_is_put_back(private: Path) -> None:
    home = private / "home"
    python = venv(home / "c" / ".venv")
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(reach.STATE), str(python)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        assert modes(private, home) == [0o701, 0o701]
    finally:
        holder.kill()
        holder.wait(30)
    assert modes(private, home) == [0o701, 0o701]  # nobody put them back: it died
    reach.restore_leftovers()  # as the `accounts` fixture does at a session's start
    assert modes(private, home) == [0o700, 0o700]

    # and the next holder's entry does too, before it opens what it needs
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(reach.STATE), str(python)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
    finally:
        holder.kill()
        holder.wait(30)
    with reach.python_reachable(SYSTEM_PYTHON, paths=(), imports="sys"):
        assert modes(private, home) == [0o700, 0o700]
    assert '"count": 0' in reach.STATE.read_text()


def test_a_directory_that_refuses_chmod_is_named_in_one_line(private: Path) -> None:
    ro = private / "home" / "ro"
    ro.mkdir(mode=0o700)
    python = venv(ro / "venv")
    mounted = subprocess.run(["mount", "--bind", str(ro), str(ro)], capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot bind-mount here: {mounted.stderr.strip()}")
    try:
        subprocess.run(["mount", "-o", "remount,ro,bind", str(ro)], check=True, timeout=30)
        with (
            pytest.raises(reach.Unreachable) as err,
            reach.python_reachable(str(python), paths=(), imports="sys"),
        ):
            pass
    finally:
        subprocess.run(["umount", str(ro)], check=True, timeout=30)
    assert str(err.value) == (
        f"test account {A} cannot enter {ro} (mode 0700, owner root; chmod o+x refused: "
        f"Read-only file system), on the way to {python}: give every account o+x on it "
        f"(chmod o+x {ro}), or put the checkout and its venv under a directory they can enter"
    )
    assert modes(private, private / "home") == [0o700, 0o700]  # put back: nothing is held


def test_a_file_the_account_cannot_read_is_named_in_one_line(private: Path) -> None:
    python = venv(private / "home" / "venv")
    site = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    secret = site / "mine.py"
    secret.write_text("")
    secret.chmod(0o600)  # as a clone made with umask 077 leaves its files
    with (
        pytest.raises(reach.Unreachable) as err,
        reach.python_reachable(str(python), paths=(), imports="mine"),
    ):
        pass
    assert str(err.value) == (
        f"test account {A} cannot run {python} -c 'import mine' (PermissionError: [Errno 13] "
        f"Permission denied: '{secret}'): make the checkout and its venv readable by every "
        "account (files o+r, directories o+rx; a clone made with umask 022 is)"
    )

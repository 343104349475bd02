"""Real Unix users for system-mode tests: the accounts' names (A, B, ADMIN, ADMIN_GROUP: their
prefix from DET_LOCAL_TEST_USERS), making and removing them, and `Shared`, a root daemon's
shared home driven as those users. tests/conftest.py's `accounts` and `shared` fixtures use it.
"""

from __future__ import annotations

import json
import os
import pwd
import subprocess
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest

from det_local import api
from det_local.errors import DetLocalError
from det_local.sched.intake import spool
from det_local.store.paths import Paths
from tests.support.world import Env, wait_for

# System mode: one daemon, run as root, on a shared DET_LOCAL_HOME, used by several real Unix
# users (created with useradd by the `accounts` fixture, removed at the end even on failure).
# The interpreter and the checkout may lie where the other users cannot go (a pyenv Python under
# /root, a clone and its venv in a private home, both 0700), so these tests need not have them
# start Python: a user's client actions run in a forked child of the test process
# (`Shared.as_user`) that has imported det-local first and then setgid/setuid's to that user, so
# the files it writes (spool requests) are really that user's, as the kernel sees them. Jobs that
# run as those users use programs anyone can run (sh, id, sleep), writing into a world-writable
# directory. What the child still imports lazily comes from the checkout, so `Shared.as_user`
# holds it reachable (`tests.support.reach.python_reachable`) while the child runs; tests whose
# users' work runs this Python (trials across machines, Slurm steps) hold it while that runs.


def _import_before_dropping_root() -> None:
    """Everything the children need is imported before they drop root (they cannot read
    /root): the modules det-local's client calls import lazily, and ctypes (inotify)."""
    import det_local.cli.job
    import det_local.cli.main
    import det_local.cli.results.history
    import det_local.client.control
    import det_local.client.daemonctl
    import det_local.client.embedded
    import det_local.config
    import det_local.sched.daemon
    import det_local.sched.engine
    import det_local.sched.intake.inotify  # noqa: F401  (ctypes: unreadable for the test users)


# DET_LOCAL_TEST_USERS: a prefix of the accounts' names, so that two checkouts' suites running at
# once on one machine do not remove each other's users
_PREFIX = os.environ.get("DET_LOCAL_TEST_USERS", "dltest")
A, B, ADMIN = f"{_PREFIX}_a", f"{_PREFIX}_b", f"{_PREFIX}_admin"
ADMIN_GROUP = f"{_PREFIX}-admin-grp"


def _quiet(*argv: str) -> None:
    subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def remove_accounts() -> None:
    for user in (A, B, ADMIN):
        _quiet("userdel", "-f", user)
    _quiet("groupdel", ADMIN_GROUP)


def create_accounts() -> None:
    """The test accounts and the admin group (any left over by a killed run removed first)."""
    remove_accounts()
    subprocess.run(["groupadd", ADMIN_GROUP], check=True)
    for user in (A, B, ADMIN):
        subprocess.run(
            ["useradd", "-M", "-N", "-s", "/usr/sbin/nologin", user],
            check=True,
            capture_output=True,
        )
    subprocess.run(["usermod", "-a", "-G", ADMIN_GROUP, ADMIN], check=True)


@dataclass
class Shared:
    """The shared home, a world-writable directory for the jobs' output, and the root CLI."""

    dl: Env
    home: Path
    out: Path

    @property
    def paths(self) -> Paths:
        return Paths(self.home)

    def as_user(self, user: str | None, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(*args) in a forked child running as `user` (None: stay root), in `out`.
        Returns its value; a DetLocalError in the child is raised here with its message.
        The child imports what `fn` needs lazily, as `user`, from this checkout: it is held
        reachable for the user meanwhile (the test skips, saying why, where it cannot be)."""
        if user is None:
            return self._forked(None, fn, *args)
        from tests.support.reach import python_reachable  # (reach imports this module)

        with python_reachable(account=user, on_blocked=pytest.skip):
            return self._forked(user, fn, *args)

    def _forked(self, user: str | None, fn: Callable[..., Any], *args: Any) -> Any:
        _import_before_dropping_root()
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: never returns into pytest
            try:
                os.close(r)
                os.environ["DET_LOCAL_HOME"] = str(self.home)
                os.chdir(self.out)
                if user is not None:
                    pw = pwd.getpwnam(user)
                    os.setgroups(os.getgrouplist(user, pw.pw_gid))
                    os.setgid(pw.pw_gid)
                    os.setuid(pw.pw_uid)
                try:
                    result: list[Any] = ["ok", fn(*args)]
                except DetLocalError as err:
                    result = ["error", str(err)]
                except BaseException:
                    result = ["crash", traceback.format_exc()]
                data = json.dumps(result, default=str).encode()
                while data:
                    data = data[os.write(w, data) :]
            finally:
                os._exit(0)
        os.close(w)
        with os.fdopen(r, "rb") as f:
            data = f.read()
        os.waitpid(pid, 0)
        kind, value = json.loads(data)
        if kind == "error":
            raise DetLocalError(value)
        assert kind == "ok", value
        return value

    def cmd(self, user: str | None, script: str, **fields: Any) -> int:
        payload = {
            "argv": ["sh", "-c", script],
            "cwd": str(self.out),
            "env": {"PATH": "/usr/bin:/bin", "DET_LOCAL_HOME": str(self.home)},
            "slots": 1,
            "priority": 42,
            "name": None,
            **fields,
        }
        return int(self.as_user(user, api.control_job, "cmd_run", payload))

    def held(self, user: str | None, name: str) -> int:
        gate = self.out / f"gate-{name}"
        return self.cmd(
            user,
            f"echo {name} >> order; while [ ! -e {gate} ]; do sleep 0.02; done",
            name=name,
        )

    def release(self, name: str) -> None:
        (self.out / f"gate-{name}").touch()

    def order(self) -> list[str]:
        path = self.out / "order"
        return path.read_text().split() if path.exists() else []

    def job(self, job_id: int) -> Any:
        store = api.open_store(self.paths)
        try:
            return store.jobs.get(job_id)
        finally:
            store.close()

    def pid(self, job_id: int) -> int:
        return int(wait_for(lambda: self.job(job_id).pid, what=f"job {job_id}'s pid"))

    def wait_job(self, job_id: int, state: str = "DONE") -> Any:
        return wait_for(
            lambda: (j := self.job(job_id)).state == state and j, what=f"job {job_id} {state}"
        )


def cli_output(args: list[str]) -> str:
    """The CLI run in this process, its stdout captured (what a pipe shows): in
    `Shared.as_user`'s child, a command as that user sees it (they cannot start Python)."""
    import contextlib
    import io

    from typer.main import get_command

    from det_local.cli.main import app

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.suppress(SystemExit):
        get_command(app).main(args, "det-local", standalone_mode=False)
    return buf.getvalue()


def _submit_raw(config: dict[str, Any], context: str) -> Any:
    """A submission written by hand (no client-side checks), answered by the daemon."""
    p = api.paths()
    payload = {"config": config, "context": context, "source": "raw"}
    return spool.request(p, "submit", payload, timeout=30)


# ---------------------------------------------------------------------------- a user's trial
# tests/security/: a root daemon runs it as its user; the test reads what the trial sees
def trial_context(sh: Shared, name: str) -> Path:
    ctx = sh.out / name
    ctx.mkdir()
    os.chmod(ctx, 0o755)
    return ctx


def start_sleeping_trial(
    sh: Shared, user: str, name: str, searcher: dict[str, Any]
) -> dict[str, Any]:
    """Submit `sleep 600` as `user`; return its running trial's environment (and ids)."""
    config = {
        "name": name,
        "entrypoint": "sleep 600",
        "max_restarts": 0,
        "searcher": {"name": "single", "max_length": 1, **searcher},
    }
    exp = int(sh.as_user(user, _submit_raw, config, str(trial_context(sh, name))))

    def job() -> Any:
        store = api.open_store(sh.paths)
        try:
            jobs = [j for j in store.jobs.list(include_done=True) if j.experiment_id == exp]
        finally:
            store.close()
        return jobs and jobs[0].pid and jobs[0]

    wrapper = int(wait_for(job, what=f"{user}'s trial to start").pid)
    uid = pwd.getpwnam(user).pw_uid

    def trial_pid() -> int | None:
        # the job's recorded pid is its wrapper (root's, under a root daemon): the trial is
        # the wrapper's descendant running as the user
        try:
            kids = psutil.Process(wrapper).children(recursive=True)
        except psutil.NoSuchProcess:
            return None
        return next((k.pid for k in kids if k.uids().real == uid), None)

    pid = int(wait_for(trial_pid, what=f"{user}'s trial process"))

    def environ() -> dict[str, str] | None:
        raw = Path(f"/proc/{pid}/environ").read_bytes().decode()
        env = dict(kv.split("=", 1) for kv in raw.split("\0") if "=" in kv)
        return env if "DET_LOCAL_TOKEN" in env else None

    env = wait_for(environ, what=f"{user}'s trial environment")
    assert Path(f"/proc/{pid}").stat().st_uid == uid
    return {"env": env, "exp": exp, "trial": int(env["DET_TRIAL_ID"]), "pid": pid}

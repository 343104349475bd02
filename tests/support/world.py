"""The det-local world a test drives: `Env` (one test's DET_LOCAL_HOME, the real CLI as a
subprocess, readers of the store), `Proc` (a CLI in the background), bounded polling
(`wait_for`, `gone`) and the checks most tests share (`one_line_error`, `steps`).

tests/conftest.py makes the fixtures (`dl`, `det_home`, `storage`) out of these; a test imports
what it names: `from tests.support.world import Env, wait_for`. Nothing here sleeps for a fixed
time.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

import psutil
import yaml

from det_local.sched.intake import spool
from det_local.store.db import Store
from det_local.store.paths import Paths
from tests.support.paths import TRAINER

CLI_TIMEOUT = 60.0

T = TypeVar("T")

# Variables a trial inherits from det-local; a test process must not leak them into a CLI.
TRIAL_VARS = ("DET_LOCAL_SOCKET", "DET_LOCAL_TOKEN", "DET_LOCAL_INFO_DIR", "DET_LOCAL_DEBUG")


class Result(NamedTuple):
    rc: int
    out: str
    err: str


def wait_for(
    predicate: Callable[[], T], timeout: float = 30.0, interval: float = 0.02, what: str = ""
) -> T:
    """Poll `predicate` until it returns something truthy (returned); fail after `timeout` s.

    Between two looks it sleeps `interval`, or as long as the look itself took when that was
    longer: a look that starts a CLI process (a few tenths of a second of CPU) then polls with at
    most half a core, not a whole one, leaving the rest to the daemon and the trials it waits
    for (the suite runs on 2 cores). A cheap look still polls every `interval`."""
    deadline = time.monotonic() + timeout
    while True:
        began = time.monotonic()
        value = predicate()
        if value:
            return value
        now = time.monotonic()
        if now > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what or predicate}")
        time.sleep(max(interval, now - began))


def gone(pid: int) -> bool:
    """The process has exited (a zombie nobody reaped counts as gone)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def one_line_error(r: Any, *fragments: str) -> None:
    """A CLI that failed with one line on stderr, `error: ...`, holding every fragment."""
    assert r.rc != 0, r
    assert "Traceback" not in r.err, r
    lines = r.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r
    for f in fragments:
        assert f in lines[0], (f, r)


def steps(dl: Env, trial_id: int, group: str = "training") -> list[int]:
    """The steps_completed of a trial's recorded metrics of `group`, in order."""
    return [m.steps_completed for m in dl.metrics(trial_id, group)]


def write_raw_request(dl: Env, body: bytes) -> str:
    """A request file with these bytes in `dl`'s spool, written as the CLI writes one
    (atomically: a hidden temporary file renamed into place); returns its request id."""
    req_id = f"{time.time_ns():020d}-{os.getpid()}-raw{len(body):05d}"
    tmp = dl.paths.queue / f".{req_id}.tmp"
    tmp.write_bytes(body)
    os.rename(tmp, dl.paths.queue / f"{req_id}{spool.SUFFIX}")
    return req_id


@dataclass
class Env:
    """One test's det-local world: its home, the environment for CLI subprocesses, helpers."""

    home: Path
    tmp: Path
    env: dict[str, str]

    @property
    def paths(self) -> Paths:
        return Paths(self.home)

    # ------------------------------------------------------------------ CLI
    def argv(self, *args: Any) -> list[str]:
        return [sys.executable, "-m", "det_local.cli.main", *(str(a) for a in args)]

    def det(self, *args: Any, timeout: float = CLI_TIMEOUT, cwd: Path | None = None) -> Result:
        """Run `det-local ARGS...` to its end; returns (rc, stdout, stderr)."""
        try:
            p = subprocess.run(
                self.argv(*args),
                env=self.env,
                cwd=cwd or self.tmp,
                capture_output=True,
                text=True,
                timeout=timeout,
            )
        except subprocess.TimeoutExpired as err:
            raise AssertionError(
                f"det-local {' '.join(map(str, args))} ran over {timeout}s; "
                f"stdout: {err.stdout!r} stderr: {err.stderr!r}"
            ) from None
        return Result(p.returncode, p.stdout, p.stderr)

    def start(self, *args: Any, cwd: Path | None = None) -> Proc:
        """Start `det-local ARGS...` in the background; output goes to files (no pipe stalls)."""
        n = len(list(self.tmp.glob("proc-*.out")))
        out = self.tmp / f"proc-{n}.out"
        err = self.tmp / f"proc-{n}.err"
        with open(out, "wb") as o, open(err, "wb") as e:
            popen = subprocess.Popen(
                self.argv(*args),
                env=self.env,
                cwd=cwd or self.tmp,
                stdout=o,
                stderr=e,
                stdin=subprocess.DEVNULL,
            )
        return Proc(popen, out, err)

    def json(self, *args: Any) -> Any:
        r = self.det(*args, "--json")
        assert r.rc == 0, r
        return json.loads(r.out)

    # ------------------------------------------------------------------ store
    def store(self) -> Store:
        """A read-only view of the store (waits for the database to exist)."""
        db = self.paths.db
        wait_for(db.exists, what=f"{db} to exist")
        return Store(db, readonly=True)

    def experiment(self, exp_id: int) -> Any:
        with _closing(self.store()) as s:
            return s.get_experiment(exp_id)

    def trials(self, exp_id: int) -> list[Any]:
        with _closing(self.store()) as s:
            return s.list_trials(exp_id)

    def trial(self, exp_id: int) -> Any:
        trials = self.trials(exp_id)
        assert len(trials) == 1, trials
        return trials[0]

    def metrics(self, trial_id: int, group: str | None = None) -> list[Any]:
        with _closing(self.store()) as s:
            return s.list_metrics(trial_id, group)

    def checkpoints(self, trial_id: int) -> list[Any]:
        with _closing(self.store()) as s:
            return s.list_checkpoints(trial_id=trial_id)

    def events(self, exp_id: int) -> list[str]:
        with _closing(self.store()) as s:
            return [e[3] for e in s.list_events(exp_id)]

    def log(self, exp_id: int, trial_id: int) -> str:
        path = self.paths.trial_log(exp_id, trial_id)
        return path.read_text() if path.exists() else ""

    # ------------------------------------------------------------------ contexts
    def context(
        self,
        script: str,
        config: dict[str, Any] | str | None = None,
        *,
        name: str = "ctx",
        files: dict[str, str] | None = None,
    ) -> tuple[Path, Path]:
        """Write a context dir holding train.py (+ files) and its config.yaml; returns
        (config path, context dir). `config` is merged over a single-searcher default."""
        ctx = self.tmp / name
        ctx.mkdir(parents=True, exist_ok=True)
        (ctx / "train.py").write_text(script)
        for rel, text in (files or {}).items():
            (ctx / rel).parent.mkdir(parents=True, exist_ok=True)
            (ctx / rel).write_text(text)
        cfg_path = ctx / "config.yaml"
        if isinstance(config, str):
            cfg_path.write_text(config)
        else:
            cfg: dict[str, Any] = {
                "name": name,
                "entrypoint": "python3 train.py",
                "searcher": {"name": "single", "metric": "loss", "max_length": 5},
                "max_restarts": 0,
            }
            cfg.update(config or {})
            cfg_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        return cfg_path, ctx

    def trainer(
        self,
        hparams: dict[str, Any],
        config: dict[str, Any] | None = None,
        *,
        name: str = "ctx",
        files: dict[str, str] | None = None,
    ) -> tuple[Path, Path]:
        """A context running tests/fixtures/trainer.py with these hyperparameters."""
        cfg = {"hyperparameters": hparams, **(config or {})}
        return self.context(TRAINER.read_text(), cfg, name=name, files=files)

    # ------------------------------------------------------------------ daemon & job queue
    def daemon_start(self, settings: dict[str, Any] | None = None, **env: str | None) -> int:
        """`det-local daemon start` with these environment changes (None unsets) and
        daemon.yaml settings; returns its pid. The `dl` fixture stops it, and every process
        of this home, at teardown."""
        self.setenv(**env)
        if settings is not None:
            self.settings(settings)
        r = self.det("daemon", "start")
        assert r.rc == 0, r
        pid = int(r.out.split()[2])
        assert pid == self.daemon_pid(), (r, self.daemon_pid())
        return pid

    def setenv(self, **env: str | None) -> None:
        for key, value in env.items():
            if value is None:
                self.env.pop(key, None)
            else:
                self.env[key] = str(value)

    def settings(self, settings: dict[str, Any]) -> None:
        self.home.mkdir(parents=True, exist_ok=True)
        self.paths.settings.write_text(yaml.safe_dump(settings))

    def daemon_pid(self) -> int | None:
        """The pid in the daemon's pid file (None without one)."""
        try:
            return int(json.loads(self.paths.pid_file.read_text())["pid"])
        except (OSError, ValueError, KeyError):
            return None

    def kill_daemon(self) -> int:
        """kill -9 the daemon; returns its pid once it is gone."""
        pid = self.daemon_pid()
        assert pid is not None and not gone(pid), "no daemon to kill"
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: gone(pid), what=f"daemon {pid} to die")
        return pid

    def jobs(self) -> list[Any]:
        """Every job, ended ones included, in id order."""
        with _closing(self.store()) as s:
            return sorted(s.jobs.list(include_done=True), key=lambda j: j.id)

    def job(self, job_id: int) -> Any:
        with _closing(self.store()) as s:
            return s.jobs.get(job_id)

    def job_pid(self, job_id: int) -> int:
        """The pid of a running job's process (recorded just after its spawn: wait for it)."""
        return int(wait_for(lambda: self.job(job_id).pid, what=f"job {job_id}'s pid"))

    def wait_job(self, job_id: int, state: str = "DONE", timeout: float = 30.0) -> Any:
        return wait_for(
            lambda: (j := self.job(job_id)).state == state and j,
            timeout=timeout,
            what=f"job {job_id} to be {state}",
        )

    def cmd(self, *argv: Any, slots: int = 1, priority: int = 42, name: str | None = None) -> int:
        """`det-local cmd run` of argv; returns the job id."""
        opts: list[Any] = ["--slots", slots, "--priority", priority]
        if name is not None:
            opts += ["--name", name]
        r = self.det("cmd", "run", *opts, "--", *argv)
        assert r.rc == 0 and r.out.startswith("Queued command "), r
        return int(r.out.split()[2])

    def held(self, name: str, extra: str = "") -> list[str]:
        """A command that appends NAME to the file `order` when it starts, runs EXTRA, then
        waits (polling inside the job) until the test creates gate-NAME (`release`)."""
        gate = self.tmp / f"gate-{name}"
        script = (
            f"echo {name} >> {self.tmp / 'order'}; {extra}"
            f"while [ ! -e {gate} ]; do sleep 0.02; done"
        )
        return ["sh", "-c", script]

    def release(self, *names: str) -> None:
        for name in names:
            (self.tmp / f"gate-{name}").touch()

    def order(self) -> list[str]:
        path = self.tmp / "order"
        return path.read_text().split() if path.exists() else []

    def records(self) -> list[dict[str, Any]]:
        """The JSON lines trainer.py wrote to `self.record_path`, one per run start."""
        path = self.record_path
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    @property
    def record_path(self) -> Path:
        return self.tmp / "runs.jsonl"


class Proc:
    """A background CLI process with its output in files."""

    def __init__(self, popen: subprocess.Popen[bytes], out: Path, err: Path) -> None:
        self.popen = popen
        self.out_path = out
        self.err_path = err

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def out(self) -> str:
        return self.out_path.read_text(errors="replace")

    @property
    def err(self) -> str:
        return self.err_path.read_text(errors="replace")

    def signal(self, sig: int = signal.SIGINT) -> None:
        self.popen.send_signal(sig)

    def wait(self, timeout: float = CLI_TIMEOUT) -> Result:
        try:
            rc = self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()
            raise AssertionError(
                f"det-local did not exit in {timeout}s; stdout: {self.out!r} stderr: {self.err!r}"
            ) from None
        return Result(rc, self.out, self.err)

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait()


class _closing:
    def __init__(self, store: Store) -> None:
        self.store = store

    def __enter__(self) -> Store:
        return self.store

    def __exit__(self, *_: Any) -> None:
        self.store.close()


def _is_descendant_trial(pid: int, tmp_path: Path) -> bool:
    """Only processes whose command line points into this test's directory are ours to kill."""
    try:
        return any(str(tmp_path) in a for a in psutil.Process(pid).cmdline()) or any(
            str(tmp_path) in v for v in psutil.Process(pid).environ().values()
        )
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def kill_home_processes(home: Path) -> list[int]:
    """SIGKILL the daemon of `home` and every process whose environment names it as
    DET_LOCAL_HOME (jobs, trials, the daemon's children), except this process and its
    ancestors; returns their pids. Job process groups go as a whole."""
    me = psutil.Process()
    spared = {me.pid, *(p.pid for p in me.parents())}
    victims: list[int] = []
    pidfile = Paths(home).pid_file
    try:
        victims.append(int(json.loads(pidfile.read_text())["pid"]))
    except (OSError, ValueError, KeyError):
        pass
    for proc in psutil.process_iter(["pid"]):
        if proc.pid in spared or proc.pid in victims:
            continue
        try:
            if proc.environ().get("DET_LOCAL_HOME") == str(home):
                victims.append(proc.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess, OSError):
            continue
    victims = [p for p in victims if p not in spared]
    for pid in victims:
        for kill in (os.killpg, os.kill):
            try:
                if kill is os.killpg and pid == os.getpgid(0):
                    continue
                kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError, OSError):
                pass
    deadline = time.monotonic() + 5
    while not all(gone(pid) for pid in victims) and time.monotonic() < deadline:
        time.sleep(0.01)
    if os.geteuid() == 0:  # the home's job cgroups (a kill -9'd daemon leaves them behind)
        from det_local.sched.run.cgroups import remove_home

        remove_home(home)
    return victims


# ---------------------------------------------------------------------------- real Unix users
# System mode: one daemon, run as root, on a shared DET_LOCAL_HOME, used by several real Unix
# users (created with useradd by the `accounts` fixture, removed at the end even on failure).
# The interpreter lives under /root (mode 700), so the other users cannot start Python: a user's
# client actions run in a forked child of the test process (`Shared.as_user`) that has imported
# det-local first and then setgid/setuid's to that user, so the files it writes (spool requests)
# are really that user's, as the kernel sees them. Jobs that run as those users use programs
# anyone can run (sh, id, sleep), writing into a world-writable directory.

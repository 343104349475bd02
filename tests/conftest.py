"""Shared fixtures for the tests that run det-local for real.

Every test gets its own DET_LOCAL_HOME (through the environment, so the CLI subprocesses and
anything the test opens in-process agree on it). The helpers start the real CLI as a subprocess
(`python -m det_local.cli.main ...`), write small context directories, and wait with bounded
polling: nothing here sleeps for a fixed time.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

import psutil
import pytest
import yaml

from det_local import api
from det_local.errors import DetLocalError
from det_local.sched.intake import spool
from det_local.store.db import Store
from det_local.store.paths import Paths

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

REPO = Path(__file__).resolve().parent.parent
COMPAT = REPO / "det_local" / "compat"
CLI_TIMEOUT = 60.0
TRAINER = Path(__file__).resolve().parent / "fixtures" / "trainer.py"

T = TypeVar("T")

# Variables a trial inherits from det-local; a test process must not leak them into a CLI.
_TRIAL_VARS = ("DET_LOCAL_SOCKET", "DET_LOCAL_TOKEN", "DET_LOCAL_INFO_DIR", "DET_LOCAL_DEBUG")


class Result(NamedTuple):
    rc: int
    out: str
    err: str


def wait_for(
    predicate: Callable[[], T], timeout: float = 30.0, interval: float = 0.02, what: str = ""
) -> T:
    """Poll `predicate` until it returns something truthy (returned); fail after `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what or predicate}")
        time.sleep(interval)


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
    # tests/test_cli_live_metrics.py turns them back on
    monkeypatch.setenv("DET_LOCAL_METRIC_LINES", "0")
    for var in _TRIAL_VARS:
        monkeypatch.delenv(var, raising=False)
    return home


@pytest.fixture
def dl(det_home: Path, tmp_path: Path) -> Iterator[Env]:
    """The test's det-local world; background CLI processes and their trials are cleaned up."""
    env = {k: v for k, v in os.environ.items() if k not in _TRIAL_VARS}
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


def _import_before_dropping_root() -> None:
    """Everything the children need is imported before they drop root (they cannot read
    /root): the modules det-local's client calls import lazily, and ctypes (inotify)."""
    import det_local.cli.job
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


def _remove_accounts() -> None:
    for user in (A, B, ADMIN):
        _quiet("userdel", "-f", user)
    _quiet("groupdel", ADMIN_GROUP)


@pytest.fixture(scope="module")
def accounts() -> Iterator[None]:
    _remove_accounts()  # left over by a run that was killed
    try:
        subprocess.run(["groupadd", ADMIN_GROUP], check=True)
        for user in (A, B, ADMIN):
            subprocess.run(
                ["useradd", "-M", "-N", "-s", "/usr/sbin/nologin", user],
                check=True,
                capture_output=True,
            )
        subprocess.run(["usermod", "-a", "-G", ADMIN_GROUP, ADMIN], check=True)
        yield
    finally:
        _remove_accounts()


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
        Returns its value; a DetLocalError in the child is raised here with its message."""
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


@pytest.fixture
def shared(dl: Env, accounts: None) -> Iterator[Shared]:
    """A root daemon on a home every user can reach, with admin_group set."""
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
            DET_LOCAL_CPU_SLOTS="2",
        )
        yield Shared(dl, home, out)
    finally:
        kill_home_processes(home)
        shutil.rmtree(base, ignore_errors=True)


def _submit_raw(config: dict[str, Any], context: str) -> Any:
    """A submission written by hand (no client-side checks), answered by the daemon."""
    p = api.paths()
    payload = {"config": config, "context": context, "source": "raw"}
    return spool.request(p, "submit", payload, timeout=30)

"""The daemon's components as units (issue 12, item 9): request dispatch, the trial server and
process supervision, each constructed directly, with real SQLite, sockets and processes, not
through the CLI or a whole engine."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sqlite3
import time
from pathlib import Path
from typing import Any

import pytest

from det_local.errors import DetLocalError
from det_local.sched.intake.dispatch import apply_request
from det_local.sched.intake.spool import Request
from det_local.sched.life.experiments import TrialRun
from det_local.sched.queue import hardware as slots
from det_local.sched.run.launcher import LocalLauncher, Lost
from det_local.sched.run.launchplan import LaunchPlan
from det_local.sched.run.supervisor import Exit, Supervisor
from det_local.sched.sessions.trialserver import Refused, TrialServer
from det_local.sched.settings import DaemonSettings
from det_local.store.db import Store
from det_local.store.paths import Paths
from det_local.wire import rpc
from tests.support.world import wait_for


# ---------------------------------------------------------------------------- request dispatch
class Controls:
    """The engine side of dispatch: a real store, every call recorded."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.settings = DaemonSettings()
        self.calls: list[tuple[str, Any]] = []
        self.fail: BaseException | None = None

    def __getattr__(self, name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            if self.fail is not None:
                raise self.fail
            self.calls.append((name, args or kwargs))
            return f"{name} done"

        return call


def _req(op: str, payload: dict[str, Any], *, user: str = "alice", uid: int = 4242) -> Request:
    return Request("r1", op, user, uid, payload, Path(f"/spool/r1-{op}.req"))


@pytest.fixture
def controls(tmp_path: Path) -> Any:
    store = Store(tmp_path / "db.sqlite")
    yield Controls(store)
    store.close()


def test_dispatch_finds_each_handler_by_its_op(controls: Controls) -> None:
    exp = controls.store.create_experiment(name="e", config={}, user="alice")
    assert apply_request(controls, _req("pause", {"experiment_id": exp})) == {"value": "pause done"}
    assert apply_request(controls, _req("label_add", {"experiment_id": exp, "label": "x"})) == {
        "value": "set_labels done"
    }
    assert controls.calls == [("pause", (exp,)), ("set_labels", (exp, "x", None))]
    assert apply_request(controls, _req("nope", {})) == {
        "error": "unknown request 'nope' in r1-nope.req"
    }


def test_dispatch_refuses_another_users_experiment_and_changes_nothing(
    controls: Controls,
) -> None:
    exp = controls.store.create_experiment(name="e", config={}, user="bob")
    answer = apply_request(controls, _req("kill", {"experiment_id": exp}))
    assert answer == {
        "error": f"permission denied: experiment {exp} belongs to bob; only its owner or a "
        f"member of the {controls.settings.admin_group} group may change it"
    }
    assert controls.calls == []  # the handler never reached the engine


def test_dispatch_answers_malformed_requests_and_retries_the_machines_errors(
    controls: Controls,
) -> None:
    answer = apply_request(controls, _req("pause", {}))
    assert answer["error"].startswith("request r1-pause.req (pause) is malformed: KeyError(")
    exp = controls.store.create_experiment(name="e", config={}, user="alice")
    controls.fail = DetLocalError("experiment 1 is COMPLETED; only ACTIVE experiments ...")
    assert apply_request(controls, _req("pause", {"experiment_id": exp})) == {
        "error": "experiment 1 is COMPLETED; only ACTIVE experiments ..."
    }
    controls.fail = sqlite3.OperationalError("database is locked")
    with pytest.raises(sqlite3.OperationalError):  # stays in the spool, tried again
        apply_request(controls, _req("pause", {"experiment_id": exp}))


def test_daemon_stop_is_refused_to_other_users(controls: Controls) -> None:
    answer = apply_request(controls, _req("daemon_stop", {}, uid=os.geteuid() + 4242))
    assert answer == {"error": "permission denied: only root or the daemon's user may stop it"}
    assert controls.calls == []


# ---------------------------------------------------------------------------- the trial server
class Sessions:
    """The engine side of the trial server: one live run, messages answered by kind."""

    def __init__(self, run: TrialRun) -> None:
        self.run = run
        self.live = True
        self.handled: list[dict[str, Any]] = []
        self.opened: list[TrialRun] = []
        self.closed: list[TrialRun] = []

    def managed_run(self, trial_id: int) -> TrialRun | None:
        return self.run if trial_id == self.run.trial_id else None

    def is_live(self, run: TrialRun) -> bool:
        return self.live and run is self.run

    def run_uid(self, run: TrialRun) -> int:
        return os.geteuid()

    def unmanaged_hello(self, msg: dict[str, Any], writer: Any) -> TrialRun | None:
        return None

    def session_opened(self, run: TrialRun) -> dict[str, Any] | None:
        self.opened.append(run)
        return None

    def session_closed(self, run: TrialRun) -> None:
        self.closed.append(run)

    def handle(self, run: TrialRun, msg: dict[str, Any], uid: int) -> Any:
        self.handled.append(msg)
        if msg.get("t") == "ckpt_get":
            raise Refused("checkpoint x belongs to trial 9")
        return {"echo": msg.get("v")}


def _serve(tmp_path: Path, sessions: Sessions, notes: list[str], body: Any) -> None:
    """Run a TrialServer on a real unix socket while `body(path)` talks to it (in a thread)."""

    async def main() -> None:
        server = TrialServer(tmp_path / "s.sock", sessions, lambda m, **_: notes.append(m))
        await server.start()
        try:
            await asyncio.get_running_loop().run_in_executor(None, body, tmp_path / "s.sock")
        finally:
            await server.stop()

    asyncio.run(main())


def _connect(path: Path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(str(path))
    return sock


def _run() -> TrialRun:
    return TrialRun(3, 1, "req-1", 2, "good-token", job_id=5, pid=0)


def test_trial_server_binds_a_session_to_its_run(tmp_path: Path) -> None:
    sessions, notes = Sessions(_run()), []
    replies: list[Any] = []

    def body(path: Path) -> None:
        with _connect(path) as s:
            rpc.send(s, {"t": "hello", "trial_id": 3, "run_id": 2, "token": "good-token"})
            replies.append(rpc.recv(s))
            rpc.send(s, {"t": "op_next", "id": 1, "v": 7})
            replies.append(rpc.recv(s))
            rpc.send(s, {"t": "ckpt_get", "id": 2})
            replies.append(rpc.recv(s))
            sessions.live = False  # the run ended: the session is closed at its next frame
            rpc.send(s, {"t": "op_next", "id": 3})
            replies.append(rpc.recv(s))

    _serve(tmp_path, sessions, notes, body)
    assert replies[0] == {"t": "hello", "preempt": False}
    assert replies[1] == {"t": "reply", "id": 1, "value": {"echo": 7}}
    assert replies[2] == {"t": "reply", "id": 2, "error": "checkpoint x belongs to trial 9"}
    assert replies[3] == {"t": "reply", "id": 3, "error": "run 2 of trial 3 has ended; closed"}
    assert len(sessions.handled) == 2 and sessions.closed == [sessions.run]
    assert any("refused ckpt_get" in n and "belongs to trial 9" in n for n in notes), notes
    assert any("refused op_next" in n and "has ended" in n for n in notes), notes


def test_trial_server_refuses_a_wrong_token_and_a_big_first_frame(tmp_path: Path) -> None:
    sessions, notes = Sessions(_run()), []
    replies: list[Any] = []

    def body(path: Path) -> None:
        with _connect(path) as s:
            rpc.send(s, {"t": "hello", "trial_id": 3, "run_id": 2, "token": "stolen"})
            replies.append(rpc.recv(s))
        with _connect(path) as s:
            s.sendall(rpc.HEADER.pack(rpc.HELLO_MAX_FRAME + 1) + b"x" * 64)
            replies.append(rpc.recv(s))

    _serve(tmp_path, sessions, notes, body)
    assert replies[0] == {"t": "hello", "error": "unknown trial or wrong token"}
    assert replies[1]["error"].startswith(
        f"a frame of {rpc.HELLO_MAX_FRAME + 1} bytes before hello"
    )
    assert sessions.handled == [] and sessions.run.writers == []
    assert any("refused hello" in n and "unknown trial or wrong token" in n for n in notes)


# ---------------------------------------------------------------------------- supervision
@pytest.fixture
def supervised(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setenv("DET_LOCAL_FAKE_GPUS", "0")
    paths = Paths(tmp_path / "home").ensure()
    store = Store(paths.db)
    yield paths, store
    store.close()


def _job(store: Store, argv: list[str]) -> Any:
    job_id = store.jobs.create(
        kind="COMMAND", name="t", user="u", uid=os.getuid(), priority=42, slots_needed=0
    )
    store.jobs.allocate(job_id, [], 1)
    return store.jobs.get(job_id)


def _plan(paths: Paths, job: Any, argv: list[str]) -> LaunchPlan:
    return LaunchPlan(
        argv=argv,
        env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")},
        cwd="/",
        user="u",
        slots=[],
        log_path=str(paths.command_log(job.id)),
        info_dir=str(paths.job_dir(job.id)),
    )


def _supervisor(paths: Paths, store: Store, exits: list[Exit], cgroups: str = "off") -> Supervisor:
    launcher = LocalLauncher(paths, slots.discover(), cgroups, lambda m, **_: None)
    launcher.start()
    return Supervisor(launcher, store.jobs, note=lambda m, **_: None, on_exit=exits.append)


def test_supervisor_spawns_records_and_reaps(supervised: Any) -> None:
    paths, store = supervised
    exits: list[Exit] = []

    async def main() -> None:
        sup = _supervisor(paths, store, exits)
        sup.loop = asyncio.get_running_loop()
        job = _job(store, [])
        proc = sup.spawn(job, _plan(paths, job, ["sh", "-c", "exit 3"]))
        recorded = store.jobs.get(job.id)
        assert recorded.pid == proc.pid and recorded.pid_start  # durable before it is watched
        while not exits:
            await asyncio.sleep(0.01)
        assert job.id not in sup

    asyncio.run(main())
    assert exits == [Exit(exits[0].job_id, 3, None)]


def test_supervisor_terminates_then_kills(supervised: Any) -> None:
    paths, store = supervised
    exits: list[Exit] = []

    async def main() -> None:
        sup = _supervisor(paths, store, exits)
        sup.loop = asyncio.get_running_loop()
        sup.kill_grace = 0.2
        job = _job(store, [])
        # ignores SIGTERM (once its trap is set: the marker file says so): only the SIGKILL
        # after the grace period ends it
        ready = paths.home / "trap-set"
        script = f"trap '' TERM; touch {ready}; sleep 60"
        proc = sup.spawn(job, _plan(paths, job, ["sh", "-c", script]))
        for _ in range(1000):  # bounded: 10 s
            if ready.exists():
                break
            await asyncio.sleep(0.01)
        assert ready.exists(), "the job never set its trap"
        started = time.monotonic()
        sup.terminate(job.id, proc.pid)
        while not exits:
            await asyncio.sleep(0.01)
        assert time.monotonic() - started >= 0.2

    asyncio.run(main())
    assert exits[0].code in (-signal.SIGKILL, 128 + signal.SIGKILL)


@pytest.mark.parametrize("cgroups", ["off", "v2"])
def test_a_terminated_runs_delayed_kill_spares_the_next_run_of_its_job(
    supervised: Any, cgroups: str
) -> None:
    """Issue 34 item 2: a run SIGTERMed and gone within the grace period, its job started again
    under the same job id (a requeued trial): the old run's SIGKILL, due at the end of the
    grace period, must not reach the new run (it looked the job id up and SIGKILLed the new
    run's cgroup). With cgroups where the machine has them (a daemon's default), and without."""
    paths, store = supervised
    exits: list[Exit] = []

    async def main() -> None:
        loop = asyncio.get_running_loop()
        sup = _supervisor(paths, store, exits, cgroups)
        if cgroups != "off" and sup.launcher.containment.mode == "off":  # type: ignore[attr-defined]
            pytest.skip(f"no cgroups here: {sup.launcher.containment.why}")  # type: ignore[attr-defined]
        sup.loop = loop
        sup.kill_grace = 1.0
        job = _job(store, [])
        ready = paths.home / "first-runs"  # once it runs its own code (SIGTERM ends it)
        first = sup.spawn(job, _plan(paths, job, ["sh", "-c", f"touch {ready}; exec sleep 60"]))
        for _ in range(1000):  # bounded: 10 s
            if ready.exists():
                break
            await asyncio.sleep(0.01)
        assert ready.exists(), "the first run never started"
        sup.terminate(job.id, first.pid)
        deadline = loop.time() + sup.kill_grace
        # fires after the old run's SIGKILL timer: both are due, in order of their times
        past_grace = loop.create_future()
        loop.call_later(sup.kill_grace + 0.05, past_grace.set_result, None)
        while not exits:  # the first run ends on SIGTERM and is reaped
            await asyncio.sleep(0.01)
        assert exits[0].code in (-signal.SIGTERM, 128 + signal.SIGTERM)
        store.jobs.requeue(job.id)
        store.jobs.allocate(job.id, [], 2)
        second = sup.spawn(job, _plan(paths, job, ["sh", "-c", "exec sleep 60"]))
        assert loop.time() < deadline, "the second run started after the grace period"
        await past_grace
        assert not _zombie(second.pid) and job.id in sup and len(exits) == 1, (
            "the first run's delayed SIGKILL reached the second run of its job"
        )
        sup.terminate(job.id, second.pid)
        while len(exits) < 2:
            await asyncio.sleep(0.01)
        sup.launcher.stop()

    asyncio.run(main())
    assert exits[1].code in (-signal.SIGTERM, 128 + signal.SIGTERM)


def test_supervisor_adopts_a_live_run_after_a_restart(supervised: Any) -> None:
    """A second supervisor (a restarted engine) adopts the first one's live run, reads its exit
    status from the wrapper's exit file, and settles a run that died meanwhile as lost."""
    paths, store = supervised
    first: list[Exit] = []
    exits: list[Exit] = []

    async def main() -> None:
        old = _supervisor(paths, store, first)
        old.loop = asyncio.get_running_loop()
        job = _job(store, [])
        gate = paths.home / "go"
        wait = f"while [ ! -e {gate} ]; do sleep 0.02; done; exit 7"
        old.spawn(job, _plan(paths, job, ["sh", "-c", wait]))
        dead = _job(store, [])
        gone = old.spawn(dead, _plan(paths, dead, ["sh", "-c", "exit 5"]))
        wait_for(lambda: not os.path.exists(f"/proc/{gone.pid}/stat") or _zombie(gone.pid))
        # the old engine goes away without reaping (as a crashed daemon would)
        for fd in [old.launcher.wait_fd(p) for p in old.procs.values()]:
            if fd is not None:
                asyncio.get_running_loop().remove_reader(fd)
        new = _supervisor(paths, store, exits)
        new.loop = asyncio.get_running_loop()
        _job_now, found = new.adopt(store.jobs.get(job.id))
        assert not isinstance(found, Lost) and job.id in new
        _dead_now, lost = new.adopt(store.jobs.get(dead.id))
        assert lost == Lost(5, True, None) and dead.id not in new
        gate.touch()
        while not exits:
            await asyncio.sleep(0.01)

    asyncio.run(main())
    assert [(e.code, e.problem) for e in exits] == [(7, None)]


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1].startswith("Z")
    except OSError:
        return True

"""The daemon process and its spool: lifecycle (foreground, start/status/stop, one per home,
stale pid files), `det-local run` against a running daemon, spool order and crash safety, bad
request files, and a full disk.

Every test runs a real daemon (`det-local daemon start`) on its own DET_LOCAL_HOME; the `dl`
fixture kills it and every process of that home at teardown. Waits are bounded polls.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import msgpack
import pytest

from det_local.errors import DetLocalError
from det_local.sched.intake import spool
from det_local.store.db import Store
from det_local.store.states import State
from tests.support.world import Env, gone, one_line_error, wait_for
from tests.support.world import write_raw_request as _write_raw

CPU1 = {"DET_LOCAL_FAKE_GPUS": "0", "DET_LOCAL_CPU_SLOTS": "1"}


def daemon_running(dl: Env) -> bool:
    r = dl.det("daemon", "status", "--json")
    return bool(json.loads(r.out)["running"])


def dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


# ---------------------------------------------------------------------------- lifecycle
def test_foreground_daemon_serves_until_sigterm(dl: Env) -> None:
    dl.setenv(**CPU1)
    proc = dl.start("daemon")
    wait_for(lambda: dl.daemon_pid() == proc.pid and dl.paths.socket.exists(), what="daemon")
    st = dl.json("daemon", "status")
    assert st["running"] and st["pid"] == proc.pid and st["home"] == str(dl.home)
    job = dl.cmd("sh", "-c", "echo served")
    dl.wait_job(job)
    assert dl.det("cmd", "logs", job).out == "served\n"

    proc.signal(signal.SIGTERM)
    r = proc.wait()
    assert r.rc == 0, r
    assert "serving" in r.err and "daemon stopped" in r.err
    assert not dl.paths.pid_file.exists() and not dl.paths.socket.exists()
    r = dl.det("daemon", "status")
    assert r.rc == 3 and "no det-local daemon is running" in r.out, r


def test_start_status_stop_and_one_daemon_per_home(dl: Env) -> None:
    pid = dl.daemon_start(**CPU1)
    r = dl.det("daemon", "status")
    assert r.rc == 0 and f"det-local daemon {pid} running for {dl.home}" in r.out, r
    assert "jobs: 0 running, 0 queued; 0 request(s) waiting in the spool" in r.out

    # a second daemon refuses, naming the first one's pid, in both forms
    one_line_error(dl.det("daemon", "start"), "already running", f"(pid {pid})")
    one_line_error(dl.det("daemon"), "already running", f"(pid {pid})", "daemon stop")
    assert dl.daemon_pid() == pid and not gone(pid)

    r = dl.det("daemon", "stop")
    assert (r.rc, r.out.strip()) == (0, f"det-local daemon {pid} stopped"), r
    wait_for(lambda: gone(pid), what="the daemon to exit")
    assert "no det-local daemon" in dl.det("daemon", "stop").out
    assert dl.det("daemon", "status").rc == 3
    # and it starts again
    assert dl.daemon_start() != pid


@pytest.mark.parametrize("stale", ["dead", "reused"])
def test_stale_pid_file_is_replaced(dl: Env, stale: str) -> None:
    """A crash leaves the pid file behind; its pid may be dead or reused by another process.
    Only the engine lock counts: the pid file is replaced."""
    pid = dead_pid() if stale == "dead" else os.getpid()
    dl.paths.ensure()
    dl.paths.pid_file.write_text(
        json.dumps({"pid": pid, "started_at": time.time() - 100, "home": str(dl.home)})
    )
    r = dl.det("daemon", "status")
    assert r.rc == 3 and "no det-local daemon is running" in r.out, r
    assert "no det-local daemon" in dl.det("daemon", "stop").out
    new = dl.daemon_start(**CPU1)
    assert new != pid and dl.daemon_pid() == new
    assert dl.json("daemon", "status")["pid"] == new


def test_daemon_start_reports_a_daemon_that_cannot_start(dl: Env) -> None:
    dl.settings({"scheduler": {"preemptoin": False}})
    r = dl.det("daemon", "start")
    one_line_error(
        r, "exited at start", "scheduler.preemptoin", "did you mean 'preemption'", "daemon.log"
    )
    assert not daemon_running(dl)


def test_daemon_refuses_while_an_embedded_run_uses_the_home(dl: Env) -> None:
    dl.setenv(DET_LOCAL_FAKE_GPUS="0", DET_LOCAL_CPU_SLOTS="2")
    gate = dl.tmp / "gate"
    cfg, ctx = dl.context(_PARENT_SCRIPT, {"entrypoint": f"python3 train.py {gate} 0"})
    run = dl.start("run", cfg, ctx)
    wait_for(lambda: "Created experiment 1" in run.out, what="the embedded run")
    one_line_error(dl.det("daemon", "start"), "`det-local run` is using", str(dl.home))
    one_line_error(dl.det("daemon"), "`det-local run` is using", "when it ends")
    # meanwhile commands go to the run's engine, which runs them
    assert dl.wait_job(dl.cmd("true")).exit_code == 0
    gate.touch()
    assert run.wait().rc == 0
    dl.daemon_start()


# ---------------------------------------------------------------------------- det-local run
_PARENT_SCRIPT = """
import pathlib, sys, time
import psutil
import determined as det

gate = pathlib.Path(sys.argv[1])
info = det.get_cluster_info()
print("ancestors", *[p.pid for p in psutil.Process().parents()], flush=True)
with det.core.init() as core:
    deadline = time.monotonic() + 60
    while not gate.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    core.train.report_validation_metrics(steps_completed=1, metrics={"loss": 0.5})
print("trial done", flush=True)
sys.exit(int(sys.argv[2]))
"""


def test_run_submits_to_the_daemon_and_follows(dl: Env) -> None:
    pid = dl.daemon_start(**CPU1)
    gate = dl.tmp / "gate"
    gate.touch()
    cfg, ctx = dl.context(_PARENT_SCRIPT, {"entrypoint": f"python3 train.py {gate} 0"})
    r = dl.det("run", cfg, ctx)
    assert r.rc == 0, r
    lines = r.out.splitlines()
    assert lines[0] == "Created experiment 1"
    # the daemon started the trial (through its wrapper), not this CLI
    ancestors = next(x for x in lines if x.startswith("ancestors")).split()[1:]
    assert str(pid) in ancestors
    summary = next(i for i, x in enumerate(lines) if x.startswith("Experiment 1 (ctx) COMPLETED"))
    assert lines.index("trial done") < summary
    assert "trial 1: COMPLETED" in r.out
    assert [(j.kind, j.state, j.exit_code) for j in dl.jobs()] == [("TRIAL", "DONE", 0)]

    # a failing trial: the same exit code as an embedded run
    cfg, ctx = dl.context(_PARENT_SCRIPT, {"entrypoint": f"python3 train.py {gate} 3"}, name="bad")
    r = dl.det("run", cfg, ctx)
    assert r.rc == 1, r
    assert "Created experiment 2" in r.out and "Experiment 2 (bad) ERROR" in r.out
    assert "exited with code 3" in r.out
    assert daemon_running(dl)


def test_run_detach_returns_at_once(dl: Env) -> None:
    dl.daemon_start(**CPU1)
    gate = dl.tmp / "gate"
    cfg, ctx = dl.context(_PARENT_SCRIPT, {"entrypoint": f"python3 train.py {gate} 0"})
    r = dl.det("run", "--detach", cfg, ctx)
    assert (r.rc, r.out.strip()) == (0, "Created experiment 1"), r
    # it returned while the trial waits for the gate
    assert dl.experiment(1).state == State.ACTIVE
    gate.touch()
    wait_for(lambda: dl.experiment(1).state == State.COMPLETED, what="experiment 1 to complete")


def test_ctrl_c_stops_following_not_the_experiment(dl: Env) -> None:
    dl.daemon_start(**CPU1)
    cfg, ctx = dl.trainer({"batches": 30, "ckpt_every": 10, "delay": 0.03})
    run = dl.start("run", cfg, ctx)
    wait_for(lambda: "run 1 starts at batch 0" in run.out, what="the trial to start")
    run.signal(signal.SIGINT)
    r = run.wait()
    assert r.rc == 0, r
    assert "stopped following; experiment 1 goes on" in r.err
    assert "Traceback" not in r.err
    wait_for(lambda: dl.experiment(1).state == State.COMPLETED, what="experiment 1 to complete")
    trial = dl.trial(1)
    assert trial.state == State.COMPLETED and trial.steps_completed == 30
    assert [m.steps_completed for m in dl.metrics(1, "training")] == list(range(1, 31))


# ---------------------------------------------------------------------------- the spool
def _cmd_payload(dl: Env, name: str) -> dict[str, Any]:
    return {
        "argv": ["sh", "-c", f"echo {name} >> order"],
        "cwd": str(dl.tmp),
        "env": dl.env,
        "slots": 1,
        "priority": 42,
        "name": name,
    }


def test_spool_lists_in_apply_order(dl: Env) -> None:
    """Requests written while no daemon runs wait in queue/; `ls` shows them in the order the
    daemon applies them (their names sort by submission time)."""
    dl.paths.ensure()
    names = [f"c{i}" for i in range(6)]
    ids = [spool.submit(dl.paths, "cmd_run", _cmd_payload(dl, n)) for n in names]
    ls = subprocess.run(
        ["ls", str(dl.paths.queue)], capture_output=True, text=True, env={"LC_ALL": "C"}
    )
    listed = [n for n in ls.stdout.split() if n.endswith(".req")]
    assert listed == [f"{i}.req" for i in ids]
    st = dl.json("daemon", "status")
    assert not st["running"] and st["pending_requests"] == 6

    dl.daemon_start(**CPU1)
    job_ids = [spool.wait_response(dl.paths, i, timeout=30) for i in ids]
    assert job_ids == [1, 2, 3, 4, 5, 6]
    for j in job_ids:
        dl.wait_job(j)
    assert [j.name for j in dl.jobs()] == names
    assert dl.order() == names  # one slot, equal priorities: first come, first served
    assert list(dl.paths.queue.glob("*.req")) == []


def test_cmd_run_without_a_daemon_waits_for_one(dl: Env) -> None:
    r = dl.det("cmd", "run", "--", "sh", "-c", "echo later")
    assert (r.rc, r.out) == (0, "Queued command 1\n"), r
    assert "no daemon is running" in r.err and "waits in the queue" in r.err
    job = 1
    assert dl.job(job).state == "QUEUED"
    dl.daemon_start(**CPU1)
    assert dl.wait_job(job).exit_code == 0
    assert dl.det("cmd", "logs", job).out == "later\n"


def _me() -> str:
    return spool.user_name(os.geteuid())


def _pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


_GOOD = {"op": "cmd_kill", "user": "", "payload": {"job_id": 1}}


BAD_REQUESTS: dict[str, tuple[Any, list[str]]] = {
    "garbage": (
        lambda: b"\xc1\xc1 not msgpack",
        ["refused: message is not msgpack (byte 0xc1 at 0); submit it with the det-local CLI"],
    ),
    "truncated": (
        lambda: _pack({**_GOOD, "user": _me()})[:-4],
        ["refused: message is truncated"],
    ),
    "empty": (lambda: b"", ["refused: empty message"]),
    "not-a-map": (lambda: _pack([1, 2, 3]), ["has no operation"]),
    "no-op": (lambda: _pack({"user": _me(), "payload": {}}), ["has no operation"]),
    "payload-list": (
        lambda: _pack({"op": "cmd_kill", "user": _me(), "payload": [1]}),
        ["not a map"],
    ),
    "unknown-op": (
        lambda: _pack({"op": "frobnicate", "user": _me(), "payload": {}}),
        ["unknown request 'frobnicate'"],
    ),
    "missing-field": (
        lambda: _pack({"op": "cmd_kill", "user": _me(), "payload": {}}),
        ["malformed", "job_id"],
    ),
    "wrong-type": (
        lambda: _pack({"op": "cmd_kill", "user": _me(), "payload": {"job_id": "x"}}),
        ["malformed", "cmd_kill"],
    ),
    "wrong-shape": (
        lambda: _pack({"op": "cmd_run", "user": _me(), "payload": {"argv": ["x"], "env": [1]}}),
        ["malformed", "cmd_run"],
    ),
    "forged-user": (
        lambda: _pack({**_GOOD, "user": "somebody-else"}),
        ["claims user 'somebody-else'", f"owned by '{_me()}'"],
    ),
}


def test_bad_request_files_get_an_error_answer(dl: Env) -> None:
    """Each bad file: its writer gets a one-line error; the daemon goes on; later requests
    work (one daemon for all the cases, one after another)."""
    pid = dl.daemon_start(**CPU1)
    for case, (make, fragments) in BAD_REQUESTS.items():
        req_id = _write_raw(dl, make())
        with pytest.raises(DetLocalError) as err:
            spool.wait_response(dl.paths, req_id, timeout=20)
        for f in fragments:
            assert f in str(err.value), (case, str(err.value))
        assert "\n" not in str(err.value), case
        # removed once answered (off the daemon's event loop: a moment after the answer)
        request = dl.paths.queue / f"{req_id}.req"
        wait_for(lambda request=request: not request.exists(), what=case)
        assert dl.daemon_pid() == pid and not gone(pid), case
    assert dl.jobs() == []
    assert dl.wait_job(dl.cmd("true")).exit_code == 0


def test_request_paths_that_are_not_files(dl: Env) -> None:
    """A directory, a symlink or a fifo named like a request cannot stop the daemon."""
    pid = dl.daemon_start(**CPU1)
    base = f"{time.time_ns():020d}-{os.getpid()}"
    (dl.paths.queue / f"{base}-dir.req").mkdir()
    (dl.paths.queue / f"{base}-dir.req" / "inner").write_text("x")
    target = dl.tmp / "target"
    target.write_bytes(_pack({**_GOOD, "user": _me()}))
    os.symlink(target, dl.paths.queue / f"{base}-link.req")
    os.mkfifo(dl.paths.queue / f"{base}-fifo.req")
    for name in ("dir", "link", "fifo"):
        with pytest.raises(DetLocalError, match="is not a regular file"):
            spool.wait_response(dl.paths, f"{base}-{name}", timeout=20)
    assert target.exists()  # the link went, not what it points to
    wait_for(lambda: not list(dl.paths.queue.glob("*.req")), what="the spool to be empty")
    assert not gone(pid)
    assert dl.wait_job(dl.cmd("true")).exit_code == 0


UNKNOWN_IDS: list[tuple[list[Any], str]] = [
    (["job", "update", 99, "--priority", 3], "job 99 not found"),
    (["job", "update", 99, "--ahead-of", 1], "job 99 not found"),
    (["job", "update-batch", "99.priority=3"], "job 99 not found"),
    (["cmd", "kill", 99], "job 99 not found"),
    (["cmd", "logs", 99], "job 99 not found"),
    (["experiment", "pause", 99], "experiment 99 not found"),
    (["experiment", "activate", 99], "experiment 99 not found"),
    (["experiment", "kill", 99], "experiment 99 not found"),
    (["experiment", "label", "add", 99, "x"], "experiment 99 not found"),
]


def test_unknown_ids_through_the_daemon(dl: Env) -> None:
    pid = dl.daemon_start(**CPU1)
    for args, fragment in UNKNOWN_IDS:
        one_line_error(dl.det(*args), fragment)
    assert not gone(pid) and dl.jobs() == []


def test_unknown_target_job_of_an_update(dl: Env) -> None:
    dl.daemon_start(**CPU1)
    job = dl.cmd(*dl.held("a"))
    one_line_error(dl.det("job", "update", job, "--ahead-of", 42), "job 42 not found")
    one_line_error(dl.det("job", "update", job, "--behind-of", 42), "job 42 not found")
    dl.release("a")


def test_an_applied_request_is_answered_again_not_applied_twice(dl: Env) -> None:
    """A crash after the result was committed but before the file was removed: the next
    daemon answers from the store and applies nothing."""
    dl.daemon_start(**CPU1)
    assert dl.det("daemon", "stop").rc == 0
    req_id = spool.submit(dl.paths, "cmd_run", _cmd_payload(dl, "twice"))
    store = Store(dl.paths.db)
    store.jobs.record_request(req_id, {"value": 77})
    store.close()

    dl.daemon_start()
    assert spool.wait_response(dl.paths, req_id, timeout=20) == 77
    wait_for(lambda: not (dl.paths.queue / f"{req_id}.req").exists(), what="the removal")
    later = dl.cmd("true")
    assert later == 1  # the replayed request created no job
    dl.wait_job(later)
    assert dl.order() == []


def test_request_answered_while_the_requester_is_gone(dl: Env) -> None:
    """A client that gave up (Ctrl-C) leaves its request; it is applied, the answer waits."""
    dl.daemon_start(**CPU1)
    req_id = spool.submit(dl.paths, "cmd_run", _cmd_payload(dl, "orphan"))
    answer = dl.paths.queue / "responses" / f"{req_id}.resp"
    wait_for(answer.exists, what="the answer")
    dl.wait_job(1)
    assert dl.order() == ["orphan"]
    assert spool.wait_response(dl.paths, req_id, timeout=5) == 1
    assert not answer.exists()


# ---------------------------------------------------------------------------- a full disk
@pytest.fixture
def small_home(tmp_path: Path) -> Any:
    """DET_LOCAL_HOME on a 4 MiB tmpfs (root only), unmounted at the end."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mnt = tmp_path / "small"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)])
    if r.returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        yield mnt / "home"
    finally:
        from tests.support.world import kill_home_processes

        kill_home_processes(mnt / "home")
        subprocess.run(["umount", "-l", str(mnt)])


def _fill(directory: Path) -> Path:
    """Fill the filesystem of `directory` to the last byte; returns the filler file."""
    filler = directory / f"filler-{len(list(directory.glob('filler-*')))}"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        for size in (65536, 4096, 1):
            try:
                while os.write(fd, b"\0" * size) == size:
                    pass
            except OSError:
                pass
    finally:
        os.close(fd)
    return filler


def test_full_disk(dl: Env, small_home: Path) -> None:
    """With the home's disk full: a client that cannot write its request says so in one line
    and leaves nothing behind; a request the daemon cannot apply stays in the spool (in its
    place) and is applied, once, when there is room again; the daemon keeps running."""
    # the daemon's run dir (log, socket, lock) lives elsewhere, so that its log can be read
    small_home.mkdir()
    run_dir = dl.tmp / "run"
    run_dir.mkdir()
    (small_home / "run").symlink_to(run_dir)
    dl.home = small_home
    dl.env["DET_LOCAL_HOME"] = str(small_home)
    pid = dl.daemon_start(**CPU1)
    log = run_dir / "daemon.log"
    _fill(small_home)

    # 1. the client cannot write its request
    r = dl.det("cmd", "run", "--", "sh", "-c", "echo one >> order")
    one_line_error(r, "cannot write a request to", str(dl.paths.queue), "No space left on device")
    assert sorted(dl.paths.queue.iterdir()) == [dl.paths.queue / "responses"]

    # 2. a request written just before the disk filled: the daemon cannot record it
    os.kill(pid, signal.SIGSTOP)
    try:
        for filler in small_home.glob("filler-*"):
            filler.unlink()
        req_id = spool.submit(dl.paths, "cmd_run", _cmd_payload(dl, "two"))
        _fill(small_home)
    finally:
        os.kill(pid, signal.SIGCONT)
    wait_for(
        lambda: f"could not apply request {req_id}.req" in log.read_text(),
        what="the daemon to report the full disk",
    )
    assert "tried again" in log.read_text()
    assert (dl.paths.queue / f"{req_id}.req").exists()
    st = dl.json("daemon", "status")
    assert st["running"] and st["pid"] == pid and st["pending_requests"] == 1

    # 3. room again: the request is applied (once) and answered; later ones work
    for filler in small_home.glob("filler-*"):
        filler.unlink()
    assert spool.wait_response(dl.paths, req_id, timeout=30) == 1
    dl.wait_job(1)
    assert dl.order() == ["two"]
    assert dl.wait_job(dl.cmd("sh", "-c", "echo three >> order")).exit_code == 0
    assert dl.order() == ["two", "three"]
    assert [j.id for j in dl.jobs()] == [1, 2]
    assert not gone(pid)


def test_cli_in_a_fresh_interpreter_has_no_daemon_imports() -> None:
    """`det-local cmd run` / `job list` stay light: no torch, no watchfiles in the client."""
    code = (
        "import sys; import det_local.cli.main, det_local.cli.job, det_local.cli.cmd;"
        "print(sorted(m for m in ('torch', 'watchfiles', 'pynvml') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout
    assert out.strip() == "[]"


def _loaded(dl: Env, *args: str) -> tuple[set[str], str]:
    """The modules `det-local ARGS` imports (from -X importtime) and its stdout."""
    p = subprocess.run(
        [sys.executable, "-X", "importtime", *dl.argv(*args)[1:]],
        env=dl.env,
        cwd=dl.tmp,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 0, p
    lines = p.stderr.splitlines()
    return {line.rsplit("|", 1)[-1].strip() for line in lines if "|" in line}, p.stdout


@pytest.mark.parametrize(
    "args", [("cmd", "run", "--", "true"), ("job", "list")], ids=["cmd-run", "job-list"]
)
def test_light_commands_load_no_experiment_config(dl: Env, args: tuple[str, ...]) -> None:
    """Queueing a command through a running daemon, and listing the queue, import neither yaml
    nor the experiment config (a `--config` parser once pulled both into `cmd run`, and the
    daemon.yaml section check into `job list`: +40-60 modules, ~+100 ms each)."""
    dl.daemon_start(**CPU1)
    loaded, out = _loaded(dl, *args)
    assert "det_local.client.control" in loaded or "det_local.client.queueview" in loaded, out
    assert not loaded & {"yaml", "det_local.config.experiment", "det_local.sched.engine"}

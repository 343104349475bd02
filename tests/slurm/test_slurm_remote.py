"""A Slurm pool whose compute node is not the daemon's host (issue 29): slurmd runs in a mount
namespace of its own with an empty tmpfs over every test's directory (the daemon's state
directory and socket among them, tests/slurmkit.py ``hide``), so a trial can reach the daemon
only over the pool's TCP channel (loopback) and sees only the shared directory (stage_dir,
checkpoints). A recording proxy between the trial and the daemon shows what crosses the wire."""

from __future__ import annotations

import hashlib
import os
import pwd
import socket
from pathlib import Path
from typing import Any

import msgpack
import psutil
import pytest

from det_local.errors import ConfigError
from det_local.slurm.config import parse_slurm_pool
from det_local.slurm.stage import check_stage_dir
from det_local.store.states import State
from det_local.wire import channel, rpc
from tests.support import slurmkit
from tests.support.slurmproxy import config, daemon_log, shared, start
from tests.support.world import Env, one_line_error, wait_for

pytestmark = pytest.mark.slow
__all__ = ["shared"]  # the fixture (tests/support/slurmproxy.py), used by name


@pytest.fixture(scope="module")
def slurm(slurm_hiding_tests: slurmkit.Slurm) -> slurmkit.Slurm:
    return slurm_hiding_tests  # the folder's (tests/slurm/conftest.py)


PROBE = """
import json, os, sys, determined as det
hidden = os.path.exists(sys.argv[1])
with det.core.init() as core:
    with core.checkpoint.store_path({"steps_completed": 1}) as (path, _):
        (path / "w").write_text("1")
    core.train.report_training_metrics(steps_completed=1, metrics={"loss": 0.5})
    with open(sys.argv[2], "w") as f:  # the token, so the test can look for it on the wire
        f.write(os.environ["DET_LOCAL_TOKEN"])
    print("PROBE " + json.dumps({
        "sees_state_dir": hidden,
        "socket": os.environ["DET_LOCAL_SOCKET"],
        "cwd": os.getcwd(),
        "info": os.environ["DET_LOCAL_INFO_DIR"],
    }), flush=True)
"""


def test_a_trial_on_a_node_without_the_state_dir_reports_over_tcp(
    dl: Env, slurm: slurmkit.Slurm, shared: Path
) -> None:
    proxy = start(dl, slurm, shared)
    # another user took the run's old, predictable staged name (sha256 of its info directory)
    # first: the run stages under its keyed name and leaves theirs alone
    info = str(dl.paths.trial_info_dir(1, 1, 1))
    squat = shared / "stage" / f"det-local-{hashlib.sha256(info.encode()).hexdigest()[:16]}"
    squat.mkdir()
    (squat / "theirs").write_text("x")
    nobody = pwd.getpwnam("nobody")
    for path in (squat, squat / "theirs"):
        os.chown(path, nobody.pw_uid, nobody.pw_gid)
    token_file = shared / "token.txt"
    cfg = {**config(shared), "entrypoint": f"python3 train.py {dl.home} {token_file}"}
    cfg_path, ctx = dl.context(PROBE, cfg)
    r = dl.det("run", "--detach", cfg_path, ctx)
    assert r.rc == 0, r
    wait_for(
        lambda: dl.experiment(1).state == State.COMPLETED,
        timeout=120,
        what=f"completion\n{slurm.logs()}\n{daemon_log(dl)}",
    )
    log = dl.det("trial", "logs", "1").out
    probe = __import__("json").loads(log.split("PROBE ", 1)[1].splitlines()[0])
    assert probe["sees_state_dir"] is False  # this node cannot see the daemon's files
    assert probe["socket"] == f"tcp://127.0.0.1:{proxy.port}"
    assert probe["cwd"].startswith(str(shared / "stage")) and probe["cwd"].endswith("/context")
    assert probe["info"].startswith(str(shared / "stage"))
    assert not probe["cwd"].startswith(str(squat)), probe
    assert [m.metrics["loss"] for m in dl.metrics(1, "training")] == [0.5]
    assert len(dl.checkpoints(1)) == 1
    (job,) = dl.jobs()
    assert job.state == "DONE" and job.exit_code == 0
    # the token never crossed the wire, though the trial spoke over it
    token = token_file.read_text().encode()
    assert len(token) >= 32 and proxy.sent and all(len(b) > 0 for b in proxy.sent[:1])
    assert not any(token in bytes(b) for b in proxy.sent)
    # the staged copy is gone once the run ended (the squatter's stays as it was); the log
    # stayed in the state directory
    wait_for(
        lambda: list((shared / "stage").iterdir()) == [squat], timeout=30, what="stage cleanup"
    )
    assert (squat / "theirs").read_text() == "x" and squat.stat().st_uid == nobody.pw_uid
    assert "PROBE" in dl.log(1, 1)
    proxy.close()


def _frame(sock: socket.socket) -> dict[str, Any] | None:
    head = b""
    while len(head) < 4:
        chunk = sock.recv(4 - len(head))
        if not chunk:
            return None
        head += chunk
    (size,) = rpc.HEADER.unpack(head)
    body = b""
    while len(body) < size:
        chunk = sock.recv(size - len(body))
        if not chunk:
            return None
        body += chunk
    return dict(msgpack.unpackb(body, raw=False))


def session(
    port: int, token: str, trial_id: int, run_id: int, rank: int
) -> tuple[socket.socket, channel.Link]:
    """A handshake as a trial makes it (wire/channel.connect)."""
    hello = {"trial_id": trial_id, "run_id": run_id, "rank": rank, "pid": os.getpid()}
    sock, answer, link = channel.connect(f"tcp://127.0.0.1:{port}", token, hello)
    assert answer is not None and answer.get("error") is None, answer
    sock.settimeout(10)
    return sock, link


def token_of(trial_id: int, url: str) -> str:
    """A running trial's token, from its process's environment (the test is root); ``url``:
    its channel (other tests' trials run on this machine too)."""

    def find() -> str | None:
        for proc in psutil.process_iter():
            try:
                env = proc.environ()
            except (psutil.Error, OSError):
                continue
            if (
                env.get("DET_TRIAL_ID") == str(trial_id)
                and env.get("DET_LOCAL_SOCKET") == url
                and env.get("DET_LOCAL_TOKEN")
            ):
                return env["DET_LOCAL_TOKEN"]
        return None

    return str(wait_for(find, timeout=30, what=f"trial {trial_id}'s process"))


def _closed(sock: socket.socket) -> bool:
    sock.settimeout(10)
    try:
        while sock.recv(4096):
            pass
    except OSError:
        pass
    return True


def test_pause_activate_over_tcp_and_refused_connections(
    dl: Env, slurm: slurmkit.Slurm, shared: Path
) -> None:
    proxy = start(dl, slurm, shared)
    daemon = dl.daemon_pid()
    hp = {"batches": 12, "ckpt_every": 4, "hold_at": 6}
    cfg, ctx = dl.trainer(hp, config(shared))
    assert dl.det("run", "--detach", cfg, ctx).rc == 0
    wait_for(
        lambda: dl.store().get_trial(1).steps_completed >= 6,
        timeout=90,
        what=f"batch 6\n{slurm.logs()}\n{daemon_log(dl)}",
    )
    port = proxy.target
    # 1. a wrong token: refused, nothing learned
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    challenge = _frame(s)
    assert challenge is not None and challenge["t"] == "challenge"
    nc = os.urandom(32)
    who = channel.ids(1, 1, 0)
    hello = {"t": "hello", "v": 1, "trial_id": 1, "run_id": 1, "rank": 0, "nc": nc}
    s.sendall(rpc.pack({**hello, "mac": channel.client_mac("0" * 64, challenge["ns"], nc, who)}))
    assert _frame(s) == {"t": "hello", "error": "unknown trial or wrong token"}
    assert _closed(s)
    # 2. garbage on a plain connect
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    assert _frame(s)["t"] == "challenge"  # type: ignore[index]
    s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + os.urandom(64))
    answer = _frame(s)
    assert answer is not None and "closed" in answer["error"]
    assert _closed(s)
    # ... or a unix-socket hello (a token in clear): not a channel hello, refused
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    assert _frame(s)["t"] == "challenge"  # type: ignore[index]
    s.sendall(rpc.pack({"t": "hello", "token": "f" * 64, "trial_id": 1, "run_id": 1}))
    assert _frame(s) == {
        "t": "hello",
        "error": "the first frame must be a version-1 channel hello; closed",
    }
    assert _closed(s)
    # 3. the trial's own handshake, recorded by the proxy, replayed on a new connection
    recorded = bytes(proxy.sent[0])
    (size,) = rpc.HEADER.unpack(recorded[:4])
    replay = recorded[: 4 + size]
    assert msgpack.unpackb(replay[4:])["t"] == "hello"
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    assert _frame(s)["t"] == "challenge"  # type: ignore[index]
    s.sendall(replay)
    assert _frame(s) == {"t": "hello", "error": "unknown trial or wrong token"}
    assert _closed(s)
    # 4. the right token opens its own run, never another one's
    token = token_of(1, f"tcp://127.0.0.1:{proxy.port}")
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    challenge = _frame(s)
    assert challenge is not None
    mac = channel.client_mac(token, challenge["ns"], nc, channel.ids(1, 1, 5))
    s.sendall(rpc.pack({**hello, "rank": 5, "mac": mac}))
    answer = _frame(s)
    assert answer is not None and answer.get("error") is None, answer
    assert answer["mac"] == channel.server_mac(token, challenge["ns"], nc, channel.ids(1, 1, 5))
    # ... and then every frame is sealed: one under another key, or one replayed, closes it
    key = channel.session_key(token, challenge["ns"], nc, channel.ids(1, 1, 5))
    forged = channel.Link(s, channel.Sealer(os.urandom(32), channel.C2S))
    forged.send_packed(rpc.pack({"t": "progress", "progress": 0.5}))
    reader = channel.Link(s, None, channel.Sealer(key, channel.S2C))
    assert reader.recv() == {
        "t": "refused",
        "error": "frame refused: a frame whose MAC does not verify (altered, or not this "
        "session's); closed",
    }
    assert _closed(s)
    s, link = session(port, token, 1, 1, 6)
    sealed = channel.Sealer(link.out.key, channel.C2S).seal(
        rpc.pack({"t": "progress", "progress": 0.5})
    )  # type: ignore[union-attr]
    s.sendall(sealed + sealed)
    assert link.recv() == {
        "t": "refused",
        "error": "frame refused: frame 1 out of sequence (expected 2): replayed?; closed",
    }
    assert _closed(s)
    cfg2, ctx2 = dl.trainer({"batches": 50, "hold_at": 1}, config(shared), name="other")
    assert dl.det("run", "--detach", cfg2, ctx2).rc == 0
    wait_for(lambda: dl.store().get_trial(2).steps_completed >= 1, timeout=90, what="trial 2")
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    challenge = _frame(s)
    assert challenge is not None
    mac = channel.client_mac(token, challenge["ns"], nc, channel.ids(2, 1, 0))
    s.sendall(rpc.pack({**hello, "trial_id": 2, "mac": mac}))
    assert _frame(s) == {"t": "hello", "error": "unknown trial or wrong token"}
    assert _closed(s)
    assert "unknown trial or wrong token (trial 2)" in daemon_log(dl)
    assert dl.det("experiment", "kill", 2).rc == 0
    wait_for(lambda: dl.experiment(2).state == State.CANCELED, timeout=60, what="the kill")
    # the daemon stayed up and said each refusal in one line
    assert dl.daemon_pid() == daemon and os.path.exists(f"/proc/{daemon}")
    text = daemon_log(dl)
    assert text.count("trial channel: refused a connection from 127.0.0.1:") >= 4, text
    assert "unknown trial or wrong token (trial 1)" in text
    assert "bytes before hello (the limit is 4096); closed" in text

    # pause: the trial checkpoints over the channel and its job ends; activate resumes it
    assert dl.det("experiment", "pause", 1).out.strip() == "experiment 1 paused"
    wait_for(lambda: dl.experiment(1).state == State.PAUSED, timeout=60, what="the pause")
    wait_for(lambda: slurm.queue() == [], timeout=30, what="the job to leave squeue")
    assert dl.store().get_trial(1).steps_completed == 6
    assert dl.det("experiment", "activate", 1).rc == 0
    wait_for(lambda: dl.experiment(1).state == State.COMPLETED, timeout=120, what="completion")
    final = dl.metrics(1, "validation")[-1]
    assert final.metrics["x"] == sum(range(12))  # no batch skipped or repeated
    assert dl.jobs()[0].trial_id == 1 and dl.store().get_trial(1).steps_completed == 12
    assert len(proxy.sent) >= 2  # the second job connected through the channel too
    # every run's staged directory (paused, resumed, killed) is gone once it ended
    wait_for(lambda: list((shared / "stage").iterdir()) == [], timeout=30, what="stage cleanup")
    proxy.close()


WAITER = """
import os, sys, time, determined as det
with det.core.init() as core:
    print("before the restart", flush=True)
    core.train.report_training_metrics(steps_completed=1, metrics={"loss": 1.0})
    deadline = time.monotonic() + 120
    while not os.path.exists(sys.argv[1]) and time.monotonic() < deadline:
        time.sleep(0.05)
    print("after the restart", flush=True)
    core.train.report_training_metrics(steps_completed=2, metrics={"loss": 0.5})
"""


def test_a_staged_run_is_adopted_after_the_daemon_is_killed(
    dl: Env, slurm: slurmkit.Slurm, shared: Path
) -> None:
    start(dl, slurm, shared)
    go = shared / "go"
    go.unlink(missing_ok=True)
    cfg, ctx = dl.context(WAITER, {**config(shared), "entrypoint": f"python3 train.py {go}"})
    assert dl.det("run", "--detach", cfg, ctx).rc == 0
    wait_for(lambda: dl.metrics(1, "training"), timeout=90, what="the first metric")
    wait_for(lambda: "before the restart" in dl.log(1, 1), timeout=30, what="the staged log")
    dl.kill_daemon()
    dl.daemon_start()  # the same daemon.yaml: the same channel
    go.write_text("1")
    wait_for(lambda: dl.experiment(1).state == State.COMPLETED, timeout=120, what="completion")
    assert [m.steps_completed for m in dl.metrics(1, "training")] == [1, 2]
    log = dl.det("trial", "logs", "1").out
    assert log.count("before the restart") == 1 and "after the restart" in log, log
    wait_for(lambda: list((shared / "stage").iterdir()) == [], timeout=30, what="stage cleanup")
    go.unlink()


def test_time_limit_over_tcp_and_a_staged_command(
    dl: Env, slurm: slurmkit.Slurm, shared: Path
) -> None:
    """The batch shell's USR1 (`slurm/notify.py`) tells the engine over the TCP channel; the
    trial checkpoints and a second job continues it. A command of the pool runs staged too."""
    start(dl, slurm, shared, sbatch_args=["--time=10"], signal_lead=300)
    hp = {"batches": 30, "ckpt_every": 5, "delay": 0.1}
    cfg, ctx = dl.trainer(hp, config(shared))
    assert dl.det("run", "--detach", cfg, ctx).rc == 0
    wait_for(lambda: dl.store().get_trial(1).steps_completed >= 7, timeout=90, what="batch 7")
    (job,) = dl.jobs()
    slurm.run("scancel", "--signal=USR1", "--batch", str(job.pid))
    wait_for(lambda: dl.experiment(1).state == State.COMPLETED, timeout=120, what="completion")
    assert dl.metrics(1, "validation")[-1].metrics["x"] == sum(range(30))
    assert any("reaches its time limit soon" in e for e in dl.events(1))
    trial = dl.store().get_trial(1)
    assert trial.restarts == 0 and trial.steps_completed == 30
    assert "ends soon: checkpointing to continue in a new job" in dl.log(1, 1)
    # a command: its output (staged) in `cmd logs`, its exit status recorded
    r = dl.det(
        "cmd", "run", "--pool", "hpc", "--", "sh", "-c", "echo staged $SLURM_JOB_ID; exit 3",
        cwd=shared,
    )  # fmt: skip
    assert r.rc == 0, r
    cmd = [j for j in dl.jobs() if j.trial_id is None][0]
    done = dl.wait_job(cmd.id, timeout=90)
    assert done.exit_code == 3
    assert f"staged {done.pid}" in dl.det("cmd", "logs", cmd.id).out
    wait_for(lambda: list((shared / "stage").iterdir()) == [], timeout=30, what="stage cleanup")


def test_a_stage_dir_that_cannot_be_used_is_one_line(
    dl: Env, slurm: slurmkit.Slurm, shared: Path
) -> None:
    start(dl, slurm, shared, stage_dir=str(shared / "missing"))
    cfg, ctx = dl.context("print('x')", config(shared))
    r = dl.det("run", "--detach", cfg, ctx)
    one_line_error(
        r,
        f"resource_pools.hpc.slurm.stage_dir {shared / 'missing'} does not exist: create it on "
        "the filesystem the compute nodes share, writable by the pool's users",
    )
    assert dl.jobs() == []
    r = dl.det("cmd", "run", "--pool", "hpc", "--", "true", cwd=shared)
    one_line_error(r, f"resource_pools.hpc.slurm.stage_dir {shared / 'missing'} does not exist")
    # a directory the submitter cannot write (the check runs as that user: here, nobody)
    closed = shared / "closed"
    closed.mkdir(exist_ok=True)
    os.chmod(closed, 0o755)
    pool = parse_slurm_pool("hpc", {"partition": "debug", "stage_dir": str(closed)}, "daemon.yaml")
    with pytest.raises(ConfigError) as err:
        check_stage_dir(pool, __import__("pwd").getpwnam("nobody").pw_uid)
    assert str(err.value) == (
        f"resource_pools.hpc.slurm.stage_dir {closed} is not writable by user nobody: the "
        "pool's runs stage their context, log and info files there; make it writable by them "
        "(e.g. chmod 1777) or choose another"
    )


def test_channel_and_stage_dir_settings_are_checked() -> None:
    def refused(raw: dict[str, Any]) -> str:
        with pytest.raises(ConfigError) as err:
            parse_slurm_pool("hpc", {"partition": "debug", **raw}, "daemon.yaml")
        return str(err.value)

    assert refused({"channel": {"listen": "0.0.0.0:7461"}}) == (
        "resource_pools.hpc.slurm.channel.advertise is missing in daemon.yaml: the daemon "
        "listens on every interface (0.0.0.0:7461); name the host compute nodes reach it by, "
        "e.g. 'advertise: login01'"
    )
    assert refused({"channel": {"listen": "login01"}}) == (
        "resource_pools.hpc.slurm.channel.listen in daemon.yaml: expected host:port (e.g. "
        "0.0.0.0:7461), found 'login01'"
    )
    assert "did you mean 'advertise'?" in refused(
        {"channel": {"listen": "0.0.0.0:7461", "advertize": "login01"}}
    )
    assert refused({"stage_dir": "shared/x"}) == (
        "resource_pools.hpc.slurm.stage_dir in daemon.yaml: expected an absolute path on the "
        "filesystem the compute nodes share (e.g. /shared/det-local), found 'shared/x'"
    )
    assert "did you mean 'stage_dir'?" in refused({"stagedir": "/x"})
    pool = parse_slurm_pool(
        "hpc",
        {"partition": "debug", "channel": {"listen": "0.0.0.0:7461", "advertise": "login01"}},
        "daemon.yaml",
    )
    assert pool.channel is not None and pool.channel.url == "tcp://login01:7461"

"""The trial socket of a root daemon is an authority, not a pipe (issue 11).

Real users (A = alice, B = bob, ADMIN = a third user), a real root daemon on a shared home (the
`shared` fixture of test_multiuser).

The arrangement: the test users cannot start Python (the interpreter lives under /root), so a
trial's Python side cannot run as them. Each user submits an experiment whose entrypoint is
`sleep 600`: the daemon schedules it and starts it as that user, with a real allocation (job,
token, socket path, checkpoint directory in its environment). The test, as root, reads that
environment from /proc/PID/environ of the running trial process, exactly what the trial itself
would see, and then speaks for the trial from a forked child that setuid's to the same user
(det-local's own trial code, `Session` and `CheckpointContext`, imported before the fork): to
the daemon it is indistinguishable from the trial's Python process (same uid, same token). Bob's
attacks are made the same way, from bob's uid with bob's own valid token (and once with alice's
stolen token).
"""

from __future__ import annotations

import contextlib
import math
import os
import pwd
import select
import socket
import struct
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import msgpack
import psutil
import pytest

# everything the children use is imported before they drop root (they cannot read /root)
import det_local.trial.core._distributed
from det_local import api
from det_local.errors import DetLocalError
from det_local.trial.core._checkpoint import CheckpointContext
from det_local.trial.session import Session
from det_local.views import experiments as expviews
from det_local.wire import rpc
from tests.support.users import (
    ADMIN,
    A,
    B,
    Shared,
    start_sleeping_trial,
)
from tests.support.world import wait_for

SESSION_LIMIT = 4 << 20  # the daemon's limit on a session's frames (rpc.SESSION_MAX_FRAME)

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0, reason="multi-user tests create real users: they need root"
)


def _session(env: dict[str, str]) -> Session:
    return Session(
        env["DET_LOCAL_SOCKET"],
        env["DET_LOCAL_TOKEN"],
        int(env["DET_TRIAL_ID"]),
        int(env["DET_TRIAL_RUN_ID"]),
    )


def _checkpoints(env: dict[str, str], session: Session | None = None) -> CheckpointContext:
    dist = det_local.trial.core._distributed.DummyDistributedContext()
    return CheckpointContext(dist, Path(env["DET_LOCAL_CHECKPOINT_DIR"]), session)


def _daemon_log(sh: Shared) -> str:
    path = sh.paths.run_dir / "daemon.log"
    return path.read_text() if path.exists() else ""


def _store(sh: Shared) -> Any:
    return contextlib.closing(api.open_store(sh.paths))


# ---------------------------------------------------------------------------- in the children
def store_checkpoint(env: dict[str, str], steps: int) -> str:
    """As the trial: core_context.checkpoint.store_path(), as a Core API script does."""
    with _checkpoints(env, _session(env)).store_path({"steps_completed": steps}) as (path, sid):
        (path / "weights").write_text(f"weights at {steps}\n")
    return sid


def attempts(env: dict[str, str], requests: list[list[Any]]) -> list[Any]:
    """Each [kind, fields] as a request of the trial's session: ["ok", value] or ["refused",
    message]. Kind "delete" is core_context.checkpoint.delete(uuid) itself."""
    session = _session(env)
    out: list[Any] = []
    for kind, fields in requests:
        try:
            if kind == "delete":
                _checkpoints(env, session).delete(fields["uuid"])
                out.append(["ok", None])
            else:
                out.append(["ok", session.request(kind, timeout=20, **fields)])
        except DetLocalError as err:
            out.append(["refused", str(err)])
    return out


def make_dir(path: str, link_to: str | None = None) -> None:
    if link_to is None:
        os.mkdir(path)
    else:
        os.symlink(link_to, path)


def report_validations(env: dict[str, str], metric: str, values: list[float]) -> Any:
    session = _session(env)
    for steps, value in enumerate(values, start=1):
        session.report("validation", steps, {metric: value})
    return session.request("best_val", timeout=20)


def hello(env: dict[str, str], token: str) -> Any:
    """A raw hello (as a trial's Session sends it) with this token: the daemon's answer."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(20)
    sock.connect(env["DET_LOCAL_SOCKET"])
    rpc.send(
        sock,
        {"t": "hello", "token": token, "trial_id": int(env["DET_TRIAL_ID"]), "run_id": 1},
    )
    answer = rpc.recv(sock)
    sock.close()
    return answer


def _fate(sock: socket.socket, timeout: float) -> list[Any]:
    """What the daemon does with a connection: ["closed", seconds, frames it sent first] or
    ["open", timeout, frames]."""
    t0 = time.monotonic()
    data = b""
    sock.setblocking(False)
    while time.monotonic() - t0 < timeout:
        ready, _, _ = select.select([sock], [], [], 0.05)
        if not ready:
            continue
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            chunk = b""
        if not chunk:
            frames = []
            while len(data) >= 4:
                (n,) = struct.unpack(">I", data[:4])
                frames.append(msgpack.unpackb(data[4 : 4 + n], raw=False))
                data = data[4 + n :]
            return ["closed", time.monotonic() - t0, frames]
        data += chunk
    return ["open", timeout, []]


def _connect(path: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    return sock


def before_hello(path: str) -> dict[str, Any]:
    """Connections that never say hello properly."""
    out: dict[str, Any] = {}
    # a frame far over the pre-hello limit: closed at once, told why
    sock = _connect(path)
    sock.sendall(struct.pack(">I", 32 << 20) + b"\0" * 65536)
    out["oversized"] = _fate(sock, 5.0)
    sock.close()
    # 1 KiB of a frame, then nothing: closed after the hello timeout
    sock = _connect(path)
    sock.sendall(struct.pack(">I", 1024) + b"\0" * 1000)
    out["idle"] = _fate(sock, 15.0)
    sock.close()
    # many connections at once: those over the per-user cap are refused (busy, retry)
    socks = [_connect(path) for _ in range(40)]
    fates = [_fate(s, 0.5) if i >= 16 else None for i, s in enumerate(socks)]
    still = [s for s in socks[:16] if _fate(s, 0.05)[0] == "open"]
    out["many"] = {"refused": [f for f in fates if f and f[0] == "closed"], "open": len(still)}
    for s in socks:
        s.close()
    return out


def after_close(path: str) -> bool:
    """Once the connections above are gone, a new connection is not refused."""
    sock = _connect(path)
    fate = _fate(sock, 0.5)
    sock.close()
    return fate[0] == "open"


def flood(env: dict[str, str], ready_fd: int, hold_fd: int) -> None:
    """Bob's process: everything that used to grow the daemon's memory, at once, held open
    until the test has measured (hold_fd closes)."""
    path = env["DET_LOCAL_SOCKET"]
    big = memoryview(b"\0" * (32 << 20))
    hello = rpc.pack(
        {
            "t": "hello",
            "token": env["DET_LOCAL_TOKEN"],
            "trial_id": int(env["DET_TRIAL_ID"]),
            "run_id": int(env["DET_TRIAL_RUN_ID"]),
        }
    )

    def session() -> socket.socket:
        sock = _connect(path)
        sock.settimeout(5.0)
        sock.sendall(hello)
        assert rpc.recv(sock) == {"t": "hello", "preempt": False}
        return sock

    def send(sock: socket.socket, data: Any) -> None:
        try:
            sock.sendall(data)
        except OSError:  # closed by the daemon, or it stopped reading (timeout)
            pass

    # requests with 200 KiB ids, whose replies (echoing the id) it never reads
    unread = session()
    replies = b"".join(rpc.pack({"t": "bye", "id": "x" * (200 << 10)}) for _ in range(1000))
    # sessions (bob's own token) each sending a large frame, all but its last byte
    sessions = [session() for _ in range(20)]
    large = struct.pack(">I", SESSION_LIMIT) + big[: SESSION_LIMIT - 1]
    jobs = [(unread, replies)] + [(s, large) for s in sessions]
    # connections sending large frames before hello
    for _ in range(20):
        sock = _connect(path)
        sock.settimeout(5.0)
        jobs.append((sock, struct.pack(">I", 32 << 20) + big))
    threads = [threading.Thread(target=send, args=job) for job in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    os.write(ready_fd, b"ready")
    os.read(hold_fd, 1)  # until the test closes its end


def busy_then_welcome(env: dict[str, str]) -> float:
    """A trial's Session while its user has the most connections waiting for hello: it is told
    to retry, and gets in once one of them is closed (here by the hello timeout)."""
    idle = [_connect(env["DET_LOCAL_SOCKET"]) for _ in range(16)]
    assert _fate(idle[-1], 0.3)[0] == "open"  # all 16 accepted and waiting
    t0 = time.monotonic()
    session = _session(env)
    took = time.monotonic() - t0
    assert session.request("best_val", timeout=20) is None
    for sock in idle:
        sock.close()
    return took


def session_frame_over_limit(env: dict[str, str]) -> list[Any]:
    sock = _connect(env["DET_LOCAL_SOCKET"])
    sock.settimeout(20)
    rpc.send(
        sock,
        {
            "t": "hello",
            "token": env["DET_LOCAL_TOKEN"],
            "trial_id": int(env["DET_TRIAL_ID"]),
            "run_id": int(env["DET_TRIAL_RUN_ID"]),
        },
    )
    assert rpc.recv(sock) == {"t": "hello", "preempt": False}
    sock.sendall(struct.pack(">I", SESSION_LIMIT + 1) + b"\0" * 65536)
    return _fate(sock, 5.0)


# ---------------------------------------------------------------------------- the tests
def test_a_trial_session_acts_only_for_its_own_trial(shared: Shared) -> None:  # noqa: F811
    alice = start_sleeping_trial(shared, A, "alice", {"metric": "loss"})
    bob = start_sleeping_trial(shared, B, "bob", {"metric": "acc", "smaller_is_better": False})
    storage = Path(alice["env"]["DET_LOCAL_CHECKPOINT_DIR"])
    assert storage == Path(bob["env"]["DET_LOCAL_CHECKPOINT_DIR"])  # the shared default storage

    # alice's trial records a checkpoint, as a Core API script does
    mine = shared.as_user(A, store_checkpoint, alice["env"], 7)
    ckpt_dir = storage / mine
    with _store(shared) as store:
        before = store.get_checkpoint(mine)
        trial_before = store.get_trial(alice["trial"])
    assert (before.state, before.trial_id, before.path) == (
        "COMPLETED",
        alice["trial"],
        str(ckpt_dir),
    )
    assert trial_before.latest_checkpoint == mine
    files_before = {p.name: p.read_bytes() for p in ckpt_dir.iterdir()}
    # a directory alice's trial made and has not recorded yet (a checkpoint being written)
    unrecorded = str(uuid.uuid4())
    shared.as_user(A, make_dir, str(storage / unrecorded))
    # bob's own links in the shared storage, pointing at alice's checkpoint
    link = str(uuid.uuid4())
    shared.as_user(B, make_dir, str(storage / link), str(ckpt_dir))
    fresh = str(uuid.uuid4())

    # bob's trial, with bob's own valid token, tries everything on alice's checkpoint
    answers = shared.as_user(
        B,
        attempts,
        bob["env"],
        [
            ["delete", {"uuid": mine}],
            ["ckpt_delete", {"uuid": mine}],
            ["ckpt_get", {"uuid": mine}],
            ["checkpoint", {"uuid": mine, "path": str(ckpt_dir), "steps_completed": 99}],
            ["checkpoint", {"uuid": fresh, "path": str(ckpt_dir), "steps_completed": 1}],
            ["checkpoint", {"uuid": link, "path": str(storage / link), "steps_completed": 1}],
            ["checkpoint", {"uuid": fresh, "path": f"{storage}/../{fresh}"}],
            ["checkpoint", {"uuid": unrecorded, "path": str(storage / unrecorded)}],
            ["checkpoint", {"uuid": "../../etc", "path": str(storage / "x")}],
            ["progress", {"progress": 0.5, "trial_id": alice["trial"]}],
        ],
    )
    owner = (
        f"belongs to trial {alice['trial']} of experiment {alice['exp']}, "
        f"not to trial {bob['trial']}"
    )
    expected = [
        f"checkpoint {mine} {owner}; a trial may delete only its own checkpoints",
        f"checkpoint {mine} {owner}; a trial may delete only its own checkpoints",
        f"checkpoint {mine} {owner}; a trial may read only its own checkpoints",
        f"checkpoint {mine} {owner}; a trial may record only its own checkpoints",
        "is not its experiment's checkpoint directory",
        "is not a directory (a link?)",
        "leaves its directory with '..'",
        f"belongs to {A}, not to the trial's user {B}; a trial records only directories it made",
        "checkpoint uuid '../../etc' is not a UUID",
        f"trial_id {alice['trial']} is not this session's ({bob['trial']}); a session speaks only "
        "for its own run",
    ]
    for (kind, text), want in zip(answers, expected, strict=True):
        assert kind == "refused" and want in text, (text, want)
        assert "\n" not in text

    # nothing of alice's changed: records, files, her trial
    with _store(shared) as store:
        assert store.get_checkpoint(mine) == before
        assert store.get_trial(alice["trial"]).latest_checkpoint == mine
        assert [c.uuid for c in store.list_checkpoints()] == [mine]
        assert store.get_experiment(alice["exp"]).progress == 0.0
    assert {p.name: p.read_bytes() for p in ckpt_dir.iterdir()} == files_before
    # each refusal is one line in the daemon's log
    log = _daemon_log(shared)
    who = f"from {B} (uid {pwd.getpwnam(B).pw_uid}), trial {bob['trial']} run 1"
    assert log.count(f"trial socket: refused ckpt_delete {who}: checkpoint {mine}") == 2, log
    assert f"trial socket: refused ckpt_get {who}" in log
    assert log.count(f"trial socket: refused checkpoint {who}") == 6

    # the owners' own requests still work: alice reads hers, bob records and deletes his own
    got = shared.as_user(A, attempts, alice["env"], [["ckpt_get", {"uuid": mine}]])
    assert got[0][0] == "ok" and got[0][1]["trial_id"] == alice["trial"]
    his = shared.as_user(B, store_checkpoint, bob["env"], 3)
    assert shared.as_user(B, attempts, bob["env"], [["delete", {"uuid": his}]]) == [["ok", None]]
    with _store(shared) as store:
        assert store.get_checkpoint(his).state == "DELETED"
        assert store.get_checkpoint(mine).state == "COMPLETED"

    # alice's token, stolen, is useless from bob's uid
    answer = shared.as_user(B, hello, alice["env"], alice["env"]["DET_LOCAL_TOKEN"])
    assert answer["error"] == (
        f"trial {alice['trial']} runs as {A}; this connection is from {B} "
        f"(uid {pwd.getpwnam(B).pw_uid}): a trial's token is valid only in its own processes"
    ), answer
    with pytest.raises(DetLocalError, match=f"refused trial {alice['trial']}: trial .* runs as"):
        shared.as_user(B, report_validations, alice["env"], "loss", [-1e9])
    with _store(shared) as store:
        assert store.list_metrics(alice["trial"]) == []
    assert f"trial socket: refused hello from {B}" in _daemon_log(shared)
    # ... while alice's own session (her uid, her token) is welcome
    assert shared.as_user(A, hello, alice["env"], alice["env"]["DET_LOCAL_TOKEN"]) == {
        "t": "hello",
        "preempt": False,
    }

    # +-inf: warned about, and never the best, whichever direction is better
    assert shared.as_user(A, report_validations, alice["env"], "loss", [0.5, -math.inf]) == 0.5
    assert shared.as_user(B, report_validations, bob["env"], "acc", [0.7, math.inf]) == 0.7
    with _store(shared) as store:
        assert store.get_trial(alice["trial"]).best_validation == 0.5
        assert store.get_trial(bob["trial"]).best_validation == 0.7
        assert [m.metrics["loss"] for m in store.list_metrics(alice["trial"], "validation")] == [
            0.5,
            -math.inf,
        ]  # recorded as reported
    assert shared.as_user(None, expviews.best_trial, alice["exp"])["best_validation"] == 0.5
    log = _daemon_log(shared)
    assert f"trial {alice['trial']}: validation metric 'loss' is -inf at steps_completed=2" in log
    assert f"trial {bob['trial']}: validation metric 'acc' is inf at steps_completed=2" in log


def test_connections_that_do_not_say_hello_are_bounded(shared: Shared) -> None:  # noqa: F811
    path = str(shared.paths.socket)
    seen = shared.as_user(B, before_hello, path)
    fate, seconds, frames = seen["oversized"]
    assert fate == "closed" and seconds < 2.0, seen["oversized"]
    assert frames == [
        {
            "t": "hello",
            "error": f"a frame of {32 << 20} bytes before hello (the limit is 4096); closed",
        }
    ]
    fate, seconds, _ = seen["idle"]
    assert fate == "closed" and 4.0 <= seconds <= 10.0, seen["idle"]
    many = seen["many"]
    assert many["open"] == 16 and len(many["refused"]) == 24, many
    assert all(
        f[2] == [{"t": "hello", "error": "the daemon is busy; retry", "retry": True}]
        for f in many["refused"]
    ), many
    log = _daemon_log(shared)
    uid = pwd.getpwnam(B).pw_uid
    assert f"trial socket: refused connection from {B} (uid {uid}): a frame of" in log
    assert f"refused connection from {B} (uid {uid}): no hello within 5s; closed" in log
    assert "16 connections of this user are already waiting to say hello" in log
    # once they are gone, connecting works again
    wait_for(lambda: shared.as_user(B, after_close, path), what="the cap to free up")


def test_daemon_memory_stays_bounded_and_others_are_served(shared: Shared) -> None:  # noqa: F811
    bob = start_sleeping_trial(shared, B, "bob", {"metric": "loss"})
    daemon = psutil.Process(shared.dl.daemon_pid())
    # a legitimate trial is not refused by the cap on waiting connections: it retries
    took = shared.as_user(B, busy_then_welcome, bob["env"])
    assert 3.0 <= took <= 12.0, took
    # a session frame over the limit closes the session
    fate = shared.as_user(B, session_frame_over_limit, bob["env"])
    assert fate[0] == "closed" and fate[1] < 2.0, fate
    assert "refused frame from" in _daemon_log(shared)

    baseline = daemon.memory_info().rss
    ready_r, ready_w = os.pipe()
    hold_r, hold_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # bob's flooding process
        try:
            os.close(ready_r)
            os.close(hold_w)
            pw = pwd.getpwnam(B)
            os.setgroups([])
            os.setgid(pw.pw_gid)
            os.setuid(pw.pw_uid)
            flood(bob["env"], ready_w, hold_r)
        finally:
            os._exit(0)
    os.close(ready_w)
    os.close(hold_r)
    try:
        assert os.read(ready_r, 5) == b"ready"
        peak = baseline
        t0 = time.monotonic()
        while time.monotonic() - t0 < 2.0:
            peak = max(peak, daemon.memory_info().rss)
            time.sleep(0.05)
        # a third user is served meanwhile, promptly
        t0 = time.monotonic()
        job = shared.cmd(ADMIN, "true")
        assert shared.wait_job(job).exit_code == 0
        served = time.monotonic() - t0
        peak = max(peak, daemon.memory_info().rss)
    finally:
        os.close(hold_w)
        os.waitpid(pid, 0)
        os.close(ready_r)
    grown = (peak - baseline) / (1 << 20)
    assert grown < 120, f"the daemon grew by {grown:.0f} MiB"
    assert served < 10.0, served
    # bob's trial is still his, and still served
    assert shared.as_user(B, report_validations, bob["env"], "loss", [0.25]) == 0.25
    assert rpc.SESSION_MAX_FRAME == SESSION_LIMIT

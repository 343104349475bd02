"""System mode: one daemon, run as root, on a shared DET_LOCAL_HOME, used by several real Unix
users (created with useradd by conftest's `accounts` fixture, removed at the end even on
failure).

The interpreter lives under /root (mode 700), so the other users cannot start Python. A user's
client actions run in a forked child of this test process (tests/support/users.py's
`Shared.as_user`) that imports det-local first and then setgid/setuid's to that user: the files it
writes (spool requests) are really that user's, as the kernel sees them. Jobs that run as those
users use programs anyone can run (sh, id, sleep), writing into a world-writable directory.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pwd
import shutil
import signal
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import msgpack
import pytest

import det_local.cli.job
import det_local.client.control
import det_local.client.daemonctl
from det_local import api
from det_local.errors import DetLocalError
from det_local.sched.intake import spool
from det_local.store.paths import Paths
from det_local.store.states import State
from tests.support.users import ADMIN, ADMIN_GROUP, A, B, Shared, _submit_raw
from tests.support.world import gone, wait_for

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("useradd") is None,
    reason="multi-user tests create real users: they need root and useradd",
)


def denied(exc: pytest.ExceptionInfo[DetLocalError], what: str, owner: str) -> None:
    msg = str(exc.value)
    assert msg.startswith(f"permission denied: {what} belongs to {owner}"), msg
    assert f"member of the {ADMIN_GROUP} group" in msg, msg


# ---------------------------------------------------------------------------- identity
def test_jobs_run_as_their_submitter(shared: Shared) -> None:
    a = shared.cmd(A, "id -un > a.txt")
    b = shared.cmd(B, "id -un > b.txt")
    root = shared.cmd(None, "id -un > root.txt")
    for job_id, user, file in ((a, A, "a.txt"), (b, B, "b.txt"), (root, "root", "root.txt")):
        job = shared.wait_job(job_id)
        assert (job.user, job.uid, job.exit_code) == (user, pwd.getpwnam(user).pw_uid, 0)
        assert (shared.out / file).read_text() == f"{user}\n"
        assert (shared.out / file).stat().st_uid == pwd.getpwnam(user).pw_uid
    # its log is its own too
    assert shared.paths.command_log(a).stat().st_uid == pwd.getpwnam(A).pw_uid


def test_a_request_claiming_another_user_is_rejected(shared: Shared) -> None:
    def forge(claimed: str) -> Any:
        p = api.paths()
        req_id = f"{time.time_ns():020d}-{os.getpid()}-forged"
        body = {
            "op": "cmd_run",
            "user": claimed,
            "payload": {"argv": ["id"], "cwd": "/", "env": {"PATH": "/usr/bin:/bin"}},
        }
        tmp = p.queue / f".{req_id}.tmp"
        tmp.write_bytes(msgpack.packb(body, use_bin_type=True))
        os.rename(tmp, p.queue / f"{req_id}.req")
        return spool.wait_response(p, req_id, timeout=20)

    for claimed in (B, "root"):
        with pytest.raises(DetLocalError) as exc:
            shared.as_user(A, forge, claimed)
        msg = str(exc.value)
        assert f"claims user '{claimed}' but its file is owned by '{A}'" in msg, msg
    assert api.open_store(shared.paths).jobs.list(include_done=True) == []
    # the daemon goes on, and A's honest requests work
    assert shared.wait_job(shared.cmd(A, "true")).user == A


def test_a_request_waiting_in_the_spool_is_safe_from_other_users(shared: Shared) -> None:
    """With the daemon stopped, requests wait; nobody else can remove them (sticky spool),
    and the daemon applies them as their owner once it starts."""
    assert shared.dl.det("daemon", "stop").rc == 0

    def submit() -> str:
        payload = {
            "argv": ["sh", "-c", "id -un > waited.txt"],
            "cwd": str(shared.out),
            "env": {"PATH": "/usr/bin:/bin"},
        }
        return spool.submit(api.paths(), "cmd_run", payload)

    req_id = shared.as_user(A, submit)
    path = shared.paths.queue / f"{req_id}.req"
    assert path.stat().st_uid == pwd.getpwnam(A).pw_uid

    def remove() -> None:
        path.unlink()

    with pytest.raises(AssertionError, match="PermissionError"):
        shared.as_user(B, remove)
    assert path.exists()
    # without a daemon, other users get a clear message rather than an engine of their own
    with pytest.raises(DetLocalError, match="no det-local daemon is running for .* administrator"):
        shared.cmd(B, "true")

    shared.dl.daemon_start()
    job_id = shared.as_user(A, spool.wait_response, Paths(shared.home), req_id, 20)
    assert shared.wait_job(job_id).user == A
    assert (shared.out / "waited.txt").read_text() == f"{A}\n"


def test_everyone_sees_all_jobs(shared: Shared) -> None:
    job = shared.held(A, "a")
    wait_for(lambda: shared.order() == ["a"], what="A's job to start")

    def job_list() -> Any:
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            det_local.cli.job.list_jobs(show_all=False, limit=None, as_json=True, cluster=False)
        return json.loads(buf.getvalue())

    for user in (B, ADMIN):
        listed = shared.as_user(user, job_list)
        assert [(j["id"], j["user"], j["state"]) for j in listed] == [(job, A, "SCHEDULED")]
    st = shared.as_user(B, lambda: det_local.client.daemonctl.status(api.paths()))
    assert st["running"] and st["running_jobs"] == 1
    shared.release("a")


# ---------------------------------------------------------------------------- ownership
def test_only_the_owner_or_an_admin_changes_a_job(shared: Shared) -> None:
    running = shared.held(A, "running")
    shared.held(A, "other")  # takes the second slot
    queued = shared.held(A, "queued")
    wait_for(lambda: sorted(shared.order()) == ["other", "running"], what="A's jobs to start")
    assert shared.job(queued).state == "QUEUED"

    # B may not
    for op, payload in [
        ("cmd_kill", {"job_id": running}),
        ("job_update", {"job_id": queued, "priority": 1}),
        ("job_update", {"job_id": queued, "ahead_of": running}),
        ("job_update_batch", {"updates": [{"job_id": queued, "priority": 1}]}),
    ]:
        with pytest.raises(DetLocalError) as exc:
            shared.as_user(B, api.control_job, op, payload)
        denied(exc, f"job {payload.get('job_id', queued)}", A)
    assert shared.job(queued).priority == 42 and shared.job(running).state == "SCHEDULED"

    # the owner may
    assert shared.as_user(A, api.control_job, "job_update", {"job_id": queued, "priority": 30})
    assert shared.job(queued).priority == 30
    # so may a member of the admin group, and root
    assert shared.as_user(ADMIN, api.control_job, "job_update", {"job_id": queued, "priority": 20})
    assert shared.job(queued).priority == 20
    pids = [shared.pid(running)]
    msg = shared.as_user(ADMIN, api.control_job, "cmd_kill", {"job_id": running})
    assert msg == f"command {running} is being stopped"
    assert shared.wait_job(running).message == "killed on request"
    wait_for(lambda: all(gone(p) for p in pids), what="A's killed command to go")
    wait_for(lambda: "queued" in shared.order(), what="the queued job to start")
    msg = shared.as_user(None, api.control_job, "cmd_kill", {"job_id": queued})
    assert msg == f"command {queued} is being stopped"
    assert shared.wait_job(queued).message == "killed on request"
    shared.release("other")


def test_only_the_owner_or_an_admin_controls_an_experiment(shared: Shared) -> None:
    ctx = shared.out / "ctx"
    ctx.mkdir()
    (ctx / "config.yaml").write_text(
        "name: a-exp\nentrypoint: sleep 1000\nmax_restarts: 0\n"
        "searcher: {name: single, metric: loss, max_length: 1}\n"
    )
    os.chmod(ctx, 0o755)

    def submit() -> int:
        return api.run(ctx / "config.yaml", ctx, follow=False)

    assert shared.as_user(A, submit) == 0
    wait_for(lambda: shared.job(1).state == "SCHEDULED", what="A's trial to start")
    trial_pid = shared.pid(1)
    assert shared.job(1).user == A

    for action in ("pause", "kill"):
        with pytest.raises(DetLocalError) as exc:
            shared.as_user(B, api.control, 1, action)
        denied(exc, "experiment 1", A)
    with pytest.raises(DetLocalError) as exc:  # the trial's job, by its job id
        shared.as_user(B, api.control_job, "job_update", {"job_id": 1, "priority": 1})
    denied(exc, "job 1", A)
    assert not gone(trial_pid)

    # an admin pauses it (the trial ignores the request: stopped after preemption_timeout)
    assert shared.as_user(ADMIN, api.control, 1, "pause") == "experiment 1 paused"
    wait_for(lambda: gone(trial_pid), what="the trial to stop")
    store = api.open_store(shared.paths)
    wait_for(lambda: store.get_experiment(1).state == State.PAUSED, what="the pause")
    # the owner kills it
    assert shared.as_user(A, api.control, 1, "kill") == "experiment 1 killed"
    wait_for(lambda: store.get_experiment(1).state == State.CANCELED, what="the kill")
    store.close()


def test_daemon_stop_is_for_root_only(shared: Shared) -> None:
    def stop() -> Any:
        from det_local.client.requester import remote_request

        return remote_request(api.paths(), "daemon_stop", {}, timeout=20)

    with pytest.raises(DetLocalError, match="only root or the daemon's user may stop it"):
        shared.as_user(A, stop)
    pid = shared.dl.daemon_pid()
    assert pid is not None and not gone(pid)
    os.kill(pid, signal.SIGTERM)
    wait_for(lambda: gone(pid), what="the daemon to stop")


def test_fair_share_between_users(shared: Shared) -> None:
    """Fair share (daemon.yaml scheduler.mode): when a slot frees up it goes to the user
    furthest below their share, not to the oldest job."""
    dl = shared.dl
    assert dl.det("daemon", "stop").rc == 0
    dl.settings({"admin_group": ADMIN_GROUP, "scheduler": {"mode": "fair_share"}})
    dl.daemon_start()
    for name in ("a1", "a2", "a3"):
        shared.held(A, name)
    wait_for(lambda: sorted(shared.order()) == ["a1", "a2"], what="A's first jobs")
    for name in ("b1", "b2"):
        shared.held(B, name)
    shared.release("a1")  # A holds 1 slot, B none: B's turn, though a3 is older
    wait_for(lambda: len(shared.order()) == 3, what="the next job")
    assert shared.order()[2] == "b1"
    shared.release("a2")  # A holds 0, B 1: A's turn
    wait_for(lambda: len(shared.order()) == 4, what="the next job")
    assert shared.order()[3] == "a3"
    for name in ("b1", "a3", "b2"):
        shared.release(name)
    wait_for(lambda: len(shared.order()) == 5, what="the last job")


# ---------------------------------------------------------------------------- root acts for users
def test_the_daemon_reads_a_context_with_the_submitters_rights(shared: Shared) -> None:
    """Root takes the snapshot, but only of what the submitter may read: no copying root's
    files into a context the submitter's trial then reads."""
    secret = shared.out.parent / "secret"
    secret.mkdir(mode=0o700)
    (secret / "train.py").write_text("print('root only')\n")
    os.chmod(secret / "train.py", 0o644)  # readable, but inside a directory A cannot enter
    config = {
        "name": "steal",
        "entrypoint": "sh -c true",
        "searcher": {"name": "single", "metric": "loss", "max_length": 1},
    }
    with pytest.raises(DetLocalError) as exc:
        shared.as_user(A, _submit_raw, config, str(secret))
    assert "permission denied" in str(exc.value).lower(), str(exc.value)
    # a link in A's own context to a file only root can reach is refused the same way
    ctx = shared.out / "ctx-link"
    ctx.mkdir()
    os.symlink(secret / "train.py", ctx / "stolen.py")
    os.chmod(ctx, 0o755)
    with pytest.raises(DetLocalError) as exc:
        shared.as_user(A, _submit_raw, config, str(ctx))
    assert "stolen.py" in str(exc.value) and "permission denied" in str(exc.value).lower()
    assert api.open_store(shared.paths).list_experiments() == []
    # A's own readable context works, and its snapshot holds what A gave
    ok = shared.out / "ctx-ok"
    ok.mkdir()
    (ok / "train.py").write_text("print('mine')\n")
    os.chmod(ok, 0o755)
    os.chmod(ok / "train.py", 0o644)
    exp = shared.as_user(A, _submit_raw, config, str(ok))
    assert (shared.paths.context_dir(exp) / "train.py").read_text() == "print('mine')\n"


def test_checkpoint_storage_is_never_opened_up_for_a_user(shared: Shared) -> None:
    """A user's checkpoint_storage pointing at a root directory must not make root change its
    permissions (nor create directories there for the user)."""
    guarded = shared.out.parent / "guarded"
    guarded.mkdir(mode=0o755)
    ctx = shared.out / "ctx"
    ctx.mkdir()
    os.chmod(ctx, 0o755)
    config = {
        "name": "storage",
        "entrypoint": "sh -c true",
        "searcher": {"name": "single", "metric": "loss", "max_length": 1},
        "checkpoint_storage": {"type": "shared_fs", "host_path": str(guarded)},
    }
    exp = shared.as_user(A, _submit_raw, config, str(ctx))
    store = api.open_store(shared.paths)
    wait_for(lambda: store.get_experiment(exp).state.terminal, what="the experiment to end")
    assert oct(guarded.stat().st_mode & 0o7777) == oct(0o755)
    sub = {**config, "checkpoint_storage": {**config["checkpoint_storage"], "storage_path": "x"}}
    exp = shared.as_user(A, _submit_raw, {**sub, "name": "storage2"}, str(ctx))
    wait_for(lambda: store.get_experiment(exp).state.terminal, what="the experiment to end")
    assert not (guarded / "x").exists()
    assert oct(guarded.stat().st_mode & 0o7777) == oct(0o755)
    store.close()


def test_a_trial_runs_as_its_submitter_with_their_identity(shared: Shared) -> None:
    ctx = shared.out / "ctx-who"
    ctx.mkdir()
    os.chmod(ctx, 0o755)
    who = shared.out / "who.txt"
    config = {
        "name": "who",
        "entrypoint": ["sh", "-c", f'echo "$(id -un) $HOME $USER $LOGNAME" > {who}'],
        "searcher": {"name": "single", "metric": "loss", "max_length": 1},
    }
    exp = shared.as_user(A, _submit_raw, config, str(ctx))
    store = api.open_store(shared.paths)
    wait_for(lambda: store.get_experiment(exp).state == State.COMPLETED, what="the trial")
    store.close()
    home = pwd.getpwnam(A).pw_dir
    assert who.read_text().split() == [A, home, A, A]
    assert who.stat().st_uid == pwd.getpwnam(A).pw_uid


def test_checkpoint_gc_removes_files_with_the_owners_rights(accounts: None) -> None:
    """A root daemon removes a user's checkpoints with that user's rights (in a child process:
    the engine's own ids never change): what the user may not delete stays, and says why."""
    from det_local.sched.life.ckpt_gc import remove_files
    from det_local.sched.run.runas import identity as _identity

    base = Path(tempfile.mkdtemp(prefix="det-local-mu-gc-", dir="/tmp"))
    try:
        os.chmod(base, 0o755)
        owned_parent = base / "open"
        owned_parent.mkdir()
        os.chmod(owned_parent, 0o1777)
        uid = pwd.getpwnam(A).pw_uid
        owned = owned_parent / str(uuid.uuid4())
        (owned / "sub").mkdir(parents=True)
        (owned / "sub" / "weights").write_text("w")
        for path in (owned, owned / "sub", owned / "sub" / "weights"):
            os.chown(path, uid, -1)
        guarded = base / "guarded" / str(uuid.uuid4())  # root's, in a directory only root writes
        guarded.mkdir(parents=True)
        os.chmod(base / "guarded", 0o755)
        (guarded / "weights").write_text("w")
        targets = [(owned.name, str(owned)), (guarded.name, str(guarded))]
        removed, failed = remove_files(targets, _identity(uid))
        assert removed == [owned.name] and not owned.exists()
        assert len(failed) == 1 and failed[0].startswith(f"{guarded.name}: {guarded}: "), failed
        assert "Permission denied" in failed[0] and (guarded / "weights").exists()
        assert os.geteuid() == 0 and os.getegid() == 0
        # as root for root (no identity), the same call removes it
        assert remove_files(targets[1:], {}) == ([guarded.name], [])
    finally:
        shutil.rmtree(base, ignore_errors=True)

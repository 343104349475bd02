"""A root daemon's files for a user's job, and checkpoints a trial never completed.

* Jobs run with the umask their submitter's client had, and what the daemon creates for them
  (log files, run directories) is the submitter's, with a mode from that umask: a user with
  umask 077 keeps their logs from other users, while the admin group still reads them (a POSIX
  ACL entry) and so does `det-local trial logs` / `cmd logs` run by an admin.
* A umask in a request is user input: anything but 0..0o777 is refused in one line.
* The daemon never follows a link (nor takes over another user's file) where a job's log goes.
* A checkpoint whose trial died while writing it is never listed, and its directory is removed
  at the trial's next start or by checkpoint GC.
* When a trial resumes from another checkpoint than its latest, the message says why.
"""

from __future__ import annotations

import contextlib
import io
import os
import pwd
import shutil
import signal
import stat
import struct
import tempfile
from pathlib import Path
from typing import Any

import pytest
import typer

# imported before the multi-user children drop root (they cannot read the interpreter's files)
import det_local.cli.cmd
import det_local.cli.main
import det_local.cli.trial  # noqa: F401
import det_local.trial.core
from det_local import api
from det_local.errors import DetLocalError
from det_local.store.states import State
from tests.support.users import ADMIN, ADMIN_GROUP, A, B, Shared
from tests.support.world import Env, wait_for

with contextlib.suppress(ImportError):  # what a trial imports to write a checkpoint
    import det_local.store.acl  # noqa: F401
_MAIN = typer.main.get_command(det_local.cli.main.app)
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (real users, chown)")


# ---------------------------------------------------------------------------- helpers
def cli(*args: str) -> str:
    """`det-local ARGS` in this process (a multi-user child): its stdout."""
    raw = io.BytesIO()
    out = io.TextIOWrapper(raw, encoding="utf-8")
    with contextlib.redirect_stdout(out):
        try:
            _MAIN.main(list(args), prog_name="det-local", standalone_mode=False)
        finally:
            out.flush()
    return raw.getvalue().decode()


def with_umask(mask: int, fn: Any, *args: Any) -> Any:
    os.umask(mask)
    return fn(*args)


def read_or_denied(path: str) -> str:
    try:
        return Path(path).read_text()
    except PermissionError:
        return "permission denied"


def acl_groups(path: Path) -> dict[int, int]:
    """{gid: permission bits} of the named-group entries of path's access ACL."""
    try:
        raw = os.getxattr(path, "system.posix_acl_access")
    except OSError:
        return {}
    entries = [struct.unpack_from("<HHI", raw, 4 + 8 * i) for i in range((len(raw) - 4) // 8)]
    return {ident: perm for tag, perm, ident in entries if tag == 0x08}


def private_to(path: Path, user: str) -> None:
    """path is user's, hidden from others (the admin group excepted, through its ACL)."""
    import grp

    st = path.lstat()
    assert st.st_uid == pwd.getpwnam(user).pw_uid, (path, st.st_uid)
    assert stat.S_IMODE(st.st_mode) & 0o007 == 0, oct(st.st_mode)
    admin_gid = grp.getgrnam(ADMIN_GROUP).gr_gid
    want = 0o5 if stat.S_ISDIR(st.st_mode) else 0o4
    assert acl_groups(path).get(admin_gid) == want, (path, acl_groups(path))


# ---------------------------------------------------------------------------- umask and owners
@root_only
def test_a_private_users_command_log_is_hers_and_only_admins_read_it(
    shared: Shared,  # noqa: F811
) -> None:
    out = shared.out
    script = f"echo alice-secret; umask > {out}/umask-seen; echo x > {out}/made-by-job"

    def submit() -> str:
        os.chdir(out)
        return cli("cmd", "run", "--", "sh", "-c", script)

    said = shared.as_user(A, with_umask, 0o077, submit)
    job_id = int(said.split()[2])
    assert shared.wait_job(job_id).exit_code == 0
    # the job ran with her umask, as if she had run it herself
    assert (out / "umask-seen").read_text().strip() == "0077"
    assert stat.S_IMODE((out / "made-by-job").stat().st_mode) == 0o600
    log = shared.paths.command_log(job_id)
    assert log.read_text() == "alice-secret\n"
    private_to(log, A)
    private_to(log.parent, A)
    assert shared.as_user(B, read_or_denied, str(log)) == "permission denied"
    assert shared.as_user(ADMIN, read_or_denied, str(log)) == "alice-secret\n"
    assert shared.as_user(ADMIN, cli, "cmd", "logs", str(job_id)) == "alice-secret\n"
    # with the usual umask, the usual modes (nothing more open than before)
    said = shared.as_user(A, with_umask, 0o022, submit)
    job_id = int(said.split()[2])
    shared.wait_job(job_id)
    log = shared.paths.command_log(job_id)
    assert stat.S_IMODE(log.stat().st_mode) == 0o644 and log.stat().st_uid == pwd.getpwnam(A).pw_uid
    assert shared.as_user(B, read_or_denied, str(log)) == "alice-secret\n"


@root_only
def test_a_private_users_trial_log_and_run_directory(shared: Shared) -> None:  # noqa: F811
    ctx = shared.out / "ctx"
    ctx.mkdir()
    os.chmod(ctx, 0o755)
    (ctx / "config.yaml").write_text(
        "name: private\nentrypoint: [sh, -c, 'echo trial-secret; umask']\nmax_restarts: 0\n"
        "searcher: {name: single, metric: loss, max_length: 1}\n"
    )

    def submit() -> int:
        return api.run(ctx / "config.yaml", ctx, follow=False)

    assert shared.as_user(A, with_umask, 0o077, submit) == 0
    store = api.open_store(shared.paths)
    wait_for(lambda: store.get_experiment(1).state == State.COMPLETED, what="the trial")
    store.close()
    log = shared.paths.trial_log(1, 1)
    assert log.read_text() == "trial-secret\n0077\n"
    private_to(log, A)
    run_dir = shared.paths.trial_info_dir(1, 1, 1)
    private_to(run_dir, A)
    token = run_dir / "cluster.json"  # the run's session token: hers alone
    assert token.stat().st_uid == pwd.getpwnam(A).pw_uid
    assert stat.S_IMODE(token.stat().st_mode) == 0o600
    assert shared.as_user(B, read_or_denied, str(log)) == "permission denied"
    assert shared.as_user(B, read_or_denied, str(token)) == "permission denied"
    assert shared.as_user(ADMIN, cli, "trial", "logs", "1") == "trial-secret\n0077\n"


def private_checkpoint(storage: str, admin_gid: int) -> str:
    """A Core API checkpoint written with umask 077 by a trial of a root daemon (which tells
    it the admin group's gid); its path."""
    os.umask(0o077)
    os.environ["DET_LOCAL_ADMIN_GID"] = str(admin_gid)
    with (
        det_local.trial.core.init(checkpoint_storage=storage) as core,
        core.checkpoint.store_path({"steps_completed": 1}) as (path, _),
    ):
        (path / "sub").mkdir()
        (path / "sub" / "weights").write_text("her weights")
    return str(path)


@root_only
def test_admins_read_a_private_users_checkpoint(shared: Shared) -> None:  # noqa: F811
    import grp

    storage = shared.out / "ckpts"  # as det-local's own default storage: anyone creates
    storage.mkdir()
    os.chmod(storage, 0o1777)
    ckpt = Path(
        shared.as_user(A, private_checkpoint, str(storage), grp.getgrnam(ADMIN_GROUP).gr_gid)
    )
    weights = ckpt / "sub" / "weights"
    for path in (ckpt, ckpt / "sub", weights, ckpt / "metadata.json"):
        private_to(path, A)
    assert shared.as_user(B, read_or_denied, str(weights)) == "permission denied"
    assert shared.as_user(ADMIN, read_or_denied, str(weights)) == "her weights"


@root_only
@pytest.mark.parametrize("umask", ["0077", -1, 0o1000, True, 2**40, 1.5])
def test_a_hostile_umask_is_refused(shared: Shared, umask: Any) -> None:  # noqa: F811
    with pytest.raises(DetLocalError) as exc:
        shared.cmd(A, "echo never", umask=umask)
    message = str(exc.value)
    assert message == (
        f"umask {umask!r} is not a file mode mask: give a whole number from 0 to 0o777 "
        "(e.g. 0o022, or 0o077 to keep your files private)"
    )
    assert "\n" not in message
    store = api.open_store(shared.paths)
    assert store.jobs.list(include_done=True) == []
    store.close()
    daemon_log = (shared.paths.run_dir / "daemon.log").read_text()
    assert f"of {A}: {message}" in daemon_log


@root_only
def test_the_log_is_never_written_through_a_link_or_into_anothers_file(
    accounts: None,  # noqa: F811
) -> None:
    """Where a job's log goes may be the user's own directory (a command's job directory): a
    link put there, or a hard link to a file of someone else, is refused; nothing of the
    victim changes."""
    from det_local.errors import TrialError
    from det_local.sched.run import executor
    from det_local.sched.run.launchplan import LaunchPlan
    from det_local.sched.run.runas import identity as _identity

    uid = pwd.getpwnam(A).pw_uid
    tmp_path = Path(tempfile.mkdtemp(prefix="det-local-sf-", dir="/tmp"))  # A can reach it
    os.chmod(tmp_path, 0o755)
    try:
        _log_refusals(tmp_path, uid, executor, LaunchPlan, _identity, TrialError)
    finally:
        shutil.rmtree(tmp_path, ignore_errors=True)


def _log_refusals(
    tmp_path: Path, uid: int, executor: Any, LaunchPlan: Any, _identity: Any, TrialError: Any
) -> None:
    victim = tmp_path / "victim"
    victim.write_text("root's\n")
    os.chmod(victim, 0o600)
    jobdir = tmp_path / "job"
    jobdir.mkdir()
    os.chown(jobdir, uid, -1)

    def spawn(name: str) -> None:
        plan = LaunchPlan(
            argv=["sh", "-c", "echo pwned"],
            env={"PATH": "/usr/bin:/bin"},
            cwd="/",
            user=A,
            slots=[],
            log_path=str(jobdir / name),
            info_dir=str(jobdir),
            **_identity(uid),
        )
        proc = executor.spawn(1, plan, jobdir / "exit-1")
        assert proc.popen is not None
        proc.popen.wait()

    os.symlink(victim, jobdir / "output.log")
    os.lchown(jobdir / "output.log", uid, -1)
    with pytest.raises(TrialError) as exc:
        spawn("output.log")
    assert str(exc.value) == (
        f"log file {jobdir / 'output.log'} is a symbolic link; refusing to follow it"
    )
    os.link(victim, jobdir / "hard.log")
    with pytest.raises(TrialError) as exc:
        spawn("hard.log")
    assert str(exc.value) == (
        f"log file {jobdir / 'hard.log'} is owned by uid 0, not by the job's user "
        f"(uid {uid}); refusing to write the job's output to it"
    )
    st = victim.stat()
    assert victim.read_text() == "root's\n" and st.st_uid == 0
    assert stat.S_IMODE(st.st_mode) == 0o600
    spawn("fresh.log")  # an ordinary log is created, hers
    fresh = jobdir / "fresh.log"
    assert fresh.read_text() == "pwned\n" and fresh.stat().st_uid == uid


# ---------------------------------------------------------------------------- checkpoints
# A Core API trial. Run 1 stores the checkpoints `ckpts` (steps), then, with `block`, begins
# one more and blocks while writing it (its path in out/partial), else exits with `fail`.
# Later runs log the checkpoint they start from and finish.
TRIAL = """
import os, pathlib, sys, time
import determined as det

info = det.get_cluster_info()
hp = info.trial.hparams
out = pathlib.Path(hp["out"])
run = int(os.environ["DET_TRIAL_RUN_ID"])
with det.core.init() as core:
    with open(out / "runs", "a") as f:
        f.write(f"{run} {info.latest_checkpoint}\\n")
    if run == 1:
        for steps in hp.get("ckpts", []):
            with core.checkpoint.store_path({"steps_completed": steps}) as (path, _):
                (path / "steps").write_text(str(steps))
        if hp.get("block"):
            with core.checkpoint.store_path({"steps_completed": 99}) as (path, _):
                (path / "half").write_bytes(b"x" * 4096)
                (out / "partial").write_text(str(path))
                while True:
                    time.sleep(0.05)
        sys.stdout.flush()
        os._exit(hp.get("fail", 0))
    core.train.report_validation_metrics(steps_completed=1, metrics={"loss": 0.0})
"""
CPU = {"DET_LOCAL_FAKE_GPUS": "0", "DET_LOCAL_CPU_SLOTS": "1"}


def submit(
    dl: Env, name: str, restarts: int, config: dict[str, Any] | None = None, **hp: Any
) -> tuple[int, Path]:
    out = dl.tmp / f"out-{name}"
    out.mkdir()
    cfg, ctx = dl.context(
        TRIAL,
        {
            "hyperparameters": {"out": str(out), **hp},
            "max_restarts": restarts,
            "searcher": {"name": "single", "metric": "loss", "max_length": 1},
            **(config or {}),
        },
        name=name,
    )
    r = dl.det("run", "--detach", cfg, ctx)
    assert r.rc == 0, r
    return int(r.out.split()[-1]), out


def kill_mid_write(dl: Env, exp_id: int, out: Path) -> Path:
    """Wait until the trial is inside its checkpoint; kill -9 its process group."""
    partial = Path(wait_for(lambda: (out / "partial").exists() and (out / "partial").read_text()))
    assert (partial / "half").exists()
    # while it is being written, nothing lists it
    r = dl.det("checkpoint", "list", exp_id)
    assert r.rc == 0 and partial.name not in r.out, r
    job = next(j for j in dl.jobs() if j.experiment_id == exp_id)
    os.killpg(dl.job_pid(job.id), signal.SIGKILL)
    return partial


def listed(dl: Env, exp_id: int, trial_id: int) -> str:
    """Every place a checkpoint could be listed: CLI list, trial describe, api."""
    text = dl.det("checkpoint", "list", exp_id).out + dl.det("trial", "describe", trial_id).out
    with contextlib.closing(dl.store()) as store:
        text += " ".join(c.uuid for c in store.list_checkpoints(experiment_id=exp_id))
    return text


def test_a_checkpoint_cut_short_is_removed_at_the_trials_next_start(dl: Env) -> None:
    dl.daemon_start(**CPU)
    exp_id, out = submit(dl, "restart", 1, ckpts=[1], block=True)
    partial = kill_mid_write(dl, exp_id, out)
    wait_for(lambda: dl.experiment(exp_id).state == State.COMPLETED, what="the restarted trial")
    trial = dl.trial(exp_id)
    assert not os.path.lexists(partial)
    assert partial.name not in listed(dl, exp_id, trial.id)
    (done,) = dl.checkpoints(trial.id)  # the complete one stays, and is what run 2 started from
    assert Path(done.path).is_dir() and done.steps_completed == 1
    assert (out / "runs").read_text().splitlines() == ["1 None", f"2 {done.uuid}"]
    assert (
        f"trial {trial.id}: removed incomplete checkpoint {partial.name} (an earlier run "
        "stopped while writing it)"
    ) in dl.events(exp_id)


def test_checkpoint_gc_removes_a_checkpoint_cut_short(dl: Env) -> None:
    dl.daemon_start(**CPU)
    exp_id, out = submit(dl, "gc", 0, block=True)
    partial = kill_mid_write(dl, exp_id, out)
    wait_for(lambda: dl.experiment(exp_id).state == State.ERROR, what="the trial to fail")
    wait_for(lambda: not os.path.lexists(partial), what="GC to remove the partial checkpoint")
    assert partial.name not in listed(dl, exp_id, dl.trial(exp_id).id)
    message = (
        f"experiment {exp_id}: checkpoint GC removed incomplete checkpoint {partial.name} "
        "(its trial stopped while writing it)"
    )
    wait_for(lambda: message in dl.events(exp_id), what="the GC's note")
    with contextlib.closing(dl.store()) as store:
        assert store.list_incomplete_checkpoints(experiment_id=exp_id) == []


def test_resuming_from_a_checkpoint_with_more_steps_says_so(dl: Env) -> None:
    """The latest checkpoint recorded (2 steps) is on disk; the trial resumes from the one with
    the most steps (5): the message says that, not that the latest is gone from disk."""
    dl.daemon_start(**CPU)
    keep = {"checkpoint_storage": {"host_path": str(dl.tmp / "ckpts"), "save_trial_latest": 2}}
    exp_id, out = submit(dl, "resume", 1, keep, ckpts=[5, 2], fail=3)
    wait_for(lambda: dl.experiment(exp_id).state == State.COMPLETED, what="the restarted trial")
    trial = dl.trial(exp_id)
    five, two = dl.checkpoints(trial.id)
    assert (five.steps_completed, two.steps_completed) == (5, 2)
    assert trial.latest_checkpoint == two.uuid and Path(two.path).is_dir()
    assert (out / "runs").read_text().splitlines()[-1] == f"2 {five.uuid}"
    events = dl.events(exp_id)
    assert not any("gone from disk" in e for e in events), events
    assert (
        f"trial {trial.id}: resuming from {five.uuid} (steps_completed=5), which has more steps "
        f"than its latest checkpoint {two.uuid} (steps_completed=2)"
    ) in events

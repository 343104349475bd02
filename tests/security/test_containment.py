"""Containment in system mode: each job in its own cgroup (kill, pause and the end of a job reach
processes that left its session), GPU fencing by the v1 devices controller, and an exit status
the root daemon trusts only from root's directory (a user's FIFO, symlink or garbage never
blocks it). A real root daemon, real users (tests/security/test_multiuser.py's accounts).
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import signal
import stat
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from det_local import api
from det_local.sched.run import cgroups, executor
from det_local.store.states import State
from tests.support.users import A, B, Shared, _submit_raw
from tests.support.world import Env, gone, kill_home_processes, wait_for

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0
    or not any(kind == "cgroup2" or "freezer" in opts for _, kind, opts in cgroups._mounts()),
    reason="containment tests need root and a cgroup hierarchy",
)


@pytest.fixture
def contained(
    dl: Env,
    accounts: None,  # noqa: F811
    request: pytest.FixtureRequest,
) -> Iterator[Shared]:
    """A root daemon on a shared home like test_multiuser's `shared`; the test's parameter
    (indirect) gives extra environment for the daemon: a cgroup mode, fake GPUs."""
    extra: dict[str, str] = dict(getattr(request, "param", {}) or {})
    base = Path(tempfile.mkdtemp(prefix="det-local-cg-", dir="/tmp"))
    os.chmod(base, 0o755)
    out = base / "out"
    out.mkdir()
    os.chmod(out, 0o1777)
    home = base / "home"
    dl.home = home
    dl.env["DET_LOCAL_HOME"] = str(home)
    env = {"DET_LOCAL_FAKE_GPUS": "0", "DET_LOCAL_CPU_SLOTS": "2", **extra}
    try:
        dl.daemon_start({"scheduler": {"preemption_timeout": 1}}, **env)
        yield Shared(dl, home, out)
    finally:
        kill_home_processes(home)
        cgroups.remove_home(home)
        shutil.rmtree(base, ignore_errors=True)


def _proc_gone(pid: int) -> bool:
    return gone(pid)


def _escaper(out: Path, name: str, *, leader_ignores_term: bool = False) -> str:
    """A script whose grandchild leaves the job's session (setsid), ignores SIGTERM, writes its
    pid to NAME.pid and runs until killed; the command itself then waits forever."""
    trap = "trap '' TERM; " if leader_ignores_term else ""
    pidfile = out / f"{name}.pid"
    return (
        f'{trap}setsid sh -c \'trap "" TERM; echo $$ > {pidfile}.tmp; mv {pidfile}.tmp {pidfile};'
        " while :; do sleep 0.05; done' & while :; do sleep 0.05; done"
    )


def _grandchild(out: Path, name: str, job_pid: int) -> int:
    pidfile = out / f"{name}.pid"
    wait_for(pidfile.exists, what="the grandchild's pid file")
    pid = int(pidfile.read_text())
    assert os.getsid(pid) != os.getsid(job_pid), "the grandchild did not leave the job's session"
    return pid


# ---------------------------------------------------------------------------- kill
@pytest.mark.parametrize(
    "contained", [{"DET_LOCAL_CGROUPS": "v2"}, {"DET_LOCAL_CGROUPS": "v1"}], indirect=True
)
def test_kill_reaches_a_grandchild_that_left_the_session(contained: Shared) -> None:
    sh = contained
    containment = sh.dl.json("daemon", "status").get("containment", {})
    wanted = sh.dl.env["DET_LOCAL_CGROUPS"]
    if containment and containment["mode"] != wanted:
        pytest.skip(f"no cgroup {wanted} hierarchy here ({containment['why']})")
    victim = sh.cmd(A, _escaper(sh.out, "gc"), slots=2)  # the whole machine
    gc = _grandchild(sh.out, "gc", sh.pid(victim))
    # waits for a slot; once it runs, it looks whether the grandchild is still there
    probe = sh.out / "probe.txt"
    waiter = sh.cmd(
        None,
        f"if [ -e /proc/{gc} ] && ! grep -q '^State:.*Z' /proc/{gc}/status; "
        f"then echo alive > {probe}; else echo gone > {probe}; fi",
    )
    assert sh.job(waiter).state == "QUEUED"
    reply = sh.as_user(A, api.control_job, "cmd_kill", {"job_id": victim})
    assert reply == f"command {victim} is being stopped"
    job = sh.wait_job(victim)
    assert job.message == "killed on request"
    assert _proc_gone(gc), "cmd kill left the grandchild that escaped with setsid running"
    sh.wait_job(waiter)
    # the slots were handed on only once the victim's cgroup was empty
    assert probe.read_text().strip() == "gone"
    cg = Path(containment["base"]) / f"job-{victim}-{job.run_id}"
    assert not cg.exists(), "the job's cgroup was not removed"


def test_a_job_that_ends_takes_its_escaped_processes_along(contained: Shared) -> None:
    sh = contained
    gate = sh.out / "gate"
    script = (
        f'setsid sh -c \'trap "" TERM HUP; echo $$ > {sh.out}/gc.pid.tmp; '
        f"mv {sh.out}/gc.pid.tmp {sh.out}/gc.pid; while :; do sleep 0.05; done' & "
        f"while [ ! -e {gate} ]; do sleep 0.02; done; exit 0"
    )
    job_id = sh.cmd(A, script)
    gc = _grandchild(sh.out, "gc", sh.pid(job_id))
    gate.touch()
    job = sh.wait_job(job_id)
    assert job.exit_code == 0
    assert _proc_gone(gc), "the job ended but its escaped grandchild runs on"


# ---------------------------------------------------------------------------- pause
def test_pause_reaches_an_escaped_descendant(contained: Shared) -> None:
    sh = contained
    ctx = sh.out / "ctx"
    ctx.mkdir()
    os.chmod(ctx, 0o755)
    config = {
        "name": "escaper",
        "entrypoint": ["sh", "-c", _escaper(sh.out, "tgc")],
        "searcher": {"name": "single", "metric": "loss", "max_length": 1},
    }
    exp = sh.as_user(A, _submit_raw, config, str(ctx))
    store = api.open_store(sh.paths)
    try:
        wait_for(lambda: store.jobs.for_trial(1) and store.jobs.for_trial(1).pid, what="trial")
        gc = _grandchild(sh.out, "tgc", store.jobs.for_trial(1).pid)
        sh.as_user(A, api.control, exp, "pause")
        # the trial never answers the preemption: SIGTERM after preemption_timeout (1 s), then
        # its leader is gone and the rest of its cgroup goes with it
        wait_for(
            lambda: (
                store.get_experiment(exp).state == State.PAUSED
                and store.jobs.for_trial(1).state != "SCHEDULED"
            ),
            what="the trial to stop",
        )
        assert _proc_gone(gc), "pause left the trial's escaped grandchild running"
    finally:
        store.close()


# ---------------------------------------------------------------------------- exit status
def _swap_exit_file(path: str, kind: str) -> str:
    """As the user: replace the job's (pre-upgrade) exit file with a FIFO, a symlink to
    /dev/zero, or garbage."""
    try:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        if kind == "fifo":
            os.mkfifo(path)
        elif kind == "devzero":
            os.symlink("/dev/zero", path)
        else:
            with open(path, "w") as f:
                f.write("hello\n")
    except PermissionError:
        return "denied"
    return "swapped"


@pytest.mark.parametrize("kind", ["fifo", "devzero"])
def test_a_swapped_exit_file_does_not_fool_or_block_a_restarted_daemon(
    contained: Shared, kind: str
) -> None:
    sh = contained
    gate = sh.out / "gate"
    job_id = sh.cmd(A, f"while [ ! -e {gate} ]; do sleep 0.02; done; exit 3")
    pid = sh.pid(job_id)
    sh.dl.kill_daemon()
    gate.touch()
    wait_for(lambda: gone(pid), what="the job to end")
    legacy = sh.paths.legacy_job_exit_file(job_id, 1)
    sh.as_user(A, _swap_exit_file, str(legacy), kind)  # the old daemon read it from here
    t0 = time.monotonic()
    r = sh.dl.det("daemon", "start", timeout=20)
    assert r.rc == 0, r
    assert time.monotonic() - t0 < 15
    job = sh.wait_job(job_id)
    assert (job.exit_code, job.message) == (
        3,
        f"command {job_id} ended while the daemon was down with exit code 3",
    )
    # and it serves
    after = sh.cmd(B, "exit 0")
    assert sh.wait_job(after).exit_code == 0


@pytest.mark.parametrize(
    ("kind", "reason"),
    [
        ("fifo", "is not a regular file; refusing to read it"),
        ("devzero", "is a symbolic link; refusing to follow it"),
        ("garbage", "does not hold an exit status: b'hello\\n'"),
    ],
)
def test_a_pre_upgrade_exit_file_is_read_bounded(contained: Shared, kind: str, reason: str) -> None:
    """A job whose only status is in the user's directory (as the wrapper of an earlier
    det-local wrote it): a FIFO, a symlink or garbage there ends the job with one line."""
    sh = contained
    job_id = sh.cmd(A, "while :; do sleep 0.05; done")
    pid = sh.pid(job_id)
    sh.dl.kill_daemon()
    os.killpg(pid, signal.SIGKILL)  # no status from the wrapper: the legacy file is all there is
    wait_for(lambda: gone(pid), what="the job to end")
    legacy = sh.paths.legacy_job_exit_file(job_id, 1)
    legacy.parent.mkdir(parents=True, exist_ok=True)
    os.chown(legacy.parent, pwd.getpwnam(A).pw_uid, -1)  # as the old daemon left it
    assert sh.as_user(A, _swap_exit_file, str(legacy), kind) == "swapped"
    r = sh.dl.det("daemon", "start", timeout=20)
    assert r.rc == 0, r
    job = sh.wait_job(job_id)
    assert job.exit_code is None
    assert job.message == (
        f"command {job_id} ended while the daemon was down; its exit status is unknown: "
        f"exit file {legacy} {reason}"
    )
    log = (sh.paths.run_dir / "daemon.log").read_text()
    assert f"det-local: job {job_id}: exit file {legacy} {reason}" in log
    after = sh.cmd(B, "exit 0")
    assert sh.wait_job(after).exit_code == 0


def test_a_job_cannot_kill_its_wrapper(contained: Shared) -> None:
    """The wrapper that writes the status stays root: the job's user cannot signal it."""
    sh = contained
    err = sh.out / "kill.err"
    job_id = sh.cmd(A, f"kill -9 $PPID 2> {err}; exit 4")
    job = sh.wait_job(job_id)
    assert job.exit_code == 4, job
    assert "Operation not permitted" in err.read_text()
    assert sh.paths.job_exit_file(job_id, 1).stat().st_uid == 0


def test_a_job_starts_only_in_a_directory_its_user_can_reach(contained: Shared) -> None:
    """The root wrapper does not enter the working directory for the user: a command asking for
    a directory its user cannot reach (behind a root-only parent) fails to start there."""
    sh = contained
    locked = sh.out.parent / "locked"
    inner = locked / "inner"
    inner.mkdir(parents=True)
    os.chmod(locked, 0o700)  # root's: the user cannot pass it
    os.chmod(inner, 0o777)  # open itself, reachable only through `locked`
    job_id = sh.cmd(A, f"touch escaped; pwd > {sh.out}/where", cwd=str(inner))
    job = sh.wait_job(job_id)
    assert job.exit_code == 125, job
    assert "cannot change directory" in sh.paths.command_log(job_id).read_text()
    assert not (inner / "escaped").exists() and not (sh.out / "where").exists()
    ok = sh.cmd(A, f"pwd > {sh.out}/where", cwd=str(sh.out))
    assert sh.wait_job(ok).exit_code == 0
    assert (sh.out / "where").read_text().strip() == str(sh.out)


def test_a_pre_upgrade_wrapper_is_still_found(tmp_path: Path) -> None:
    """find_wrapper matches the wrapper text of earlier det-local releases, so their jobs are
    adopted after an upgrade."""
    legacy = tmp_path / "exit-1"
    proc = subprocess.Popen(
        ["/bin/sh", "-c", executor._LEGACY_WRAPPER, str(legacy), "sleep", "30"],
        start_new_session=True,
    )
    try:
        found = wait_for(
            lambda: executor.find_wrapper(tmp_path / "new", legacy), what="the old wrapper"
        )
        assert found == proc.pid
        assert executor.find_wrapper(tmp_path / "new") is None
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


# ---------------------------------------------------------------------------- GPU fencing
def _fake_nodes(base: Path) -> Path:
    nodes = base / "dev"
    nodes.mkdir()
    os.chmod(nodes, 0o755)
    for minor in (0, 1):
        node = nodes / f"nvidia{minor}"
        os.mknod(node, 0o666 | stat.S_IFCHR, os.makedev(cgroups.NVIDIA_MAJOR, minor))
        os.chmod(node, 0o666)
    return nodes


@pytest.mark.parametrize("contained", [{"DET_LOCAL_FAKE_GPUS": "2"}], indirect=True)
def test_a_job_cannot_open_another_jobs_gpu(contained: Shared) -> None:
    sh = contained
    if not sh.dl.json("daemon", "status").get("containment", {"gpu_fencing": True})["gpu_fencing"]:
        pytest.skip("no v1 devices controller here: CUDA_VISIBLE_DEVICES is advisory")
    nodes = _fake_nodes(sh.out)

    def probe(tag: str) -> str:
        # the job unsets CUDA_VISIBLE_DEVICES and opens both GPUs' device nodes
        return (
            f"echo $DET_SLOT_IDS > {sh.out}/{tag}.slots; "
            f"unset CUDA_VISIBLE_DEVICES; for m in 0 1; do "
            f"(exec 3<>{nodes}/nvidia$m) 2> {sh.out}/{tag}-$m.err; done"
        )

    def opened(tag: str, minor: int) -> str:
        text = (sh.out / f"{tag}-{minor}.err").read_text()
        if "Operation not permitted" in text:
            return "fenced"
        if "No such device" in text:  # ENXIO/ENODEV: allowed, but no driver behind the node
            return "allowed"
        return text

    one = sh.cmd(A, probe("one"), slots=1)
    sh.wait_job(one)
    (own,) = json.loads((sh.out / "one.slots").read_text())
    assert opened("one", own) == "allowed"
    assert opened("one", 1 - own) == "fenced"
    both = sh.cmd(A, probe("both"), slots=2)
    sh.wait_job(both)
    assert [opened("both", m) for m in (0, 1)] == ["allowed", "allowed"]
    none = sh.cmd(B, probe("none"), slots=0)
    sh.wait_job(none)
    assert [opened("none", m) for m in (0, 1)] == ["fenced", "fenced"]


# ---------------------------------------------------------------------------- status
def test_daemon_status_reports_the_containment_mode(contained: Shared) -> None:
    sh = contained
    st = sh.dl.json("daemon", "status")["containment"]
    assert st["mode"] in (cgroups.V2, cgroups.V1)
    digest = cgroups.home_hash(sh.home)
    assert st["base"].endswith(f"/det-local/{digest}")
    r = sh.dl.det("daemon", "status")
    assert r.rc == 0
    line = [x for x in r.out.splitlines() if x.startswith("containment: ")]
    assert line == [f"containment: {st['text']}"]
    assert st["text"].startswith(f"cgroup {st['mode']} at {st['base']}; ")


@pytest.mark.parametrize(
    ("how", "env", "settings"),
    [("env", {"DET_LOCAL_CGROUPS": "0"}, {}), ("yaml", {}, {"cgroups": False})],
)
def test_daemon_status_reports_the_fallback(
    dl: Env, how: str, env: dict[str, str], settings: dict[str, Any]
) -> None:
    dl.daemon_start(settings or None, DET_LOCAL_CPU_SLOTS="1", **env)
    r = dl.det("daemon", "status")
    assert r.rc == 0
    assert (
        "containment: off (turned off by the cgroups setting); "
        "jobs are tracked by their process group"
    ) in r.out.splitlines()
    assert dl.json("daemon", "status")["containment"]["mode"] == "off"
    # jobs still run and are reaped by their process group
    job_id = dl.cmd("sh", "-c", "exit 5")
    assert dl.wait_job(job_id).exit_code == 5
    assert not (Path("/sys/fs/cgroup/unified/det-local") / cgroups.home_hash(dl.home)).exists()


# ---------------------------------------------------------------------------- which runs
def _det_local_cgroup(pid: int) -> str | None:
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        path = line.split(":", 2)[2]
        if "/det-local/" in path:
            return path
    return None


def test_auto_contains_the_runs_that_cross_a_trust_boundary(contained: Shared) -> None:
    """With `cgroups: auto`, a job the root daemon runs as another user gets a cgroup of its
    own; a job of the daemon's own user (root's) does not (nothing to fence it from, and each
    move into a cgroup waits for an RCU grace period)."""
    sh = contained
    users = sh.cmd(A, f"sleep 30; echo > {sh.out}/a-done", name="a")
    roots = sh.cmd(None, f"sleep 30; echo > {sh.out}/r-done", name="r")
    a_pid, r_pid = sh.pid(users), sh.pid(roots)
    assert wait_for(lambda: _det_local_cgroup(a_pid), what="A's job in its cgroup")
    assert _det_local_cgroup(r_pid) is None
    for job_id in (users, roots):
        sh.as_user(None, api.control_job, "cmd_kill", {"job_id": job_id})


@pytest.mark.parametrize("contained", [{"DET_LOCAL_CGROUPS": "v2"}], indirect=True)
def test_an_explicit_mode_contains_every_run(contained: Shared) -> None:
    """`cgroups: v2` (or v1) contains the daemon's own user's runs too."""
    sh = contained
    roots = sh.cmd(None, "sleep 30", name="r")
    r_pid = sh.pid(roots)
    assert wait_for(lambda: _det_local_cgroup(r_pid), what="root's job in its cgroup")
    sh.as_user(None, api.control_job, "cmd_kill", {"job_id": roots})

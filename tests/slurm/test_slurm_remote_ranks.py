"""Multi-rank trials of a Slurm pool whose compute node is not the daemon's host (issue 29):
every rank reports over the pool's TCP channel with its own rank's handshake; TensorBoard files
a staged run writes come back to the run's own info directory. slurmd runs in a mount namespace
that hides every test's directory (tests/support/slurmkit.py ``hide``), as in
tests/slurm/test_slurm_remote.py, whose recording proxy shows what crosses the wire."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest

from det_local.store.states import State
from det_local.wire import rpc
from tests.support import slurmkit
from tests.support.slurmproxy import Proxy, config, daemon_log, shared, start
from tests.support.world import Env, steps, wait_for

pytestmark = pytest.mark.slow
__all__ = ["shared"]  # the fixture, used by name


@pytest.fixture(scope="module")
def slurm(slurm_hiding_tests: slurmkit.Slurm) -> slurmkit.Slurm:
    return slurm_hiding_tests  # the folder's (tests/slurm/conftest.py)


def hellos(proxy: Proxy) -> list[dict[str, Any]]:
    """The first frame of each connection through the proxy: the trial's channel hello (plain
    msgpack: ids, nonce and MAC; never the token)."""
    found = []
    for buf in list(proxy.sent):
        data = bytes(buf)
        if len(data) < rpc.HEADER.size:
            continue
        (size,) = rpc.HEADER.unpack(data[: rpc.HEADER.size])
        if len(data) < rpc.HEADER.size + size:
            continue
        found.append(dict(msgpack.unpackb(data[rpc.HEADER.size : rpc.HEADER.size + size])))
    return found


TWO_RANKS = """
import json, os, sys, torch, torch.distributed as dist, determined as det
from determined import core
dist.init_process_group("gloo")
dctx = core.DistributedContext.from_torch_distributed()
with core.init(distributed=dctx) as c:
    t = torch.tensor([float(dctx.rank + 1)])
    dist.all_reduce(t)
    print(f"RANKLINE {dctx.rank} of {dctx.size} sum {t.item():g} "
          f"via {os.environ['DET_LOCAL_SOCKET']} hidden {os.path.exists(sys.argv[1])}",
          flush=True)
    with c.checkpoint.store_path({"steps_completed": 1}, shard=True) as (path, _):
        (path / f"w{dctx.rank}").write_text(str(dctx.rank))
    if dctx.rank == 0:
        c.train.report_training_metrics(steps_completed=1, metrics={"loss": 0.5, "sum": t.item()})
        c.train.report_validation_metrics(steps_completed=1, metrics={"loss": 0.25})
    c.preempt.should_preempt()  # every rank: the chief asks the daemon, the worker the chief
dist.destroy_process_group()
"""

RANKS = {"resources": {"resource_pool": "hpc", "slots_per_trial": 2}}


def test_two_ranks_report_over_tcp_each_with_its_own_handshake(
    dl: Env, slurm: slurmkit.Slurm, shared: Path
) -> None:
    proxy = start(dl, slurm, shared, slots_per_node=2)
    cfg = {
        **config(shared),
        **RANKS,
        "entrypoint": f"python3 -m determined.launch.torch_distributed python3 train.py {dl.home}",
    }
    cfg_path, ctx = dl.context(TWO_RANKS, cfg)
    assert dl.det("run", "--detach", cfg_path, ctx).rc == 0
    wait_for(
        lambda: dl.experiment(1).state in (State.COMPLETED, State.ERROR),
        timeout=180,
        what=f"completion\n{slurm.logs()}\n{daemon_log(dl)}",
    )
    log = dl.det("trial", "logs", "1").out
    assert dl.experiment(1).state == State.COMPLETED, log
    url = f"tcp://127.0.0.1:{proxy.port}"
    for rank in (0, 1):  # both ranks' lines, each with its prefix; neither sees the state dir
        assert f"[rank={rank}] RANKLINE {rank} of 2 sum 3 via {url} hidden False" in log, log
    ranks_only = dl.det("trial", "logs", "1", "--rank", "1").out
    assert "RANKLINE 1 of 2" in ranks_only and "RANKLINE 0 of 2" not in ranks_only
    assert [m.metrics for m in dl.metrics(1, "training")] == [{"loss": 0.5, "sum": 3.0}]
    assert [m.metrics for m in dl.metrics(1, "validation")] == [{"loss": 0.25}]
    (ckpt,) = dl.checkpoints(1)
    files = sorted(p.name for p in (shared / "ckpts" / ckpt.uuid).iterdir())
    assert "w0" in files and "w1" in files
    # every rank opened its own session over TCP, each its own handshake (ids and MAC)
    seen = hellos(proxy)
    trial = [h for h in seen if h.get("t") == "hello" and h.get("trial_id") == 1]
    assert sorted(h["rank"] for h in trial) == [0, 1], seen
    assert len({bytes(h["mac"]) for h in trial}) == 2 and len({bytes(h["nc"]) for h in trial}) == 2
    assert all("token" not in h for h in seen)
    (job,) = dl.jobs()
    assert job.state == "DONE" and job.exit_code == 0
    wait_for(lambda: list((shared / "stage").iterdir()) == [], timeout=30, what="stage cleanup")
    proxy.close()


TB_WRITER = """
import hashlib, json, os, sys, time, determined as det
from pathlib import Path
from det_local.store.tfevents import EventFileWriter
go = Path(sys.argv[1])
with det.core.init() as core:
    tb = Path(core.train.get_tensorboard_path())
    w = EventFileWriter(tb)
    w.add_scalar("Determined/loss", 1.0, 1, time.time())
    w._file.flush()
    core.train.report_training_metrics(steps_completed=1, metrics={"loss": 1.0})
    deadline = time.monotonic() + 120
    while not go.exists() and time.monotonic() < deadline:  # the test sees the first copy
        time.sleep(0.05)
    w.add_scalar("Determined/loss", 0.5, 2, time.time())  # the same file grows
    w.close()
    (tb / "sub").mkdir()
    (tb / "sub" / "trace.bin").write_bytes(os.urandom(9 * 1024 * 1024))  # over one pass
    (tb / "passwd").symlink_to("/etc/passwd")  # links, FIFOs: not copied, never followed
    (tb / "sub" / "up").symlink_to(tb.parent.parent)
    os.mkfifo(tb / "fifo")
    core.train.report_training_metrics(steps_completed=2, metrics={"loss": 0.5})
    sums = {str(p.relative_to(tb)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(tb.rglob("*")) if p.is_file() and not p.is_symlink()}
    print("TB " + json.dumps({"dir": str(tb), "sums": sums}), flush=True)
"""


def _sums(directory: Path) -> dict[str, str]:
    import hashlib

    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file() and not p.is_symlink()
    }


def test_a_staged_runs_tensorboard_files_come_back(
    dl: Env, slurm: slurmkit.Slurm, shared: Path
) -> None:
    from det_local.client.tbexport import has_event_files, trial_logdirs

    start(dl, slurm, shared)
    go = shared / "go"
    cfg, ctx = dl.context(TB_WRITER, {**config(shared), "entrypoint": f"python3 train.py {go}"})
    assert dl.det("run", "--detach", cfg, ctx).rc == 0
    local = dl.home / "experiments" / "1" / "trials" / "1" / "runs" / "1" / "tensorboard"
    # copied while the job runs: the first event file, as it is so far
    wait_for(
        lambda: list(local.glob("events.out.tfevents.*")),
        timeout=120,
        what=f"the first event file\n{slurm.logs()}\n{daemon_log(dl)}",
    )
    (first,) = local.glob("events.out.tfevents.*")
    size = first.stat().st_size
    assert size > 0 and has_event_files(dl.home / "experiments" / "1" / "trials" / "1")
    go.write_text("1")
    wait_for(lambda: dl.experiment(1).state == State.COMPLETED, timeout=120, what="completion")
    log = dl.det("trial", "logs", "1").out
    tb = json.loads(log.split("TB ", 1)[1].splitlines()[0])
    assert tb["dir"].startswith(str(shared / "stage"))  # written on the shared filesystem
    assert sorted(tb["sums"]) == [first.name, "sub/trace.bin"]
    # after the run: every file whole (the 9 MiB one over several passes), the event file grown
    wait_for(lambda: _sums(local) == tb["sums"], timeout=60, what=f"the copies {_sums(local)}")
    assert first.stat().st_size > size
    names = sorted(str(p.relative_to(local)) for p in local.rglob("*"))
    assert names == [first.name, "sub", "sub/trace.bin"]  # no link, no FIFO
    assert first.stat().st_uid == os.geteuid() and first.stat().st_mode & 0o777 == 0o644
    # `det-local tensorboard start` reads the trial's own directory (not curves from metrics)
    store = dl.store()
    try:
        ((name, logdir),) = trial_logdirs(store, dl.paths, [1])
    finally:
        store.close()
    assert (name, logdir) == ("trial_1", dl.home / "experiments" / "1" / "trials" / "1")
    wait_for(lambda: list((shared / "stage").iterdir()) == [], timeout=30, what="stage cleanup")
    go.unlink()


def test_a_two_rank_pytorch_trial_pauses_and_resumes_exactly_over_tcp(
    dl: Env, slurm: slurmkit.Slurm, shared: Path
) -> None:
    """The PyTorchTrial path (pytorch.init, the Trainer's searcher operations, progress,
    checkpoints and preemption of both ranks) over the channel: straight vs paused while at
    batch 6 and activated, bit-identical. With several ranks the Trainer sees a pause at its
    next boundary (README: validation every 4 batches here), so it stops at batch 8."""
    import torch

    from tests.support.trials.pytorch import TRAIN, final_state
    from tests.support.trials.pytorch import config as pt_config

    proxy = start(dl, slurm, shared, slots_per_node=2)
    launch = "python3 -m determined.launch.torch_distributed python3 train.py"

    def cfg(name: str, **hp: Any) -> dict[str, Any]:
        base = pt_config(name, {"batches": 12}, **hp)
        return {**base, **config(shared), **RANKS, "entrypoint": launch}

    c1, x1 = dl.context(TRAIN, cfg("straight"), name="straight")
    r = dl.det("run", c1, x1, timeout=300)
    assert r.rc == 0, f"{r}\n{dl.det('trial', 'logs', '1').out}"
    marker = shared / "holding"
    c2, x2 = dl.context(TRAIN, cfg("paused", hold_at=6, marker=str(marker)), name="paused")
    assert dl.det("run", "--detach", c2, x2).rc == 0
    wait_for(marker.exists, timeout=180, what=f"batch 6\n{daemon_log(dl)}")
    assert dl.det("experiment", "pause", 2).rc == 0
    wait_for(lambda: dl.experiment(2).state == State.PAUSED, timeout=90, what="the pause")
    wait_for(lambda: slurm.queue() == [], timeout=30, what="the job to leave squeue")
    assert dl.trial(2).steps_completed == 8
    assert [c.steps_completed for c in dl.checkpoints(2)][-1] == 8
    assert dl.det("experiment", "activate", 2).rc == 0
    wait_for(lambda: dl.experiment(2).state == State.COMPLETED, timeout=240, what="completion")
    assert steps(dl, 2, "training") == steps(dl, 1, "training")
    assert steps(dl, 2, "validation") == steps(dl, 1, "validation") == [4, 8, 12]
    a, b = final_state(dl, 1), final_state(dl, 2)
    for name, value in a["models_state_dict"][0].items():
        assert torch.equal(value, b["models_state_dict"][0][name]), name
    assert [m.metrics for m in dl.metrics(1, "validation")] == [
        m.metrics for m in dl.metrics(2, "validation")
    ]
    log = dl.det("trial", "logs", "2").out
    assert "[rank=0]" in log and "[rank=1]" in log
    # three jobs (straight, paused, resumed), two ranks each: six sessions over TCP
    trial_hellos = [h for h in hellos(proxy) if h.get("t") == "hello"]
    by_trial = sorted((h["trial_id"], h["run_id"], h["rank"]) for h in trial_hellos)
    assert by_trial == [(1, 1, 0), (1, 1, 1), (2, 1, 0), (2, 1, 1), (2, 2, 0), (2, 2, 1)]
    wait_for(lambda: list((shared / "stage").iterdir()) == [], timeout=30, what="stage cleanup")
    proxy.close()


TWO_RANK_STEPS = """
import json, sys, time, torch, torch.distributed as dist, determined as det
from determined import core
dist.init_process_group("gloo")
d = core.DistributedContext.from_torch_distributed()
info = det.get_cluster_info()
with core.init(distributed=d) as c:
    start, total = 0, 0.0
    if info.latest_checkpoint:
        with c.checkpoint.restore_path(info.latest_checkpoint) as p:
            state = json.loads((p / "state.json").read_text())
            start, total = state["step"], state["total"]
    print(f"rank {d.rank} starts after step {start}", flush=True)
    for step in range(start + 1, 31):
        t = torch.tensor([float(step * (d.rank + 1))])
        dist.all_reduce(t)
        total += t.item()
        time.sleep(0.1)
        if d.rank == 0:
            c.train.report_training_metrics(steps_completed=step, metrics={"total": total})
        stop = c.preempt.should_preempt()  # every rank, every step (a collective)
        if step % 5 == 0 or stop:
            with c.checkpoint.store_path({"steps_completed": step}, shard=True) as (p, _):
                if d.rank == 0:
                    (p / "state.json").write_text(json.dumps({"step": step, "total": total}))
        if stop:
            print(f"rank {d.rank} stops at step {step}", flush=True)
            sys.exit(0)
    if d.rank == 0:
        c.train.report_validation_metrics(steps_completed=30, metrics={"loss": 1.0, "x": total})
dist.destroy_process_group()
"""


def test_two_ranks_reach_a_time_limit_and_continue_in_a_second_job(
    dl: Env, slurm: slurmkit.Slurm, shared: Path
) -> None:
    """The batch shell's USR1 tells the engine over TCP (its own handshake, rank -1); both
    ranks of the first job see the preemption, checkpoint and end; a second job continues."""
    proxy = start(dl, slurm, shared, sbatch_args=["--time=10"], signal_lead=300, slots_per_node=2)
    launch = "python3 -m determined.launch.torch_distributed python3 train.py"
    cfg, ctx = dl.context(TWO_RANK_STEPS, {**config(shared), **RANKS, "entrypoint": launch})
    assert dl.det("run", "--detach", cfg, ctx).rc == 0
    wait_for(
        lambda: len(dl.metrics(1, "training")) >= 7,
        timeout=120,
        what=f"step 7\n{slurm.logs()}\n{daemon_log(dl)}",
    )
    (job,) = dl.jobs()
    slurm.run("scancel", "--signal=USR1", "--batch", str(job.pid))
    wait_for(lambda: dl.experiment(1).state == State.COMPLETED, timeout=180, what="completion")
    assert dl.metrics(1, "validation")[-1].metrics["x"] == 3 * sum(range(1, 31))
    trial = dl.store().get_trial(1)
    assert trial.restarts == 0 and trial.steps_completed == 30
    log = dl.det("trial", "logs", "1").out
    assert "ends soon: checkpointing to continue in a new job" in log
    stopped = [line for line in log.splitlines() if "stops at step" in line]
    assert len(stopped) == 2, log  # both ranks of the first job, at the same step
    at = int(stopped[0].rsplit(" ", 1)[1])
    assert stopped[1].endswith(f"stops at step {at}") and at >= 7
    assert f"[rank=1] rank 1 starts after step {at}" in log
    # no step trained twice or skipped: each reported once, in order, across the two jobs
    assert [m.steps_completed for m in dl.metrics(1, "training")] == list(range(1, 31))
    ids = sorted((h["run_id"], h["rank"]) for h in hellos(proxy) if h.get("t") == "hello")
    assert ids == [(1, -1), (1, 0), (1, 1), (2, 0), (2, 1)], ids
    wait_for(lambda: list((shared / "stage").iterdir()) == [], timeout=30, what="stage cleanup")
    proxy.close()


def test_tensorboard_copy_takes_only_the_users_own_files_bounded(
    tmp_path: Path, accounts: None
) -> None:
    """What a run's user left in the staged directory (or planted in its own info directory)
    is hostile to a root daemon: links and FIFOs are skipped and never followed on either side,
    another user's file is not copied, the copies are the user's; a pass copies at most its
    limit and the next goes on."""
    import pwd

    from det_local.sched.run.userfiles import Owner
    from det_local.slurm import tbcopy
    from tests.support.users import A, B

    a, b = pwd.getpwnam(A), pwd.getpwnam(B)
    owner = Owner(a.pw_uid, a.pw_gid, 0o077, None)
    staged, info = tmp_path / "staged", tmp_path / "info"
    tb = staged / "info" / "tensorboard"
    deep = tb.joinpath(*[f"d{i}" for i in range(tbcopy.MAX_DEPTH + 1)])
    deep.mkdir(parents=True)
    info.mkdir()
    big = os.urandom(3 * 1024 * 1024 + 5)
    (tb / "events.out.tfevents.1").write_bytes(big)
    (tb / "d0" / "kept").write_bytes(b"kept")
    (deep.parent / "at-the-limit").write_bytes(b"x")  # MAX_DEPTH directories down: kept
    (deep / "too-deep").write_bytes(b"x")
    (tb / "bs").write_bytes(b"not the user's")
    (tb / "shadow").symlink_to("/etc/shadow")
    os.mkfifo(tb / "fifo")
    victim = tmp_path / "victim"
    victim.write_bytes(b"root's")
    (tb / "planted").write_bytes(b"through a link?")
    (tb / "d1").mkdir()
    (tb / "d1" / "f").write_bytes(b"into a linked dir?")
    for top, dirs, files in os.walk(tmp_path):
        for name in [*dirs, *files]:
            os.chown(os.path.join(top, name), a.pw_uid, a.pw_gid, follow_symlinks=False)
    os.chown(tb / "bs", b.pw_uid, b.pw_gid)
    os.chown(victim, 0, 0)
    os.chown(tmp_path, 0, 0)
    # the user's own info dir, with links planted where the copies will go
    (info / "tensorboard").mkdir()
    os.chown(info / "tensorboard", a.pw_uid, a.pw_gid)
    (info / "tensorboard" / "planted").symlink_to(victim)
    (info / "tensorboard" / "d1").symlink_to(tmp_path)
    src = os.open(staged, os.O_RDONLY | os.O_DIRECTORY)
    dst = os.open(info, os.O_RDONLY | os.O_DIRECTORY)
    try:
        passes = []
        while True:
            moved = tbcopy.copy(src, dst, owner, 1024 * 1024)
            passes.append(moved)
            if moved == 0:
                break
        assert len(passes) >= 4 and max(passes) <= 1024 * 1024  # bounded, then goes on
        assert tbcopy.copy(src, dst, owner, 1024 * 1024) == 0  # nothing new: nothing copied
    finally:
        os.close(src)
        os.close(dst)
    out = info / "tensorboard"
    got = sorted(str(p.relative_to(out)) for p in out.rglob("*") if not p.is_symlink())
    limit = "/".join(f"d{i}" for i in range(tbcopy.MAX_DEPTH)) + "/at-the-limit"
    assert [g for g in got if not (out / g).is_dir()] == sorted(
        ["events.out.tfevents.1", "d0/kept", limit]
    )
    assert (out / "events.out.tfevents.1").read_bytes() == big
    st = (out / "events.out.tfevents.1").stat()
    assert (st.st_uid, st.st_gid, st.st_mode & 0o777) == (a.pw_uid, a.pw_gid, 0o600)
    assert (out / "d0").stat().st_uid == a.pw_uid
    assert victim.read_bytes() == b"root's" and not (tmp_path / "f").exists()
    assert (out / "planted").is_symlink() and (out / "d1").is_symlink()  # left as they were


@pytest.fixture(scope="module")
def open_hidden() -> Iterator[Path]:
    """A directory the compute node cannot see that the test users can enter (the daemon's
    home goes there: they reach its socket)."""
    import shutil
    import tempfile

    path = Path(tempfile.mkdtemp(prefix="det-local-slurmtcp2-hid-", dir="/tmp"))
    os.chmod(path, 0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def users_slurm(
    tmp_path_factory: pytest.TempPathFactory, open_hidden: Path
) -> Iterator[slurmkit.Slurm]:
    yield from slurmkit.slurm_fixture(tmp_path_factory, hide=(open_hidden,))


def test_a_users_staged_tensorboard_files_are_the_users(
    dl: Env, accounts: None, users_slurm: slurmkit.Slurm, open_hidden: Path
) -> None:
    """A root daemon, a real user's staged run (a shell command: the test users cannot start
    the venv's Python): what it writes under its tensorboard dir comes back as the user's, a
    link it leaves there does not."""
    import pwd
    import shutil
    import tempfile

    import yaml

    from det_local import api
    from tests.support.users import A, Shared
    from tests.support.world import kill_home_processes

    home = Path(tempfile.mkdtemp(prefix="home-", dir=open_hidden))
    os.chmod(home, 0o755)
    outer = Path(tempfile.mkdtemp(prefix="det-local-slurmtcp2-", dir="/tmp"))
    os.chmod(outer, 0o755)
    for sub in ("out", "stage"):
        (outer / sub).mkdir()
        os.chmod(outer / sub, 0o1777)
    dl.home = home
    dl.env["DET_LOCAL_HOME"] = str(home)
    (port,) = slurmkit._free_ports(1)
    pool = {
        "partition": "debug",
        "channel": {"listen": f"127.0.0.1:{port}"},
        "stage_dir": str(outer / "stage"),
    }
    try:
        dl.daemon_start(
            {"resource_pools": {"hpc": {"slurm": pool}}}, SLURM_CONF=str(users_slurm.conf)
        )
        shared = Shared(dl, home, outer / "out")
        ctx = shared.out / "ctx"
        ctx.mkdir()
        script = (
            'd="$DET_LOCAL_TENSORBOARD_DIR"; mkdir -p "$d/sub" && '
            'printf "event bytes" > "$d/events.out.tfevents.1.n1" && '
            'head -c 5000000 /dev/urandom > "$d/sub/trace.bin" && '
            'ln -s /etc/shadow "$d/shadow" && cd "$d" && '
            "sha256sum events.out.tfevents.1.n1 sub/trace.bin | sed 's/^/SUM /'"
        )
        cfg = {
            "name": "tb",
            "entrypoint": f"sh -c {__import__('shlex').quote(script)}",
            "max_restarts": 0,
            "resources": {"resource_pool": "hpc"},
            "searcher": {"name": "single", "metric": "loss", "max_length": 1},
        }
        (ctx / "config.yaml").write_text(yaml.safe_dump(cfg))
        os.chmod(ctx, 0o755)
        shared.as_user(A, lambda: api.run(ctx / "config.yaml", ctx, follow=False))
        wait_for(lambda: shared.job(1).state == "DONE", timeout=90, what="A's trial to end")
        assert (shared.job(1).user, shared.job(1).exit_code) == (A, 0)
        log = shared.paths.trial_log(1, 1).read_text()
        sums = {
            words[2]: words[1]
            for words in (x.split() for x in log.splitlines())
            if words[:1] == ["SUM"]
        }
        assert sorted(sums) == ["events.out.tfevents.1.n1", "sub/trace.bin"], log
        local = shared.paths.trial_info_dir(1, 1, 1) / "tensorboard"
        wait_for(
            lambda: _sums(local) == sums,
            timeout=60,
            what=f"the copies {_sums(local) if local.exists() else None}",
        )
        uid = pwd.getpwnam(A).pw_uid
        for p in [local, local / "sub", *(local / name for name in sums)]:
            assert p.stat().st_uid == uid, p
        assert not (local / "shadow").exists() and not (local / "shadow").is_symlink()
        wait_for(lambda: list((outer / "stage").iterdir()) == [], timeout=30, what="stage cleanup")
    finally:
        kill_home_processes(home)
        shutil.rmtree(home, ignore_errors=True)
        shutil.rmtree(outer, ignore_errors=True)


def test_tensorboard_copy_reads_a_bounded_number_of_names(tmp_path: Path) -> None:
    """A staged tensorboard dir of many names: a pass reads at most MAX_ENTRIES of them and
    looks at MAX_FILES files; a run's files beyond those are left out (the next pass finds
    the same ones up to date)."""
    from det_local.slurm import tbcopy

    tb = tmp_path / "staged" / "info" / "tensorboard"
    tb.mkdir(parents=True)
    (tmp_path / "info").mkdir()
    for i in range(tbcopy.MAX_ENTRIES + 500):
        (tb / f"f{i:05d}").write_bytes(b"x")
    src = os.open(tmp_path / "staged", os.O_RDONLY | os.O_DIRECTORY)
    dst = os.open(tmp_path / "info", os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert tbcopy.copy(src, dst, None, 1 << 30) == tbcopy.MAX_FILES
        assert len(list((tmp_path / "info" / "tensorboard").iterdir())) == tbcopy.MAX_FILES
        assert tbcopy.copy(src, dst, None, 1 << 30) == 0
        assert len(list((tmp_path / "info" / "tensorboard").iterdir())) == tbcopy.MAX_FILES
    finally:
        os.close(src)
        os.close(dst)


def test_two_deepspeed_ranks_report_over_tcp(dl: Env, slurm: slurmkit.Slurm, shared: Path) -> None:
    """The DeepSpeed launcher's ranks (a DeepSpeedTrial) over the channel, each its own
    handshake; both write their part of the checkpoint on the shared filesystem."""
    pytest.importorskip("deepspeed")
    from tests.support.trials.deepspeed import config as ds_config
    from tests.support.trials.deepspeed import context as ds_context

    proxy = start(dl, slurm, shared, slots_per_node=2)
    cfg = ds_config(
        dl,
        "python3 -m determined.launch.deepspeed --trial model_def:LinearDS",
        6,
        overwrite_deepspeed_args={"train_batch_size": 8},  # 2 micro x 2 steps x 2 ranks
        record=str(shared / "record.jsonl"),  # the node cannot see the test's directory
    )
    cfg_path, ctx = ds_context(dl, {**cfg, **config(shared), **RANKS})
    r = dl.det("run", cfg_path, ctx, timeout=300)
    assert r.rc == 0, (r, dl.log(1, 1)[-3000:])
    trial = dl.trial(1)
    assert trial.state == State.COMPLETED and trial.steps_completed == 6
    rows = [json.loads(x) for x in (shared / "record.jsonl").read_text().splitlines()]
    assert sorted({row["rank"] for row in rows}) == [0, 1]
    last = Path(dl.checkpoints(1)[-1].path)
    assert last.is_relative_to(shared / "ckpts")
    names = {p.name for p in last.iterdir()}
    assert {"det_state_dict_rank0.pth", "det_state_dict_rank1.pth", "model0"} <= names
    ids = sorted(h["rank"] for h in hellos(proxy) if h.get("t") == "hello")
    assert ids == [0, 1], ids
    proxy.close()


def test_tensorboard_copy_follows_a_file_rewritten(tmp_path: Path) -> None:
    """Appends are copied from where the copy ends; a file replaced by another (a new inode)
    or made shorter is copied again from its start."""
    from det_local.slurm import tbcopy

    tb = tmp_path / "staged" / "info" / "tensorboard"
    tb.mkdir(parents=True)
    (tmp_path / "info").mkdir()
    src = os.open(tmp_path / "staged", os.O_RDONLY | os.O_DIRECTORY)
    dst = os.open(tmp_path / "info", os.O_RDONLY | os.O_DIRECTORY)
    copy = tmp_path / "info" / "tensorboard" / "plugin.json"
    inodes: dict[str, int] = {}

    def step(write: Any) -> bytes:
        write()
        tbcopy.copy(src, dst, None, 1 << 20, inodes)
        return copy.read_bytes()

    try:
        f = tb / "plugin.json"
        assert step(lambda: f.write_bytes(b"first version")) == b"first version"
        with open(f, "ab") as out:
            assert step(lambda: out.write(b", appended") and out.flush()) == (
                b"first version, appended"
            )
        second = b"second, longer version written aside and renamed over it"
        tmp = tb / ".new"
        tmp.write_bytes(second)
        assert step(lambda: os.replace(tmp, f)) == second
        assert step(lambda: f.write_bytes(b"third")) == b"third"  # in place, shorter
    finally:
        os.close(src)
        os.close(dst)

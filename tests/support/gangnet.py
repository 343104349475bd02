"""Two (or more) real daemons in network namespaces running one trial across machines: the
harness tests/federation/netns/ shares (tests/support/fednet.py makes the namespaces; the `net`
fixture is in tests/federation/netns/conftest.py). Each machine has one CPU slot unless told
otherwise, joined by a cluster key and a static peer, mDNS off. The owner's and members' stores
are read directly (read-only SQLite)."""

from __future__ import annotations

import json
import os
import re
import shutil
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from det_local.federate import keys
from tests.support.fednet import Net, Node, as_submitter, cli_env, ip, reachable
from tests.support.world import wait_for

pytestmark = [
    pytest.mark.skipif(
        os.geteuid() != 0 or shutil.which("ip") is None, reason="needs root and iproute2"
    ),
    pytest.mark.slow,
]

NO_MDNS = {"DET_LOCAL_MDNS": "0"}

CORE_SCRIPT = """
import os, sys, time
import torch
import torch.distributed as dist
import determined as det
from determined import core

dist.init_process_group("gloo")
distributed = core.DistributedContext.from_torch_distributed()
with det.core.init(distributed=distributed) as ctx:
    rank, size = ctx.distributed.rank, ctx.distributed.size
    nodes = ctx.distributed.allgather(os.environ.get("DET_LOCAL_NODE_RANK"))
    word = ctx.distributed.broadcast("from-chief" if rank == 0 else None)
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    print(f"RESULT rank={rank} size={size} cross={ctx.distributed.cross_rank} "
          f"nodes={nodes} word={word} sum={t.item()}", flush=True)
    steps = int(os.environ.get("STEPS", "3"))
    start = 0
    info = det.get_cluster_info()
    if info.latest_checkpoint is not None:
        with ctx.checkpoint.restore_path(info.latest_checkpoint) as path:
            start = int((path / "step").read_text())
    for step in range(start + 1, steps + 1):
        t = torch.tensor([float(step)])
        dist.all_reduce(t)
        if rank == 0:
            ctx.train.report_training_metrics(steps_completed=step, metrics={"loss": t.item()})
            with ctx.checkpoint.store_path({"steps_completed": step}) as (path, uuid):
                (path / "step").write_text(str(step))
        time.sleep(float(os.environ.get("STEP_SLEEP", "0")))
        if ctx.preempt.should_preempt():
            print(f"rank {rank} preempted at {step}", flush=True)
            sys.exit(0)
    if rank == 0:
        ctx.train.report_validation_metrics(steps_completed=steps, metrics={"loss": 0.5})
"""


def two_nodes(net: Net, **n2_env: str) -> tuple[Node, Node]:
    key = keys.new_key()
    n1 = net.node(1, key).start(**NO_MDNS)
    n2 = net.node(2, key).start(**NO_MDNS, DET_LOCAL_PEERS="10.77.0.1:47800", **n2_env)

    def alive(node: Node, peer: str) -> bool:
        return node.states().get(peer) == "alive"

    wait_for(lambda: alive(n1, "n2") and alive(n2, "n1"), timeout=30, what="a 2-node cluster")
    return n1, n2


def experiment(
    tmp: Path, script: str = CORE_SCRIPT, env: dict[str, str] | None = None, **extra: object
) -> tuple[Path, Path]:
    ctx = tmp / "ctx"
    ctx.mkdir(exist_ok=True)
    (ctx / "train.py").write_text(textwrap.dedent(script))
    shared = tmp / "shared"
    shared.mkdir(exist_ok=True)
    shared.chmod(0o777)
    cfg = {
        "name": "gang",
        "entrypoint": "python3 -m determined.launch.torch_distributed python3 train.py",
        "resources": {"slots_per_trial": 2},
        "searcher": {"name": "single", "metric": "loss", "max_length": 3},
        "checkpoint_storage": {"type": "shared_fs", "host_path": str(shared)},
        "max_restarts": 0,
        "environment": {"environment_variables": [f"{k}={v}" for k, v in (env or {}).items()]},
        **extra,
    }
    path = tmp / "config.yaml"
    path.write_text(json.dumps(cfg))
    return path, ctx


def db(node: Node) -> sqlite3.Connection:
    return sqlite3.connect(f"file:{node.home / 'det-local.db'}?mode=ro", uri=True)


def exp_state(node: Node, exp_id: int) -> str:
    with db(node) as conn:
        row = conn.execute("SELECT state FROM experiments WHERE id=?", (exp_id,)).fetchone()
    return str(row[0]) if row else "?"


def submit(node: Node, cfg: Path, ctx: Path) -> int:
    res = node.cli("run", "--detach", str(cfg), str(ctx), timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    with db(node) as conn:
        return int(conn.execute("SELECT MAX(id) FROM experiments").fetchone()[0])


def wait_end(n1: Node, n2: Node, exp_id: int, timeout: float = 180) -> str:
    try:
        wait_for(
            lambda: exp_state(n1, exp_id) in ("COMPLETED", "ERROR", "CANCELED"),
            timeout=timeout,
            what=f"experiment {exp_id} to end",
        )
    except AssertionError:
        pytest.fail(f"experiment {exp_id} did not end\n{_story(n1, n2, exp_id)}")
    state = exp_state(n1, exp_id)
    if state != "COMPLETED":  # what led there, shown with a failed `== "COMPLETED"`
        print(f"experiment {exp_id} ended {state}\n{_story(n1, n2, exp_id)}")
    return state


def _story(n1: Node, n2: Node, exp_id: int) -> str:
    return (
        f"--- n1\n{n1.log_text()[-6000:]}\n--- n2\n{n2.log_text()[-6000:]}\n"
        f"--- trial log\n{trial_log(n1, exp_id)[-4000:]}"
    )


def trial_log(node: Node, exp_id: int) -> str:
    path = node.home / "experiments" / str(exp_id)
    logs = list(path.rglob("*.log"))
    return "\n".join(p.read_text(errors="replace") for p in logs)


def relayed(owner: Node, exp_id: int, line: str = "RESULT rank=1") -> None:
    """Wait until the owner's trial log holds `line`: a member's ranks' output reaches the
    owner every LOG_EVERY_S, later on a loaded machine, and what a machine killed -9 had not
    sent yet is gone with it. A test that kills a machine and then counts its lines waits
    here first."""
    wait_for(lambda: line in trial_log(owner, exp_id), timeout=60, what=f"{line!r} relayed")


def ns_pids(node: Node) -> list[int]:
    out = node.in_ns("true")  # the namespace exists
    assert out.returncode == 0
    res = ip("netns", "pids", node.ns, check=False)
    return [int(p) for p in res.stdout.split()]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def checkpoints(node: Node, exp_id: int) -> int:
    with db(node) as conn:
        return int(
            conn.execute(
                "SELECT COUNT(*) FROM checkpoints c JOIN trials t ON c.trial_id = t.id"
                " WHERE t.experiment_id=?",
                (exp_id,),
            ).fetchone()[0]
        )


def rank_pids(node: Node) -> list[int]:
    """The trial's processes in the node's namespace (torchrun and its workers)."""
    out = []
    for pid in ns_pids(node):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"train.py" in cmd:
            out.append(pid)
    return out


CLI = [sys.executable, "-m", "det_local.cli.main"]


def run_anywhere(node: Node, work: Path, *argv: str) -> int:
    """`cmd run --anywhere -- ARGV` on `node`, from `work`, as the ordinary submitting account
    (root's work never runs on a peer); returns the command's job id."""
    res = subprocess.run(
        [*CLI, "cmd", "run", "--anywhere", "--", *argv],
        cwd=reachable(work),
        env=cli_env(node.home),
        capture_output=True,
        text=True,
        timeout=60,
        **as_submitter(),
    )
    assert res.returncode == 0, res.stderr
    return int(res.stdout.split()[-1])


def job_row(node: Node, job: int) -> tuple[str, int | None, str | None]:
    """A job's state, exit code and message in `node`'s store."""
    with db(node) as conn:
        row = conn.execute(
            "SELECT state, exit_code, message FROM jobs WHERE id=?", (job,)
        ).fetchone()
    return (str(row[0]), row[1], row[2])


# ---------------------------------------------------------------------------- faults
# A gang trial whose ranks fail (FAIL_RANK at FAIL_AT) or go slowly (STEP_SLEEP) on demand,
# checkpointing every step, and readers of what a faulted gang left in the owner's store
# (tests/federation/netns/test_federation_gang_faults.py, test_federation_gang_lost.py).
FAULT_SCRIPT = """
import os, sys, time
import torch
import torch.distributed as dist
import determined as det
from determined import core

dist.init_process_group("gloo")
distributed = core.DistributedContext.from_torch_distributed()
with det.core.init(distributed=distributed) as ctx:
    rank = ctx.distributed.rank
    info = det.get_cluster_info()
    run_id = info.trial._trial_run_id
    steps = int(os.environ.get("STEPS", "3"))
    fail_rank, fail_at = int(os.environ.get("FAIL_RANK", "-1")), int(os.environ.get("FAIL_AT", "0"))
    start = 0
    if info.latest_checkpoint is not None:
        with ctx.checkpoint.restore_path(info.latest_checkpoint) as path:
            start = int((path / "step").read_text())
    print(f"rank {rank} run {run_id} starts after step {start}", flush=True)
    for step in range(start + 1, steps + 1):
        time.sleep(float(os.environ.get("STEP_SLEEP", "0")))
        if rank == fail_rank and step == fail_at:
            raise RuntimeError(f"rank {rank} fails at step {step}")
        if rank != 0:
            ctx.train.report_metrics("member", step, {"run": run_id})
        t = torch.tensor([float(step)])
        dist.all_reduce(t)
        if rank == 0:
            ctx.train.report_training_metrics(steps_completed=step, metrics={"loss": t.item()})
            with ctx.checkpoint.store_path({"steps_completed": step}) as (path, uuid):
                (path / "step").write_text(str(step))
        if ctx.preempt.should_preempt():
            print(f"rank {rank} preempted at {step}", flush=True)
            sys.exit(0)
    if rank == 0:
        ctx.train.report_validation_metrics(steps_completed=steps, metrics={"loss": 0.5})
"""


REQUEUED = "does not count toward max_restarts"


def restarts(node: Node) -> int:
    with db(node) as conn:
        return int(conn.execute("SELECT restarts FROM trials").fetchone()[0])


def member_jobs(node: Node) -> list[tuple[str, int | None, str]]:
    with db(node) as conn:
        return conn.execute(
            "SELECT state, exit_code, message FROM jobs WHERE kind='MEMBER' ORDER BY id"
        ).fetchall()


def finished_once(node: Node, steps: int) -> None:
    """Completed once: one validation, training steps 1..steps each run resuming where its
    predecessor checkpointed, no restart used."""
    with db(node) as conn:
        val = conn.execute("SELECT COUNT(*) FROM metrics WHERE grp='validation'").fetchone()[0]
        rows = conn.execute(
            "SELECT run_id, steps_completed FROM metrics WHERE grp='training' ORDER BY id"
        ).fetchall()
        state = conn.execute("SELECT state FROM trials").fetchone()[0]
    assert val == 1 and state == "COMPLETED", (val, state)
    assert {s for _, s in rows} == set(range(1, steps + 1)), rows
    by_run: dict[int, list[int]] = {}
    for run_id, step in rows:
        by_run.setdefault(run_id, []).append(step)
    for run_steps in by_run.values():
        assert run_steps == list(range(run_steps[0], run_steps[0] + len(run_steps))), by_run
    assert restarts(node) == 0


def resumed_after(node: Node, exp_id: int) -> list[int]:
    """The steps each placement of rank 0 started after (its checkpoint)."""
    return [
        int(m)
        for m in re.findall(r"rank 0 run \d+ starts after step (\d+)", trial_log(node, exp_id))
    ]

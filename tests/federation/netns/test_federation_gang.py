"""One trial across two machines (cross-machine gangs), each machine a real `det-local daemon`
in its own network namespace with one CPU slot, joined by a cluster key and a static peer.

The trial asks for 2 slots: its ranks run on both machines under torch.distributed.run with
--nnodes 2; the owner (n1) records its metrics and checkpoints and shows every rank's log.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import sqlite3
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from det_local.federate import keys
from tests.support.fednet import Net, Node, interpreter_reachable, namespaces, sweep
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


@pytest.fixture
def net(tmp_path: Path, accounts: None) -> Iterator[Net]:
    """Namespaced machines; work is submitted as an ordinary account (`fednet.submitter`)."""
    sweep()
    with Net(tmp_path) as n, interpreter_reachable():
        yield n
    assert not [ns for ns in namespaces() if ns.startswith(n.prefix)]


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
        pytest.fail(
            f"experiment {exp_id} did not end\n--- n1\n{n1.log_text()[-6000:]}\n--- n2\n"
            f"{n2.log_text()[-6000:]}\n--- trial log\n{trial_log(n1, exp_id)[-4000:]}"
        )
    return exp_state(n1, exp_id)


def trial_log(node: Node, exp_id: int) -> str:
    path = node.home / "experiments" / str(exp_id)
    logs = list(path.rglob("*.log"))
    return "\n".join(p.read_text(errors="replace") for p in logs)


def test_core_api_trial_across_two_machines(net: Net, tmp_path: Path) -> None:
    n1, n2 = two_nodes(net)
    # refused before anything starts: a size no set of machines fits; storage not shared
    cfg, ctx = experiment(tmp_path, resources={"slots_per_trial": 3})
    res = n1.cli("run", "--detach", str(cfg), str(ctx))
    assert res.returncode != 0 and "3 slots cannot be fitted" in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1
    cfg, ctx = experiment(
        tmp_path, checkpoint_storage={"type": "directory", "container_path": "/tmp"}
    )
    res = n1.cli("run", "--detach", str(cfg), str(ctx))
    assert "needs type shared_fs" in res.stderr, res.stderr
    cfg, ctx = experiment(tmp_path)
    exp_id = submit(n1, cfg, ctx)
    wait_end(n1, n2, exp_id, timeout=90)
    log = trial_log(n1, exp_id)
    assert exp_state(n1, exp_id) == "COMPLETED", log + n1.log_text() + n2.log_text()
    # ranks 0 and 1 on different nodes, collectives right, both ranks' output on the owner
    assert "RESULT rank=0 size=2 cross=0 nodes=['0', '1'] word=from-chief sum=3.0" in log
    assert "RESULT rank=1 size=2 cross=1 nodes=['0', '1'] word=from-chief sum=3.0" in log
    assert "[rank=1]" in log and "[rank=0]" in log
    with db(n1) as conn:
        metrics = conn.execute("SELECT COUNT(*) FROM metrics").fetchone()[0]
        ckpts = conn.execute("SELECT COUNT(*) FROM checkpoints").fetchone()[0]
    assert metrics >= 4 and ckpts == 3  # checkpoint GC keeps the best one; all are recorded
    # the member's share ran as an ordinary job of n2's queue, and is done
    with db(n2) as conn:
        rows = conn.execute("SELECT kind, state, exit_code FROM jobs").fetchall()
    assert rows == [("MEMBER", "DONE", 0)], rows


def ns_pids(node: Node) -> list[int]:
    out = node.in_ns("true")  # the namespace exists
    assert out.returncode == 0
    from tests.support.fednet import ip

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


def test_member_killed_mid_training_requeues_without_using_max_restarts(
    net: Net, tmp_path: Path
) -> None:
    n1, n2 = two_nodes(net)
    cfg, ctx = experiment(tmp_path, env={"STEPS": "40", "STEP_SLEEP": "0.4"})
    exp_id = submit(n1, cfg, ctx)
    wait_for(lambda: checkpoints(n1, exp_id) >= 2, timeout=90, what="two checkpoints")
    survivors = rank_pids(n1)
    assert survivors
    t0 = time.monotonic()
    for pid in ns_pids(n2):  # the member's daemon and its ranks, kill -9
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    wait_for(
        lambda: not any(alive(p) for p in survivors), timeout=20, what="the owner's ranks to stop"
    )
    stopped = time.monotonic() - t0
    assert stopped <= 15.0, stopped
    # requeued (waiting for a second machine), not failed; max_restarts (0) untouched
    wait_for(
        lambda: "does not count toward max_restarts" in n1.log_text(),
        timeout=20,
        what="the requeue",
    )
    assert exp_state(n1, exp_id) == "ACTIVE"
    with db(n1) as conn:
        restarts = conn.execute("SELECT restarts FROM trials").fetchone()[0]
    assert restarts == 0
    res = n1.cli("job", "list")
    assert "waiting for machines" in res.stdout or "QUEUED" in res.stdout, res.stdout
    # the machine comes back: the trial is placed again and resumes from its checkpoint
    n2.start()
    assert wait_end(n1, n2, exp_id, timeout=150) == "COMPLETED"
    log = trial_log(n1, exp_id)
    assert log.count("RESULT rank=1") == 2  # two placements, each with a rank on n2
    with db(n1) as conn:
        steps = [r[0] for r in conn.execute("SELECT steps_completed FROM metrics")]
    assert max(steps) == 40


def test_pause_and_activate_reach_every_node(net: Net, tmp_path: Path) -> None:
    n1, n2 = two_nodes(net)
    cfg, ctx = experiment(tmp_path, env={"STEPS": "30", "STEP_SLEEP": "0.3"})
    exp_id = submit(n1, cfg, ctx)
    wait_for(lambda: checkpoints(n1, exp_id) >= 1, timeout=90, what="a checkpoint")
    res = n1.cli("experiment", "pause", str(exp_id))
    assert res.returncode == 0, res.stderr
    wait_for(lambda: exp_state(n1, exp_id) == "PAUSED", timeout=40, what="paused")
    assert "preempted at" in trial_log(n1, exp_id)
    with db(n2) as conn:
        rows = conn.execute("SELECT state FROM jobs").fetchall()
    assert rows == [("DONE",)], rows
    assert not rank_pids(n1) and not rank_pids(n2)
    res = n1.cli("experiment", "activate", str(exp_id))
    assert res.returncode == 0, res.stderr
    assert wait_end(n1, n2, exp_id, timeout=150) == "COMPLETED"
    with db(n1) as conn:
        steps = [r[0] for r in conn.execute("SELECT steps_completed FROM metrics")]
        restarts = conn.execute("SELECT restarts FROM trials").fetchone()[0]
    assert max(steps) == 30 and restarts == 0


def test_two_owners_place_two_machine_gangs_at_once(net: Net, tmp_path: Path) -> None:
    n1, n2 = two_nodes(net)
    a_dir, b_dir = tmp_path / "a", tmp_path / "b"
    a_dir.mkdir()
    b_dir.mkdir()
    cfg_a, ctx_a = experiment(a_dir, env={"STEPS": "3", "STEP_SLEEP": "0.5"})
    cfg_b, ctx_b = experiment(b_dir, env={"STEPS": "3", "STEP_SLEEP": "0.5"})
    import threading

    ids: dict[str, int] = {}
    threads = [
        threading.Thread(target=lambda: ids.__setitem__("a", submit(n1, cfg_a, ctx_a))),
        threading.Thread(target=lambda: ids.__setitem__("b", submit(n2, cfg_b, ctx_b))),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert wait_end(n1, n2, ids["a"], timeout=200) == "COMPLETED"
    assert wait_end(n2, n1, ids["b"], timeout=200) == "COMPLETED"
    # one order everywhere: the gangs ran one after the other, never both holding a machine
    with db(n1) as conn:
        a = conn.execute("SELECT started_at, ended_at FROM jobs WHERE kind='TRIAL'").fetchone()
    with db(n2) as conn:
        b = conn.execute("SELECT started_at, ended_at FROM jobs WHERE kind='TRIAL'").fetchone()
    first, second = sorted([a, b])
    assert first[1] <= second[0] + 0.5, (a, b)

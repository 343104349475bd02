"""Trials over two Slurm nodes: each slurmd in its own network namespace with its own hostname
(tests/support/slurmnodes.py), the daemon on the host submitting with `sbatch`. A 2-slot
torch_distributed trial on a pool of 1 slot per node runs one launcher per node through `srun`,
the rendezvous on the allocation's first host over the bridge; both ranks train, report over
the daemon's Unix socket (reachable from the namespaces through the filesystem), checkpoint and
complete, and learn exactly what one slot of this machine learns; a Core API trial over both
nodes (allgather, sharded checkpoints) pauses and resumes exactly."""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from det_local.slurm import node
from det_local.store.states import State
from tests.support import slurmnodes
from tests.support.paths import FIXTURES
from tests.support.trials.nodes import CORE, core_config, core_lines
from tests.support.users import A, Shared
from tests.support.world import Env, kill_home_processes, wait_for

# the module's Slurm is two slurmd in network namespaces (its few unit tests are marked too, so
# that a test added here that uses `slurm` is)
pytestmark = pytest.mark.netns

DDP = FIXTURES / "ddp_trial.py"
# each rank says where it runs (its node's hostname and the DET_AGENT_ID the script gave it)
WHERE = (
    "import os, socket\n"
    "print(f\"NODE rank={os.environ['RANK']} host={socket.gethostname()} "
    "agent={os.environ['DET_AGENT_ID']} chief={os.environ['DET_CHIEF_IP']} "
    "ifname={os.environ.get('GLOO_SOCKET_IFNAME')}\", flush=True)\n"
)


@pytest.fixture(scope="module")
def slurm() -> Iterator[slurmnodes.Nodes]:
    reason = slurmnodes.skip_reason()
    if reason:
        pytest.skip(reason)
    root = Path(tempfile.mkdtemp(prefix="det-local-slurmn-", dir="/tmp"))
    root.chmod(0o755)
    try:
        with slurmnodes.cluster(root) as cluster:
            yield cluster
    finally:
        shutil.rmtree(root, ignore_errors=True)


def start_daemon(dl: Env, slurm: slurmnodes.Nodes) -> None:
    pools = {"resource_pools": {"hpc": {"slurm": {"partition": "debug", "slots_per_node": 1}}}}
    # one CPU slot of this machine for the default pool (the 1-slot reference run)
    dl.daemon_start(
        pools, SLURM_CONF=str(slurm.conf), DET_LOCAL_FAKE_GPUS="0", DET_LOCAL_CPU_SLOTS="1"
    )


def ddp_config(**extra: Any) -> dict[str, Any]:
    return {
        "name": "ddp-2-node",
        "hyperparameters": {"global_batch_size": 32},
        "resources": {"slots_per_trial": 2, "resource_pool": "hpc"},
        "reproducibility": {"experiment_seed": 7},
        "searcher": {
            "name": "single",
            "metric": "validation_loss",
            "smaller_is_better": True,
            "max_length": 24,
        },
        "entrypoint": "python3 -m determined.launch.torch_distributed python3 train.py",
        "max_restarts": 0,
        **extra,
    }


def where(text: str) -> dict[int, dict[str, str]]:
    """rank -> {host, agent, chief, ifname} from the ranks' NODE lines."""
    found = {}
    pattern = r"NODE rank=(\d) host=(\S+) agent=(\S+) chief=(\S+) ifname=(\S+)"
    for m in re.finditer(pattern, text):
        found[int(m.group(1))] = dict(
            zip(("host", "agent", "chief", "ifname"), m.groups()[1:], strict=True)
        )
    return found


@pytest.mark.slow
def test_torch_distributed_trial_over_two_nodes(dl: Env, slurm: slurmnodes.Nodes) -> None:
    start_daemon(dl, slurm)
    cfg, ctx = dl.context(WHERE + DDP.read_text(), ddp_config(), name="ddp")
    r = dl.det("run", cfg, ctx, timeout=300)
    assert r.rc == 0, (r, slurm.logs())
    assert "Experiment 1 (ddp-2-node) COMPLETED" in r.out, r
    trial = dl.store().get_trial(1)
    assert trial.state == State.COMPLETED and trial.steps_completed == 24
    assert [m.steps_completed for m in dl.metrics(1, "validation")] == [8, 16, 24]
    assert len(dl.checkpoints(1)) >= 1
    (job,) = dl.jobs()
    shown = slurm.run("scontrol", "show", "job", str(job.pid)).stdout
    assert "NumNodes=2" in shown and "NodeList=dln[1-2]" in shown, shown
    # `trial logs` shows both ranks' lines, each from its own node
    logs = dl.det("trial", "logs", 1).out
    ranks = where(logs)
    assert sorted(ranks) == [0, 1], logs
    assert {ranks[0]["host"], ranks[1]["host"]} == set(slurmnodes.NODES)
    assert all(r["agent"] == r["host"] for r in ranks.values())  # DET_AGENT_ID: its node
    # the rendezvous: the first host's bridge address, on both nodes
    assert {r["chief"] for r in ranks.values()} == {f"{slurm.subnet}.1"}
    assert ranks[0]["host"] == "dln1"
    # gloo on each node's bridge interface (left alone it binds the address the hostname
    # resolves to; these names resolve nowhere, so it fell back to loopback and never met)
    assert {r["ifname"] for r in ranks.values()} == {"eth0"}
    assert "[rank=1]" in logs and "[rank=0]" in logs
    assert slurm.queue() == []

    # the same experiment on 1 slot of this machine learns the same (gradients were averaged
    # across the two nodes: the global batch of 32 split 16 + 16)
    from tests.support.trials.ddp import final_weights

    one = {**ddp_config(name="ddp-1-slot"), "resources": {"slots_per_trial": 1}}
    cfg, ctx = dl.context(WHERE + DDP.read_text(), one, name="ddp1")
    r = dl.det("run", cfg, ctx, timeout=300)
    assert r.rc == 0 and "Experiment 2 (ddp-1-slot) COMPLETED" in r.out, r
    val2, val1 = dl.metrics(1, "validation"), dl.metrics(2, "validation")
    for a, b in zip(val2, val1, strict=True):
        assert a.metrics["validation_loss"] == pytest.approx(b.metrics["validation_loss"], rel=1e-5)
        assert a.metrics["accuracy"] == pytest.approx(b.metrics["accuracy"], abs=1e-6)
    weights2, weights1 = final_weights(dl, 1), final_weights(dl, 2)
    assert weights2.keys() == weights1.keys()
    for name, w in weights2.items():
        torch.testing.assert_close(w, weights1[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.slow
def test_core_api_trial_over_two_nodes_pauses_and_resumes(dl: Env, slurm: slurmnodes.Nodes) -> None:
    start_daemon(dl, slurm)
    batches = 12
    cfg, ctx = dl.context(CORE, core_config({"batches": batches, "ckpt_every": 4, "hold_at": 6}))
    assert dl.det("run", "--detach", cfg, ctx).rc == 0
    follow = dl.start("trial", "logs", "-f", 1)  # until the trial stops or pauses
    wait_for(lambda: dl.store().get_trial(1).steps_completed >= 6, timeout=120, what="batch 6")
    (first,) = [j.pid for j in dl.jobs() if j.pid]
    assert str(first) in slurm.queue()
    assert dl.det("experiment", "pause", 1).out.strip() == "experiment 1 paused"
    wait_for(lambda: dl.experiment(1).state == State.PAUSED, timeout=90, what="the pause")
    wait_for(lambda: slurm.queue() == [], timeout=30, what="both nodes' job to leave squeue")
    wait_for(
        lambda: slurm.node_processes() == {n: [] for n in slurmnodes.NODES},
        timeout=30,
        what="nothing left running on the nodes but slurmd",
    )
    assert dl.store().get_trial(1).steps_completed == 6
    # `trial logs -f` followed every rank, on both nodes
    followed = follow.wait(timeout=60)
    assert followed.rc == 0, followed
    assert sorted((d["rank"], d["host"]) for d in core_lines(followed.out)) == [
        ("0", "dln1"),
        ("1", "dln2"),
    ], followed
    assert dl.det("experiment", "activate", 1).rc == 0
    wait_for(lambda: dl.experiment(1).state == State.COMPLETED, timeout=180, what="completion")
    only = dl.det("trial", "logs", 1, "--rank", 1).out
    assert [d["rank"] for d in core_lines(only)] == ["1", "1"], only
    trial = dl.store().get_trial(1)
    assert trial.state == State.COMPLETED and trial.steps_completed == batches
    # every batch once, on both ranks: x = 2 * (1 + ... + 12)
    assert dl.metrics(1, "validation")[-1].metrics["x"] == 2 * sum(range(1, batches + 1))
    assert [m.steps_completed for m in dl.metrics(1, "training")] == list(range(1, batches + 1))
    # two Slurm jobs, each over both nodes; allgather saw both hostnames in each
    logs = dl.det("trial", "logs", 1).out
    lines = core_lines(logs)
    assert sorted((d["start"], d["rank"], d["host"]) for d in lines) == [
        ("0", "0", "dln1"),
        ("0", "1", "dln2"),
        ("6", "0", "dln1"),
        ("6", "1", "dln2"),
    ], lines
    assert {d["hosts"] for d in lines} == {"dln1,dln2"}
    # get_cluster_info() on each node: its agent and rank, both nodes' addresses and slots
    # (dln2's name resolves nowhere here: it stays a name)
    seen = [json.loads(line.split("INFO ", 1)[1]) for line in logs.splitlines() if "INFO [" in line]
    chief = f"{slurm.subnet}.1"
    assert sorted(map(json.dumps, seen)) == sorted(
        json.dumps([host, rank, [chief, "dln2"], [1, 1]])
        for host, rank in (("dln1", 0), ("dln2", 1))
        for _ in range(2)  # both runs
    ), seen
    assert len(list(dl.home.glob("experiments/1/trials/1/runs/*/slurm-batch.sh"))) == 2
    # each checkpoint (4, 6 at the pause, 8, 12) holds both nodes' shards
    ckpts = dl.checkpoints(1)
    assert [c.steps_completed for c in ckpts] == [4, 6, 8, 12]
    for ckpt in ckpts:
        assert {"rank0.json", "rank1.json"} <= set(ckpt.resources), ckpt
    assert slurm.queue() == []


@pytest.mark.slow
def test_two_node_trial_at_its_time_limit_continues_in_a_second_job(
    dl: Env, slurm: slurmnodes.Nodes
) -> None:
    """Slurm's time-limit signal (USR1 to the batch shell on the first node, sent here with
    `scancel --signal=USR1 --batch` as Slurm does at the lead): both ranks checkpoint, and a
    second 2-node job continues the trial without spending max_restarts."""
    start_daemon(dl, slurm)
    cfg, ctx = dl.context(CORE, core_config({"batches": 10, "ckpt_every": 4, "hold_at": 6}))
    assert dl.det("run", "--detach", cfg, ctx).rc == 0
    wait_for(lambda: dl.store().get_trial(1).steps_completed >= 6, timeout=120, what="batch 6")
    (first,) = [j.pid for j in dl.jobs() if j.pid]
    slurm.run("scancel", "--signal=USR1", "--batch", str(first))
    wait_for(lambda: dl.experiment(1).state == State.COMPLETED, timeout=180, what="completion")
    trial = dl.store().get_trial(1)
    assert trial.steps_completed == 10 and trial.restarts == 0
    assert dl.metrics(1, "validation")[-1].metrics["x"] == 2 * sum(range(1, 11))
    lines = core_lines(dl.log(1, 1))
    assert sorted((d["start"], d["host"]) for d in lines) == [
        ("0", "dln1"),
        ("0", "dln2"),
        ("6", "dln1"),
        ("6", "dln2"),
    ], lines
    assert len(list(dl.home.glob("experiments/1/trials/1/runs/*/slurm-batch.sh"))) == 2
    assert any("reaches its time limit soon" in e for e in dl.events(1))
    assert slurm.queue() == []


@pytest.mark.slow
def test_two_node_trials_killed_or_failing_leave_nothing(dl: Env, slurm: slurmnodes.Nodes) -> None:
    """kill: scancel takes both nodes' ranks; a rank failing on the second node ends the job
    on both (srun --kill-on-bad-exit) and the trial errors. Nothing is left in squeue or on
    the nodes either way."""
    start_daemon(dl, slurm)
    empty = {n: [] for n in slurmnodes.NODES}
    cfg, ctx = dl.context(CORE, core_config({"batches": 4, "ckpt_every": 4, "hold_at": 1}))
    assert dl.det("run", "--detach", cfg, ctx).rc == 0
    wait_for(lambda: len(core_lines(dl.log(1, 1))) == 2, timeout=120, what="both ranks up")
    assert dl.det("experiment", "kill", 1).out.strip() == "experiment 1 killed"
    wait_for(lambda: dl.experiment(1).state == State.CANCELED, timeout=60, what="the kill")
    wait_for(lambda: slurm.queue() == [], timeout=30, what="squeue to be empty")
    wait_for(lambda: slurm.node_processes() == empty, timeout=30, what="the nodes to be empty")

    hp = {"batches": 4, "ckpt_every": 4, "hold_at": 0, "fail_rank": 1}
    cfg, ctx = dl.context(CORE, core_config(hp), name="bad")
    r = dl.det("run", cfg, ctx, timeout=180)
    assert r.rc == 1 and "Experiment 2 (core-2-node) ERROR" in r.out, r
    trial = dl.store().get_trial(2)
    assert trial.state == State.ERROR and trial.steps_completed == 0
    (job,) = [j for j in dl.jobs() if j.trial_id == 2]
    # the first failure is rank 1's on dln2 (its own exit 3), not srun's status (the highest of
    # the tasks', often 143: the other node's, stopped by srun): each node's step wrote its exit
    # and the batch shell and the daemon picked the first failing one
    named = f"rank 1 on node dln2 (node rank 1 of Slurm job {job.pid}) failed first"
    records = [p.read_text() for p in dl.home.glob("experiments/2/trials/2/runs/*/slurm-rank-*")]
    assert trial.message == (
        f"trial 2 exited with code 3: {named}; see `det-local trial logs 2`"
    ), (trial.message, records, dl.log(2, 2))
    assert job.exit_code == 3, job
    log = dl.log(2, 2)
    assert "det-local: rank 1 exited with code 3" in log, log
    assert "srun: error: dln2: task 1: Exited with exit code" in log, log
    assert f"det-local: {named}: exited with code 3" in log, log
    # Slurm's own record has the rank's code too (the batch shell exited with it)
    shown = slurm.run("scontrol", "show", "job", str(job.pid)).stdout
    assert "ExitCode=3:0" in shown or "Invalid job id" in shown, shown
    assert slurm.queue() == []
    wait_for(lambda: slurm.node_processes() == empty, timeout=30, what="the nodes to be empty")


@pytest.mark.slow
@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("useradd") is None or shutil.which("runuser") is None,
    reason="real users: needs root, useradd and runuser",
)
def test_a_users_two_node_trial_runs_as_them_on_both_nodes(
    dl: Env, accounts: None, slurm: slurmnodes.Nodes
) -> None:
    """A root daemon submits a user's 2-slot trial as that user (`runuser -u USER -- sbatch`):
    one Slurm job of theirs, and the trial's command runs as them on both nodes."""
    import pwd

    from det_local import api
    from tests.support.reach import python_reachable

    base = Path(tempfile.mkdtemp(prefix="det-local-slurmn-", dir="/tmp"))
    try:
        base.chmod(0o755)
        out = base / "out"
        out.mkdir()
        out.chmod(0o1777)
        home = base / "home"
        dl.home = home
        dl.env["DET_LOCAL_HOME"] = str(home)
        dl.daemon_start(
            {"resource_pools": {"hpc": {"slurm": {"partition": "debug"}}}},
            SLURM_CONF=str(slurm.conf),
        )
        shared = Shared(dl, home, out)
        ctx = out / "ctx"
        ctx.mkdir()
        who = out / "who.txt"
        (ctx / "config.yaml").write_text(
            "name: a-exp\n"
            'entrypoint: echo "$(id -un) $(hostname) $DET_LOCAL_NODE_RANK $SLURM_JOB_ID"'
            f" >> {who}\n"
            "max_restarts: 0\nresources: {resource_pool: hpc, slots_per_trial: 2}\n"
            "searcher: {name: single, metric: loss, max_length: 1}\n"
        )
        ctx.chmod(0o755)
        with python_reachable(
            on_blocked=pytest.skip
        ):  # srun runs det_local.slurm.node as A on each node
            shared.as_user(A, lambda: api.run(ctx / "config.yaml", ctx, follow=False))
            wait_for(lambda: shared.job(1).state == "DONE", timeout=90, what="A's trial")
        job = shared.job(1)
        assert (job.user, job.exit_code) == (A, 0), (job, who.read_text())
        lines = sorted(who.read_text().split("\n")[:-1])
        assert lines == [f"{A} dln1 0 {job.pid}", f"{A} dln2 1 {job.pid}"], lines
        shown = slurm.run("scontrol", "show", "job", str(job.pid)).stdout
        assert f"UserId={A}({pwd.getpwnam(A).pw_uid})" in shown and "NumNodes=2" in shown
    finally:
        kill_home_processes(base / "home")
        shutil.rmtree(base, ignore_errors=True)


@pytest.mark.slow
def test_deepspeed_trial_over_two_nodes(dl: Env, slurm: slurmnodes.Nodes) -> None:
    """DeepSpeed's launcher on each node (no hostfile over several nodes: torchrun's
    rendezvous on the chief); each rank trains its own shard and writes its part."""
    pytest.importorskip("deepspeed")
    from tests.support.trials.deepspeed import config, context, records

    start_daemon(dl, slurm)
    cfg_dict = config(
        dl,
        "python3 -m determined.launch.deepspeed --trial model_def:LinearDS",
        6,
        overwrite_deepspeed_args={"train_batch_size": 8},  # 2 micro x 2 steps x 2 ranks
    )
    cfg_dict["resources"] = {"slots_per_trial": 2, "resource_pool": "hpc"}
    cfg, ctx = context(dl, cfg_dict)
    r = dl.det("run", cfg, ctx, timeout=300)
    assert r.rc == 0, (r, dl.log(1, 1)[-3000:])
    trial = dl.store().get_trial(1)
    assert trial.state == State.COMPLETED and trial.steps_completed == 6
    rows = records(dl)
    for rank in (0, 1):
        mine = [r for r in rows if r["rank"] == rank]
        assert [r["batch"] for r in mine] == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5]
        assert {r["node_rank"] for r in mine} == {str(rank)}  # rank N on node N
    # each rank in its own node's network namespace
    assert len({r["netns"] for r in rows}) == 2
    assert slurm.queue() == []


@pytest.mark.slow
def test_a_one_node_trials_cluster_info_is_its_nodes(dl: Env, slurm: slurmnodes.Nodes) -> None:
    """get_cluster_info() in a 1-slot trial on a Slurm node: that node's agent, rank 0 of one
    node holding its slot (not the daemon's machine, where it holds none)."""
    start_daemon(dl, slurm)
    probe = (
        "import json, determined as det\n"
        "i = det.get_cluster_info()\n"
        "seen = [i.agent_id, i.container_rank, i.container_addrs, i.container_slot_counts,"
        " i.slot_ids]\n"
        "print('INFO ' + json.dumps(seen), flush=True)\n"
    )
    cfg, ctx = dl.context(probe, {"resources": {"resource_pool": "hpc"}})
    r = dl.det("run", cfg, ctx, timeout=120)
    assert r.rc == 0, r
    agent, rank, addrs, counts, slots = json.loads(r.out.split("INFO ", 1)[1].splitlines()[0])
    assert agent in slurmnodes.NODES and (rank, addrs, counts, slots) == (
        0,
        ["127.0.0.1"],
        [1],
        [0],
    )


def test_the_node_step_environment_from_slurms() -> None:
    """What det_local.slurm.node gives a node's launcher: the chief from
    SLURM_LAUNCH_NODE_IPADDR, the node rank and count from Slurm, the interface toward the
    chief (here loopback), an interface the experiment set kept."""
    import socket

    step = {
        "SLURM_LAUNCH_NODE_IPADDR": "127.0.0.1",
        "SLURM_NNODES": "2",
        "SLURM_NODEID": "1",
        "DET_SLOT_IDS": "[0, 1]",
    }
    env = node.node_env(step)
    assert json.loads(env.pop("DET_LOCAL_NODE_INFO")) == {
        "agent_id": socket.gethostname(),
        "container_addrs": ["127.0.0.1", "node1"],  # no SLURM_JOB_NODELIST to name node 1
        "container_rank": 1,
        "container_slot_counts": [2, 2],
    }
    assert env == {
        "DET_CHIEF_IP": "127.0.0.1",
        "DET_LOCAL_NNODES": "2",
        "DET_LOCAL_NODE_RANK": "1",
        "DET_AGENT_ID": socket.gethostname(),
        "GLOO_SOCKET_IFNAME": "lo",
        "NCCL_SOCKET_IFNAME": "lo",
        "TP_SOCKET_IFNAME": "lo",
    }
    env = node.node_env({**step, "NCCL_SOCKET_IFNAME": "ib0"})
    assert "NCCL_SOCKET_IFNAME" not in env and env["GLOO_SOCKET_IFNAME"] == "lo"


def test_the_node_step_without_a_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert node.main(["--"]) == 2
    assert capsys.readouterr().err == (
        "det-local: error: slurm.node: no command to run\n"
        "usage: python3 -m det_local.slurm.node -- CMD...\n"
    )


def test_a_malformed_node_info_is_ignored(monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    from det_local.wire import trialinfo

    for bad in ("{", "[]", '{"container_addrs": ["a"], "container_rank": 3}'):
        info = SimpleNamespace(agent_id="here", _rendezvous_info=None)
        monkeypatch.setenv("DET_LOCAL_NODE_INFO", bad)
        trialinfo._node_overlay(info)  # type: ignore[arg-type]
        assert (info.agent_id, info._rendezvous_info) == ("here", None)


def test_the_bridge_takes_a_subnet_no_other_run_uses(slurm: slurmnodes.Nodes) -> None:
    """Each run's bridge is a 10.77.X.0/24 the host does not use yet (chosen under a lock), so
    a second run of these tests at once gets another X; fednet's namespaced nets keep X = 0."""
    x = int(slurm.subnet.rsplit(".", 1)[1])
    assert 1 <= x <= 254 and slurm.host_addr == f"{slurm.subnet}.254"
    used = slurmnodes.used_subnets()
    assert slurm.subnet in used  # this run's host veth
    second = slurmnodes.free_subnet(used, x - 1)  # a second run starting its search at ours
    assert second != slurm.subnet and second not in used
    assert slurmnodes.free_subnet({"10.77.1", "10.77.2"}, 0) == "10.77.3"
    assert slurmnodes.free_subnet({"10.77.254"}, 253) == "10.77.1"  # wraps
    with pytest.raises(RuntimeError, match="no free /24 in 10.77.1-254.0"):
        slurmnodes.free_subnet({f"10.77.{i}" for i in range(1, 255)}, 0)

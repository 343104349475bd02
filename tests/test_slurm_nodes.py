"""Trials over two Slurm nodes: each slurmd in its own network namespace with its own hostname
(tests/slurmnodes.py), the daemon on the host submitting with `sbatch`. A 2-slot
torch_distributed trial on a pool of 1 slot per node runs one launcher per node through `srun`,
the rendezvous on the allocation's first host over the bridge; both ranks train, report over
the daemon's Unix socket (reachable from the namespaces through the filesystem), checkpoint and
complete."""

from __future__ import annotations

import re
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import slurmkit
import slurmnodes
from conftest import Env

from det_local.slurm import node
from det_local.store.states import State

DDP = Path(__file__).resolve().parent / "fixtures" / "ddp_trial.py"
# each rank says where it runs (its node's hostname and the DET_AGENT_ID the script gave it)
WHERE = (
    "import os, socket\n"
    "print(f\"NODE rank={os.environ['RANK']} host={socket.gethostname()} "
    "agent={os.environ['DET_AGENT_ID']} chief={os.environ['DET_CHIEF_IP']} "
    "ifname={os.environ.get('GLOO_SOCKET_IFNAME')}\", flush=True)\n"
)


@pytest.fixture(scope="module")
def slurm() -> Iterator[slurmkit.Slurm]:
    reason = slurmnodes.skip_reason()
    if reason:
        pytest.skip(reason)
    root = Path(tempfile.mkdtemp(prefix="det-local-slurmn-", dir="/tmp"))
    root.chmod(0o755)
    try:
        with slurmnodes.cluster(root) as cluster:
            yield cluster
    finally:
        import shutil

        shutil.rmtree(root, ignore_errors=True)


def start_daemon(dl: Env, slurm: slurmkit.Slurm) -> None:
    pools = {"resource_pools": {"hpc": {"slurm": {"partition": "debug", "slots_per_node": 1}}}}
    dl.daemon_start(pools, SLURM_CONF=str(slurm.conf))


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
def test_torch_distributed_trial_over_two_nodes(dl: Env, slurm: slurmkit.Slurm) -> None:
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
    assert {r["chief"] for r in ranks.values()} == {f"{slurmnodes.fednet.SUBNET}.1"}
    assert ranks[0]["host"] == "dln1"
    # gloo on each node's bridge interface (left alone it binds the address the hostname
    # resolves to; these names resolve nowhere, so it fell back to loopback and never met)
    assert {r["ifname"] for r in ranks.values()} == {"eth0"}
    assert "[rank=1]" in logs and "[rank=0]" in logs
    assert slurm.queue() == []


def test_the_node_step_environment_from_slurms() -> None:
    """What det_local.slurm.node gives a node's launcher: the chief from
    SLURM_LAUNCH_NODE_IPADDR, the node rank and count from Slurm, the interface toward the
    chief (here loopback), an interface the experiment set kept."""
    import socket

    step = {"SLURM_LAUNCH_NODE_IPADDR": "127.0.0.1", "SLURM_NNODES": "2", "SLURM_NODEID": "1"}
    assert node.node_env(step) == {
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

"""One trial's ranks on several machines: the rendezvous a plan carries, the environment it
gives each node, ClusterInfo's RendezvousInfo, and the launchers' multi-node contract
(Determined's: ``--nnodes N --node_rank R --master_addr $DET_CHIEF_IP --master_port
$C10D_PORT``).

The end-to-end runs start two "nodes" on loopback, each from its own plan
(``build_trial_plan`` with a ``Rendezvous``): two launcher invocations, real torchrun, real
gloo, det-local's in-trial hub across the nodes, and the workers' own checks of ranks, sizes,
cross ranks and collectives."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import pytest

from det_local.launch import _args, deepspeed, torch_distributed
from det_local.launch._args import LaunchError
from det_local.launch.ports import allocate_ports
from det_local.sched.queue import hardware as slots
from det_local.sched.run.launchplan import LaunchPlan
from det_local.sched.run.rendezvous import (
    IFNAME_VARS,
    Rendezvous,
    RendezvousError,
    interface_of,
)
from det_local.sched.run.trialplan import TrialFacts, build_trial_plan
from det_local.sched.run.trialstart import TrialIds, cluster_info, write_info
from det_local.store.paths import Paths
from det_local.trial.core import DistributedContext
from det_local.wire import trialinfo as info_module
from det_local.wire.trialinfo import ClusterInfo
from tests.support import paths
from tests.support.world import wait_for

REPO = paths.REPO
TIMEOUT = 120
SECRET = "5e" * 32
LOOPBACK = "127.0.0.1"
NOT_HERE = "192.0.2.1"  # TEST-NET-1: never one of this machine's addresses

WORKER = r"""
import json, os, sys
import torch
import torch.distributed as dist
import determined as det
from determined.core import DistributedContext

out = sys.argv[1]
dist.init_process_group("gloo")
ctx = DistributedContext.from_torch_distributed()
total = torch.tensor([float(ctx.rank + 1)])
dist.all_reduce(total)
value = torch.tensor([float(ctx.rank) * 10])
dist.broadcast(value, src=ctx.size - 1)
info = det.get_cluster_info()
facts = {
    "rank": ctx.rank, "size": ctx.size, "local_rank": ctx.local_rank,
    "local_size": ctx.local_size, "cross_rank": ctx.cross_rank, "cross_size": ctx.cross_size,
    "allgather": ctx.allgather((ctx.rank, ctx.cross_rank)),
    "allgather_local": ctx.allgather_local(ctx.rank),
    "broadcast": ctx.broadcast(f"from rank {ctx.rank}"),
    "gather": ctx.gather(ctx.rank),
    "all_reduce": total.item(), "torch_broadcast": value.item(),
    "torch_world": dist.get_world_size(),
    "container_addrs": info.container_addrs, "container_rank": info.container_rank,
    "container_slot_counts": info.container_slot_counts,
    "interface": info.trial._inter_node_network_interface,
    "env": {k: os.environ.get(k) for k in (
        "DET_CHIEF_IP", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK", "DET_LOCAL_NNODES",
        "DET_LOCAL_NODE_RANK", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "TP_SOCKET_IFNAME",
        "DET_SLOT_IDS", "C10D_PORT", "INTER_TRAIN_PROCESS_COMM_PORT_1", "DET_LOCAL_TOKEN",
    )},
}
with open(os.path.join(out, f"facts-{ctx.rank}.json"), "w") as f:
    json.dump(facts, f)
print(f"rank {ctx.rank} of {ctx.size} on node {ctx.cross_rank}", flush=True)
ctx.close()
dist.barrier()  # leave together: gloo aborts a rank whose peer tore down first
dist.destroy_process_group()
"""

DS_WORKER = r"""
import json, os, sys
import deepspeed
import deepspeed.comm as comm
import torch
from determined.core import DistributedContext

out = sys.argv[1]
deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
ctx = DistributedContext.from_deepspeed()
total = torch.tensor([float(ctx.rank + 1)])
comm.all_reduce(total)
facts = {
    "rank": ctx.rank, "size": ctx.size, "local_size": ctx.local_size,
    "cross_rank": ctx.cross_rank, "cross_size": ctx.cross_size,
    "allgather": ctx.allgather(ctx.rank), "all_reduce": total.item(),
    "deepspeed_world": comm.get_world_size(),
    "env": {k: os.environ.get(k) for k in ("USE_DEEPSPEED", "LOCAL_SIZE", "CROSS_RANK",
                                           "CROSS_SIZE", "DET_DEEPSPEED_HOSTFILE_PATH")},
}
with open(os.path.join(out, f"facts-{ctx.rank}.json"), "w") as f:
    json.dump(facts, f)
ctx.close()
comm.barrier()
"""

CONFIG: dict[str, Any] = {
    "name": "multinode",
    "entrypoint": "python3 -m determined.launch.torch_distributed python3 worker.py",
    "resources": {"slots_per_trial": 3},
    "searcher": {"name": "single", "metric": "loss", "max_length": {"batches": 1}},
}


def _ports() -> dict[str, int]:
    return allocate_ports()


def _rdzv(
    node_rank: int, counts: list[int], ifname: str | None = "lo", addrs: list[str] | None = None
) -> Rendezvous:
    return Rendezvous(
        addrs=addrs or [LOOPBACK] * len(counts),
        node_rank=node_rank,
        slot_counts=counts,
        ifname=ifname,
        dist_secret=SECRET,
    )


def _facts(tmp_path: Path, node: int, **over: Any) -> TrialFacts:
    context = tmp_path / "ctx"
    context.mkdir(exist_ok=True)
    base: dict[str, Any] = dict(
        experiment_id=7,
        trial_id=12,
        run_id=3,
        seed=99,
        hparams={"lr": 0.1},
        config=CONFIG,
        context=context,
        steps_completed=0,
        latest_checkpoint=None,
        slots=[0],
        token=f"token-of-node-{node}",  # each node's session token is its own
        user="alice",
        uid=None,
        umask=0o022,
        checkpoint_dir=tmp_path / "ckpt",
        slots_per_trial=3,
        captured_env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")},
    )
    base.update(over)
    return TrialFacts(**base)


def _plan(tmp_path: Path, facts: TrialFacts, monkeypatch: pytest.MonkeyPatch) -> LaunchPlan:
    monkeypatch.setenv("DET_LOCAL_FAKE_GPUS", "0")
    return build_trial_plan(facts, Paths(tmp_path / "home"), slots.discover(cpu_slots=2))


# ---------------------------------------------------------------------------- the plan
def test_plan_env_with_a_rendezvous(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ports = _ports()
    facts = _facts(
        tmp_path,
        1,
        slots=[0, 1],
        ports=ports,
        rendezvous=Rendezvous(
            addrs=["10.1.0.5", "10.1.0.7"],
            node_rank=1,
            slot_counts=[2, 2],
            ifname="enp3s0",
            dist_secret=SECRET,
        ),
        info_dir=tmp_path / "elsewhere" / "info",
        log_path=tmp_path / "elsewhere" / "output.log",
    )
    plan = _plan(tmp_path, facts, monkeypatch)
    env = plan.env
    assert env["DET_CHIEF_IP"] == "10.1.0.5"
    assert env["DET_LOCAL_NNODES"] == "2" and env["DET_LOCAL_NODE_RANK"] == "1"
    assert env["DET_LOCAL_DIST_SECRET"] == SECRET
    assert all(env[name] == "enp3s0" for name in IFNAME_VARS)
    # the chief's ports, as given, on every node; this node's own slots
    assert {k: int(env[k]) for k in ports} == ports and plan.ports == ports
    assert env["DET_SLOT_IDS"] == "[0, 1]" and plan.slots == [0, 1]
    # a node running another node's trial keeps its files where it was told
    assert plan.info_dir == env["DET_LOCAL_INFO_DIR"] == str(tmp_path / "elsewhere" / "info")
    assert plan.log_path == str(tmp_path / "elsewhere" / "output.log")
    # without a rendezvous: none of it (the golden files pin the rest of the single-node plan)
    single = _plan(tmp_path, _facts(tmp_path, 0, ports=ports), monkeypatch)
    added = {"DET_CHIEF_IP", "DET_LOCAL_NNODES", "DET_LOCAL_NODE_RANK", "DET_LOCAL_DIST_SECRET"}
    assert not (added | set(IFNAME_VARS)) & set(single.env)
    paths = Paths(tmp_path / "home")
    assert single.info_dir == str(paths.trial_info_dir(7, 12, 3))
    assert single.log_path == str(paths.trial_log(7, 12))


def test_ifname_rule(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The interface variables are the rendezvous's ifname, unless the experiment's
    environment_variables set them (the user's choice stays); none without an ifname."""
    config = {
        **CONFIG,
        "environment": {"environment_variables": ["NCCL_SOCKET_IFNAME=ib0", "DET_CHIEF_IP=x"]},
    }
    ports = _ports()
    plan = _plan(
        tmp_path, _facts(tmp_path, 0, config=config, ports=ports, rendezvous=_rdzv(0, [1, 1])),
        monkeypatch,
    )  # fmt: skip
    assert plan.env["NCCL_SOCKET_IFNAME"] == "ib0"
    assert plan.env["GLOO_SOCKET_IFNAME"] == plan.env["TP_SOCKET_IFNAME"] == "lo"
    assert plan.env["DET_CHIEF_IP"] == LOOPBACK  # the rendezvous decides where the chief is
    plan = _plan(
        tmp_path, _facts(tmp_path, 0, ports=ports, rendezvous=_rdzv(0, [1, 1], ifname=None)),
        monkeypatch,
    )  # fmt: skip
    assert not set(IFNAME_VARS) & set(plan.env)
    assert _rdzv(0, [1, 1]).to_env(configured={"GLOO_SOCKET_IFNAME"}) == {
        "DET_CHIEF_IP": LOOPBACK,
        "DET_LOCAL_NNODES": "2",
        "DET_LOCAL_NODE_RANK": "0",
        "DET_LOCAL_DIST_SECRET": SECRET,
        "NCCL_SOCKET_IFNAME": "lo",
        "TP_SOCKET_IFNAME": "lo",
    }


def test_a_multi_node_plan_needs_the_chiefs_ports(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    facts = _facts(tmp_path, 1, ports={"C10D_PORT": 20001}, rendezvous=_rdzv(1, [1, 1]))
    with pytest.raises(RendezvousError) as err:
        _plan(tmp_path, facts, monkeypatch)
    assert str(err.value) == (
        "trial 12 (node 1 of 2): the plan has no INTER_TRAIN_PROCESS_COMM_PORT_1, "
        "INTER_TRAIN_PROCESS_COMM_PORT_2; pass the chief's ports in TrialFacts.ports on every node"
    )


@pytest.mark.parametrize(
    ("over", "message"),
    [
        ({"addrs": []}, "addrs must be one non-empty address per node"),
        ({"addrs": ["a", ""]}, "addrs must be one non-empty address per node"),
        ({"slot_counts": [1]}, "1 slot counts for 2 nodes; give one per node"),
        ({"slot_counts": [1, 0]}, "slot_counts [1, 0] must all be >= 1"),
        ({"node_rank": 2}, "node_rank must be in 0..1"),
        ({"node_rank": -1}, "node_rank must be in 0..1"),
        ({"dist_secret": ""}, "dist_secret must be a non-empty hex string"),
        ({"dist_secret": "not hex"}, "dist_secret must be a non-empty hex string"),
    ],
)
def test_bad_rendezvous(over: dict[str, Any], message: str) -> None:
    args: dict[str, Any] = dict(
        addrs=["10.0.0.1", "10.0.0.2"], node_rank=0, slot_counts=[1, 1], ifname=None,
        dist_secret=SECRET,
    )  # fmt: skip
    args.update(over)
    with pytest.raises(RendezvousError) as err:
        Rendezvous(**args)
    text = str(err.value)
    assert text.startswith("rendezvous (node_rank ") and text.endswith(message), text
    assert "\n" not in text


def test_rendezvous_properties() -> None:
    rdzv = Rendezvous(["10.0.0.1", "10.0.0.2", "10.0.0.3"], 2, [4, 4, 2], "eth0", SECRET)
    assert rdzv.nnodes == 3 and rdzv.chief == "10.0.0.1"


def test_interface_of() -> None:
    loopback = next(
        name
        for name, addrs in psutil.net_if_addrs().items()
        if any(a.family == socket.AF_INET and a.address == LOOPBACK for a in addrs)
    )
    assert interface_of(LOOPBACK) == loopback
    assert interface_of(NOT_HERE) is None
    assert interface_of("not an address") is None


def test_cluster_info_carries_the_rendezvous(tmp_path: Path) -> None:
    """What `det.get_cluster_info()` reads back inside the trial (Determined's names)."""
    trial = TrialIds(12, 99, {"lr": 0.1})
    paths = Paths(tmp_path / "home")
    rdzv = Rendezvous(["10.1.0.5", "10.1.0.7"], 1, [2, 1], "enp3s0", SECRET)
    args = (paths, 7, trial, 3, CONFIG, [4], "tok", None, 0, [])
    write_info(cluster_info(*args, rendezvous=rdzv), tmp_path / "multi", None)
    info = ClusterInfo._from_files(tmp_path / "multi")
    assert info is not None
    assert info.container_addrs == ["10.1.0.5", "10.1.0.7"]
    assert info.container_rank == 1 and info.container_slot_counts == [2, 1]
    assert info.trial._inter_node_network_interface == "enp3s0"
    assert info.slot_ids == [4]
    write_info(cluster_info(*args), tmp_path / "single", None)  # the callers of today
    info = ClusterInfo._from_files(tmp_path / "single")
    assert info is not None
    assert (info.container_addrs, info.container_rank, info.container_slot_counts) == (
        [LOOPBACK],
        0,
        [1],
    )
    assert info.trial._inter_node_network_interface is None


# ---------------------------------------------------------------------------- launchers
def test_nnodes_and_node_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("DET_LOCAL_NNODES", "DET_LOCAL_NODE_RANK", "DET_CHIEF_IP"):
        monkeypatch.delenv(name, raising=False)
    assert (_args.nnodes(), _args.node_rank(), _args.chief_ip()) == (1, 0, LOOPBACK)
    monkeypatch.setenv("DET_LOCAL_NNODES", "3")
    monkeypatch.setenv("DET_LOCAL_NODE_RANK", "2")
    monkeypatch.setenv("DET_CHIEF_IP", "10.1.0.5")
    assert (_args.nnodes(), _args.node_rank(), _args.chief_ip()) == (3, 2, "10.1.0.5")
    monkeypatch.setenv("DET_SLOT_IDS", "[0, 1]")
    monkeypatch.setenv("C10D_PORT", "41234")
    cmd, env, nproc = torch_distributed.plan(["python3", "-c", "pass"])
    assert nproc == 2
    assert env == {"USE_TORCH_DISTRIBUTED": "1", "DET_CHIEF_IP": "10.1.0.5"}
    assert cmd[:15] == [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "3",
        "--nproc_per_node", "2", "--node_rank", "2", "--max_restarts", "0",
        "--master_addr", "10.1.0.5", "--master_port", "41234",
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("env", "message"),
    [
        (
            {"DET_LOCAL_NNODES": "two"},
            "DET_LOCAL_NNODES='two' is not a number of machines (an integer >= 1); det-local "
            "sets it for a multi-node trial: unset it to run on this machine alone",
        ),
        (
            {"DET_LOCAL_NNODES": "0"},
            "DET_LOCAL_NNODES='0' is not a number of machines (an integer >= 1)",
        ),
        (
            {"DET_LOCAL_NNODES": "2", "DET_LOCAL_NODE_RANK": "2"},
            "DET_LOCAL_NODE_RANK='2' is not a node rank in 0..1 (DET_LOCAL_NNODES=2); give each "
            "machine of the trial its own rank, the chief 0",
        ),
        (
            {"DET_LOCAL_NODE_RANK": "x"},
            "DET_LOCAL_NODE_RANK='x' is not a node rank in 0..0 (DET_LOCAL_NNODES=1)",
        ),
    ],
)
@pytest.mark.parametrize("launcher", ["torch_distributed", "deepspeed", "horovod"])
def test_bad_node_variables(
    tmp_path: Path, launcher: str, env: dict[str, str], message: str
) -> None:
    (tmp_path / "w.py").write_text("")
    full = dict(os.environ, PYTHONPATH=str(REPO), DET_SLOT_IDS="[0]", **env)
    proc = subprocess.run(
        [sys.executable, "-m", f"det_local.launch.{launcher}", "python3", "w.py"],
        cwd=tmp_path, env=full, capture_output=True, text=True, timeout=TIMEOUT,
    )  # fmt: skip
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"det-local: error: {message}"), proc.stderr


def test_horovod_refuses_several_machines(tmp_path: Path) -> None:
    (tmp_path / "w.py").write_text("")
    env = dict(
        os.environ, PYTHONPATH=str(REPO), DET_SLOT_IDS="[0, 1]", DET_LOCAL_NNODES="2",
        DET_LOCAL_NODE_RANK="0",
    )  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-m", "det_local.launch.horovod", "python3", "w.py"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=TIMEOUT,
    )  # fmt: skip
    assert proc.returncode == 1
    assert proc.stderr == (
        "det-local: error: Horovod multi-node is not supported: this trial runs on 2 machines "
        "(DET_LOCAL_NNODES=2); launch it with `python3 -m determined.launch.torch_distributed` "
        "or `python3 -m determined.launch.deepspeed`, or fit it on one machine\n"
    )


def test_port_check_only_on_the_chief(monkeypatch: pytest.MonkeyPatch) -> None:
    holder = socket.socket()
    holder.bind((LOOPBACK, 0))
    holder.listen(1)
    port = holder.getsockname()[1]
    try:
        monkeypatch.setenv("DET_CHIEF_IP", LOOPBACK)
        monkeypatch.setenv("DET_LOCAL_NNODES", "2")
        monkeypatch.setenv("DET_LOCAL_NODE_RANK", "1")
        torch_distributed.check_port_free(port)  # node 1 only dials the chief's store
        monkeypatch.setenv("DET_LOCAL_NODE_RANK", "0")
        with pytest.raises(LaunchError, match=f"the rendezvous port C10D_PORT={port} is in use"):
            torch_distributed.check_port_free(port)
    finally:
        holder.close()
    monkeypatch.setenv("DET_CHIEF_IP", NOT_HERE)
    with pytest.raises(LaunchError) as err:
        torch_distributed.check_port_free(port)
    assert str(err.value) == (
        f"DET_CHIEF_IP='{NOT_HERE}' is not an address of this machine, yet this is node rank 0 "
        "(the chief, where the rendezvous store listens); set DET_CHIEF_IP to this machine's "
        "LAN address on every node"
    )
    monkeypatch.setenv("DET_LOCAL_NODE_RANK", "1")
    torch_distributed.check_port_free(port)


def test_deepspeed_multi_node_plan(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Several machines: torchrun per machine (no hostfile, pdsh or ssh), DeepSpeed's
    LOCAL_SIZE / CROSS_RANK / CROSS_SIZE added; overrides refused; the batch check counts
    every machine's slots."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("DET_LOCAL_INFO_DIR", raising=False)
    monkeypatch.delenv("DET_HPARAMS", raising=False)
    monkeypatch.setenv("DET_SLOT_IDS", "[0, 1]")
    monkeypatch.setenv("C10D_PORT", "41234")
    monkeypatch.setenv("DET_LOCAL_NNODES", "2")
    monkeypatch.setenv("DET_LOCAL_NODE_RANK", "1")
    monkeypatch.setenv("DET_CHIEF_IP", "10.1.0.5")
    (tmp_path / "train.py").write_text("")
    cmd, env, nproc = deepspeed.plan(["python3", "train.py"], str(tmp_path))
    assert nproc == 2
    assert cmd == torch_distributed.create_launch_cmd(
        2, 41234, [], ["python3", "train.py"], nnodes=2, node_rank=1
    )
    assert cmd[cmd.index("--master_addr") + 1] == "10.1.0.5"
    assert env["USE_DEEPSPEED"] == "1" and env["DET_CHIEF_IP"] == "10.1.0.5"
    assert (env["LOCAL_SIZE"], env["CROSS_RANK"], env["CROSS_SIZE"]) == ("2", "1", "2")
    assert "DET_DEEPSPEED_HOSTFILE_PATH" not in env
    assert not (tmp_path / "deepspeed-hostfile.txt").exists()
    with pytest.raises(LaunchError) as err:
        deepspeed.plan(["--include", "localhost:0", "--", "python3", "train.py"], str(tmp_path))
    assert str(err.value) == (
        "DeepSpeed launcher overrides (--include localhost:0) do not apply to a trial on 2 "
        "machines: det-local runs each machine's workers under torch.distributed.run, without "
        "DeepSpeed's runner; remove them"
    )
    config = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2}
    (tmp_path / "ds.json").write_text(json.dumps(config))
    ok = ["python3", "train.py", "--deepspeed_config", "ds.json"]
    deepspeed.plan(ok, str(tmp_path))  # 2 x 2 machines x 2 slots = 8
    config["train_batch_size"] = 4  # right for one machine, not for two
    (tmp_path / "ds.json").write_text(json.dumps(config))
    with pytest.raises(LaunchError, match=r"train_batch_size 4 is not a multiple of .* 4 slots"):
        deepspeed.plan(ok, str(tmp_path))
    # machines of different sizes: the trial's rendezvous.json has every machine's slots
    rdzv = Rendezvous(["10.1.0.5", "10.1.0.7"], 1, [2, 1], None, SECRET)
    trial = TrialIds(12, 99, {})
    args = (Paths(tmp_path / "home"), 7, trial, 3, CONFIG, [0], "tok", None, 0, [])
    write_info(cluster_info(*args, rendezvous=rdzv), tmp_path / "info", None)
    monkeypatch.setenv("DET_LOCAL_INFO_DIR", str(tmp_path / "info"))
    monkeypatch.setattr(info_module, "_loaded", False)  # get_cluster_info() caches
    monkeypatch.setattr(info_module, "_info", None)
    monkeypatch.setenv("DET_SLOT_IDS", "[0]")
    assert deepspeed.world_slots(1, 2) == 3
    config["train_batch_size"] = 6  # 2 x (2 + 1) slots
    (tmp_path / "ds.json").write_text(json.dumps(config))
    deepspeed.plan(ok, str(tmp_path))


@pytest.mark.parametrize(("chief_ip", "bound"), [(LOOPBACK, LOOPBACK), (NOT_HERE, "0.0.0.0")])
def test_hub_listens_where_the_others_dial(
    monkeypatch: pytest.MonkeyPatch, chief_ip: str, bound: str
) -> None:
    """Several machines: the chief's hub listens on DET_CHIEF_IP (all interfaces when that is
    not one of its addresses), and a member dials DET_CHIEF_IP:PORT_1 with the shared secret."""
    monkeypatch.setenv("DET_LOCAL_DIST_SECRET", SECRET)
    port = allocate_ports()["INTER_TRAIN_PROCESS_COMM_PORT_1"]
    common = dict(size=2, local_rank=0, local_size=1, cross_size=2, pub_port=port)
    got: dict[int, Any] = {}

    def rank(r: int, ip: str) -> None:
        try:
            ctx = DistributedContext(rank=r, cross_rank=r, chief_ip=ip, **common)  # type: ignore[arg-type]
            got[r] = ctx.allgather(r * 7)
            ctx.close()
        except Exception as exc:  # reported by the assertion below
            got[r] = repr(exc)

    chief = threading.Thread(target=rank, args=(0, chief_ip), daemon=True)
    chief.start()

    def listening() -> str | None:
        for conn in psutil.Process().net_connections(kind="tcp"):
            if conn.status == psutil.CONN_LISTEN and conn.laddr.port == port:
                return str(conn.laddr.ip)
        return None

    assert wait_for(listening, timeout=30, what="the chief's hub") == bound
    member = threading.Thread(target=rank, args=(1, LOOPBACK), daemon=True)
    member.start()
    chief.join(60)
    member.join(60)
    assert got == {0: [0, 7], 1: [0, 7]}


def test_machines_of_different_sizes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two ranks on machine 0, one on machine 1: the lone rank takes part in setting up machine
    0's own group (it used to skip that collective, and everyone hung)."""
    monkeypatch.setenv("DET_LOCAL_DIST_SECRET", SECRET)
    port = allocate_ports()["INTER_TRAIN_PROCESS_COMM_PORT_1"]
    layout = {0: (0, 2, 0), 1: (1, 2, 0), 2: (0, 1, 1)}  # rank: (local_rank, local_size, node)
    got: dict[int, Any] = {}

    def rank(r: int) -> None:
        local_rank, local_size, node = layout[r]
        try:
            ctx = DistributedContext(
                rank=r, size=3, local_rank=local_rank, local_size=local_size, cross_rank=node,
                cross_size=2, chief_ip=LOOPBACK, pub_port=port,
            )  # fmt: skip
            got[r] = (ctx.allgather(r), ctx.allgather_local(r), ctx.broadcast_local(f"n{r}"))
            ctx.close()
        except Exception as exc:  # reported by the assertion below
            got[r] = repr(exc)

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in layout]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert got == {
        0: ([0, 1, 2], [0, 1], "n0"),
        1: ([0, 1, 2], [0, 1], "n0"),
        2: ([0, 1, 2], [2], "n2"),
    }


# ---------------------------------------------------------------------------- real runs
def _start_node(plan: LaunchPlan, out: Path, wrap: list[str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [*wrap, *plan.argv[:-1], plan.argv[-1] + f" {out}"],  # sh -c "<entrypoint> OUT"
        cwd=plan.cwd,
        env=plan.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own group: a failed test stops all of the node's tree
    )


def _stop(proc: subprocess.Popen[str]) -> None:
    """A node left running by a failed test: SIGTERM to its group (the launcher's supervisor
    stops the workers), SIGKILL to whatever is left."""
    for sig, grace in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(grace)
            return
        except subprocess.TimeoutExpired:
            continue


def _run_nodes(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    entrypoint: str,
    worker: str,
    counts: list[int],
    *,
    addrs: list[str] | None = None,
    ifname: str | None = None,
    wrap: Callable[[int], list[str]] = lambda node: [],
) -> tuple[list[tuple[int, str, str]], dict[str, int], Path]:
    """Build each node's plan (its rendezvous, the chief's ports), write its run directory,
    start both launchers (``wrap(node)`` before each command line: where it runs);
    [(returncode, stdout, stderr)] by node. Default: every node on loopback."""
    config = {**CONFIG, "entrypoint": entrypoint}
    ports = _ports()
    out = tmp_path / "out"
    out.mkdir()
    (tmp_path / "ctx").mkdir()
    (tmp_path / "ctx" / "worker.py").write_text(worker)
    procs = []
    trial = TrialIds(12, 99, {"lr": 0.1})
    for node, count in enumerate(counts):
        rdzv = _rdzv(node, counts, ifname=ifname or interface_of(LOOPBACK), addrs=addrs)
        info_dir = tmp_path / f"node{node}" / "info"
        facts = _facts(
            tmp_path,
            node,
            config=config,
            slots=list(range(count)),
            ports=ports,
            rendezvous=rdzv,
            info_dir=info_dir,
            log_path=tmp_path / f"node{node}" / "output.log",
        )
        plan = _plan(tmp_path, facts, monkeypatch)
        paths = Paths(tmp_path / "home")
        info = cluster_info(
            paths, 7, trial, 3, config, facts.slots, facts.token, None, 0, [], rendezvous=rdzv
        )
        write_info(info, info_dir, None)
        procs.append(_start_node(plan, out, wrap(node)))
    results = []
    try:
        for proc in procs:
            stdout, stderr = proc.communicate(timeout=TIMEOUT)
            results.append((proc.returncode, stdout, stderr))
    finally:
        for proc in procs:
            if proc.poll() is None:
                _stop(proc)
    return results, ports, out


def test_two_nodes_torch_distributed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Node 0 with two slots, node 1 with one: three ranks over gloo, the hub across the
    nodes and each node's own local group."""
    results, ports, out = _run_nodes(
        tmp_path,
        monkeypatch,
        "python3 -m determined.launch.torch_distributed python3 worker.py",
        WORKER,
        [2, 1],
    )
    for code, _, err in results:
        assert code == 0, err
    facts = [json.loads((out / f"facts-{r}.json").read_text()) for r in range(3)]
    lo = interface_of(LOOPBACK)
    for rank, f in enumerate(facts):
        node = 0 if rank < 2 else 1
        assert (f["rank"], f["size"], f["cross_rank"], f["cross_size"]) == (rank, 3, node, 2)
        assert f["local_size"] == (2 if node == 0 else 1)
        assert f["local_rank"] == (rank if node == 0 else 0)
        assert f["allgather"] == [[0, 0], [1, 0], [2, 1]]
        assert f["allgather_local"] == ([0, 1] if node == 0 else [2])
        assert f["broadcast"] == "from rank 0"
        assert f["gather"] == ([0, 1, 2] if rank == 0 else None)
        assert f["all_reduce"] == 6.0 and f["torch_broadcast"] == 20.0
        assert f["torch_world"] == 3
        assert f["container_addrs"] == [LOOPBACK, LOOPBACK]
        assert f["container_rank"] == node and f["container_slot_counts"] == [2, 1]
        assert f["interface"] == lo
        env = f["env"]
        assert env["DET_CHIEF_IP"] == env["MASTER_ADDR"] == LOOPBACK
        assert env["MASTER_PORT"] == env["C10D_PORT"] == str(ports["C10D_PORT"])
        assert env["INTER_TRAIN_PROCESS_COMM_PORT_1"] == str(
            ports["INTER_TRAIN_PROCESS_COMM_PORT_1"]
        )
        assert env["GROUP_RANK"] == env["DET_LOCAL_NODE_RANK"] == str(node)
        assert env["DET_LOCAL_NNODES"] == "2"
        assert env["GLOO_SOCKET_IFNAME"] == env["NCCL_SOCKET_IFNAME"] == lo
        assert env["DET_SLOT_IDS"] == ("[0, 1]" if node == 0 else "[0]")
        assert env["DET_LOCAL_TOKEN"] == f"token-of-node-{node}"
        assert f"[rank={rank}] rank {rank} of 3 on node {node}\n" in results[node][1]


def test_two_nodes_deepspeed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same through the deepspeed launcher, one slot per node: DeepSpeed's
    init_distributed() and comm in the torchrun world, from_deepspeed() across the nodes."""
    pytest.importorskip("deepspeed")
    results, _, out = _run_nodes(
        tmp_path,
        monkeypatch,
        "python3 -m determined.launch.deepspeed python3 worker.py",
        DS_WORKER,
        [1, 1],
    )
    for code, _, err in results:
        assert code == 0, err
    for rank in (0, 1):
        f = json.loads((out / f"facts-{rank}.json").read_text())
        assert (f["rank"], f["size"], f["cross_rank"], f["cross_size"]) == (rank, 2, rank, 2)
        assert f["local_size"] == 1 and f["allgather"] == [0, 1]
        assert f["all_reduce"] == 3.0 and f["deepspeed_world"] == 2
        assert f["env"] == {
            "USE_DEEPSPEED": "1",
            "LOCAL_SIZE": "1",
            "CROSS_RANK": str(rank),
            "CROSS_SIZE": "2",
            "DET_DEEPSPEED_HOSTFILE_PATH": None,
        }


@pytest.mark.netns
@pytest.mark.slow
@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None, reason="needs root and iproute2"
)
def test_two_nodes_in_network_namespaces(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two machines for real: each node in its own network namespace (10.77.0.1 and .2 on a
    bridge; each namespace has its own loopback), so torchrun's store, gloo and det-local's hub
    all cross the bridge to the chief's LAN address, over the interface the plan names."""
    from tests.support.fednet import Net, sweep

    sweep()
    with Net(tmp_path / "net") as net:
        nodes = [net.node(1), net.node(2)]
        ip_cmd = shutil.which("ip")
        assert ip_cmd is not None
        results, ports, out = _run_nodes(
            tmp_path,
            monkeypatch,
            "python3 -m determined.launch.torch_distributed python3 worker.py",
            WORKER,
            [1, 1],
            addrs=[n.addr for n in nodes],
            ifname="eth0",
            wrap=lambda node: [ip_cmd, "netns", "exec", nodes[node].ns],
        )
    for code, _, err in results:
        assert code == 0, err
    for rank in (0, 1):
        f = json.loads((out / f"facts-{rank}.json").read_text())
        assert (f["rank"], f["size"], f["cross_rank"], f["cross_size"]) == (rank, 2, rank, 2)
        assert f["allgather"] == [[0, 0], [1, 1]] and f["broadcast"] == "from rank 0"
        assert f["all_reduce"] == 3.0 and f["torch_broadcast"] == 10.0
        assert f["container_addrs"] == ["10.77.0.1", "10.77.0.2"]
        assert f["env"]["DET_CHIEF_IP"] == f["env"]["MASTER_ADDR"] == "10.77.0.1"
        assert f["env"]["GLOO_SOCKET_IFNAME"] == f["env"]["TP_SOCKET_IFNAME"] == "eth0"
        assert f["env"]["C10D_PORT"] == str(ports["C10D_PORT"])

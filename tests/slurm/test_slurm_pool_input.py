"""Slurm pools: bad input is one line at submission (or `config check`), and the batch script
of a trial larger than one node."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from det_local.sched.run.launchplan import LaunchPlan
from det_local.slurm.config import parse_slurm_pool
from det_local.slurm.script import Shape, batch_script
from tests.support import slurmkit
from tests.support.world import Env, one_line_error

HPC = {"resources": {"resource_pool": "hpc"}}


def pools(**slurm_settings: Any) -> dict[str, Any]:
    return {"resource_pools": {"hpc": {"slurm": slurm_settings}}}


def run(dl: Env, slurm: slurmkit.Slurm, settings: dict[str, Any], config: dict[str, Any]) -> Any:
    dl.settings(settings)
    dl.setenv(SLURM_CONF=str(slurm.conf))
    cfg, ctx = dl.context("print('never runs')\n", config)
    return dl.det("run", cfg, ctx)


def test_unknown_pool_lists_the_pools(dl: Env, slurm: slurmkit.Slurm) -> None:
    r = run(dl, slurm, pools(partition="debug"), {"resources": {"resource_pool": "gpus"}})
    one_line_error(
        r,
        "resources.resource_pool: pool 'gpus' does not exist; pools: default, hpc "
        f"(add it under resource_pools: in {dl.paths.settings})",
    )
    # and without any resource_pools: the default pool only
    r = run(dl, slurm, {}, {"resources": {"resource_pool": "gpus"}})
    one_line_error(r, "pool 'gpus' does not exist; pools: default (add it under resource_pools:")
    assert dl.jobs() == []


def test_pool_without_a_partition(dl: Env, slurm: slurmkit.Slurm) -> None:
    r = run(dl, slurm, pools(qos="normal"), HPC)
    one_line_error(
        r,
        f"resource_pools.hpc.slurm.partition is missing in {dl.paths.settings}: a Slurm pool "
        "needs the partition its jobs go to, e.g. 'partition: debug' (`sinfo -s` lists them)",
    )
    r = run(dl, slurm, pools(partiton="debug"), HPC)
    one_line_error(
        r, "unknown field 'resource_pools.hpc.slurm.partiton'", "did you mean 'partition'?"
    )
    r = run(dl, slurm, pools(partition="debug", sbatch_args=["--output=/x"]), HPC)
    one_line_error(r, "'--output=/x' is det-local's to set")


def test_partition_slurm_does_not_have(dl: Env, slurm: slurmkit.Slurm) -> None:
    r = run(dl, slurm, pools(partition="nope"), HPC)
    one_line_error(
        r,
        "resources.resource_pool: Slurm pool 'hpc' (partition nope): Slurm refuses its jobs: "
        "sbatch failed: sbatch: error: invalid partition specified: nope; allocation failure: "
        "Invalid partition name specified; check resource_pools.hpc.slurm in daemon.yaml",
    )
    assert slurm.queue() == []


def test_sbatch_missing_from_path(dl: Env, slurm: slurmkit.Slurm, tmp_path: Path) -> None:
    bare = tmp_path / "bin"
    bare.mkdir()
    for tool in ("python3", "sh", "bash"):
        os.symlink(sys.executable if tool == "python3" else f"/bin/{tool}", bare / tool)
    dl.setenv(PATH=str(bare))
    r = run(dl, slurm, pools(partition="debug"), HPC)
    one_line_error(
        r,
        f"resources.resource_pool: Slurm pool 'hpc': sbatch is not on the daemon's PATH ({bare}): "
        "install Slurm's client commands (slurm-client) or start the daemon where they are",
    )


def test_storage_the_compute_nodes_lack(dl: Env, slurm: slurmkit.Slurm, tmp_path: Path) -> None:
    storage = {"checkpoint_storage": {"type": "shared_fs", "host_path": str(tmp_path / "ck")}}
    r = run(dl, slurm, pools(partition="debug", shared_paths=["/scratch"]), {**HPC, **storage})
    one_line_error(
        r,
        f"checkpoint_storage.host_path {tmp_path / 'ck'} is not on a filesystem the compute "
        "nodes of Slurm pool 'hpc' share (resource_pools.hpc.slurm.shared_paths: /scratch); "
        "put it under one of them",
    )
    storage = {"checkpoint_storage": {"type": "directory", "container_path": "/ck"}}
    r = run(dl, slurm, pools(partition="debug"), {**HPC, **storage})
    one_line_error(
        r,
        "checkpoint_storage.type directory: Slurm pool 'hpc' needs shared_fs storage (a "
        "directory the compute nodes and this host share); set checkpoint_storage.type: shared_fs",
    )


def test_config_check_prints_the_batch_script(dl: Env) -> None:
    dl.settings(pools(partition="debug", sbatch_args=["--time=01:00:00"], qos="long"))
    cfg, ctx = dl.context("print('x')\n", HPC)
    r = dl.det("config", "check", cfg, ctx)
    assert r.rc == 0, r
    script = r.out.split("# batch script (resource pool hpc: each trial run is one Slurm job)\n")[1]
    lines = script.splitlines()
    assert lines[0] == "#!/bin/bash"
    for opt in (
        "--partition=debug",
        "--no-requeue",
        "--signal=B:USR1@120",
        "--qos=long",
        "--time=01:00:00",
        "--nodes=1",
        "--export=ALL",
    ):
        assert f"#SBATCH {opt}" in lines, opt
    assert "export DET_LOCAL_TOKEN='<per-run token>'" in lines
    assert "trap _det_local_lead USR1" in lines
    assert dl.json("config", "check", cfg, ctx)["plan"]["pool"] == "hpc"


def _plan(argv: list[str], env: dict[str, str]) -> LaunchPlan:
    """A trial's launch plan as the script generator sees it (paths are only written into it)."""
    return LaunchPlan(
        argv=argv,
        env=env,
        cwd="/ctx",
        user="alice",
        slots=[],
        log_path="/home/det/out.log",
        info_dir="/home/det/runs/1",
    )


def test_a_two_node_trial_starts_one_launcher_per_node_with_srun() -> None:
    """The script of a GPU pool's 2-node trial (run for real on CPU nodes in network
    namespaces: tests/test_slurm_nodes.py)."""
    pool = parse_slurm_pool("hpc", {"partition": "gpu", "gres": "gpu", "slots_per_node": 4}, "x")
    assert Shape.of(8, pool) == Shape(nodes=2, per_node=4)
    plan = _plan(
        ["python3", "-m", "determined.launch.torch_distributed", "python3", "train.py"],
        {"DET_TRIAL_ID": "3", "DET_EXPERIMENT_ID": "2", "DET_TRIAL_RUN_ID": "1"},
    )
    script = batch_script(plan, pool, 8)
    assert "#SBATCH --nodes=2" in script and "#SBATCH --gres=gpu:4" in script
    assert "export DET_SLOT_IDS='[0, 1, 2, 3]'" in script
    srun = next(line for line in script.splitlines() if line.startswith("srun "))
    assert srun.startswith("srun --nodes=2 --ntasks-per-node=1 --kill-on-bad-exit=1 --wait=60 ")
    assert srun.endswith(
        " -m det_local.slurm.node -- python3 -m determined.launch.torch_distributed "
        "python3 train.py &"
    )


def test_the_ports_are_chosen_again_on_the_first_node() -> None:
    """The daemon chose the trial's ports where they were free: on its own machine. The batch
    shell chooses them again on the node it runs on (the allocation's first, the chief): a port
    taken there is not the one the trial gets."""
    import socket
    import subprocess

    from det_local.launch.ports import PORT_VARS, allocate_ports

    busy = socket.socket()
    busy.bind(("0.0.0.0", 0))
    busy.listen(1)
    taken = busy.getsockname()[1]
    try:
        daemons = {**{k: str(v) for k, v in allocate_ports().items()}, "C10D_PORT": str(taken)}
        pool = parse_slurm_pool("hpc", {"partition": "debug"}, "x")
        plan = _plan(
            ["python3", "train.py"], {"DET_TRIAL_ID": "3", "DET_EXPERIMENT_ID": "2", **daemons}
        )
        lines = batch_script(plan, pool, 1).splitlines()
        exports = [line for line in lines if line.startswith("export ")]
        assert f"export C10D_PORT={taken}" in exports  # the daemon's, then chosen again:
        again = next(i for i, line in enumerate(lines) if "-m det_local.launch.ports" in line)
        assert again > max(lines.index(f"export {name}={daemons[name]}") for name in PORT_VARS)
        show = "; ".join(f'echo "{name}=${name}"' for name in PORT_VARS)
        shell = "\n".join([*exports, lines[again], show])
        out = subprocess.run(["bash", "-c", shell], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        got = dict(line.split("=") for line in out.stdout.split())
        assert set(got) == set(PORT_VARS) and len(set(got.values())) == 4
        assert int(got["C10D_PORT"]) != taken
        for port in got.values():  # each free on this node
            with socket.socket() as probe:
                probe.bind(("0.0.0.0", int(port)))
    finally:
        busy.close()


def test_a_node_that_cannot_choose_ports_keeps_the_daemons() -> None:
    """`python3 -m det_local.launch.ports` failing (one line on stderr) leaves the ports the
    script exported: the trial starts with them rather than with none."""
    import subprocess

    pool = parse_slurm_pool("hpc", {"partition": "debug"}, "x")
    plan = _plan(["python3", "train.py"], {"DET_TRIAL_ID": "3", "C10D_PORT": "23456"})
    lines = batch_script(plan, pool, 1).splitlines()
    again = next(line for line in lines if "-m det_local.launch.ports" in line)
    # the same line with a chooser that fails the way main() does
    failing = again.replace(
        again.split('"$(')[1].split(')"')[0],
        "sh -c 'echo \"det-local: cannot choose ports on this machine: x\" >&2; exit 1'",
    )
    shell = f"export C10D_PORT=23456\n{failing}\necho $C10D_PORT"
    out = subprocess.run(["bash", "-c", shell], capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["23456"]
    assert out.stderr.strip() == "det-local: cannot choose ports on this machine: x"

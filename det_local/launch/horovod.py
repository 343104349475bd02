"""``python3 -m det_local.launch.horovod [HVD_OVERRIDES... --] (--trial TRIAL | SCRIPT...)``

Also ``python3 -m determined.launch.horovod`` (deprecated in Determined 0.38, as here). Runs
``horovodrun`` with one worker per slot of the trial, as Determined's launcher does on one
machine:

    horovodrun -np <slots> -p $DTRAIN_SSH_PORT -H localhost:<slots> --start-timeout 1200
        --gloo-timeout-seconds 240 <tensor-fusion options from `optimizations`> [--verbose]
        <data.__det_dtrain_args> [HVD_OVERRIDES...] --
        python -m det_local.launch.wrap_rank HOROVOD_RANK,OMPI_COMM_WORLD_RANK,PMI_RANK -- SCRIPT

With ``--autohorovod`` a one-slot trial runs SCRIPT directly. Without Horovod installed (no
``horovodrun``) it fails in one line naming the alternative, torch_distributed. A trial whose
ranks run on several machines (DET_LOCAL_NNODES > 1) is refused: det-local runs Horovod on one
machine only (horovodrun would need ssh between the machines).
"""

from __future__ import annotations

import os
import shutil
import sys
from typing import Any

from det_local.launch import _args
from det_local.launch.supervise import Supervisor

PROG = "det_local.launch.horovod"
DEFAULT_SSH_PORT = 12350
STARTUP_TIMEOUT = 1200
GLOO_TIMEOUT = 240
RANK_VARS = "HOROVOD_RANK,OMPI_COMM_WORLD_RANK,PMI_RANK"
NOT_INSTALLED = (
    "Horovod is not installed in this environment (no `horovodrun` command on PATH), and the "
    "Horovod launcher is deprecated; launch with "
    "`python3 -m determined.launch.torch_distributed` instead (or pip install horovod)"
)

MULTI_NODE = (
    "Horovod multi-node is not supported: this trial runs on {nodes} machines "
    "(DET_LOCAL_NNODES={nodes}); launch it with `python3 -m determined.launch.torch_distributed` "
    "or `python3 -m determined.launch.deepspeed`, or fit it on one machine"
)


def performance_args(optimizations: dict[str, Any]) -> list[str]:
    if optimizations.get("auto_tune_tensor_fusion"):
        args = ["--autotune", "--autotune-log-file", "/tmp/autotune_log.csv"]
    else:
        args = [
            "--fusion-threshold-mb",
            str(optimizations.get("tensor_fusion_threshold", 64)),
            "--cycle-time-ms",
            str(optimizations.get("tensor_fusion_cycle_time", 1)),
        ]
    return [
        *args,
        "--cache-capacity",
        "1024",
        "--no-hierarchical-allreduce",
        "--no-hierarchical-allgather",
    ]


def create_run_command(
    horovodrun: str, slots: int, config: dict[str, Any], overrides: list[str]
) -> list[str]:
    debug = bool(config.get("debug"))
    dtrain_args = (config.get("data") or {}).get("__det_dtrain_args") or []
    return [
        horovodrun,
        "-np",
        str(slots),
        "-p",
        str(_args.port("DTRAIN_SSH_PORT", DEFAULT_SSH_PORT)),
        "-H",
        f"localhost:{slots}",
        "--start-timeout",
        str(STARTUP_TIMEOUT),
        "--gloo-timeout-seconds",
        str(GLOO_TIMEOUT),
        *performance_args(config.get("optimizations") or {}),
        *(["--verbose"] if debug else []),
        *[str(a) for a in dtrain_args],
        *overrides,
        "--",
    ]


def plan(argv: list[str]) -> tuple[list[str], dict[str, str], int]:
    """(command, environment additions, number of workers) for these arguments."""
    args = list(argv)
    autohorovod = "--autohorovod" in args[:1]
    if autohorovod:
        args = args[1:]
    launch = _args.parse(args, PROG, "horovodrun")
    nodes, _ = _args.nodes()
    if nodes > 1:
        raise _args.LaunchError(MULTI_NODE.format(nodes=nodes))
    slots = _args.slot_count()
    env = {"DET_CHIEF_IP": _args.chief_ip()}
    if autohorovod and slots <= 1:
        return list(launch.script), env, 1
    horovodrun = shutil.which("horovodrun")
    if horovodrun is None:
        raise _args.LaunchError(NOT_INSTALLED)
    env["USE_HOROVOD"] = "1"
    cmd = create_run_command(
        horovodrun, slots, _args.json_env("DET_EXPERIMENT_CONFIG"), launch.overrides
    )
    return cmd + _args.worker_command(RANK_VARS, launch.script), env, slots


def main(argv: list[str]) -> int:
    cmd, extra_env, slots = plan(argv)
    env = dict(os.environ)
    env.update(extra_env)
    env.pop("SLURM_JOBID", None)
    return Supervisor(slots).run(cmd, env, "horovodrun")


if __name__ == "__main__":
    sys.exit(_args.run_main(main))

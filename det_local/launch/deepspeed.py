"""``python3 -m det_local.launch.deepspeed [DEEPSPEED_OVERRIDES... --] (--trial TRIAL | SCRIPT...)``

Also ``python3 -m determined.launch.deepspeed``. Runs DeepSpeed's own launcher with one worker
per slot of the trial, as Determined's launcher does on one machine:

    deepspeed -H <hostfile> --master_addr 127.0.0.1 --master_port $C10D_PORT
        --no_python --no_local_rank --no_ssh_check [OVERRIDES...] --
        python -m det_local.launch.wrap_rank RANK -- SCRIPT...

* the hostfile is ``localhost slots=<len(DET_SLOT_IDS)>``, written to the trial's info directory
  (DET_DEEPSPEED_HOSTFILE_PATH names it), so DeepSpeed starts exactly the trial's slots;
* ``--master_port`` is the trial's own C10D_PORT (Determined leaves DeepSpeed's fixed 29500,
  which collides when two trials share a machine);
* DeepSpeed rewrites CUDA_VISIBLE_DEVICES to indices 0..n-1; det-local keeps the trial's own
  devices (GPU UUIDs) in DET_LOCAL_VISIBLE_DEVICES and wrap_rank maps the indices back, so a
  worker still sees only the trial's GPUs;
* USE_DEEPSPEED=1 and DET_CHIEF_IP are set; DeepSpeed itself sets RANK, WORLD_SIZE, LOCAL_RANK,
  LOCAL_SIZE, CROSS_RANK, CROSS_SIZE (what ``DistributedContext.from_deepspeed()`` reads);
* before anything starts, a DeepSpeed config named by the script's ``--deepspeed_config`` (or
  the ``deepspeed_config`` hyperparameter, with ``overwrite_deepspeed_args`` applied) is
  checked against the slot count: ``train_batch_size`` must equal
  ``train_micro_batch_size_per_gpu * gradient_accumulation_steps * slots``.

On several machines (DET_LOCAL_NNODES > 1, one launcher per machine) there is no hostfile,
pdsh or ssh: each machine runs its workers under torch.distributed.run, with the contract of
``torch_distributed`` (``--nnodes $DET_LOCAL_NNODES --node_rank $DET_LOCAL_NODE_RANK
--master_addr $DET_CHIEF_IP --master_port $C10D_PORT``), and adds what DeepSpeed's own per-node
launcher sets and torchrun does not: LOCAL_SIZE (this machine's slots), CROSS_RANK (its node
rank), CROSS_SIZE (the number of machines). DeepSpeed's ``init_distributed()`` reads torchrun's
RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT. DeepSpeed launcher overrides have
nothing to apply to there and are refused; the batch-size check counts every machine's slots.

Without DeepSpeed installed (no ``deepspeed`` command) it fails in one line naming the
alternative. The tree runs under the launcher supervision of ``supervise``.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from det_local.launch import _args, torch_distributed
from det_local.launch.supervise import Supervisor
from det_local.launch.wrap_rank import VISIBLE_DEVICES_ENV

PROG = "det_local.launch.deepspeed"
DEFAULT_MASTER_PORT = 29500
NOT_INSTALLED = (
    "DeepSpeed is not installed in this environment (no `deepspeed` command on PATH): install "
    "it (pip install deepspeed) where the trial runs, or launch with "
    "`python3 -m determined.launch.torch_distributed` instead"
)


def create_run_command(
    deepspeed: str, hostfile: str, master_port: int, overrides: list[str]
) -> list[str]:
    return [
        deepspeed,
        "-H",
        hostfile,
        "--master_addr",
        _args.chief_ip(),
        "--master_port",
        str(master_port),
        "--no_python",
        "--no_local_rank",
        "--no_ssh_check",  # one machine: the hostfile names localhost, which needs no ssh
        *overrides,
        "--",
    ]


def write_hostfile(directory: str, slots: int) -> str:
    path = os.path.join(directory, "deepspeed-hostfile.txt")
    with open(path, "w") as f:
        f.write(f"localhost slots={slots}\n")
    return path


# ---------------------------------------------------------------------------- config check
def _script_config(script: list[str]) -> str | None:
    for i, arg in enumerate(script):
        for flag in ("--deepspeed_config", "--deepspeed-config", "--deepspeed_config_file"):
            if arg == flag and i + 1 < len(script):
                return script[i + 1]
            if arg.startswith(flag + "="):
                return arg.partition("=")[2]
    return None


def merge_config(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """`base` with the leaves of `over` written over it: a dict in both is merged key by key,
    anything else in `over` replaces (or adds) the value. Neither input is changed."""
    out = copy.deepcopy(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge_config(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def find_config(script: list[str]) -> tuple[str, dict[str, Any]] | None:
    """(where, the DeepSpeed config) the workers will use, when det-local can tell."""
    hparams = _args.json_env("DET_HPARAMS")
    name = _script_config(script)
    source = "--deepspeed_config"
    if name is None:
        value = hparams.get("deepspeed_config")
        if isinstance(value, dict):
            config: dict[str, Any] = value
            where = "the deepspeed_config hyperparameter"
            name = None
        elif isinstance(value, str):
            name, source = value, "the deepspeed_config hyperparameter"
        else:
            return None
    if name is not None:
        path = Path(name)
        if not path.is_file():
            raise _args.LaunchError(
                f"DeepSpeed config {name!r} (from {source}) does not exist in {os.getcwd()}"
            )
        try:
            loaded = json.loads(path.read_text())
        except ValueError as err:
            raise _args.LaunchError(f"DeepSpeed config {name}: not valid JSON: {err}") from None
        if not isinstance(loaded, dict):
            raise _args.LaunchError(f"DeepSpeed config {name}: expected a JSON object")
        config, where = loaded, name
    overwrite = hparams.get("overwrite_deepspeed_args")
    if isinstance(overwrite, dict):
        config = merge_config(config, overwrite)
        where += " (with overwrite_deepspeed_args)"
    return where, config


def check_batch_sizes(where: str, config: dict[str, Any], world_size: int) -> None:
    """DeepSpeed's rule train_batch_size = micro_batch * grad_accum * world_size, checked
    before any worker starts (DeepSpeed itself only fails inside every worker)."""

    def number(key: str) -> int | None:
        value = config.get(key)
        if isinstance(value, bool) or not isinstance(value, int):
            return None  # absent, "auto", or something DeepSpeed will complain about itself
        return value

    tbs = number("train_batch_size")
    mb = number("train_micro_batch_size_per_gpu")
    ga = number("gradient_accumulation_steps")
    slots = f"{world_size} slot{'s' if world_size != 1 else ''}"
    if tbs is not None and mb is not None and ga is not None:
        if tbs != mb * ga * world_size:
            fit = tbs // (mb * ga) if mb * ga and tbs % (mb * ga) == 0 else None
            hint = f"resources.slots_per_trial: {fit}, or " if fit else ""
            raise _args.LaunchError(
                f"DeepSpeed config {where}: train_batch_size {tbs} != "
                f"train_micro_batch_size_per_gpu {mb} x gradient_accumulation_steps {ga} x "
                f"{slots} (= {mb * ga * world_size}); set {hint}train_batch_size: "
                f"{mb * ga * world_size}"
            )
    elif tbs is not None and mb is not None:
        if tbs % (mb * world_size):
            raise _args.LaunchError(
                f"DeepSpeed config {where}: train_batch_size {tbs} is not a multiple of "
                f"train_micro_batch_size_per_gpu {mb} x {slots} (= {mb * world_size}); "
                "change the batch sizes or resources.slots_per_trial"
            )
    elif tbs is not None and ga is not None and tbs % (ga * world_size):
        raise _args.LaunchError(
            f"DeepSpeed config {where}: train_batch_size {tbs} is not a multiple of "
            f"gradient_accumulation_steps {ga} x {slots} (= {ga * world_size}); change the "
            "batch sizes or resources.slots_per_trial"
        )


# ---------------------------------------------------------------------------- launch
def plan(argv: list[str], workdir: str) -> tuple[list[str], dict[str, str], int]:
    """(command, environment additions, number of workers); writes the hostfile in workdir."""
    launch = _args.parse(argv, PROG, "deepspeed")
    deepspeed = shutil.which("deepspeed")
    if deepspeed is None:
        raise _args.LaunchError(NOT_INSTALLED)
    slots = _args.slot_count()
    if _args.nodes()[0] > 1:
        return _multi_node_plan(launch, slots)
    found = find_config(launch.script)
    if found is not None:
        check_batch_sizes(found[0], found[1], slots)
    hostfile = write_hostfile(workdir, slots)
    port = _args.port("C10D_PORT", DEFAULT_MASTER_PORT)
    cmd = create_run_command(deepspeed, hostfile, port, launch.overrides)
    cmd += _args.worker_command("RANK", launch.script)
    env = {
        "USE_DEEPSPEED": "1",
        "DET_CHIEF_IP": _args.chief_ip(),
        "DET_DEEPSPEED_HOSTFILE_PATH": hostfile,
    }
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    if visible:
        env[VISIBLE_DEVICES_ENV] = visible
        iface = os.environ.get("DET_INTER_NODE_NETWORK_INTERFACE")
        if iface and not os.environ.get("NCCL_SOCKET_IFNAME"):
            env["NCCL_SOCKET_IFNAME"] = iface
    return cmd, env, slots


def world_slots(slots: int, nodes: int) -> int:
    """The slots of every machine together: from the trial's rendezvous.json (its slot counts
    per machine), else ``slots`` on each of ``nodes`` machines (Determined's equal fit)."""
    from det_local.wire.trialinfo import get_cluster_info

    info = get_cluster_info()
    counts = info.container_slot_counts if info is not None else []
    return sum(counts) if len(counts) == nodes else slots * nodes


def _multi_node_plan(launch: _args.Launch, slots: int) -> tuple[list[str], dict[str, str], int]:
    """This machine's part of a multi-node DeepSpeed trial: torch.distributed.run, as
    ``torch_distributed`` runs it, plus DeepSpeed's LOCAL_SIZE, CROSS_RANK and CROSS_SIZE."""
    nodes, rank = _args.nnodes(), _args.node_rank()
    if launch.overrides:
        raise _args.LaunchError(
            f"DeepSpeed launcher overrides ({' '.join(launch.overrides)}) do not apply to a "
            f"trial on {nodes} machines: det-local runs each machine's workers under "
            "torch.distributed.run, without DeepSpeed's runner; remove them"
        )
    found = find_config(launch.script)
    if found is not None:
        check_batch_sizes(found[0], found[1], world_slots(slots, nodes))
    port = _args.port("C10D_PORT", DEFAULT_MASTER_PORT)
    cmd = torch_distributed.create_launch_cmd(
        slots, port, [], launch.script, nnodes=nodes, node_rank=rank
    )
    env = {
        "USE_DEEPSPEED": "1",
        "DET_CHIEF_IP": _args.chief_ip(),
        "LOCAL_SIZE": str(slots),
        "CROSS_RANK": str(rank),
        "CROSS_SIZE": str(nodes),
    }
    env.update(torch_distributed.worker_threads(slots))
    return cmd, env, slots


def main(argv: list[str]) -> int:
    workdir = os.environ.get("DET_LOCAL_INFO_DIR") or ""
    own_dir = None
    if not workdir or not os.path.isdir(workdir):
        own_dir = workdir = tempfile.mkdtemp(prefix="det-local-deepspeed-")
    try:
        cmd, extra_env, slots = plan(argv, workdir)
        if _args.nnodes() > 1:  # torchrun's store listens on the chief
            torch_distributed.check_port_free(torch_distributed.master_port(cmd))
        env = dict(os.environ)
        env.update(extra_env)
        tool = "torch.distributed.run" if _args.nnodes() > 1 else "deepspeed"
        return Supervisor(slots).run(cmd, env, tool)
    finally:
        if own_dir is not None:
            shutil.rmtree(own_dir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(_args.run_main(main))

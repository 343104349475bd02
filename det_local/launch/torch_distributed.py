"""``python3 -m det_local.launch.torch_distributed [OVERRIDES... --] (--trial TRIAL | SCRIPT...)``

Also ``python3 -m determined.launch.torch_distributed``. Runs ``torch.distributed.run``
(torchrun) with one worker per slot of the trial, as Determined's launcher does:

    python -m torch.distributed.run --nnodes $DET_LOCAL_NNODES --nproc_per_node <slots>
        --node_rank $DET_LOCAL_NODE_RANK --max_restarts 0 --master_addr $DET_CHIEF_IP
        --master_port $C10D_PORT [TORCH_OVERRIDES...]
        --module det_local.launch.wrap_rank RANK -- SCRIPT...

* slots: the length of DET_SLOT_IDS (at least 1): this machine's slots;
* DET_LOCAL_NNODES / DET_LOCAL_NODE_RANK / DET_CHIEF_IP: set by det-local when the trial's
  ranks run on several machines (one launcher per machine, the chief's node rank 0); unset,
  1 / 0 / 127.0.0.1, one machine;
* C10D_PORT: the trial's own rendezvous port (det-local gives each trial its own, the chief's
  on every machine; 29400 when unset, Determined's default); node rank 0 checks that it is
  free on the chief's address before starting, as torchrun's store listens there;
* the workers get torchrun's RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK,
  GROUP_WORLD_SIZE, MASTER_ADDR, MASTER_PORT plus USE_TORCH_DISTRIBUTED=1 and DET_CHIEF_IP, all
  that ``DistributedContext.from_torch_distributed()`` and ``pytorch.init()`` read;
* ``--trial model_def:MyTrial`` runs det-local's Trial harness in each worker;
* overrides go after det-local's arguments, so they win (``--nproc_per_node 1 --``).

The whole tree runs under :class:`~det_local.launch.supervise.Supervisor`: one failed worker
stops the others within 5 s, and the launcher exits non-zero (see ``supervise``).
"""

from __future__ import annotations

import errno
import os
import socket
import sys

from det_local.launch import _args
from det_local.launch.supervise import Supervisor

PROG = "det_local.launch.torch_distributed"
DEFAULT_C10D_PORT = 29400


def create_launch_cmd(
    nproc: int,
    master_port: int,
    overrides: list[str],
    script: list[str],
    *,
    nnodes: int = 1,
    node_rank: int = 0,
) -> list[str]:
    """The torchrun command line (without the supervisor around it)."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        str(nnodes),
        "--nproc_per_node",
        str(nproc),
        "--node_rank",
        str(node_rank),
        "--max_restarts",
        "0",
        "--master_addr",
        _args.chief_ip(),
        "--master_port",
        str(master_port),
        *overrides,
        "--module",
        _args.WRAP_RANK_MODULE,
        "RANK",
        "--",
        *script,
    ]


def plan(argv: list[str]) -> tuple[list[str], dict[str, str], int]:
    """(command, environment additions, number of workers) for these arguments."""
    launch = _args.parse(argv, PROG, "torch.distributed.run")
    nproc = _args.slot_count()
    port = _args.port("C10D_PORT", DEFAULT_C10D_PORT)
    cmd = create_launch_cmd(
        nproc,
        port,
        launch.overrides,
        launch.script,
        nnodes=_args.nnodes(),
        node_rank=_args.node_rank(),
    )
    env = {"USE_TORCH_DISTRIBUTED": "1", "DET_CHIEF_IP": _args.chief_ip()}
    env.update(worker_threads(nproc))
    return cmd, env, nproc


def worker_threads(nproc: int) -> dict[str, str]:
    """det-local gave the trial OMP_NUM_THREADS = its share of the cores (CPU slots): split it
    among the workers, as torchrun would split a machine (it leaves a set value alone)."""
    if os.environ.get("DET_LOCAL_OMP_DEFAULT") != "1" or nproc < 1:
        return {}
    try:
        total = int(os.environ.get("OMP_NUM_THREADS", ""))
    except ValueError:
        return {}
    return {"OMP_NUM_THREADS": str(max(1, total // nproc))}


def master_port(cmd: list[str]) -> int:
    """The rendezvous port torchrun will use: the last --master_port / --master-port given."""
    port = DEFAULT_C10D_PORT
    end = cmd.index("--module") if "--module" in cmd else len(cmd)
    for i, arg in enumerate(cmd[:end]):
        flag, eq, value = arg.partition("=")
        if flag in ("--master_port", "--master-port"):
            raw = value if eq else (cmd[i + 1] if i + 1 < end else "")
            try:
                port = int(raw)
            except ValueError:
                pass
    return port


def check_port_free(port: int) -> None:
    """torchrun's rendezvous store listens on the port (on the chief, node rank 0): say so now
    if something else does. The other machines only connect to it: nothing to check there."""
    if _args.node_rank() != 0:
        return
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        chief = _args.chief_ip()
        try:
            probe.bind((chief, port))
        except OSError as err:
            if err.errno in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT) or isinstance(
                err, socket.gaierror
            ):
                raise _args.LaunchError(
                    f"DET_CHIEF_IP={chief!r} is not an address of this machine, yet this is "
                    f"node rank 0 (the chief, where the rendezvous store listens); set "
                    "DET_CHIEF_IP to this machine's LAN address on every node"
                ) from None
            raise _args.LaunchError(
                f"the rendezvous port C10D_PORT={port} is in use ({err.strerror or err}); "
                "det-local gives each trial its own, so another program holds it: free it, or "
                "set C10D_PORT to a free port when launching by hand"
            ) from None


def main(argv: list[str]) -> int:
    cmd, extra_env, nproc = plan(argv)
    check_port_free(master_port(cmd))
    env = dict(os.environ)
    env.update(extra_env)
    supervisor = Supervisor(nproc)
    return supervisor.run(cmd, env, "torch.distributed.run")


if __name__ == "__main__":
    sys.exit(_args.run_main(main))

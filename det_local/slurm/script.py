"""The batch script of one trial run on a Slurm pool, generated from its launch plan.

The plan is the one a local run carries out (`sched/run/trialplan.build_trial_plan`): the same
argv, environment (DET_*, the session's socket and token, the latest checkpoint), working
directory and umask. The script adds only what Slurm decides: the node's name
(``DET_AGENT_ID``), the GPUs Slurm gave (``CUDA_VISIBLE_DEVICES`` is Slurm's, never this
machine's), the trial's ports chosen again on the allocation's first node (those the daemon
chose were free on its own machine: `launch/ports.py`), and, for a trial over several nodes,
``srun`` starting the plan's command once per node with the rendezvous on that first host.

The batch shell runs the command in the background and waits for it. On ``USR1`` (sent by
Slurm ``signal_lead`` seconds before the time limit: ``--signal=B:USR1@N``) it tells the engine,
over the run's own authenticated session (`det_local/slurm/notify.py`), that the run is about
to end: the engine asks the trial to checkpoint (``should_preempt()``) and queues it again.
The command's exit status is the job's (over several nodes: the first failing node's own,
`slurm/rankexit.py`, not srun's), and is also written to ``slurm-exit.<jobid>`` in the run's
info directory (read when Slurm has forgotten the job).
"""

from __future__ import annotations

import json
import shlex
import sys
from dataclasses import dataclass

from det_local.launch.ports import PORT_VARS
from det_local.sched.run.launchplan import LaunchPlan
from det_local.slurm.config import SlurmPool
from det_local.slurm.stage import for_pool

# variables of the plan that describe this machine, not the compute node
_NODE_LOCAL = ("CUDA_VISIBLE_DEVICES", "DET_AGENT_ID")


@dataclass(frozen=True)
class Shape:
    """How many nodes and slots a trial asks of the pool."""

    nodes: int
    per_node: int  # slots per node

    @classmethod
    def of(cls, slots: int, pool: SlurmPool) -> Shape:
        slots = max(int(slots), 1)
        per_node = min(slots, pool.slots_per_node)
        nodes = -(-slots // per_node)
        return cls(nodes, per_node)


def job_name(plan: LaunchPlan) -> str:
    env = plan.env
    if "DET_TRIAL_ID" not in env:  # a command (`cmd run --pool`)
        return f"det-local_cmd{env.get('DET_LOCAL_JOB_ID', '?')}"
    return (
        f"det-local_e{env.get('DET_EXPERIMENT_ID', '?')}_t{env.get('DET_TRIAL_ID', '?')}"
        f"_r{env.get('DET_TRIAL_RUN_ID', '?')}"
    )


def directives(plan: LaunchPlan, pool: SlurmPool, shape: Shape) -> list[str]:
    """The #SBATCH options, det-local's first, then the pool's sbatch_args."""
    opts = [
        f"--job-name={job_name(plan)}",
        f"--partition={pool.partition}",
        f"--output={plan.log_path}",
        "--open-mode=append",
        "--no-requeue",  # det-local requeues a trial itself, from its latest checkpoint
        f"--signal=B:USR1@{pool.signal_lead}",
        f"--chdir={plan.cwd}",
        # sbatch runs in the plan's environment (client.job_env), which the job takes; the
        # script sets it again below, so what the job runs with is written here
        "--export=ALL",
        f"--nodes={shape.nodes}",
        "--ntasks-per-node=1",
    ]
    if pool.gres:
        opts.append(f"--gres={pool.gres}:{shape.per_node}")
    if pool.account:
        opts.append(f"--account={pool.account}")
    if pool.qos:
        opts.append(f"--qos={pool.qos}")
    return opts + list(pool.sbatch_args)


def batch_script(
    plan: LaunchPlan, pool: SlurmPool, slots_per_trial: int, stage_key: bytes | None = None
) -> str:
    """``stage_key``: what staged directories are named with (`stage.name_key`); None (a
    preview): a placeholder name."""
    plan = for_pool(plan, pool, stage_key)  # other hosts' compute nodes: channel, staged paths
    shape = Shape.of(slots_per_trial, pool)
    lines = ["#!/bin/bash"]
    lines += [f"#SBATCH {shlex.quote(opt)}" for opt in directives(plan, pool, shape)]
    lines.append("# det-local: one trial run (its launch plan); see det_local/slurm/script.py")
    umask = 0o022 if plan.umask is None else plan.umask
    lines.append(f"umask {umask:04o}")
    env = {k: v for k, v in plan.env.items() if k not in _NODE_LOCAL}
    env["DET_SLOT_IDS"] = json.dumps(list(range(shape.per_node)))
    env["DET_LOCAL_SLURM"] = "1"
    for key in sorted(env):
        lines.append(f"export {key}={shlex.quote(env[key])}")
    lines.append('export DET_AGENT_ID="$(hostname)"')
    if PORT_VARS[0] in env:  # the ports, chosen again here: the daemon's were free on its host
        ports = f"{shlex.quote(sys.executable)} -m det_local.launch.ports"
        lines.append(f'_det_local_ports="$({ports})" && eval "$_det_local_ports"')
    if shape.nodes == 1:  # get_cluster_info() of the node (several: slurm/node.py sets it)
        lines.append(
            'export DET_LOCAL_NODE_INFO="{\\"agent_id\\": \\"$(hostname)\\", '
            '\\"container_addrs\\": [\\"127.0.0.1\\"], \\"container_rank\\": 0, '
            f'\\"container_slot_counts\\": [{shape.per_node}]}}"'
        )
    notify = f"{shlex.quote(sys.executable)} -m det_local.slurm.notify"
    lines.append(f"_det_local_lead() {{ {notify} time_limit || true; }}")
    lines.append("trap _det_local_lead USR1")
    lines.append(_command(plan, shape) + " &")
    lines += [
        "child=$!",
        # wait returns early when the trap runs: wait again until the command has ended
        'while :; do wait "$child"; rc=$?; kill -0 "$child" 2>/dev/null || break; done',
        *_first_failure(shape),
        '[ -n "${DET_LOCAL_INFO_DIR:-}" ] && '
        'printf "%s\\n" "$rc" > "$DET_LOCAL_INFO_DIR/slurm-exit.$SLURM_JOB_ID" 2>/dev/null',
        'exit "$rc"',
    ]
    return "\n".join(lines) + "\n"


def _first_failure(shape: Shape) -> list[str]:
    """Several nodes: srun's status is the highest of its tasks' (often a node it stopped); the
    job exits with the first failing node's own code instead, said in its output
    (`slurm/rankexit.py`, from what each node's step wrote)."""
    if shape.nodes == 1:
        return []
    pick = f"{shlex.quote(sys.executable)} -m det_local.slurm.rankexit"
    return [
        'if [ "$rc" -ne 0 ] && [ -n "${DET_LOCAL_INFO_DIR:-}" ]; then',
        f'  first="$({pick} "$rc")" && [ -n "$first" ] && rc="$first"',
        "fi",
    ]


def _command(plan: LaunchPlan, shape: Shape) -> str:
    argv = " ".join(shlex.quote(a) for a in plan.argv)
    if shape.nodes == 1:
        return argv
    # one launcher per node (the plan's command: torch_distributed, DeepSpeed ...) through
    # det_local.slurm.node, which gives it the rendezvous (the allocation's first host), its
    # node rank and its network interface from Slurm's step environment
    node = f"{shlex.quote(sys.executable)} -m det_local.slurm.node"
    return (
        f"srun --nodes={shape.nodes} --ntasks-per-node=1 --kill-on-bad-exit=1 --wait=60 "
        f"{node} -- {argv}"
    )

"""A Core API trial over the nodes of a Slurm allocation (tests/slurm/: two slurmd in network
namespaces, tests/support/slurmnodes.py), its config for the `hpc` pool and the lines each rank
prints."""

from __future__ import annotations

import re
from typing import Any

# A Core API trial over both nodes: each batch adds the ranks' allgathered batch numbers to x
# (a resume that skipped or repeated a batch ends with another x); rank 0 reports; both ranks
# write their shard of every checkpoint; on the first run it holds after `hold_at` until the
# pause (should_preempt() is collective: both ranks leave together)
CORE = """
import json, socket, sys, time
import determined as det

info = det.get_cluster_info()
hp = info.trial.hparams
dist = det.core.DistributedContext.from_torch_distributed()
with det.core.init(distributed=dist) as core:
    rank = core.distributed.rank
    host = socket.gethostname()
    hosts = core.distributed.allgather(host)
    x, start = 0, 0
    if info.latest_checkpoint:
        with core.checkpoint.restore_path(info.latest_checkpoint) as path:
            x, start, _ = json.loads((path / f"rank{rank}.json").read_text())
    print(f"CORE rank={rank} host={host} hosts={','.join(hosts)} start={start}", flush=True)
    seen = [info.agent_id, info.container_rank, info.container_addrs, info.container_slot_counts]
    print("INFO " + json.dumps(seen), flush=True)
    if hp.get("fail_rank") == rank:
        raise SystemExit(3)
    if hp.get("fail_rank") is not None:  # the others wait outside a collective: srun stops them
        time.sleep(60)

    def save(step):
        with core.checkpoint.store_path({"steps_completed": step}, shard=True) as (path, _):
            (path / f"rank{rank}.json").write_text(json.dumps([x, step, host]))

    for step in range(start + 1, hp["batches"] + 1):
        x += sum(core.distributed.allgather(step))
        if rank == 0:
            core.train.report_training_metrics(steps_completed=step, metrics={"x": x})
        if step % hp["ckpt_every"] == 0:
            save(step)
        if step == hp["hold_at"] and info.latest_checkpoint is None:
            for _ in range(1200):  # the same count on both ranks: bounded, never diverging
                if core.preempt.should_preempt():
                    save(step)
                    sys.exit(0)
                time.sleep(0.1)
    if rank == 0:
        core.train.report_validation_metrics(steps_completed=hp["batches"], metrics={"x": x})
"""


def core_config(hp: dict[str, Any]) -> dict[str, Any]:
    return {
        "name": "core-2-node",
        "hyperparameters": hp,
        "resources": {"slots_per_trial": 2, "resource_pool": "hpc"},
        "searcher": {"name": "single", "metric": "x", "max_length": hp["batches"]},
        "entrypoint": "python3 -m determined.launch.torch_distributed python3 train.py",
        "max_restarts": 0,
    }


def core_lines(text: str) -> list[dict[str, str]]:
    pattern = r"CORE rank=(\d) host=(\S+) hosts=(\S+) start=(\d+)"
    return [
        dict(zip(("rank", "host", "hosts", "start"), m.groups(), strict=True))
        for m in re.finditer(pattern, text)
    ]

"""Intra-op threads on CPU slots: a trial (or command) holding k of N CPU slots gets
OMP_NUM_THREADS = its share of the cores unless the user set it, and det-local's
torch_distributed launcher splits that share among its workers."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from det_local.sched.queue.hardware import SOURCE_CPU, SOURCE_FAKE, Inventory, Slot
from det_local.sched.run.launchplan import OMP_DEFAULT_MARK, thread_env
from tests.support.world import Env

CORES = len(os.sched_getaffinity(0))

SCRIPT = """\
import json, os, torch
import determined as det
from determined import core
rank = int(os.environ.get("RANK", "0"))
with open(os.environ["OUT"] + f"/threads-{rank}.json", "w") as f:
    json.dump({"omp": os.environ.get("OMP_NUM_THREADS"), "torch": torch.get_num_threads(),
               "mark": os.environ.get("DET_LOCAL_OMP_DEFAULT")}, f)
"""


def _inventory(n: int, source: str) -> Inventory:
    kind = "cpu" if source == SOURCE_CPU else "gpu"
    slots = tuple(
        Slot(
            index=i,
            kind=kind,
            uuid=None,
            name=kind,
            memory_total_mb=None,
            memory_used_mb=None,
            utilization_pct=None,
        )
        for i in range(n)
    )
    return Inventory(slots=slots, source=source)


def test_the_share_of_the_cores() -> None:
    inv = _inventory(4, SOURCE_CPU)
    assert inv.cpu_threads(1) == max(1, CORES // 4)
    assert inv.cpu_threads(4) == CORES
    assert inv.cpu_threads(0) == max(1, CORES // 4)  # a 0-slot command: one slot's share
    assert _inventory(2, SOURCE_FAKE).cpu_threads(1) is None  # GPUs: torch's default


def test_a_user_setting_wins() -> None:
    chosen = ["OMP_NUM_THREADS=3", f"{OMP_DEFAULT_MARK}=1"]
    assert thread_env(3, {"PATH": "/bin"}, ["A=1"]) == chosen
    assert thread_env(3, {"OMP_NUM_THREADS": "8"}) == []
    assert thread_env(3, [], ["OMP_NUM_THREADS=8"]) == []
    assert thread_env(None, []) == []


def _run(dl: Env, config: dict[str, object], name: str) -> list[dict[str, object]]:
    out = dl.tmp / f"out-{name}"
    out.mkdir()
    # where the trial writes: through the config, as in Determined (a trial gets nothing else
    # of the environment `det-local run` runs in, beyond PATH, locale and terminal)
    given: Any = config.get("environment") or {}
    variables = [*given.get("environment_variables", []), f"OUT={out}"]
    config = {**config, "environment": {"environment_variables": variables}}
    cfg, ctx = dl.context(SCRIPT, config, name=name)
    env_before = dict(dl.env)
    dl.env.update({"DET_LOCAL_CPU_SLOTS": "2"})
    dl.env.pop("OMP_NUM_THREADS", None)
    try:
        r = dl.det("run", cfg, ctx)
    finally:
        dl.env.clear()
        dl.env.update(env_before)
    assert r.rc == 0, r
    return [json.loads(p.read_text()) for p in sorted(Path(out).glob("threads-*.json"))]


def test_trials_on_cpu_slots_get_their_share(dl: Env) -> None:
    share = max(1, CORES // 2)
    assert _run(dl, {}, "one") == [{"omp": str(share), "torch": share, "mark": "1"}]
    user = {"environment": {"environment_variables": ["OMP_NUM_THREADS=3"]}}
    (seen,) = _run(dl, user, "user")
    assert seen["omp"] == "3" and seen["mark"] is None  # torch may cap it at the core count
    two = {
        "resources": {"slots_per_trial": 2},
        "entrypoint": "python3 -m determined.launch.torch_distributed python3 train.py",
    }
    per_rank = max(1, CORES // 2)  # the trial's 2 slots are all the cores, split in 2 ranks
    assert _run(dl, two, "two") == [{"omp": str(per_rank), "torch": per_rank, "mark": "1"}] * 2

"""A Core API script that reports, validates and checkpoints every step (`CORE`, run as
train.py) and its config: the SDK's workflows read what it leaves."""

from __future__ import annotations

from typing import Any

# A Core API trial: validates and checkpoints every 2 steps; `val` is best at step `best_at`.
CORE = """
import pathlib, time
import determined as det


def main(core, hp):
    for step in range(1, hp["steps"] + 1):
        core.train.report_training_metrics(steps_completed=step, metrics={"loss": 1.0 / step})
        if step % 2 == 0:
            val = abs(step - hp["best_at"]) + hp.get("offset", 0)
            core.train.report_validation_metrics(
                steps_completed=step, metrics={"val": val, "accuracy": step * 10}
            )
            with core.checkpoint.store_path({"steps_completed": step}) as (path, uuid):
                (path / "w").write_text(str(step))
        gate = hp.get("gate")
        if gate and step == hp.get("gate_at", 1):
            deadline = time.monotonic() + 60
            while not pathlib.Path(gate).exists() and time.monotonic() < deadline:
                if core.preempt.should_preempt():
                    print("preempted", flush=True)
                    return
                time.sleep(0.02)
    print("trained", hp["steps"], "steps", flush=True)


with det.core.init() as core:
    main(core, det.get_cluster_info().trial.hparams)
"""


KEEP_ALL = {"save_trial_best": 20, "save_trial_latest": 20}


def core_config(**fields: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "name": "sdk",
        "entrypoint": "python3 train.py",
        "hyperparameters": {"steps": 6, "best_at": 4},
        "searcher": {"name": "single", "metric": "val", "max_length": 6},
        "checkpoint_storage": KEEP_ALL,
        "max_restarts": 0,
    }
    cfg.update(fields)
    return cfg

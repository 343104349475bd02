"""The legacy DeepSpeedTrial fixture (tests/fixtures/ds_model_def.py) with its DeepSpeed config,
the experiment config that runs it, its build context and the records it writes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.support import paths
from tests.support.paths import COMPAT, REPO
from tests.support.world import Env

MODEL_DEF = (paths.FIXTURES / "ds_model_def.py").read_text()


DS_CONFIG = {
    "train_batch_size": 4,
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 2,
    "optimizer": {"type": "SGD", "params": {"lr": 0.05}},
}


def config(dl: Env, entrypoint: str, batches: int, **hparams: Any) -> dict[str, Any]:
    return {
        "name": "ds",
        "entrypoint": entrypoint,
        "hyperparameters": {
            "deepspeed_config": "ds_config.json",
            "record": str(dl.tmp / "record.jsonl"),
            "batches": batches,
            **hparams,
        },
        "searcher": {
            "name": "single",
            "metric": "val_loss",
            "smaller_is_better": True,
            "max_length": {"batches": batches},
        },
        "min_validation_period": {"batches": 3},
        "reproducibility": {"experiment_seed": 7},
        "max_restarts": 0,
    }


def context(dl: Env, cfg: dict[str, Any]) -> tuple[Path, Path]:
    files = {"model_def.py": MODEL_DEF, "ds_config.json": json.dumps(DS_CONFIG)}
    return dl.context(MODEL_DEF, cfg, files=files)


def records(dl: Env) -> list[dict[str, Any]]:
    path = dl.tmp / "record.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


# Loads a checkpoint in a fresh process (DeepSpeed's process group and the environment it sets
# stay out of the test process) and prints what the tests check, as JSON.
LOAD_SCRIPT = """\
import json, sys
import torch
from determined import pytorch
from determined.pytorch import deepspeed as det_ds

path = sys.argv[1]
trial = pytorch.load_trial_from_checkpoint_path(path)
saved = torch.load(f"{path}/model0/mp_rank_00_model_states.pt", weights_only=False)["module"]
live = trial.engine.module.state_dict()
loader = trial.build_validation_data_loader().get_data_loader()
it = iter(loader)
with torch.no_grad():
    val = [float(trial.evaluate_batch(it, i)["val_loss"]) for i in range(len(loader))]
print(json.dumps({
    "class": type(trial).__name__,
    "context": isinstance(trial.context, det_ds.DeepSpeedTrialContext),
    "keys": sorted(live) == sorted(saved),
    "equal": all(torch.equal(live[k], saved[k]) for k in saved),
    "val_loss": sum(val) / len(val),
}))
"""


def run_loader(dl: Env, path: Path) -> subprocess.CompletedProcess[str]:
    env = dict(dl.env, PYTHONPATH=os.pathsep.join([str(COMPAT), str(REPO)]))
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    return subprocess.run(
        [sys.executable, "-c", LOAD_SCRIPT, str(path)],
        env=env,
        cwd=dl.tmp,
        capture_output=True,
        text=True,
        timeout=120,
    )


def load_in_new_process(dl: Env, path: Path) -> dict[str, Any]:
    p = run_loader(dl, path)
    assert p.returncode == 0, p.stderr[-3000:]
    return dict(json.loads(p.stdout.strip().splitlines()[-1]))

"""Determined's PyTorch tutorial as a PyTorchTrial script (`TRAIN`, run as train.py), its
experiment config and the state its last checkpoint holds."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.support.world import Env

TRAIN = """
import logging, os, pathlib, time

import torch

import determined as det
from determined import pytorch


class Data(torch.utils.data.Dataset):
    def __init__(self):
        g = torch.Generator().manual_seed(5)
        self.x = torch.randn(24, 4, generator=g)
        self.y = self.x.sum(1, keepdim=True)

    def __len__(self):
        return 24

    def __getitem__(self, i):
        return self.x[i], self.y[i]


class Net(pytorch.PyTorchTrial):
    def __init__(self, context):
        self.context = context
        self.hparams = context.get_hparams()
        model = torch.nn.Sequential(
            torch.nn.Linear(4, 8), torch.nn.Dropout(0.2), torch.nn.Linear(8, 1)
        )
        self.model = context.wrap_model(model)
        self.opt = context.wrap_optimizer(
            torch.optim.Adam(self.model.parameters(), lr=self.hparams["lr"])
        )

    def train_batch(self, batch, epoch_idx, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.model(x), y)
        self.context.backward(loss)
        self.context.step_optimizer(self.opt)
        if self.hparams.get("hold_at") == batch_idx + 1 and os.environ["DET_TRIAL_RUN_ID"] == "1":
            pathlib.Path(self.hparams["marker"]).write_text("holding")
            deadline = time.monotonic() + 60
            preempt = self.context._core.preempt
            while not preempt.should_preempt(auto_ack=False) and time.monotonic() < deadline:
                time.sleep(0.01)
        return {"loss": loss}

    def evaluate_batch(self, batch):
        x, y = batch
        return {"val_loss": torch.nn.functional.mse_loss(self.model(x), y)}

    def build_training_data_loader(self):
        return pytorch.DataLoader(
            Data(), batch_size=self.context.get_per_slot_batch_size(), shuffle=True
        )

    def build_validation_data_loader(self):
        return pytorch.DataLoader(Data(), batch_size=8)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format=det.LOG_FORMAT)
    info = det.get_cluster_info()
    # no hparams=...: under det-local pytorch.init() takes the trial's own
    with pytorch.init() as context:
        print("seeded with", torch.initial_seed(), "trial seed", info.trial.trial_seed, flush=True)
        trial = Net(context)
        trainer = pytorch.Trainer(trial, context)
        every = context.get_hparams().get("validate_every", 4)
        trainer.fit(
            validation_period=pytorch.Batch(every), latest_checkpoint=info.latest_checkpoint
        )
"""


def config(name: str, max_length: Any, **hparams: Any) -> dict[str, Any]:
    return {
        "name": name,
        "entrypoint": "python3 train.py",
        "hyperparameters": {"lr": 0.01, "global_batch_size": 6, **hparams},
        "searcher": {
            "name": "single",
            "metric": "val_loss",
            "smaller_is_better": True,
            "max_length": max_length,
        },
        "reproducibility": {"experiment_seed": 42},
        "max_restarts": 0,
    }


def final_state(dl: Env, trial_id: int) -> dict[str, Any]:
    last = dl.checkpoints(trial_id)[-1]
    state: dict[str, Any] = torch.load(Path(last.path) / "state_dict.pth", weights_only=False)
    return state

"""Train a small MLP on scikit-learn's bundled digits with Determined's Core API.

Written the way Determined's Core API tutorials are: metrics, checkpoints, preemption and the
searcher's operations all go through ``core_context``. On a cluster (or under det-local) the
hyperparameters, trial seed and latest checkpoint come from ``det.get_cluster_info()``; run as a
plain ``python3 train.py`` it uses DEFAULT_HPARAMS and the single operation the off-cluster
searcher hands out.

One step is one batch. The batch order is a function of the step number alone, so a trial that
is paused and resumed from its checkpoint trains on exactly the batches an uninterrupted run
would have seen.
"""

from __future__ import annotations

import logging
import pathlib
from typing import Any

import determined as det
import torch
from determined import core
from sklearn.datasets import load_digits
from torch import nn

DEFAULT_HPARAMS: dict[str, Any] = {
    "lr": 0.05,
    "hidden_size": 64,
    "batch_size": 64,
    "validation_every": 100,
}
REPORT_EVERY = 10  # batches between training-metric reports and preemption checks
VALIDATION_FRACTION = 0.2
DATA_SEED = 1234  # the train/validation split never changes between trials


def load_data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    digits = load_digits()  # bundled with scikit-learn: 1797 8x8 images, no download
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(DATA_SEED))
    n_val = int(len(x) * VALIDATION_FRACTION)
    val_idx, train_idx = order[:n_val], order[n_val:]
    return x[train_idx], y[train_idx], x[val_idx], y[val_idx]


def build_model(hidden_size: int) -> nn.Module:
    return nn.Sequential(
        nn.Linear(64, hidden_size),
        nn.ReLU(),
        nn.Linear(hidden_size, 10),
    )


def get_batch(
    x: torch.Tensor, y: torch.Tensor, batch_idx: int, batch_size: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch number ``batch_idx`` of an endless sequence of shuffled epochs."""
    per_epoch = len(x) // batch_size  # drop the ragged last batch
    epoch, i = divmod(batch_idx, per_epoch)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed * 100_003 + epoch))
    idx = order[i * batch_size : (i + 1) * batch_size]
    return x[idx], y[idx]


def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
    model.eval()
    with torch.no_grad():
        logits = model(x)
        loss = nn.functional.cross_entropy(logits, y).item()
        accuracy = (logits.argmax(dim=1) == y).float().mean().item()
    model.train()
    return {"validation_loss": loss, "validation_accuracy": accuracy}


def save_state(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    steps_completed: int,
    trial_id: int | None,
    path: pathlib.Path,
) -> None:
    torch.save(
        {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "steps_completed": steps_completed,
            "trial_id": trial_id,
        },
        path / "state.pt",
    )


def load_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, trial_id: int | None, path: pathlib.Path
) -> int:
    """Load a checkpoint; return the batch to continue from.

    A checkpoint from another trial (a warm start, e.g. ``searcher.source_trial_id``) gives
    only the weights: training starts again from batch 0."""
    state = torch.load(path / "state.pt", weights_only=True)
    model.load_state_dict(state["model"])
    if state["trial_id"] != trial_id:
        return 0
    optimizer.load_state_dict(state["optimizer"])
    return int(state["steps_completed"])


def main(
    core_context: core.Context,
    latest_checkpoint: str | None,
    trial_id: int | None,
    hparams: dict[str, Any],
    seed: int,
) -> None:
    torch.manual_seed(seed)
    x_train, y_train, x_val, y_val = load_data()
    model = build_model(int(hparams["hidden_size"]))
    optimizer = torch.optim.SGD(model.parameters(), lr=float(hparams["lr"]), momentum=0.9)
    batch_size = int(hparams["batch_size"])
    validation_every = int(hparams["validation_every"])

    batch = 0
    if latest_checkpoint is not None:
        with core_context.checkpoint.restore_path(latest_checkpoint) as path:
            batch = load_state(model, optimizer, trial_id, path)
        logging.info(f"resumed from checkpoint {latest_checkpoint} at batch {batch}")

    last_checkpoint_batch: int | None = None
    last_validation_batch: int | None = None
    val_metrics: dict[str, float] = {}

    def checkpoint(steps_completed: int) -> None:
        nonlocal last_checkpoint_batch
        if last_checkpoint_batch == steps_completed:
            return
        metadata = {"steps_completed": steps_completed}
        with core_context.checkpoint.store_path(metadata) as (path, storage_id):
            save_state(model, optimizer, steps_completed, trial_id, path)
        last_checkpoint_batch = steps_completed

    def validate(steps_completed: int) -> None:
        nonlocal last_validation_batch, val_metrics
        if last_validation_batch == steps_completed:
            return
        val_metrics = evaluate(model, x_val, y_val)
        core_context.train.report_validation_metrics(
            steps_completed=steps_completed, metrics=val_metrics
        )
        last_validation_batch = steps_completed

    for op in core_context.searcher.operations():
        losses: list[float] = []
        while batch < op.length:
            xb, yb = get_batch(x_train, y_train, batch, batch_size, seed)
            loss = nn.functional.cross_entropy(model(xb), yb)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
            batch += 1

            if batch % REPORT_EVERY == 0:
                core_context.train.report_training_metrics(
                    steps_completed=batch, metrics={"loss": sum(losses) / len(losses)}
                )
                losses = []
                op.report_progress(batch)
            if batch % validation_every == 0:
                validate(batch)
                checkpoint(batch)
            if batch % REPORT_EVERY == 0 and core_context.preempt.should_preempt():
                # Paused, or the scheduler needs the slot: save and exit; det-local (like
                # Determined) restarts the trial later from this checkpoint.
                checkpoint(batch)
                return

        if losses:
            core_context.train.report_training_metrics(
                steps_completed=batch, metrics={"loss": sum(losses) / len(losses)}
            )
        validate(batch)
        checkpoint(batch)
        op.report_completed(val_metrics["validation_loss"])


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format=det.LOG_FORMAT)
    info = det.get_cluster_info()
    if info is not None:
        latest_checkpoint = info.latest_checkpoint
        trial_id = info.trial.trial_id
        hparams = info.trial.hparams
        seed = info.trial.trial_seed
    else:  # plain `python3 train.py`
        latest_checkpoint, trial_id, hparams, seed = None, None, DEFAULT_HPARAMS, 0

    with core.init() as core_context:
        main(core_context, latest_checkpoint, trial_id, hparams, seed)

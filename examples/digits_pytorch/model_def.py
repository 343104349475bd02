"""A PyTorchTrial on scikit-learn's bundled digits: a small MLP, written the way Determined's
PyTorch tutorials and harness fixtures are.

The data are the same as examples/digits_core: 1797 8x8 images bundled with scikit-learn (no
download), scaled to [0, 1], split 80/20 with a fixed seed so that every trial validates on the
same images.

The class takes only the context (hyperparameters come from ``context.get_hparams()``), so it
runs both ways Determined runs a PyTorchTrial:

* ``entrypoint: model_def:DigitsTrial`` (const_legacy.yaml): the Trial harness builds it and
  trains for ``searcher.max_length``;
* ``entrypoint: python3 train.py`` (const.yaml): train.py builds it and calls
  ``pytorch.Trainer(trial, context).fit(max_length=...)``.
"""

from typing import Any

import torch
from determined import pytorch
from sklearn.datasets import load_digits
from torch import nn

VALIDATION_FRACTION = 0.2
DATA_SEED = 1234  # the train/validation split never changes between trials


def load_data(train: bool) -> torch.utils.data.TensorDataset:
    digits = load_digits()  # bundled with scikit-learn: no download
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(DATA_SEED))
    n_val = int(len(x) * VALIDATION_FRACTION)
    idx = order[n_val:] if train else order[:n_val]
    return torch.utils.data.TensorDataset(x[idx], y[idx])


def build_model(hparams: dict[str, Any]) -> nn.Module:
    hidden = int(hparams["hidden_size"])
    return nn.Sequential(
        nn.Linear(64, hidden),
        nn.ReLU(),
        nn.Dropout(float(hparams.get("dropout", 0.0))),
        nn.Linear(hidden, 10),
    )


class DigitsTrial(pytorch.PyTorchTrial):
    def __init__(self, context: pytorch.PyTorchTrialContext) -> None:
        self.context = context
        hparams = context.get_hparams()

        self.model = self.context.wrap_model(build_model(hparams))
        self.optimizer = self.context.wrap_optimizer(
            torch.optim.SGD(
                self.model.parameters(),
                lr=float(hparams["lr"]),
                momentum=float(hparams.get("momentum", 0.9)),
            )
        )
        # Optional: decay the learning rate once per epoch.
        gamma = float(hparams.get("lr_decay", 1.0))
        if gamma != 1.0:
            self.context.wrap_lr_scheduler(
                torch.optim.lr_scheduler.ExponentialLR(self.optimizer, gamma=gamma),
                step_mode=pytorch.LRScheduler.StepMode.STEP_EVERY_EPOCH,
            )
        self.loss_fn = nn.CrossEntropyLoss()

    def build_training_data_loader(self) -> pytorch.DataLoader:
        return pytorch.DataLoader(
            load_data(train=True),
            batch_size=self.context.get_per_slot_batch_size(),
            shuffle=True,
            drop_last=True,
        )

    def build_validation_data_loader(self) -> pytorch.DataLoader:
        return pytorch.DataLoader(
            load_data(train=False), batch_size=self.context.get_per_slot_batch_size()
        )

    def train_batch(
        self, batch: pytorch.TorchData, epoch_idx: int, batch_idx: int
    ) -> dict[str, torch.Tensor]:
        data, labels = batch
        loss = self.loss_fn(self.model(data), labels)
        self.context.backward(loss)
        self.context.step_optimizer(self.optimizer)
        return {"loss": loss}

    def evaluate_batch(self, batch: pytorch.TorchData, batch_idx: int) -> dict[str, Any]:
        data, labels = batch
        output = self.model(data)
        validation_loss = self.loss_fn(output, labels).item()
        accuracy = (output.argmax(dim=1) == labels).float().mean().item()
        return {"validation_loss": validation_loss, "accuracy": accuracy}

"""Train DigitsTrial with the PyTorch Trainer API (Determined 0.38 style).

The same script runs three ways, unchanged:

* ``python3 train.py [--batches N | --epochs N]``: local training, no cluster; the
  hyperparameters come from const.yaml (next to this file), or the defaults below without it;
* ``det-local run const.yaml .``: a det-local trial; hyperparameters, seed and the checkpoint to
  resume from come from ``det.get_cluster_info()``;
* ``det experiment create const.yaml .`` on a Determined cluster.
"""

import argparse
import logging
import pathlib
from typing import Any, Optional

import determined as det
import yaml
from determined import pytorch
from model_def import DigitsTrial

DEFAULT_HPARAMS: dict[str, Any] = {
    "global_batch_size": 64,
    "lr": 0.05,
    "momentum": 0.9,
    "hidden_size": 64,
    "dropout": 0.0,
    "lr_decay": 1.0,
}
VALIDATION_PERIOD = pytorch.Batch(100)


def local_config() -> dict[str, Any]:
    """const.yaml as the experiment config for local training, or a minimal one."""
    path = pathlib.Path(__file__).resolve().parent / "const.yaml"
    if path.exists():
        conf: dict[str, Any] = yaml.safe_load(path.read_text())
        return conf
    return {"hyperparameters": DEFAULT_HPARAMS}


def run(max_length: pytorch.TrainUnit, local: bool = False) -> None:
    info = det.get_cluster_info()
    latest_checkpoint: Optional[str] = None
    if local:
        exp_conf: Optional[dict[str, Any]] = local_config()
        hparams = {**DEFAULT_HPARAMS, **exp_conf.get("hyperparameters", {})}
    else:
        assert info is not None
        exp_conf = None  # on-cluster, pytorch.init() takes the experiment's own config
        hparams = info.trial.hparams
        latest_checkpoint = info.latest_checkpoint  # resume after a pause

    with pytorch.init(hparams=hparams, exp_conf=exp_conf) as train_context:
        trial = DigitsTrial(train_context)
        trainer = pytorch.Trainer(trial, train_context)
        trainer.fit(
            max_length=max_length,
            validation_period=VALIDATION_PERIOD,
            latest_checkpoint=latest_checkpoint,
        )


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format=det.LOG_FORMAT)

    parser = argparse.ArgumentParser()
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--batches", type=int)
    group.add_argument("--epochs", type=int)
    args = parser.parse_args()
    if args.batches:
        max_length: pytorch.TrainUnit = pytorch.Batch(args.batches)
    elif args.epochs:
        max_length = pytorch.Epoch(args.epochs)
    else:
        max_length = pytorch.Batch(300)  # default training length

    run(max_length, local=det.get_cluster_info() is None)

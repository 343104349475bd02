"""The data side of a Trainer's loop: the training and validation loaders the trial builds
(sharded over the ranks, the training one repeating and skipping what a resumed run already
trained on), the training iterator, and the shuffle seed a checkpoint carries."""

from __future__ import annotations

import sys
from typing import Any

from det_local.trial.pytorch._data import DataLoader, dataset_repro_error
from det_local.trial.pytorch._errors import InvalidTrialError
from det_local.trial.pytorch._fit import TrialEnv
from det_local.trial.pytorch.samplers import ReproducibleShuffleSampler


class TrainingData:
    """A PyTorchTrial's loaders: set_loaders(), then start(); train_enum yields
    (batch_idx, batch)."""

    def __init__(self, env: TrialEnv, eval_by_batch: bool) -> None:
        self.env = env
        self.eval_by_batch = eval_by_batch
        self.training_loader: Any = None
        self.validation_loader: Any = None
        self.train_iter: Any = None
        self.train_enum: Any = None
        self.train_shuffle: ReproducibleShuffleSampler | None = None

    # ------------------------------------------------------------------ shared by the loops
    def set_training_loader(
        self, skip: int, replicas: int, rank: int, checks_off: bool, *disable_hint: str
    ) -> Any:
        """training_loader from build_training_data_loader(): repeating, sharded over the
        ranks, `skip` batches in (a resumed trial). Returns what the trial built."""
        train_data = self.env.trial.build_training_data_loader()
        if isinstance(train_data, DataLoader):
            if isinstance(train_data.sampler, ReproducibleShuffleSampler):
                self.train_shuffle = train_data.sampler
            self.training_loader = train_data.get_data_loader(
                repeat=True, skip=skip, num_replicas=replicas, rank=rank
            )
        elif checks_off:
            self.training_loader = train_data
        else:
            raise dataset_repro_error(
                "build_training_data_loader", train_data, self.env.name, *disable_hint
            )
        return train_data

    def set_validation_loader(
        self, replicas: int, rank: int, checks_off: bool, *disable_hint: str
    ) -> None:
        """validation_loader from build_validation_data_loader(): sharded over the ranks when
        evaluating by batch; on the chief alone for evaluate_full_dataset."""
        validation_data = self.env.trial.build_validation_data_loader()
        if not self.eval_by_batch and not self.env.is_chief:
            self.validation_loader = None  # evaluate_full_dataset runs on the chief alone
        elif isinstance(validation_data, DataLoader):
            shards = (replicas, rank) if self.eval_by_batch else (1, 0)
            self.validation_loader = validation_data.get_data_loader(
                repeat=False, skip=0, num_replicas=shards[0], rank=shards[1]
            )
        elif checks_off:
            self.validation_loader = validation_data
        else:
            raise dataset_repro_error(
                "build_validation_data_loader", validation_data, self.env.name, *disable_hint
            )

    # ------------------------------------------------------------------ what a loop changes
    def set_loaders(self, skip: int) -> None:
        """Both loaders, and the epoch length (the same on every rank) on the context."""
        dist, context = self.env.dist, self.env.context
        size, rank = dist.size, dist.rank
        checks_off = context.experimental._data_repro_checks_disabled
        self.set_training_loader(skip, size, rank, checks_off)
        try:
            epoch_len = len(self.training_loader)
        except TypeError:
            epoch_len = sys.maxsize
        epoch_len = dist.broadcast(epoch_len)
        if not epoch_len:
            raise InvalidTrialError(
                f"{self.env.name}.build_training_data_loader() returned a loader with no "
                "batches; check the dataset and the batch size"
            )
        context._epoch_len = epoch_len

        self.set_validation_loader(size, rank, checks_off)

    def data_skip(self, start: int, saved: dict[str, Any] | None) -> int:
        """How many loader batches a run resuming at batch `start` skips (`saved`: the
        checkpoint's trial_state.pkl, None for a fresh start)."""
        return start

    def start(self, start: int) -> None:
        """The training iterator, and train_enum: (batch_idx, batch) from `start` on."""
        self.train_iter = iter(self.training_loader)
        self.train_enum = enumerate(self.train_iter, start=start)

    def close(self) -> None:
        """Drop the iterator explicitly so multiprocess loader workers shut down now."""
        self.train_enum = None
        self.train_iter = None

    # ------------------------------------------------------------------ checkpointed state
    def det_local_state(self) -> dict[str, Any]:
        """det-local's own state for a checkpoint: the training shuffle's seed."""
        if self.train_shuffle is None:
            return {}
        return {"train_shuffle_seed": self.train_shuffle.seed}

    def resume(self, det_local: dict[str, Any]) -> None:
        """The training shuffle continues with the seed it started with, however this run's
        loader was seeded (no pass has started yet: the skip replays from the first epoch)."""
        seed = det_local.get("train_shuffle_seed")
        if seed is not None and self.train_shuffle is not None:
            self.train_shuffle._reseed(int(seed))

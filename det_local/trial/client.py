"""`determined.experimental.client` over det-local's store: get_checkpoint(uuid).download().

Reads the store read-only (DET_LOCAL_HOME); the copy is store.checkpoints.download_checkpoint.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class DownloadMode(enum.Enum):
    AUTO = "AUTO"
    DIRECT = "DIRECT"
    MASTER = "MASTER"


@dataclass
class CheckpointTrainingMetadata:
    experiment_config: dict[str, Any]
    experiment_id: int
    trial_id: int
    hparams: dict[str, Any]
    validation_metrics: dict[str, Any] = field(default_factory=dict)


class Checkpoint:
    """A checkpoint recorded by det-local (Determined's client.Checkpoint, read-only)."""

    def __init__(self, record: Any, training: CheckpointTrainingMetadata | None) -> None:
        self._record = record
        self.uuid: str = record.uuid
        self.state: str = record.state
        self.metadata: dict[str, Any] = dict(record.metadata)
        self.resources: dict[str, int] = dict(record.resources)
        self.training = training

    def download(self, path: str | None = None, mode: DownloadMode = DownloadMode.AUTO) -> str:
        """Copy the checkpoint to `path` (default checkpoints/<uuid> under the current directory)
        and return that path; nothing is copied when it already holds a metadata.json."""
        from det_local.store.checkpoints import download_checkpoint

        dest = (Path(path) if path is not None else Path("checkpoints") / self.uuid).absolute()
        download_checkpoint(self._record, dest)
        return str(dest)

    def __repr__(self) -> str:
        return f"Checkpoint(uuid={self.uuid!r}, state={self.state!r})"


def get_checkpoint(uuid: str) -> Checkpoint:
    """The checkpoint with this uuid (NotFoundError naming it when det-local has none)."""
    from det_local.errors import DetLocalError
    from det_local.store.db import Store
    from det_local.store.paths import Paths

    store = Store(Paths.from_env().db, readonly=True)
    try:
        record = store.get_checkpoint(uuid)
        training = None
        try:
            exp = store.get_experiment(record.experiment_id)
            trial = store.get_trial(record.trial_id)
            validations = [
                m
                for m in store.list_metrics(record.trial_id, "validation")
                if m.steps_completed == record.steps_completed
            ]
            training = CheckpointTrainingMetadata(
                experiment_config=dict(exp.config),
                experiment_id=record.experiment_id,
                trial_id=record.trial_id,
                hparams=dict(trial.hparams),
                validation_metrics=(
                    {"avgMetrics": dict(validations[-1].metrics)} if validations else {}
                ),
            )
        except DetLocalError:  # the checkpoint alone is enough to download it
            training = None
        return Checkpoint(record, training)
    finally:
        store.close()


__all__ = ["Checkpoint", "CheckpointTrainingMetadata", "DownloadMode", "get_checkpoint"]

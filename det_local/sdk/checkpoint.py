"""`Checkpoint` (Determined 0.38's client.Checkpoint) over det-local's store, and the sorting
that Experiment.list_checkpoints and Trial.list_checkpoints share."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from det_local.errors import DetLocalError, NotFoundError
from det_local.sdk._session import Session
from det_local.sdk.enums import (
    CheckpointSortBy,
    CheckpointState,
    DownloadMode,
    OrderBy,
    checkpoint_state,
    descending,
)
from det_local.store.records import CheckpointRecord

if TYPE_CHECKING:
    from det_local.sdk.metrics import TrialMetrics
    from det_local.store.db import Store


class CheckpointStateException(DetLocalError):
    """A checkpoint whose state does not allow the request (Determined's errors name)."""


@dataclass
class CheckpointTrainingMetadata:
    experiment_config: dict[str, Any]
    experiment_id: int
    trial_id: int
    hparams: dict[str, Any]
    validation_metrics: dict[str, Any] = field(default_factory=dict)


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return None if math.isnan(value) else float(value)


class Checkpoint:
    """A checkpoint of a trial: its files (``download``), its metadata, its training context.

    Attributes: uuid, state (a CheckpointState), metadata, resources (file -> bytes),
    report_time, training (CheckpointTrainingMetadata, or None when its experiment was deleted),
    task_id and allocation_id (None: det-local has no tasks)."""

    def __init__(self, session: Session, uuid: str) -> None:
        self._session = session
        self.uuid = uuid
        self.task_id: str | None = None
        self.allocation_id: str | None = None
        self.report_time: str | None = None
        self.resources: dict[str, Any] | None = None
        self.metadata: dict[str, Any] | None = None
        self.state: CheckpointState | None = None
        self.training: CheckpointTrainingMetadata | None = None
        self.steps_completed: int = 0
        self._record: CheckpointRecord | None = None

    # ------------------------------------------------------------------ reading
    @classmethod
    def _from_record(
        cls, session: Session, store: Store, record: CheckpointRecord, validation: Any = None
    ) -> Checkpoint:
        ckpt = cls(session, record.uuid)
        ckpt._hydrate(store, record, validation)
        return ckpt

    def _hydrate(self, store: Store, record: CheckpointRecord, validation: Any = None) -> None:
        import datetime

        self._record = record
        self.state = checkpoint_state(record.state)
        self.metadata = dict(record.metadata)
        self.resources = dict(record.resources)
        self.steps_completed = record.steps_completed
        self.report_time = datetime.datetime.fromtimestamp(
            record.created_at, datetime.timezone.utc
        ).isoformat()
        try:
            exp = store.get_experiment(record.experiment_id)
            trial = store.get_trial(record.trial_id)
        except NotFoundError:  # its experiment was deleted; the checkpoint stayed (registered)
            self.training = None
            return
        if validation is None:
            validation = _validation_at(store, record)
        self.training = CheckpointTrainingMetadata(
            experiment_config=dict(exp.config),
            experiment_id=record.experiment_id,
            trial_id=record.trial_id,
            hparams=dict(trial.hparams),
            validation_metrics={"avgMetrics": dict(validation)} if validation else {},
        )

    def reload(self) -> None:
        with self._session.store() as store:
            self._hydrate(store, store.get_checkpoint(self.uuid))

    # ------------------------------------------------------------------ files
    def download(self, path: str | None = None, mode: DownloadMode = DownloadMode.AUTO) -> str:
        """Copy the checkpoint's files to ``path`` (default ``checkpoints/<uuid>`` under the
        current directory) and return that path. Only COMPLETED or PARTIALLY_DELETED
        checkpoints can be downloaded."""
        from det_local.store.checkpoints import download_checkpoint

        if self._record is None:
            self.reload()
        assert self._record is not None
        if self.state not in (CheckpointState.COMPLETED, CheckpointState.PARTIALLY_DELETED):
            state = self.state.value if self.state else "unknown"
            raise CheckpointStateException(
                "Only COMPLETED or PARTIALLY_DELETED checkpoints can be downloaded. "
                f"Checkpoint state: {state}"
            )
        dest = (Path(path) if path is not None else Path("checkpoints") / self.uuid).absolute()
        download_checkpoint(self._record, dest)
        return str(dest)

    def write_metadata_file(self, path: str) -> None:
        import json

        Path(path).write_text(json.dumps(self.metadata or {}, indent=2, sort_keys=True) + "\n")

    def delete(self) -> None:
        """Delete the checkpoint's files (its record stays, DELETED). Refused for a checkpoint
        registered in a model, one of a running experiment, or another user's."""
        self._session.send("checkpoint_delete", {"uuids": [self.uuid]})
        self.state = CheckpointState.DELETED

    # ------------------------------------------------------------------ metadata
    def add_metadata(self, metadata: dict[str, Any]) -> None:
        """Add (or replace) top-level keys of the checkpoint's user metadata (kept in the
        store, not in the checkpoint's files, as in Determined)."""
        updated = dict(self.metadata, **metadata) if self.metadata else dict(metadata)
        self.metadata = self._session.send(
            "checkpoint_metadata", {"uuid": self.uuid, "metadata": updated}
        )

    def remove_metadata(self, keys: list[str]) -> None:
        updated = {k: v for k, v in (self.metadata or {}).items() if k not in keys}
        self.metadata = self._session.send(
            "checkpoint_metadata", {"uuid": self.uuid, "metadata": updated}
        )

    def get_metrics(self, group: str | None = None) -> list[TrialMetrics]:
        """The metrics its trial reported at the checkpoint's steps_completed."""
        from det_local.sdk.metrics import trial_metrics

        if self._record is None:
            self.reload()
        assert self._record is not None
        rec = self._record
        return [
            m
            for m in trial_metrics(self._session, [rec.trial_id], group)
            if m.steps_completed == rec.steps_completed
        ]

    def __repr__(self) -> str:
        if self.training is not None:
            return (
                f"Checkpoint(uuid={self.uuid}, task_id={self.task_id},"
                f" trial_id={self.training.trial_id})"
            )
        return f"Checkpoint(uuid={self.uuid}, task_id={self.task_id})"


def get_checkpoint(session: Session, uuid: str) -> Checkpoint:
    with session.store() as store:
        return Checkpoint._from_record(session, store, store.get_checkpoint(uuid))


def _validation_at(store: Store, record: CheckpointRecord) -> dict[str, Any]:
    """The validation its trial recorded at the checkpoint's steps (the last one there)."""
    found: dict[str, Any] = {}
    for m in store.list_metrics(record.trial_id, "validation"):
        if m.steps_completed == record.steps_completed:
            found = dict(m.metrics)
    return found


# ---------------------------------------------------------------------- list_checkpoints
def check_sort(sort_by: Any, order_by: Any) -> None:
    """Determined's rules for list_checkpoints' arguments."""
    if (sort_by is None) != (order_by is None):
        raise AssertionError("sort_by and order_by must be either both set, or neither.")
    if sort_by and not isinstance(sort_by, (CheckpointSortBy, str)):
        raise ValueError("sort_by must be of type CheckpointSortBy or str")


def sorted_checkpoints(
    session: Session,
    store: Store,
    records: list[CheckpointRecord],
    config: dict[str, Any],
    sort_by: CheckpointSortBy | str | None,
    order_by: OrderBy | None,
    max_results: int | None,
) -> list[Checkpoint]:
    """Checkpoints sorted as Determined's master sorts them: by the searcher metric unless told
    otherwise (better first, as searcher.smaller_is_better says; checkpoints without the
    metric last); ties in trial order."""
    searcher = config.get("searcher") or {}
    if sort_by is None:
        sort_by = CheckpointSortBy.SEARCHER_METRIC
        order_by = OrderBy.ASC if searcher.get("smaller_is_better", True) else OrderBy.DESC
    assert order_by is not None
    vals = {r.uuid: _validation_at(store, r) for r in records}
    base = sorted(records, key=lambda r: (r.trial_id, r.steps_completed, r.created_at))
    metric = None
    if isinstance(sort_by, str):
        metric = sort_by
    elif sort_by == CheckpointSortBy.SEARCHER_METRIC:
        metric = searcher.get("metric")
    desc = descending(order_by)
    if metric is not None:
        with_value = [r for r in base if _number(vals[r.uuid].get(metric)) is not None]
        without = [r for r in base if _number(vals[r.uuid].get(metric)) is None]
        with_value.sort(key=lambda r: _number(vals[r.uuid][metric]) or 0.0, reverse=desc)
        ordered = with_value + without  # nulls last, whatever the order
    else:
        keys = {
            CheckpointSortBy.UUID: lambda r: r.uuid,
            CheckpointSortBy.TRIAL_ID: lambda r: r.trial_id,
            CheckpointSortBy.BATCH_NUMBER: lambda r: r.steps_completed,
            CheckpointSortBy.END_TIME: lambda r: r.created_at,
            CheckpointSortBy.STATE: lambda r: str(r.state),
        }
        ordered = sorted(base, key=keys[sort_by], reverse=desc)  # type: ignore[index]
    if max_results is not None:
        ordered = ordered[:max_results]
    return [Checkpoint._from_record(session, store, r, vals[r.uuid]) for r in ordered]


def warn_deprecated(what: str, instead: str) -> None:
    warnings.warn(
        f"{what} has been deprecated and will be removed in a future version."
        f"Please call {instead} instead.",
        FutureWarning,
        stacklevel=3,
    )

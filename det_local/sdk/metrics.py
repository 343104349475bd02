"""Determined's TrialMetrics (and the deprecated TrainingMetrics / ValidationMetrics), read
from the store in the order the trials reported them."""

from __future__ import annotations

import datetime
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from det_local.sdk._session import Session


@dataclass
class TrialMetrics:
    """One metric report of a trial: trial_id, trial_run_id, steps_completed, end_time,
    metrics, group ("training", "validation" or any group the trial reported)."""

    trial_id: int
    trial_run_id: int
    steps_completed: int
    end_time: datetime.datetime
    metrics: dict[str, Any]
    group: str
    batch_metrics: list[dict[str, Any]] | None = None

    @property
    def total_batches(self) -> int:
        """@deprecated: Use steps_completed instead."""
        return self.steps_completed

    @total_batches.setter
    def total_batches(self, value: int) -> None:
        self.steps_completed = value


class TrainingMetrics(TrialMetrics):
    """@deprecated: Use TrialMetrics instead."""

    def __init__(self, total_batches: int | None = None, **kwargs: Any) -> None:
        if total_batches is not None:
            kwargs["steps_completed"] = total_batches
        kwargs["group"] = "training"
        super().__init__(**kwargs)


class ValidationMetrics(TrialMetrics):
    """@deprecated: Use TrialMetrics instead."""

    def __init__(self, total_batches: int | None = None, **kwargs: Any) -> None:
        if total_batches is not None:
            kwargs["steps_completed"] = total_batches
        kwargs["group"] = "validation"
        super().__init__(**kwargs)


def trial_metrics(session: Session, trial_ids: list[int], group: str | None) -> list[TrialMetrics]:
    """Every report of `group` (every group: None) of these trials, trial by trial."""
    out: list[TrialMetrics] = []
    with session.store() as store:
        for tid in trial_ids:
            store.get_trial(tid)  # NotFoundError naming an unknown trial
            for m in store.list_metrics(tid, group):
                out.append(
                    TrialMetrics(
                        trial_id=m.trial_id,
                        trial_run_id=m.run_id,
                        steps_completed=m.steps_completed,
                        end_time=datetime.datetime.fromtimestamp(m.time, datetime.timezone.utc),
                        metrics=dict(m.metrics),
                        group=m.group,
                    )
                )
    return out


def iter_trials_metrics(
    session: Session, trial_ids: list[int], group: str
) -> Iterator[TrialMetrics]:
    yield from trial_metrics(session, trial_ids, group)


def iter_legacy(session: Session, trial_ids: list[int], group: str) -> Iterator[TrialMetrics]:
    """TrainingMetrics / ValidationMetrics objects, for the deprecated stream_* calls."""
    cls = TrainingMetrics if group == "training" else ValidationMetrics
    for m in trial_metrics(session, trial_ids, group):
        yield cls(
            trial_id=m.trial_id,
            trial_run_id=m.trial_run_id,
            steps_completed=m.steps_completed,
            end_time=m.end_time,
            metrics=m.metrics,
        )

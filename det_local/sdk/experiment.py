"""`Experiment` (Determined 0.38's client.Experiment) over det-local's store; changes go to
the engine as the caller (`sdk/_session.py`)."""

from __future__ import annotations

import sys
import time
import warnings
from typing import Any

from det_local.sdk import checkpoint as ck
from det_local.sdk import trial as _trial
from det_local.sdk._session import Session
from det_local.sdk.enums import (
    TERMINAL_STATES,
    CheckpointSortBy,
    ExperimentState,
    OrderBy,
    TrialSortBy,
    descending,
    experiment_state,
)
from det_local.sdk.trial import Trial
from det_local.store.records import ExperimentRecord, TrialRecord


class Experiment:
    """An experiment. Attributes (cached; ``reload()`` and ``wait()`` refresh them): id,
    config, state (an ExperimentState), archived, name, progress, description, notes,
    labels, project_id and workspace_id (None: det-local has no projects)."""

    def __init__(self, experiment_id: int, session: Session | None = None) -> None:
        self._id = experiment_id
        self._session = session or Session()
        self.config: dict[str, Any] | None = None
        self.state: ExperimentState | None = None
        self.labels: set[str] | None = None
        self.archived: bool | None = None
        self.name: str | None = None
        self.progress: float | None = None
        self.description: str | None = None
        self.notes: str | None = None
        self.project_id: int | None = None
        self.workspace_id: int | None = None
        self.user: str | None = None

    @property
    def id(self) -> int:
        return self._id

    def _hydrate(self, rec: ExperimentRecord, archived: bool) -> None:
        self.config = dict(rec.config)
        self.state = experiment_state(rec.state)
        self.archived = archived
        self.name = rec.name
        self.progress = rec.progress
        self.description = rec.description or ""
        self.notes = ""
        self.labels = set(rec.labels) if rec.labels else None
        self.user = rec.user

    def reload(self) -> None:
        """Explicit refresh of cached properties."""
        with self._session.store() as store:
            rec = store.get_experiment(self._id)
            self._hydrate(rec, self._id in store.lifecycle.archived())

    # ------------------------------------------------------------------ control
    def activate(self) -> None:
        self._session.control(self._id, "activate")

    def pause(self) -> None:
        self._session.control(self._id, "pause")

    def kill(self) -> None:
        self._session.control(self._id, "kill")

    def cancel(self) -> None:
        self._session.control(self._id, "kill")

    def archive(self) -> None:
        self._session.send("experiment_archive", {"experiment_id": self._id})
        self.archived = True

    def unarchive(self) -> None:
        self._session.send("experiment_unarchive", {"experiment_id": self._id})
        self.archived = False

    def delete(self) -> None:
        """Delete the experiment: its checkpoints (but those registered in a model), logs,
        context snapshot and records. Refused while it runs."""
        self._session.send("experiment_delete", {"experiment_id": self._id})

    def add_label(self, label: str) -> None:
        self._session.send("label_add", {"experiment_id": self._id, "label": label})
        self.labels = (self.labels or set()) | {label}

    def remove_label(self, label: str) -> None:
        self._session.send("label_remove", {"experiment_id": self._id, "label": label})
        self.labels = (self.labels or set()) - {label} or None

    def wait(self, interval: float = 5.0) -> ExperimentState:
        """Wait for the experiment to reach a terminal state; returns it (an ExperimentState).
        A PAUSED experiment raises ValueError, as in Determined."""
        elapsed = 0.0
        while True:
            self.reload()
            if self.state in TERMINAL_STATES:
                assert self.state is not None
                return self.state
            if self.state == ExperimentState.PAUSED:
                raise ValueError(
                    f"Experiment {self.id} is in paused state. Make sure the experiment is active."
                )
            time.sleep(interval)
            elapsed += interval
            if elapsed % 60 == 0:
                print(
                    f"Waiting for Experiment {self.id} to complete. Elapsed {elapsed / 60} minutes",
                    file=sys.stderr,
                )

    # ------------------------------------------------------------------ trials
    def list_trials(
        self, sort_by: TrialSortBy = TrialSortBy.ID, order_by: OrderBy = OrderBy.ASCENDING
    ) -> list[Trial]:
        return list(self.iter_trials(sort_by, order_by))

    def iter_trials(
        self, sort_by: TrialSortBy = TrialSortBy.ID, order_by: OrderBy = OrderBy.ASCENDING
    ) -> Any:
        with self._session.store() as store:
            records = store.list_trials(self._id)
            config = store.get_experiment(self._id).config
        for rec in _sort_trials(records, config, sort_by, order_by):
            yield Trial._from_record(self._session, rec)

    def get_trials(
        self, sort_by: TrialSortBy = TrialSortBy.ID, order_by: OrderBy = OrderBy.ASCENDING
    ) -> list[Trial]:
        warnings.warn(
            "Experiment.get_trials() has been deprecated and will be removed in a future version."
            "Please call Experiment.list_trials() instead.",
            FutureWarning,
            stacklevel=2,
        )
        return self.list_trials(sort_by, order_by)

    def await_first_trial(self, interval: float = 0.1) -> Trial:
        """Wait for the experiment's first trial to start; RuntimeError if it ends first."""
        while True:
            self.reload()
            with self._session.store() as store:
                started = [
                    t for t in store.list_trials(self._id) if store.jobs.for_trial(t.id) is not None
                ]
            if started:
                return Trial._from_record(self._session, min(started, key=lambda t: t.id))
            if self.state in TERMINAL_STATES:
                raise RuntimeError(
                    "This experiment has terminated before a trial was started."
                    f" Experiment is in state {self.state}."
                )
            time.sleep(interval)

    # ------------------------------------------------------------------ checkpoints
    def list_checkpoints(
        self,
        sort_by: str | CheckpointSortBy | None = None,
        order_by: OrderBy | None = None,
        max_results: int | None = None,
    ) -> list[ck.Checkpoint]:
        """The experiment's COMPLETED checkpoints, sorted. Requires either both `sort_by` and
        `order_by`, or neither: then by the searcher metric, best first (as
        searcher.smaller_is_better says), checkpoints without it last."""
        ck.check_sort(sort_by, order_by)
        with self._session.store() as store:
            config = store.get_experiment(self._id).config
            records = [
                r
                for r in store.list_checkpoints(experiment_id=self._id)
                if ck.checkpoint_state(r.state) == ck.CheckpointState.COMPLETED
            ]
            return ck.sorted_checkpoints(
                self._session, store, records, config, sort_by, order_by, max_results
            )

    def top_checkpoint(
        self, sort_by: str | None = None, smaller_is_better: bool | None = None
    ) -> ck.Checkpoint:
        ck.warn_deprecated(
            "Experiment.top_checkpoint()", "Experiment.list_checkpoints(...,max_results=1)"
        )
        order_by = None
        if sort_by:
            order_by = OrderBy.ASC if smaller_is_better else OrderBy.DESC
        found = self.list_checkpoints(sort_by=sort_by, order_by=order_by, max_results=1)
        if not found:
            raise AssertionError(f"No checkpoints found for experiment {self.id}")
        return found[0]

    def top_n_checkpoints(
        self, limit: int, sort_by: str | None = None, smaller_is_better: bool | None = None
    ) -> list[ck.Checkpoint]:
        """The best checkpoint of each of the best `limit` trials."""
        ck.warn_deprecated(
            "Experiment.top_n_checkpoints()", "Experiment.list_checkpoints(...,max_results=n)"
        )
        with self._session.store() as store:
            config = store.get_experiment(self._id).config
        searcher = config.get("searcher") or {}
        if not sort_by:
            metric = searcher.get("metric")
            if not isinstance(metric, str):
                raise ValueError(
                    "no searcher.metric found in experiment config; please provide a sort_by metric"
                )
            sort_by = metric
            smaller_is_better = searcher.get("smaller_is_better", True)
        order = OrderBy.ASC if smaller_is_better else OrderBy.DESC
        found = self.list_checkpoints(sort_by=sort_by, order_by=order)
        if not found:
            raise AssertionError(f"No checkpoint found for experiment {self.id}")
        seen: set[int] = set()
        best: list[ck.Checkpoint] = []
        for c in found:
            tid = c.training.trial_id if c.training else -1
            if tid not in seen:
                seen.add(tid)
                best.append(c)
        return best[:limit]

    def download_code(self, output_dir: str | None = None) -> str:
        """The experiment's context snapshot as exp-{ID}_model_def.tar.gz (in output_dir,
        else the current directory); its path."""
        import pathlib
        import tarfile

        name = f"exp-{self.id}_model_def.tar.gz"
        out = pathlib.Path(output_dir).expanduser() if output_dir else pathlib.Path(".")
        out.mkdir(parents=True, exist_ok=True)
        src = self._session.paths.context_dir(self.id)
        with tarfile.open(out / name, "w:gz") as tar:
            tar.add(src, arcname=".")
        return str(out / name)

    def __repr__(self) -> str:
        return f"Experiment(id={self.id})"


def _sort_trials(
    records: list[TrialRecord], config: dict[str, Any], sort_by: TrialSortBy, order_by: OrderBy
) -> list[TrialRecord]:
    smaller = (config.get("searcher") or {}).get("smaller_is_better", True)
    keys: dict[TrialSortBy, Any] = {
        TrialSortBy.ID: lambda t: t.id,
        TrialSortBy.START_TIME: lambda t: t.created_at,
        TrialSortBy.END_TIME: lambda t: t.ended_at or float("inf"),
        TrialSortBy.STATE: lambda t: t.state.value,
        TrialSortBy.BATCHES_PROCESSED: lambda t: t.steps_completed,
        TrialSortBy.RESTARTS: lambda t: t.restarts,
        TrialSortBy.DURATION: lambda t: (t.ended_at or time.time()) - t.created_at,
        TrialSortBy.BEST_VALIDATION_METRIC: lambda t: (
            t.best_validation is None,
            (t.best_validation or 0.0) * (1 if smaller else -1),
        ),
    }
    key = keys.get(sort_by, keys[TrialSortBy.ID])
    return sorted(sorted(records, key=lambda t: t.id), key=key, reverse=descending(order_by))


def get_experiment(session: Session, experiment_id: int) -> Experiment:
    exp = Experiment(experiment_id, session)
    exp.reload()
    return exp


_trial.experiment_maker[:] = [get_experiment]  # Trial.get_experiment()


def list_experiments(
    session: Session,
    *,
    experiment_ids: list[int] | None = None,
    labels: list[str] | None = None,
    users: list[str] | None = None,
    states: list[ExperimentState] | None = None,
    name: str | None = None,
) -> list[Experiment]:
    out = []
    with session.store() as store:
        archived = store.lifecycle.archived()
        for rec in store.list_experiments():
            if experiment_ids is not None and rec.id not in experiment_ids:
                continue
            if labels is not None and not set(labels) & set(rec.labels):
                continue
            if users is not None and rec.user not in users:
                continue
            if states is not None and experiment_state(rec.state) not in states:
                continue
            if name is not None and name not in rec.name:
                continue
            full = store.get_experiment(rec.id)
            exp = Experiment(rec.id, session)
            exp._hydrate(full, rec.id in archived)
            out.append(exp)
    return sorted(out, key=lambda e: e.id)

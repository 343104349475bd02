"""`Experiment` and `Trial` (Determined 0.38's client.Experiment and client.Trial) over
det-local's store; changes go to the engine as the caller (`sdk/_session.py`). One module: each
hands out the other."""

from __future__ import annotations

import sys
import time
import warnings
from collections.abc import Iterator
from typing import Any

from det_local.sdk import checkpoint as ck
from det_local.sdk._session import Session
from det_local.sdk.enums import (
    TERMINAL_STATES,
    CheckpointSortBy,
    ExperimentState,
    LogLevel,
    OrderBy,
    TrialSortBy,
    TrialState,
    descending,
    experiment_state,
    trial_state,
)
from det_local.sdk.metrics import TrialMetrics, iter_legacy, iter_trials_metrics
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


FOLLOW_POLL_S = 0.2


class Trial:
    """One trial of an experiment. Attributes (cached; ``reload()`` refreshes them): id,
    experiment_id, hparams, summary_metrics, state (a TrialState)."""

    def __init__(self, trial_id: int, session: Session | None = None) -> None:
        self.id = trial_id
        self._session = session or Session()
        self.experiment_id: int | None = None
        self.hparams: dict[str, Any] | None = None
        self.summary_metrics: dict[str, Any] | None = None
        self.state: TrialState | None = None

    def _hydrate(self, rec: TrialRecord) -> None:
        self.experiment_id = rec.experiment_id
        self.hparams = dict(rec.hparams)
        self.state = trial_state(rec.state)
        self.summary_metrics = {
            "steps_completed": rec.steps_completed,
            "best_validation": rec.best_validation,
        }

    def reload(self) -> None:
        with self._session.store() as store:
            self._hydrate(store.get_trial(self.id))

    @classmethod
    def _from_record(cls, session: Session, rec: TrialRecord) -> Trial:
        t = cls(rec.id, session)
        t._hydrate(rec)
        return t

    def get_experiment(self) -> Experiment:
        """The trial's Experiment."""
        if not self.experiment_id:
            self.reload()
        assert self.experiment_id is not None
        return get_experiment(self._session, self.experiment_id)

    # ------------------------------------------------------------------ control
    def kill(self) -> None:
        """Stop this trial; the searcher hears it exited early (USER_CANCELED)."""
        self._session.send("trial_kill", {"trial_id": self.id})

    # ------------------------------------------------------------------ logs
    def iter_logs(
        self,
        follow: bool = False,
        *,
        head: int | None = None,
        tail: int | None = None,
        container_ids: list[str] | None = None,
        rank_ids: list[int] | None = None,
        stdtypes: list[str] | None = None,
        min_level: LogLevel | None = None,
        timestamp_before: str | int | None = None,
        timestamp_after: str | int | None = None,
        sources: list[str] | None = None,
        search_text: str | None = None,
    ) -> Iterator[str]:
        """The trial's output lines (each ending in a newline). ``follow``: go on until the
        trial ends. rank_ids keeps the lines of those ranks (`[rank=N] ` prefixes);
        search_text those containing it. det-local's logs carry no container, stream, level,
        timestamp or source: those filters are not applied."""
        if sum(x is not None and x is not False for x in (follow or None, head, tail)) > 1:
            raise ValueError("follow, head and tail are mutually exclusive")
        with self._session.store() as store:
            rec = store.get_trial(self.id)
        path = self._session.paths.trial_log(rec.experiment_id, self.id)

        def wanted(line: str) -> bool:
            if search_text is not None and search_text not in line:
                return False
            if rank_ids is not None:
                return any(line.startswith(f"[rank={r}] ") for r in rank_ids)
            return True

        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                lines = [ln for ln in f.read().splitlines(keepends=True) if wanted(ln)]
                offset = f.tell()
        except FileNotFoundError:
            lines, offset = [], 0
        if head is not None:
            lines = lines[:head]
        elif tail is not None:
            lines = lines[-tail:] if tail else []
        yield from lines
        if not follow:
            return
        pending = ""
        while True:
            with self._session.store() as store:
                done = store.get_trial(self.id).state.terminal
            try:
                with open(path, encoding="utf-8", errors="replace") as f:
                    f.seek(offset)
                    data = f.read()
                    offset = f.tell()
            except FileNotFoundError:
                data = ""
            pending += data
            *complete, pending = pending.split("\n")
            for ln in complete:
                if wanted(ln + "\n"):
                    yield ln + "\n"
            if done and not data:
                if pending and wanted(pending):
                    yield pending
                return
            time.sleep(FOLLOW_POLL_S)

    def logs(self, *args: Any, **kwargs: Any) -> Iterator[str]:
        """DEPRECATED: Use iter_logs instead."""
        warnings.warn(
            "Trial.logs() has been deprecated and will be removed in a future version."
            "Please call Trial.iter_logs() instead.",
            FutureWarning,
            stacklevel=2,
        )
        return self.iter_logs(*args, **kwargs)

    # ------------------------------------------------------------------ checkpoints
    def list_checkpoints(
        self,
        sort_by: str | CheckpointSortBy | None = None,
        order_by: OrderBy | None = None,
        max_results: int | None = None,
    ) -> list[ck.Checkpoint]:
        """The trial's checkpoints, sorted. Requires either both `sort_by` and `order_by`, or
        neither: then by the experiment's searcher metric, best first."""
        ck.check_sort(sort_by, order_by)
        with self._session.store() as store:
            rec = store.get_trial(self.id)
            config = store.get_experiment(rec.experiment_id).config
            records = store.list_checkpoints(trial_id=self.id)
            return ck.sorted_checkpoints(
                self._session, store, records, config, sort_by, order_by, max_results
            )

    def top_checkpoint(
        self, sort_by: str | None = None, smaller_is_better: bool | None = None
    ) -> ck.Checkpoint:
        ck.warn_deprecated("Trial.top_checkpoint()", "Trial.list_checkpoints(...,max_results=1)")
        order_by = None
        if sort_by:
            order_by = OrderBy.ASC if smaller_is_better else OrderBy.DESC
        found = self.list_checkpoints(sort_by=sort_by, order_by=order_by, max_results=1)
        if not found:
            raise ValueError("No checkpoints found for criteria.")
        return found[0]

    def select_checkpoint(
        self,
        latest: bool = False,
        best: bool = False,
        uuid: str | None = None,
        sort_by: str | None = None,
        smaller_is_better: bool | None = None,
    ) -> ck.Checkpoint:
        ck.warn_deprecated("Trial.select_checkpoint()", "Trial.list_checkpoints()")
        if sum([int(latest), int(best), int(uuid is not None)]) != 1:
            raise AssertionError("Exactly one of latest, best, or uuid must be set")
        if (sort_by is None) != (smaller_is_better is None):
            raise AssertionError("sort_by and smaller_is_better must be set together")
        if sort_by is not None and not best:
            raise AssertionError(
                "`sort_by` and `smaller_is_better` parameters can only be used with `best`"
            )
        if uuid:
            return ck.get_checkpoint(self._session, uuid)
        key: str | CheckpointSortBy | None = sort_by
        order_by = None
        if latest:
            key, order_by = CheckpointSortBy.BATCH_NUMBER, OrderBy.DESC
        if sort_by:
            order_by = OrderBy.ASC if smaller_is_better else OrderBy.DESC
        found = self.list_checkpoints(sort_by=key, order_by=order_by, max_results=1)
        if not found:
            raise ValueError("No checkpoints found for criteria.")
        return found[0]

    # ------------------------------------------------------------------ metrics
    def iter_metrics(self, group: str) -> Iterator[TrialMetrics]:
        """The trial's metric reports of `group` ("training", "validation", or any group it
        reported), as TrialMetrics."""
        return iter_trials_metrics(self._session, [self.id], group)

    def stream_metrics(self, group: str) -> Iterator[TrialMetrics]:
        warnings.warn(
            "Experiment.stream_metrics() has been deprecated and will be removed in a"
            " future version. Please call Experiment.iter_trials() instead.",
            FutureWarning,
            stacklevel=2,
        )
        return self.iter_metrics(group)

    def stream_training_metrics(self) -> Iterator[TrialMetrics]:
        warnings.warn(
            "Trial.stream_training_metrics is deprecated."
            "Use Trial.iter_metrics instead with `group` set to 'training'",
            FutureWarning,
            stacklevel=2,
        )
        return iter_legacy(self._session, [self.id], "training")

    def stream_validation_metrics(self) -> Iterator[TrialMetrics]:
        warnings.warn(
            "Trial.stream_validation_metrics is deprecated."
            "Use Trial.iter_metrics instead with `group` set to 'validation'",
            FutureWarning,
            stacklevel=2,
        )
        return iter_legacy(self._session, [self.id], "validation")

    def __repr__(self) -> str:
        return f"Trial(id={self.id})"


def get_trial(session: Session, trial_id: int) -> Trial:
    with session.store() as store:
        return Trial._from_record(session, store.get_trial(trial_id))

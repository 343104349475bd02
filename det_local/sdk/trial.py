"""`Trial` (Determined 0.38's client.Trial) over det-local's store."""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from det_local.sdk import checkpoint as ck
from det_local.sdk._session import Session
from det_local.sdk.enums import (
    CheckpointSortBy,
    LogLevel,
    OrderBy,
    TrialState,
    trial_state,
)
from det_local.sdk.metrics import TrialMetrics, iter_legacy, iter_trials_metrics
from det_local.store.records import TrialRecord

if TYPE_CHECKING:
    from det_local.sdk.experiment import Experiment

FOLLOW_POLL_S = 0.2

# How a Trial makes its Experiment: experiment.py (which imports this module) sets it, so that
# the two modules do not import each other.
experiment_maker: list[Callable[[Session, int], Experiment]] = []


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
        return experiment_maker[0](self._session, self.experiment_id)

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

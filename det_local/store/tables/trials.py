"""The trials table: records, states, runs and restarts, progress."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from det_local.errors import NotFoundError
from det_local.store.records import TrialRecord
from det_local.store.sql import Db, dumps
from det_local.store.states import State, check_transition

SCHEMA = """
CREATE TABLE IF NOT EXISTS trials (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    experiment_id INTEGER NOT NULL REFERENCES experiments(id),
    state TEXT NOT NULL,
    hparams TEXT NOT NULL,
    seed INTEGER NOT NULL,
    run_id INTEGER NOT NULL DEFAULT 0,
    restarts INTEGER NOT NULL DEFAULT 0,
    steps_completed INTEGER NOT NULL DEFAULT 0,
    latest_checkpoint TEXT,
    warm_start_checkpoint TEXT,
    best_validation REAL,
    created_at REAL NOT NULL,
    ended_at REAL,
    message TEXT
);
CREATE INDEX IF NOT EXISTS trials_by_experiment ON trials(experiment_id);
"""


@dataclass
class TrialSummary:
    """An experiment's trials at a glance: how many in each state, best validations' range."""

    counts: dict[str, int] = field(default_factory=dict)
    lowest: float | None = None
    highest: float | None = None


_COLS = (
    "id, experiment_id, state, hparams, seed, run_id, restarts, steps_completed,"
    " latest_checkpoint, warm_start_checkpoint, best_validation, created_at, ended_at, message"
)


def _record(row: Sequence[Any]) -> TrialRecord:
    return TrialRecord(
        id=row[0],
        experiment_id=row[1],
        state=State(row[2]),
        hparams=json.loads(row[3]),
        seed=row[4],
        run_id=row[5],
        restarts=row[6],
        steps_completed=row[7],
        latest_checkpoint=row[8],
        warm_start_checkpoint=row[9],
        best_validation=row[10],
        created_at=row[11],
        ended_at=row[12],
        message=row[13],
    )


class TrialTable:
    """Trial rows (the Store owns the connection)."""

    def __init__(self, db: Db) -> None:
        self.db = db
        self.conn = db.conn

    def create(
        self,
        experiment_id: int,
        *,
        hparams: dict[str, Any],
        seed: int,
        warm_start_checkpoint: str | None = None,
    ) -> int:
        cur = self.db.write(
            "INSERT INTO trials(experiment_id, state, hparams, seed, warm_start_checkpoint,"
            " created_at) VALUES (?, ?, ?, ?, ?, ?)",
            (
                experiment_id,
                State.ACTIVE.value,
                dumps(hparams),
                seed,
                warm_start_checkpoint,
                time.time(),
            ),
        )
        assert cur.lastrowid is not None
        return int(cur.lastrowid)

    def get(self, trial_id: int) -> TrialRecord:
        row = self.conn.execute(f"SELECT {_COLS} FROM trials WHERE id=?", (trial_id,)).fetchone()
        if row is None:
            raise NotFoundError(
                f"trial {trial_id} not found; `det-local trial list EXPERIMENT_ID` shows the ids"
            )
        return _record(row)

    def select(self, experiment_id: int | None = None) -> list[TrialRecord]:
        if experiment_id is None:
            rows = self.conn.execute(f"SELECT {_COLS} FROM trials ORDER BY id")
        else:
            rows = self.conn.execute(
                f"SELECT {_COLS} FROM trials WHERE experiment_id=? ORDER BY id",
                (experiment_id,),
            )
        return [_record(r) for r in rows]

    def summaries(self) -> dict[int, TrialSummary]:
        """experiment id -> its trials counted by state, and the lowest and highest best
        validation among them (one query over every experiment)."""
        out: dict[int, TrialSummary] = {}
        rows = self.conn.execute(
            "SELECT experiment_id, state, count(*), min(best_validation), max(best_validation)"
            " FROM trials GROUP BY experiment_id, state"
        )
        for exp_id, state, n, lo, hi in rows:
            s = out.setdefault(int(exp_id), TrialSummary())
            s.counts[str(state)] = int(n)
            if lo is not None:
                s.lowest = lo if s.lowest is None else min(s.lowest, lo)
                s.highest = hi if s.highest is None else max(s.highest, hi)
        return out

    def set_state(self, trial_id: int, state: State, message: str | None = None) -> None:
        """StateError when the transition table does not allow the move."""
        old = self.get(trial_id).state
        check_transition("trial", trial_id, old, state)
        ended = time.time() if state.terminal else None
        self.db.write(
            "UPDATE trials SET state=?, ended_at=?, message=COALESCE(?, message) WHERE id=?",
            (state.value, ended, message, trial_id),
        )

    def next_run(self, trial_id: int) -> int:
        """A new run (process launch) of the trial; returns its run id (1, 2, ...)."""
        self.db.write("UPDATE trials SET run_id = run_id + 1 WHERE id=?", (trial_id,))
        return self.get(trial_id).run_id

    def add_restart(self, trial_id: int) -> int:
        self.db.write("UPDATE trials SET restarts = restarts + 1 WHERE id=?", (trial_id,))
        return self.get(trial_id).restarts

    def set_steps(self, trial_id: int, steps_completed: int) -> None:
        self.db.write(
            "UPDATE trials SET steps_completed=MAX(steps_completed, ?) WHERE id=?",
            (steps_completed, trial_id),
        )

    def set_best_validation(self, trial_id: int, value: float) -> None:
        self.db.write("UPDATE trials SET best_validation=? WHERE id=?", (value, trial_id))

    def warm_start_checkpoints(self) -> set[str]:
        """Every checkpoint a trial (of any experiment) was warm-started from."""
        rows = self.conn.execute(
            "SELECT DISTINCT warm_start_checkpoint FROM trials"
            " WHERE warm_start_checkpoint IS NOT NULL"
        )
        return {str(r[0]) for r in rows}

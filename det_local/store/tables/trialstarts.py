"""How long each run of a trial took to start, cold or warm (`sched/warm/starttimes.py` measures
it): one row per run, what `experiment describe` summarises."""

from __future__ import annotations

import sqlite3

from det_local.store.sql import Db

SCHEMA = """
CREATE TABLE IF NOT EXISTS trial_starts (
    trial_id INTEGER NOT NULL,
    run_id INTEGER NOT NULL,
    experiment_id INTEGER NOT NULL,
    warm INTEGER NOT NULL,
    seconds REAL NOT NULL,
    PRIMARY KEY (trial_id, run_id)
);
CREATE INDEX IF NOT EXISTS trial_starts_by_experiment ON trial_starts(experiment_id);
"""


class TrialStartTable:
    def __init__(self, db: Db) -> None:
        self.db = db

    def add(
        self, experiment_id: int, trial_id: int, run_id: int, warm: bool, seconds: float
    ) -> None:
        self.db.write(
            "INSERT OR REPLACE INTO trial_starts(trial_id, run_id, experiment_id, warm, seconds)"
            " VALUES (?, ?, ?, ?, ?)",
            (trial_id, run_id, experiment_id, int(warm), seconds),
        )

    def select(self, experiment_id: int) -> list[tuple[int, int, bool, float]]:
        """(trial id, run id, warm, seconds) of the experiment's runs, in trial and run order."""
        try:
            rows = self.db.conn.execute(
                "SELECT trial_id, run_id, warm, seconds FROM trial_starts WHERE experiment_id=?"
                " ORDER BY trial_id, run_id",
                (experiment_id,),
            ).fetchall()
        except sqlite3.OperationalError:  # a database from before the table (read-only)
            return []
        return [(int(t), int(r), bool(w), float(s)) for t, r, w, s in rows]

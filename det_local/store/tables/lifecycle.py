"""What users do with runs after they end: archive an experiment (it leaves `experiment
list`), edit a checkpoint's metadata, delete an experiment's records.

Only the engine writes (`sched/intake/lifecycle/`); readers use :meth:`LifecycleTable.archived`.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Iterable
from typing import Any

from det_local.store.sql import Db, Savepoint, dumps

SCHEMA = """
CREATE TABLE IF NOT EXISTS experiments_archived (
    experiment_id INTEGER PRIMARY KEY,
    archived_at REAL NOT NULL
);
"""


class LifecycleTable:
    def __init__(self, db: Db) -> None:
        self.db = db
        self.conn = db.conn

    def archived(self) -> set[int]:
        """The ids of the archived experiments."""
        try:
            rows = self.conn.execute("SELECT experiment_id FROM experiments_archived").fetchall()
        except sqlite3.OperationalError:  # a database written before the table (read-only)
            return set()
        return {int(r[0]) for r in rows}

    def set_archived(self, experiment_id: int, archived: bool) -> None:
        if archived:
            self.db.write(
                "INSERT OR IGNORE INTO experiments_archived(experiment_id, archived_at)"
                " VALUES (?, ?)",
                (experiment_id, time.time()),
            )
        else:
            self.db.write(
                "DELETE FROM experiments_archived WHERE experiment_id=?", (experiment_id,)
            )

    def set_checkpoint_metadata(self, uuid: str, metadata: dict[str, Any]) -> None:
        self.db.write("UPDATE checkpoints SET metadata=? WHERE uuid=?", (dumps(metadata), uuid))

    def delete_experiment(self, experiment_id: int, keep_checkpoints: Iterable[str]) -> None:
        """Forget the experiment: its trials, metrics, events, jobs, checkpoints (but those in
        ``keep_checkpoints``: registered in a model, their records stay) and the experiment."""
        keep = sorted(set(keep_checkpoints))
        trials = [
            int(r[0])
            for r in self.conn.execute(
                "SELECT id FROM trials WHERE experiment_id=?", (experiment_id,)
            )
        ]
        marks = ", ".join("?" * len(keep))
        with Savepoint(self.db, "delete_experiment"):
            for tid in trials:
                self.db.write("DELETE FROM metrics WHERE trial_id=?", (tid,))
            self.db.write(
                "DELETE FROM checkpoints WHERE experiment_id=?"
                + (f" AND uuid NOT IN ({marks})" if keep else ""),
                (experiment_id, *keep),
            )
            for table in (
                "checkpoints_incomplete",
                "events",
                "trial_starts",
                "jobs",
                "trials",
                "experiments_archived",
            ):
                self.db.write(f"DELETE FROM {table} WHERE experiment_id=?", (experiment_id,))
            self.db.write("DELETE FROM experiments WHERE id=?", (experiment_id,))

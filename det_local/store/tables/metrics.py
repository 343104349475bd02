"""The metrics and events tables: what trials report, and what happened to experiments."""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Sequence
from typing import Any

from det_local.store.records import MetricRecord
from det_local.store.sql import Db, dumps

SCHEMA = """
CREATE TABLE IF NOT EXISTS metrics (
    id INTEGER PRIMARY KEY,
    trial_id INTEGER NOT NULL,
    run_id INTEGER NOT NULL,
    grp TEXT NOT NULL,
    steps_completed INTEGER NOT NULL,
    time REAL NOT NULL,
    metrics TEXT NOT NULL,
    batch_metrics TEXT
);
CREATE INDEX IF NOT EXISTS metrics_by_trial ON metrics(trial_id, grp, steps_completed);
CREATE INDEX IF NOT EXISTS metrics_newest ON metrics(trial_id, grp, id);
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY,
    experiment_id INTEGER,
    trial_id INTEGER,
    time REAL NOT NULL,
    level TEXT NOT NULL,
    message TEXT NOT NULL
);
"""

_INSERT = (
    "INSERT INTO metrics(trial_id, run_id, grp, steps_completed, time, metrics, batch_metrics)"
    " VALUES (?, ?, ?, ?, ?, ?, ?)"
)
_COLS = "trial_id, run_id, grp, steps_completed, time, metrics"


class MetricTable:
    """Metric reports (the Store owns the connection)."""

    def __init__(self, db: Db) -> None:
        self.db = db
        self.conn = db.conn

    def add(self, trial_id: int, run_id: int, reports: Iterable[Sequence[Any]]) -> int:
        """reports: (group, steps_completed, metrics, time, batch_metrics) tuples, one commit."""
        rows = [
            (
                trial_id,
                run_id,
                r[0],
                int(r[1]),
                float(r[3]),
                dumps(r[2]),
                dumps(r[4]) if len(r) > 4 and r[4] is not None else None,
            )
            for r in reports
        ]
        with self.db.transaction():
            self.conn.executemany(_INSERT, rows)
        return len(rows)

    def select(self, trial_id: int, group: str | None = None) -> list[MetricRecord]:
        sql = f"SELECT {_COLS} FROM metrics WHERE trial_id=?"
        args: list[Any] = [trial_id]
        if group is not None:
            sql += " AND grp=?"
            args.append(group)
        sql += " ORDER BY id"
        return [
            MetricRecord(r[0], r[1], r[2], r[3], r[4], json.loads(r[5]))
            for r in self.conn.execute(sql, args)
        ]

    def sample(self, trial_id: int, group: str, max_points: int) -> list[MetricRecord]:
        """At most ~max_points of the group's reports, spread evenly over its steps_completed
        (the one at the highest steps always among them), in the order they were recorded:
        a long run's curve without reading every report. Every step is an index seek; nothing
        scans the trial's reports (not even to count them)."""
        head = self.conn.execute(
            "SELECT count(*) FROM (SELECT 1 FROM metrics WHERE trial_id=? AND grp=? LIMIT ?)",
            (trial_id, group, max_points + 1),
        ).fetchone()[0]
        if head <= max_points:
            return self.select(trial_id, group)
        ends = [
            self.conn.execute(
                f"SELECT id, {_COLS} FROM metrics WHERE trial_id=? AND grp=?"
                f" ORDER BY steps_completed {way}, id {way} LIMIT 1",
                (trial_id, group),
            ).fetchone()
            for way in ("ASC", "DESC")
        ]
        lo, hi = int(ends[0][4]), int(ends[1][4])
        seek = (
            f"SELECT id, {_COLS} FROM metrics WHERE trial_id=? AND grp=? AND steps_completed>=?"
            " ORDER BY steps_completed, id LIMIT 1"
        )
        rows: dict[int, Any] = {int(r[0]): r for r in ends}
        last_target = None
        for k in range(1, max_points - 1):
            target = lo + ((hi - lo) * k) // (max_points - 1)
            if target == last_target:
                continue
            last_target = target
            row = self.conn.execute(seek, (trial_id, group, target)).fetchone()
            if row is not None:
                rows[int(row[0])] = row
        return [
            MetricRecord(r[1], r[2], r[3], r[4], r[5], json.loads(r[6]))
            for _, r in sorted(rows.items())
        ]

    def newest_id(self) -> int:
        """The row id of the newest report of any trial (0 without one)."""
        row = self.conn.execute("SELECT max(id) FROM metrics").fetchone()
        return int(row[0] or 0)

    def last_id(self, trial_id: int, after: int) -> int:
        """The row id of the trial's newest report if it is newer than `after`, else `after`:
        what a live view asks often. Only the rows after `after` are read (a walk along the
        row ids, not the trial's index)."""
        row = self.conn.execute(
            "SELECT max(id) FROM metrics WHERE id > ? AND +trial_id = ?", (after, trial_id)
        ).fetchone()
        return int(row[0]) if row and row[0] is not None else after

    def last_id_of_experiment(self, experiment_id: int, after: int) -> int:
        """As last_id, for every trial of the experiment: the row id of its trials' newest
        report if newer than `after`, else `after` (only the rows after `after` are read)."""
        row = self.conn.execute(
            "SELECT max(id) FROM metrics WHERE id > ?"
            " AND +trial_id IN (SELECT id FROM trials WHERE experiment_id = ?)",
            (after, experiment_id),
        ).fetchone()
        return int(row[0]) if row and row[0] is not None else after

    def groups(self, trial_id: int) -> list[str]:
        """The groups the trial has reports in (training, validation, custom ones), sorted."""
        rows = self.conn.execute(
            "SELECT DISTINCT grp FROM metrics WHERE trial_id=? ORDER BY grp", (trial_id,)
        )
        return [str(r[0]) for r in rows]

    def list_validations(self, experiment_id: int) -> list[tuple[int, int, int, dict[str, Any]]]:
        """(row id, trial id, steps_completed, metrics) of every validation report of the
        experiment's trials, in the order they were recorded."""
        rows = self.conn.execute(
            "SELECT m.id, m.trial_id, m.steps_completed, m.metrics FROM metrics m"
            " JOIN trials t ON t.id = m.trial_id"
            " WHERE t.experiment_id=? AND m.grp='validation' ORDER BY m.id",
            (experiment_id,),
        )
        return [(int(r[0]), int(r[1]), int(r[2]), json.loads(r[3])) for r in rows]

    def latest(self, trial_id: int, group: str) -> MetricRecord | None:
        """The trial's newest report of `group` (the last recorded, whatever its steps): one
        seek to the end of the trial's part of metrics_newest, not a sort of its reports. A
        database from before that index gets it when the daemon next opens it (SCHEMA)."""
        r = self.conn.execute(
            f"SELECT {_COLS} FROM metrics WHERE trial_id=? AND grp=? ORDER BY id DESC LIMIT 1",
            (trial_id, group),
        ).fetchone()
        return MetricRecord(r[0], r[1], r[2], r[3], r[4], json.loads(r[5])) if r else None


class EventTable:
    """Events: one line each, of an experiment (and a trial) or of the daemon."""

    def __init__(self, db: Db) -> None:
        self.db = db
        self.conn = db.conn

    def add(
        self,
        message: str,
        *,
        experiment_id: int | None = None,
        trial_id: int | None = None,
        level: str = "INFO",
    ) -> None:
        self.db.write(
            "INSERT INTO events(experiment_id, trial_id, time, level, message)"
            " VALUES (?, ?, ?, ?, ?)",
            (experiment_id, trial_id, time.time(), level, message),
        )

    def select(self, experiment_id: int) -> list[tuple[float, str, int | None, str]]:
        return list(
            self.conn.execute(
                "SELECT time, level, trial_id, message FROM events WHERE experiment_id=?"
                " ORDER BY id",
                (experiment_id,),
            )
        )

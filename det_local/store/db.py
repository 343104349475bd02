"""The SQLite store (WAL mode): experiments, trials, checkpoints, metrics, events.

Only the daemon (or the embedded runner acting as it) opens it for writing. The CLI opens it
read-only and can read while a run writes (WAL readers never block the writer).
"""

from __future__ import annotations

import getpass
import json
import sqlite3
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from det_local.errors import NotFoundError
from det_local.store.jobs import JobTable
from det_local.store.records import (
    CHECKPOINT_DELETED,
    CheckpointRecord,
    ExperimentRecord,
    MetricRecord,
    TrialRecord,
)
from det_local.store.states import TERMINAL, State, check_transition

SCHEMA_VERSION = 1

# experiments.checkpoint_gc: NULL until the experiment's checkpoint GC has run (an ended
# experiment with NULL has a GC due, or one a crash interrupted), then one of these.
GC_DONE = "done"
GC_SKIPPED = "skipped"  # test mode, or the experiment ended before det-local had checkpoint GC

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS experiments (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    name TEXT NOT NULL,
    state TEXT NOT NULL,
    user TEXT NOT NULL,
    created_at REAL NOT NULL,
    ended_at REAL,
    labels TEXT NOT NULL DEFAULT '[]',
    description TEXT,
    context_dir TEXT NOT NULL DEFAULT '',
    progress REAL NOT NULL DEFAULT 0,
    message TEXT,
    config TEXT NOT NULL,
    searcher_state TEXT,
    priority INTEGER,
    checkpoint_gc TEXT,
    umask INTEGER
);
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
CREATE TABLE IF NOT EXISTS checkpoints (
    uuid TEXT PRIMARY KEY,
    experiment_id INTEGER NOT NULL,
    trial_id INTEGER NOT NULL,
    steps_completed INTEGER NOT NULL,
    state TEXT NOT NULL,
    path TEXT NOT NULL,
    metadata TEXT NOT NULL,
    resources TEXT NOT NULL,
    created_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS checkpoints_by_trial ON checkpoints(trial_id);
CREATE TABLE IF NOT EXISTS checkpoints_incomplete (
    uuid TEXT PRIMARY KEY,
    experiment_id INTEGER NOT NULL,
    trial_id INTEGER NOT NULL,
    path TEXT NOT NULL,
    created_at REAL NOT NULL
);
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
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY,
    experiment_id INTEGER,
    trial_id INTEGER,
    time REAL NOT NULL,
    level TEXT NOT NULL,
    message TEXT NOT NULL
);
"""

_EXP_COLS = (
    "id, name, state, user, created_at, ended_at, labels, description, context_dir, progress,"
    " message"
)
_TRIAL_COLS = (
    "id, experiment_id, state, hparams, seed, run_id, restarts, steps_completed,"
    " latest_checkpoint, warm_start_checkpoint, best_validation, created_at, ended_at, message"
)
_CKPT_COLS = (
    "uuid, experiment_id, trial_id, steps_completed, state, path, metadata, resources, created_at"
)


def _dumps(value: Any) -> str:
    return json.dumps(value, allow_nan=True, separators=(",", ":"))


def current_user() -> str:
    try:
        return getpass.getuser()
    except Exception:  # no passwd entry (containers)
        import os

        return str(os.getuid())


class Store:
    """Records under DET_LOCAL_HOME. ``readonly=True`` for clients; the writer is the daemon."""

    def __init__(self, db_path: Path, *, readonly: bool = False) -> None:
        self.path = db_path
        self.readonly = readonly
        if readonly:
            conn = None
            if db_path.exists():
                conn = sqlite3.connect(
                    f"file:{db_path}?mode=ro", uri=True, check_same_thread=False, timeout=10
                )
                ready = conn.execute(
                    "SELECT 1 FROM sqlite_master WHERE type='table' AND name='jobs'"
                ).fetchone()
                if not ready:  # the writer has created the file but not its tables yet
                    conn.close()
                    conn = None
            if conn is None:  # nothing recorded yet: an empty store
                conn = sqlite3.connect(":memory:", check_same_thread=False)
                conn.executescript(SCHEMA)
                self.conn = conn
                self.jobs = JobTable(conn, readonly=False)
            else:
                self.conn = conn
                self.jobs = JobTable(conn, readonly=True)
        else:
            db_path.parent.mkdir(parents=True, exist_ok=True)
            self.conn = sqlite3.connect(
                str(db_path), check_same_thread=False, timeout=30, isolation_level=None
            )
            self.conn.execute("PRAGMA journal_mode=WAL")
            self.conn.execute("PRAGMA synchronous=NORMAL")
            self.conn.executescript(SCHEMA)
            self.conn.execute(
                "INSERT OR IGNORE INTO meta(key, value) VALUES ('schema_version', ?)",
                (str(SCHEMA_VERSION),),
            )
            columns = {r[1] for r in self.conn.execute("PRAGMA table_info(experiments)")}
            if "priority" not in columns:  # a database from before the column
                self.conn.execute("ALTER TABLE experiments ADD COLUMN priority INTEGER")
            if "checkpoint_gc" not in columns:  # a database from before checkpoint GC
                self._add_checkpoint_gc_column()
            if "umask" not in columns:  # a database from before submitters' umasks
                self.conn.execute("ALTER TABLE experiments ADD COLUMN umask INTEGER")
            self.jobs = JobTable(self.conn, readonly=False)

    def move_secrets_out(
        self,
        keep: Callable[[dict[int, tuple[int, str]], dict[int, dict[str, str]]], None],
    ) -> bool:
        """A database an older det-local wrote holds trial tokens and commands' environments
        (which every user can read): hand those of live jobs to ``keep`` (private files,
        written durably), then clear the columns, zero the freed bytes and empty the WAL.
        Returns True when there was anything to move."""
        found = self.conn.execute(
            "SELECT 1 FROM jobs WHERE token IS NOT NULL OR env IS NOT NULL LIMIT 1"
        ).fetchone()
        if not found:
            return False
        tokens, envs = self.jobs.take_secrets()
        keep(tokens, envs)  # kept first: a crash now leaves them in both places, not in none
        # every user can read the file: the old values are zeroed, not left in free space for
        # a byte-level read
        self.conn.execute("PRAGMA secure_delete=ON")
        try:
            with self.transaction():
                self.jobs.clear_secrets()
        finally:
            self.conn.execute("PRAGMA secure_delete=OFF")
        self.jobs.reload()
        # the old values are zeroed in the pages (secure_delete); the WAL frames that still
        # hold the pages as they were go too
        self.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        return True

    def _add_checkpoint_gc_column(self) -> None:
        with self.transaction():  # checked again under the write lock: one migration only
            columns = {r[1] for r in self.conn.execute("PRAGMA table_info(experiments)")}
            if "checkpoint_gc" in columns:
                return
            self.conn.execute("ALTER TABLE experiments ADD COLUMN checkpoint_gc TEXT")
            # experiments that ended before det-local had checkpoint GC keep their checkpoints
            self.conn.execute(
                "UPDATE experiments SET checkpoint_gc=? WHERE state IN (?, ?, ?)",
                (GC_SKIPPED, *(s.value for s in TERMINAL)),
            )

    def close(self) -> None:
        self.conn.close()

    # ------------------------------------------------------------------ transactions
    def _write(self, sql: str, args: Sequence[Any] = ()) -> sqlite3.Cursor:
        assert not self.readonly, "the store was opened read-only"
        return self.conn.execute(sql, args)

    def transaction(self) -> _Txn:
        assert not self.readonly, "the store was opened read-only"
        return _Txn(self.conn)

    # ------------------------------------------------------------------ experiments
    def create_experiment(
        self,
        *,
        name: str,
        config: dict[str, Any],
        labels: Iterable[str] = (),
        description: str | None = None,
        user: str | None = None,
        umask: int | None = None,
    ) -> int:
        cur = self._write(
            "INSERT INTO experiments(name, state, user, created_at, labels, description, config,"
            " umask) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            (
                name,
                State.ACTIVE.value,
                user or current_user(),
                time.time(),
                _dumps(sorted(set(labels))),
                description,
                _dumps(config),
                umask,
            ),
        )
        assert cur.lastrowid is not None
        return int(cur.lastrowid)

    def get_experiment_umask(self, experiment_id: int) -> int | None:
        """The umask its submitter's client had (None: submitted before it was recorded)."""
        row = self.conn.execute(
            "SELECT umask FROM experiments WHERE id=?", (experiment_id,)
        ).fetchone()
        return None if row is None or row[0] is None else int(row[0])

    def set_experiment_context(self, experiment_id: int, context_dir: str) -> None:
        self._write("UPDATE experiments SET context_dir=? WHERE id=?", (context_dir, experiment_id))

    def set_experiment_state(
        self, experiment_id: int, state: State, message: str | None = None
    ) -> None:
        old = self.get_experiment(experiment_id).state
        check_transition("experiment", experiment_id, old, state)
        ended = time.time() if state.terminal else None
        self._write(
            "UPDATE experiments SET state=?, ended_at=?, message=COALESCE(?, message) WHERE id=?",
            (state.value, ended, message, experiment_id),
        )

    def set_experiment_progress(self, experiment_id: int, progress: float) -> None:
        self._write("UPDATE experiments SET progress=? WHERE id=?", (progress, experiment_id))

    def set_labels(self, experiment_id: int, labels: Iterable[str]) -> None:
        self._write(
            "UPDATE experiments SET labels=? WHERE id=?",
            (_dumps(sorted(set(labels))), experiment_id),
        )

    def set_experiment_priority(self, experiment_id: int, priority: int) -> None:
        self._write("UPDATE experiments SET priority=? WHERE id=?", (priority, experiment_id))

    def get_experiment_priority(self, experiment_id: int) -> int | None:
        row = self.conn.execute(
            "SELECT priority FROM experiments WHERE id=?", (experiment_id,)
        ).fetchone()
        return None if row is None or row[0] is None else int(row[0])

    def set_searcher_state(self, experiment_id: int, state: dict[str, Any]) -> None:
        self._write(
            "UPDATE experiments SET searcher_state=? WHERE id=?", (_dumps(state), experiment_id)
        )

    def get_searcher_state(self, experiment_id: int) -> dict[str, Any] | None:
        row = self.conn.execute(
            "SELECT searcher_state FROM experiments WHERE id=?", (experiment_id,)
        ).fetchone()
        return json.loads(row[0]) if row and row[0] else None

    @staticmethod
    def _experiment(row: Sequence[Any], config: str | None = None) -> ExperimentRecord:
        return ExperimentRecord(
            id=row[0],
            name=row[1],
            state=State(row[2]),
            user=row[3],
            created_at=row[4],
            ended_at=row[5],
            labels=json.loads(row[6]),
            description=row[7],
            context_dir=row[8],
            progress=row[9],
            message=row[10],
            config=json.loads(config) if config else {},
        )

    def get_experiment(self, experiment_id: int) -> ExperimentRecord:
        row = self.conn.execute(
            f"SELECT {_EXP_COLS}, config FROM experiments WHERE id=?", (experiment_id,)
        ).fetchone()
        if row is None:
            raise NotFoundError(
                f"experiment {experiment_id} not found; `det-local experiment list` shows the ids"
            )
        return self._experiment(row[:-1], row[-1])

    def list_experiments(
        self, *, states: Iterable[State] | None = None, with_config: bool = False
    ) -> list[ExperimentRecord]:
        """Experiments by id; their configs (left out unless with_config) read {}."""
        sql = f"SELECT {_EXP_COLS}{', config' if with_config else ''} FROM experiments"
        args: list[Any] = []
        if states is not None:
            wanted = [s.value for s in states]
            sql += f" WHERE state IN ({','.join('?' * len(wanted))})"
            args.extend(wanted)
        sql += " ORDER BY id"
        rows = self.conn.execute(sql, args)
        if with_config:
            return [self._experiment(r[:-1], r[-1]) for r in rows]
        return [self._experiment(r) for r in rows]

    # ------------------------------------------------------------------ trials
    def create_trial(
        self,
        experiment_id: int,
        *,
        hparams: dict[str, Any],
        seed: int,
        warm_start_checkpoint: str | None = None,
    ) -> int:
        cur = self._write(
            "INSERT INTO trials(experiment_id, state, hparams, seed, warm_start_checkpoint,"
            " created_at) VALUES (?, ?, ?, ?, ?, ?)",
            (
                experiment_id,
                State.ACTIVE.value,
                _dumps(hparams),
                seed,
                warm_start_checkpoint,
                time.time(),
            ),
        )
        assert cur.lastrowid is not None
        return int(cur.lastrowid)

    def set_trial_state(self, trial_id: int, state: State, message: str | None = None) -> None:
        old = self.get_trial(trial_id).state
        check_transition("trial", trial_id, old, state)
        ended = time.time() if state.terminal else None
        self._write(
            "UPDATE trials SET state=?, ended_at=?, message=COALESCE(?, message) WHERE id=?",
            (state.value, ended, message, trial_id),
        )

    def set_trial_message(self, trial_id: int, message: str | None) -> None:
        self._write("UPDATE trials SET message=? WHERE id=?", (message, trial_id))

    def next_trial_run(self, trial_id: int) -> int:
        """A new run (process launch) of the trial; returns its run id (1, 2, ...)."""
        self._write("UPDATE trials SET run_id = run_id + 1 WHERE id=?", (trial_id,))
        return self.get_trial(trial_id).run_id

    def add_restart(self, trial_id: int) -> int:
        self._write("UPDATE trials SET restarts = restarts + 1 WHERE id=?", (trial_id,))
        return self.get_trial(trial_id).restarts

    def set_trial_steps(self, trial_id: int, steps_completed: int) -> None:
        self._write(
            "UPDATE trials SET steps_completed=MAX(steps_completed, ?) WHERE id=?",
            (steps_completed, trial_id),
        )

    def set_best_validation(self, trial_id: int, value: float) -> None:
        self._write("UPDATE trials SET best_validation=? WHERE id=?", (value, trial_id))

    @staticmethod
    def _trial(row: Sequence[Any]) -> TrialRecord:
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

    def get_trial(self, trial_id: int) -> TrialRecord:
        row = self.conn.execute(
            f"SELECT {_TRIAL_COLS} FROM trials WHERE id=?", (trial_id,)
        ).fetchone()
        if row is None:
            raise NotFoundError(
                f"trial {trial_id} not found; `det-local trial list EXPERIMENT_ID` shows the ids"
            )
        return self._trial(row)

    def list_trials(self, experiment_id: int | None = None) -> list[TrialRecord]:
        if experiment_id is None:
            rows = self.conn.execute(f"SELECT {_TRIAL_COLS} FROM trials ORDER BY id")
        else:
            rows = self.conn.execute(
                f"SELECT {_TRIAL_COLS} FROM trials WHERE experiment_id=? ORDER BY id",
                (experiment_id,),
            )
        return [self._trial(r) for r in rows]

    # ------------------------------------------------------------------ checkpoints
    def add_checkpoint(self, ckpt: CheckpointRecord) -> None:
        with self.transaction():
            self._write(
                f"INSERT INTO checkpoints({_CKPT_COLS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    ckpt.uuid,
                    ckpt.experiment_id,
                    ckpt.trial_id,
                    ckpt.steps_completed,
                    ckpt.state,
                    ckpt.path,
                    _dumps(ckpt.metadata),
                    _dumps(ckpt.resources),
                    ckpt.created_at,
                ),
            )
            self._write(
                "UPDATE trials SET latest_checkpoint=?, steps_completed=MAX(steps_completed, ?)"
                " WHERE id=?",
                (ckpt.uuid, ckpt.steps_completed, ckpt.trial_id),
            )
            self._write("DELETE FROM checkpoints_incomplete WHERE uuid=?", (ckpt.uuid,))

    # A checkpoint being written: recorded (by the trial, through the daemon) before its
    # directory is made, and dropped when it is recorded complete. One still here after its
    # trial stopped never completed: its directory is removed at the trial's next start or by
    # checkpoint GC. It is never a checkpoint: nothing lists it.
    def add_incomplete_checkpoint(
        self, uuid: str, *, experiment_id: int, trial_id: int, path: str
    ) -> None:
        self._write(
            "INSERT OR IGNORE INTO checkpoints_incomplete(uuid, experiment_id, trial_id, path,"
            " created_at) VALUES (?, ?, ?, ?, ?)",
            (uuid, experiment_id, trial_id, path, time.time()),
        )

    def list_incomplete_checkpoints(
        self, *, experiment_id: int | None = None, trial_id: int | None = None
    ) -> list[tuple[str, str]]:
        """(uuid, path) of the checkpoints begun and never recorded complete."""
        sql = "SELECT uuid, path FROM checkpoints_incomplete"
        where, args = [], []
        if experiment_id is not None:
            where.append("experiment_id=?")
            args.append(experiment_id)
        if trial_id is not None:
            where.append("trial_id=?")
            args.append(trial_id)
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += " ORDER BY created_at, uuid"
        return [(str(r[0]), str(r[1])) for r in self.conn.execute(sql, args)]

    def drop_incomplete_checkpoints(self, uuids: Iterable[str]) -> None:
        """Forget incomplete checkpoints whose directories are gone."""
        for uuid in uuids:
            self._write("DELETE FROM checkpoints_incomplete WHERE uuid=?", (uuid,))

    def mark_checkpoint_deleted(self, uuid: str) -> None:
        self._write("UPDATE checkpoints SET state=? WHERE uuid=?", (CHECKPOINT_DELETED, uuid))

    def mark_checkpoints_deleted(self, uuids: Iterable[str]) -> None:
        """Mark these checkpoints DELETED, all in one commit (before their files go)."""
        with self.transaction():
            self.conn.executemany(
                "UPDATE checkpoints SET state=? WHERE uuid=?",
                [(CHECKPOINT_DELETED, u) for u in uuids],
            )

    def warm_start_checkpoints(self) -> set[str]:
        """Every checkpoint a trial (of any experiment) was warm-started from."""
        rows = self.conn.execute(
            "SELECT DISTINCT warm_start_checkpoint FROM trials"
            " WHERE warm_start_checkpoint IS NOT NULL"
        )
        return {str(r[0]) for r in rows}

    # ------------------------------------------------------------------ checkpoint GC
    def checkpoint_gc_due(self, experiment_id: int) -> bool:
        """The experiment has ended and its checkpoint GC has not run (or did not finish)."""
        row = self.conn.execute(
            "SELECT state, checkpoint_gc FROM experiments WHERE id=?", (experiment_id,)
        ).fetchone()
        return row is not None and State(row[0]).terminal and row[1] is None

    def checkpoint_gc_pending(self) -> list[int]:
        """Ended experiments whose checkpoint GC is due (e.g. interrupted by a crash)."""
        rows = self.conn.execute(
            "SELECT id FROM experiments WHERE checkpoint_gc IS NULL AND state IN (?, ?, ?)"
            " ORDER BY id",
            tuple(s.value for s in TERMINAL),
        )
        return [int(r[0]) for r in rows]

    def get_checkpoint_gc(self, experiment_id: int) -> str | None:
        row = self.conn.execute(
            "SELECT checkpoint_gc FROM experiments WHERE id=?", (experiment_id,)
        ).fetchone()
        return None if row is None else row[0]

    def set_checkpoint_gc(self, experiment_id: int, status: str) -> None:
        self._write("UPDATE experiments SET checkpoint_gc=? WHERE id=?", (status, experiment_id))

    @staticmethod
    def _checkpoint(row: Sequence[Any]) -> CheckpointRecord:
        return CheckpointRecord(
            uuid=row[0],
            experiment_id=row[1],
            trial_id=row[2],
            steps_completed=row[3],
            state=row[4],
            path=row[5],
            metadata=json.loads(row[6]),
            resources=json.loads(row[7]),
            created_at=row[8],
        )

    def get_checkpoint(self, uuid: str) -> CheckpointRecord:
        row = self.conn.execute(
            f"SELECT {_CKPT_COLS} FROM checkpoints WHERE uuid=?", (uuid,)
        ).fetchone()
        if row is None:
            raise NotFoundError(
                f"checkpoint {uuid} not found; `det-local checkpoint list EXPERIMENT_ID` shows them"
            )
        return self._checkpoint(row)

    def list_checkpoints(
        self, *, experiment_id: int | None = None, trial_id: int | None = None
    ) -> list[CheckpointRecord]:
        sql = f"SELECT {_CKPT_COLS} FROM checkpoints"
        where, args = [], []
        if experiment_id is not None:
            where.append("experiment_id=?")
            args.append(experiment_id)
        if trial_id is not None:
            where.append("trial_id=?")
            args.append(trial_id)
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += " ORDER BY created_at, steps_completed"
        return [self._checkpoint(r) for r in self.conn.execute(sql, args)]

    # ------------------------------------------------------------------ metrics
    def add_metrics(self, trial_id: int, run_id: int, reports: Iterable[Sequence[Any]]) -> int:
        """reports: (group, steps_completed, metrics, time, batch_metrics) tuples, one commit."""
        rows = [
            (
                trial_id,
                run_id,
                r[0],
                int(r[1]),
                float(r[3]),
                _dumps(r[2]),
                _dumps(r[4]) if len(r) > 4 and r[4] is not None else None,
            )
            for r in reports
        ]
        with self.transaction():
            self.conn.executemany(
                "INSERT INTO metrics(trial_id, run_id, grp, steps_completed, time, metrics,"
                " batch_metrics) VALUES (?, ?, ?, ?, ?, ?, ?)",
                rows,
            )
        return len(rows)

    def list_metrics(self, trial_id: int, group: str | None = None) -> list[MetricRecord]:
        sql = (
            "SELECT trial_id, run_id, grp, steps_completed, time, metrics FROM metrics"
            " WHERE trial_id=?"
        )
        args: list[Any] = [trial_id]
        if group is not None:
            sql += " AND grp=?"
            args.append(group)
        sql += " ORDER BY id"
        return [
            MetricRecord(r[0], r[1], r[2], r[3], r[4], json.loads(r[5]))
            for r in self.conn.execute(sql, args)
        ]

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

    def count_metrics(self, trial_id: int, group: str | None = None) -> int:
        if group is None:
            row = self.conn.execute(
                "SELECT COUNT(*) FROM metrics WHERE trial_id=?", (trial_id,)
            ).fetchone()
        else:
            row = self.conn.execute(
                "SELECT COUNT(*) FROM metrics WHERE trial_id=? AND grp=?", (trial_id, group)
            ).fetchone()
        return int(row[0])

    def latest_metrics(self, trial_id: int, group: str) -> MetricRecord | None:
        r = self.conn.execute(
            "SELECT trial_id, run_id, grp, steps_completed, time, metrics FROM metrics"
            " WHERE trial_id=? AND grp=? ORDER BY id DESC LIMIT 1",
            (trial_id, group),
        ).fetchone()
        return MetricRecord(r[0], r[1], r[2], r[3], r[4], json.loads(r[5])) if r else None

    # ------------------------------------------------------------------ events
    def add_event(
        self,
        message: str,
        *,
        experiment_id: int | None = None,
        trial_id: int | None = None,
        level: str = "INFO",
    ) -> None:
        self._write(
            "INSERT INTO events(experiment_id, trial_id, time, level, message)"
            " VALUES (?, ?, ?, ?, ?)",
            (experiment_id, trial_id, time.time(), level, message),
        )

    def list_events(self, experiment_id: int) -> list[tuple[float, str, int | None, str]]:
        return list(
            self.conn.execute(
                "SELECT time, level, trial_id, message FROM events WHERE experiment_id=?"
                " ORDER BY id",
                (experiment_id,),
            )
        )


class _Txn:
    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn

    def __enter__(self) -> _Txn:
        self.conn.execute("BEGIN IMMEDIATE")
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        self.conn.execute("ROLLBACK" if exc_type else "COMMIT")

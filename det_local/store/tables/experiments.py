"""The experiments table: records, states, priorities, searcher snapshots, checkpoint GC."""

from __future__ import annotations

import getpass
import json
import os
import time
from collections.abc import Iterable, Sequence
from typing import Any

from det_local.errors import NotFoundError
from det_local.store.records import ExperimentRecord
from det_local.store.sql import Db, dumps
from det_local.store.states import TERMINAL, State, check_transition

# experiments.checkpoint_gc: NULL until the experiment's checkpoint GC has run (an ended
# experiment with NULL has a GC due, or one a crash interrupted), then one of these.
GC_DONE = "done"
GC_SKIPPED = "skipped"  # test mode, or the experiment ended before det-local had checkpoint GC

SCHEMA = """
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
"""

_COLS = (
    "id, name, state, user, created_at, ended_at, labels, description, context_dir, progress,"
    " message"
)


def current_user() -> str:
    """The name of the user running this process (its uid where it has no passwd entry)."""
    try:
        return getpass.getuser()
    except Exception:  # no passwd entry (containers)
        return str(os.getuid())


def migrate(db: Db) -> None:
    """Add the columns a database from an older det-local lacks."""
    columns = {r[1] for r in db.conn.execute("PRAGMA table_info(experiments)")}
    if "priority" not in columns:  # a database from before the column
        db.write("ALTER TABLE experiments ADD COLUMN priority INTEGER")
    if "checkpoint_gc" not in columns:  # a database from before checkpoint GC
        _add_checkpoint_gc_column(db)
    if "umask" not in columns:  # a database from before submitters' umasks
        db.write("ALTER TABLE experiments ADD COLUMN umask INTEGER")


def _add_checkpoint_gc_column(db: Db) -> None:
    with db.transaction():  # checked again under the write lock: one migration only
        columns = {r[1] for r in db.conn.execute("PRAGMA table_info(experiments)")}
        if "checkpoint_gc" in columns:
            return
        db.write("ALTER TABLE experiments ADD COLUMN checkpoint_gc TEXT")
        # experiments that ended before det-local had checkpoint GC keep their checkpoints
        db.write(
            "UPDATE experiments SET checkpoint_gc=? WHERE state IN (?, ?, ?)",
            (GC_SKIPPED, *(s.value for s in TERMINAL)),
        )


def _record(row: Sequence[Any], config: str | None = None) -> ExperimentRecord:
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


class ExperimentTable:
    """Experiment rows (the Store owns the connection)."""

    def __init__(self, db: Db) -> None:
        self.db = db
        self.conn = db.conn

    def create(
        self,
        *,
        name: str,
        config: dict[str, Any],
        labels: Iterable[str] = (),
        description: str | None = None,
        user: str | None = None,
        umask: int | None = None,
    ) -> int:
        cur = self.db.write(
            "INSERT INTO experiments(name, state, user, created_at, labels, description, config,"
            " umask) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            (
                name,
                State.ACTIVE.value,
                user or current_user(),
                time.time(),
                dumps(sorted(set(labels))),
                description,
                dumps(config),
                umask,
            ),
        )
        assert cur.lastrowid is not None
        return int(cur.lastrowid)

    def get(self, experiment_id: int) -> ExperimentRecord:
        row = self.conn.execute(
            f"SELECT {_COLS}, config FROM experiments WHERE id=?", (experiment_id,)
        ).fetchone()
        if row is None:
            raise NotFoundError(
                f"experiment {experiment_id} not found; `det-local experiment list` shows the ids"
            )
        return _record(row[:-1], row[-1])

    def select(
        self, *, states: Iterable[State] | None = None, with_config: bool = False
    ) -> list[ExperimentRecord]:
        """Experiments by id; their configs (left out unless with_config) read {}."""
        sql = f"SELECT {_COLS}{', config' if with_config else ''} FROM experiments"
        args: list[Any] = []
        if states is not None:
            wanted = [s.value for s in states]
            sql += f" WHERE state IN ({','.join('?' * len(wanted))})"
            args.extend(wanted)
        sql += " ORDER BY id"
        rows = self.conn.execute(sql, args)
        if with_config:
            return [_record(r[:-1], r[-1]) for r in rows]
        return [_record(r) for r in rows]

    def searchers(self) -> dict[int, tuple[str | None, str | None, bool]]:
        """experiment id -> (searcher name, metric, smaller_is_better), read from the configs
        in SQL (a list page never parses a thousand configs)."""
        rows = self.conn.execute(
            "SELECT id, json_extract(config, '$.searcher.name'),"
            " json_extract(config, '$.searcher.metric'),"
            " json_extract(config, '$.searcher.smaller_is_better') FROM experiments"
        )
        return {
            int(r[0]): (
                None if r[1] is None else str(r[1]),
                None if r[2] is None else str(r[2]),
                r[3] is None or bool(r[3]),
            )
            for r in rows
        }

    def set_state(self, experiment_id: int, state: State, message: str | None = None) -> None:
        """StateError when the transition table does not allow the move."""
        old = self.get(experiment_id).state
        check_transition("experiment", experiment_id, old, state)
        ended = time.time() if state.terminal else None
        self.db.write(
            "UPDATE experiments SET state=?, ended_at=?, message=COALESCE(?, message) WHERE id=?",
            (state.value, ended, message, experiment_id),
        )

    def get_umask(self, experiment_id: int) -> int | None:
        """The umask its submitter's client had (None: submitted before it was recorded)."""
        return self._int_column("umask", experiment_id)

    def set_context(self, experiment_id: int, context_dir: str) -> None:
        self.db.write(
            "UPDATE experiments SET context_dir=? WHERE id=?", (context_dir, experiment_id)
        )

    def set_progress(self, experiment_id: int, progress: float) -> None:
        self.db.write("UPDATE experiments SET progress=? WHERE id=?", (progress, experiment_id))

    def set_labels(self, experiment_id: int, labels: Iterable[str]) -> None:
        self.db.write(
            "UPDATE experiments SET labels=? WHERE id=?",
            (dumps(sorted(set(labels))), experiment_id),
        )

    def set_priority(self, experiment_id: int, priority: int) -> None:
        self.db.write("UPDATE experiments SET priority=? WHERE id=?", (priority, experiment_id))

    def get_priority(self, experiment_id: int) -> int | None:
        return self._int_column("priority", experiment_id)

    def _int_column(self, column: str, experiment_id: int) -> int | None:
        row = self.conn.execute(
            f"SELECT {column} FROM experiments WHERE id=?", (experiment_id,)
        ).fetchone()
        return None if row is None or row[0] is None else int(row[0])

    def set_searcher_state(self, experiment_id: int, state: dict[str, Any]) -> None:
        self.db.write(
            "UPDATE experiments SET searcher_state=? WHERE id=?", (dumps(state), experiment_id)
        )

    def get_searcher_state(self, experiment_id: int) -> dict[str, Any] | None:
        row = self.conn.execute(
            "SELECT searcher_state FROM experiments WHERE id=?", (experiment_id,)
        ).fetchone()
        return json.loads(row[0]) if row and row[0] else None

    # -- checkpoint GC -----------------------------------------------------------------------
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
        self.db.write("UPDATE experiments SET checkpoint_gc=? WHERE id=?", (status, experiment_id))

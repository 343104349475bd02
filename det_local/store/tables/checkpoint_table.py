"""The checkpoints tables: recorded checkpoints (and their states), and those being written.

(Copying a checkpoint's files out is ``store/checkpoints.py``.)
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Sequence
from typing import Any

from det_local.errors import NotFoundError, StateError
from det_local.store.records import CheckpointRecord
from det_local.store.sql import Db, dumps
from det_local.store.states import (
    CHECKPOINT_INITIAL,
    CHECKPOINT_TRANSITIONS,
    CheckpointState,
    check_checkpoint_transition,
)

SCHEMA = """
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
"""

_COLS = (
    "uuid, experiment_id, trial_id, steps_completed, state, path, metadata, resources, created_at"
)
_STATE_OF = {s.value: s for s in CheckpointState}
# the UPDATE marking a checkpoint DELETED matches only the states it may be reached from
_DELETABLE = tuple(
    s.value
    for s in CheckpointState
    if s == CheckpointState.DELETED or CheckpointState.DELETED in CHECKPOINT_TRANSITIONS[s]
)
_MARK_DELETED = (
    f"UPDATE checkpoints SET state=? WHERE uuid=? AND state IN ({', '.join('?' * len(_DELETABLE))})"
)


def _state(value: str, uuid: str) -> CheckpointState:
    try:
        return _STATE_OF[value]
    except KeyError:
        raise StateError(
            f"checkpoint {uuid} has the unknown state {value!r} in the database; "
            f"the states are {', '.join(_STATE_OF)}"
        ) from None


def _record(row: Sequence[Any]) -> CheckpointRecord:
    return CheckpointRecord(
        uuid=row[0],
        experiment_id=row[1],
        trial_id=row[2],
        steps_completed=row[3],
        state=_state(row[4], row[0]),
        path=row[5],
        metadata=json.loads(row[6]),
        resources=json.loads(row[7]),
        created_at=row[8],
    )


class CheckpointTable:
    """Checkpoint rows (the Store owns the connection)."""

    def __init__(self, db: Db) -> None:
        self.db = db
        self.conn = db.conn

    def add(self, ckpt: CheckpointRecord) -> None:
        """Record a checkpoint whose files are written (COMPLETED), as its trial's latest."""
        state = _state(str(ckpt.state), ckpt.uuid)
        if state not in CHECKPOINT_INITIAL:
            raise StateError(
                f"checkpoint {ckpt.uuid} is {state.value}; a checkpoint is recorded "
                + " or ".join(s.value for s in CHECKPOINT_INITIAL)
            )
        with self.db.transaction():
            self.db.write(
                f"INSERT INTO checkpoints({_COLS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    ckpt.uuid,
                    ckpt.experiment_id,
                    ckpt.trial_id,
                    ckpt.steps_completed,
                    state.value,
                    ckpt.path,
                    dumps(ckpt.metadata),
                    dumps(ckpt.resources),
                    ckpt.created_at,
                ),
            )
            self.db.write(
                "UPDATE trials SET latest_checkpoint=?, steps_completed=MAX(steps_completed, ?)"
                " WHERE id=?",
                (ckpt.uuid, ckpt.steps_completed, ckpt.trial_id),
            )
            self.db.write("DELETE FROM checkpoints_incomplete WHERE uuid=?", (ckpt.uuid,))

    def get(self, uuid: str) -> CheckpointRecord:
        row = self.conn.execute(f"SELECT {_COLS} FROM checkpoints WHERE uuid=?", (uuid,)).fetchone()
        if row is None:
            raise NotFoundError(
                f"checkpoint {uuid} not found; `det-local checkpoint list EXPERIMENT_ID` shows them"
            )
        return _record(row)

    def select(
        self, *, experiment_id: int | None = None, trial_id: int | None = None
    ) -> list[CheckpointRecord]:
        sql, args = _where(f"SELECT {_COLS} FROM checkpoints", experiment_id, trial_id)
        sql += " ORDER BY created_at, steps_completed"
        return [_record(r) for r in self.conn.execute(sql, args)]

    def mark_deleted(self, uuid: str) -> None:
        """Mark the checkpoint DELETED (its files go next). StateError when its state does not
        allow it; NotFoundError when there is no such checkpoint."""
        args = (CheckpointState.DELETED.value, uuid, *_DELETABLE)
        if self.db.write(_MARK_DELETED, args).rowcount == 0:
            self._refuse([uuid])

    def mark_many_deleted(self, uuids: Iterable[str]) -> None:
        """Mark these checkpoints DELETED, all in one commit (before their files go); none of
        them when one's state does not allow it."""
        wanted = list(uuids)
        with self.db.transaction():
            cur = self.conn.executemany(
                _MARK_DELETED,
                [(CheckpointState.DELETED.value, u, *_DELETABLE) for u in wanted],
            )
            if cur.rowcount != len(wanted):
                self._refuse(wanted)

    def _refuse(self, uuids: list[str]) -> None:
        """Raise for the first of ``uuids`` that could not be marked DELETED."""
        for uuid in uuids:
            row = self.conn.execute(
                "SELECT state FROM checkpoints WHERE uuid=?", (uuid,)
            ).fetchone()
            if row is None:
                raise NotFoundError(
                    f"checkpoint {uuid} not found; `det-local checkpoint list EXPERIMENT_ID` "
                    "shows them"
                )
            check_checkpoint_transition(uuid, _state(row[0], uuid), CheckpointState.DELETED)
        raise AssertionError(f"marking {len(uuids)} checkpoint(s) DELETED changed fewer rows")

    # A checkpoint being written: recorded (by the trial, through the daemon) before its
    # directory is made, and dropped when it is recorded complete. One still here after its
    # trial stopped never completed: its directory is removed at the trial's next start or by
    # checkpoint GC. It is never a checkpoint: nothing lists it.
    def add_incomplete(self, uuid: str, *, experiment_id: int, trial_id: int, path: str) -> None:
        self.db.write(
            "INSERT OR IGNORE INTO checkpoints_incomplete(uuid, experiment_id, trial_id, path,"
            " created_at) VALUES (?, ?, ?, ?, ?)",
            (uuid, experiment_id, trial_id, path, time.time()),
        )

    def list_incomplete(
        self, *, experiment_id: int | None = None, trial_id: int | None = None
    ) -> list[tuple[str, str]]:
        """(uuid, path) of the checkpoints begun and never recorded complete."""
        sql, args = _where("SELECT uuid, path FROM checkpoints_incomplete", experiment_id, trial_id)
        sql += " ORDER BY created_at, uuid"
        return [(str(r[0]), str(r[1])) for r in self.conn.execute(sql, args)]

    def drop_incomplete(self, uuids: Iterable[str]) -> None:
        """Forget incomplete checkpoints whose directories are gone."""
        for uuid in uuids:
            self.db.write("DELETE FROM checkpoints_incomplete WHERE uuid=?", (uuid,))


def _where(sql: str, experiment_id: int | None, trial_id: int | None) -> tuple[str, list[Any]]:
    where, args = [], []
    if experiment_id is not None:
        where.append("experiment_id=?")
        args.append(experiment_id)
    if trial_id is not None:
        where.append("trial_id=?")
        args.append(trial_id)
    if where:
        sql += " WHERE " + " AND ".join(where)
    return sql, args

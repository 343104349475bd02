"""The model registry: models (a name, a description, labels, metadata, an owner) and their
numbered versions, each pointing at one checkpoint (Determined's model registry).

A checkpoint a version points at is *registered*: checkpoint GC keeps it
(`sched/life/ckpt_gc.py`), `checkpoint delete` refuses it and deleting its experiment leaves it
(`sched/intake/lifecycle/`). Such a checkpoint stays its creator's (its experiment's owner,
recorded in `checkpoint_creators` when the experiment is deleted): only they (or an admin)
may register it again or delete it once no version points at it. Only the engine writes
these tables (`sched/intake/lifecycle/registry.py`).
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from det_local.errors import DetLocalError, NotFoundError
from det_local.store.records import json_safe
from det_local.store.sql import Db, Savepoint, dumps

SCHEMA = """
CREATE TABLE IF NOT EXISTS models (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    name TEXT NOT NULL UNIQUE,
    description TEXT NOT NULL,
    labels TEXT NOT NULL,
    metadata TEXT NOT NULL,
    user TEXT NOT NULL,
    archived INTEGER NOT NULL DEFAULT 0,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS model_versions (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    model_id INTEGER NOT NULL REFERENCES models(id),
    version INTEGER NOT NULL,
    checkpoint_uuid TEXT NOT NULL,
    name TEXT NOT NULL,
    comment TEXT NOT NULL,
    notes TEXT NOT NULL,
    labels TEXT NOT NULL,
    metadata TEXT NOT NULL,
    user TEXT NOT NULL,
    created_at REAL NOT NULL,
    UNIQUE (model_id, version)
);
CREATE INDEX IF NOT EXISTS model_versions_by_checkpoint ON model_versions(checkpoint_uuid);
CREATE TABLE IF NOT EXISTS checkpoint_creators (
    uuid TEXT PRIMARY KEY,
    user TEXT NOT NULL
);
"""

MAX_NAME = 256


class BadModel(DetLocalError):
    """A model name, label list or metadata that cannot be recorded."""


@dataclass
class ModelRecord:
    id: int
    name: str
    description: str
    labels: list[str]
    metadata: dict[str, Any]
    user: str
    archived: bool
    created_at: float
    updated_at: float
    num_versions: int = 0

    def to_json(self) -> dict[str, Any]:
        return json_safe(asdict(self))


@dataclass
class VersionRecord:
    id: int
    model_id: int
    model_name: str
    version: int
    checkpoint_uuid: str
    name: str
    comment: str
    notes: str
    labels: list[str]
    metadata: dict[str, Any]
    user: str
    created_at: float
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return json_safe(asdict(self))


_MODEL_COLS = (
    "m.id, m.name, m.description, m.labels, m.metadata, m.user, m.archived, m.created_at, "
    "m.updated_at, (SELECT COUNT(*) FROM model_versions v WHERE v.model_id = m.id)"
)
_VERSION_COLS = (
    "v.id, v.model_id, m.name, v.version, v.checkpoint_uuid, v.name, v.comment, v.notes, "
    "v.labels, v.metadata, v.user, v.created_at"
)


def _model(row: Sequence[Any]) -> ModelRecord:
    return ModelRecord(
        id=int(row[0]),
        name=str(row[1]),
        description=str(row[2]),
        labels=list(json.loads(row[3])),
        metadata=dict(json.loads(row[4])),
        user=str(row[5]),
        archived=bool(row[6]),
        created_at=float(row[7]),
        updated_at=float(row[8]),
        num_versions=int(row[9]),
    )


def _version(row: Sequence[Any]) -> VersionRecord:
    return VersionRecord(
        id=int(row[0]),
        model_id=int(row[1]),
        model_name=str(row[2]),
        version=int(row[3]),
        checkpoint_uuid=str(row[4]),
        name=str(row[5]),
        comment=str(row[6]),
        notes=str(row[7]),
        labels=list(json.loads(row[8])),
        metadata=dict(json.loads(row[9])),
        user=str(row[10]),
        created_at=float(row[11]),
    )


def check_name(name: Any) -> str:
    if not isinstance(name, str) or not name.strip():
        raise BadModel("a model needs a name: a non-empty string (`det-local model create NAME`)")
    if len(name) > MAX_NAME or any(ord(ch) < 32 for ch in name):
        raise BadModel(
            f"model name {name[:40]!r} is not usable: at most {MAX_NAME} characters, "
            "no control characters"
        )
    if name.isdigit():
        raise BadModel(
            f"model name {name!r} is all digits, which reads as a model id; choose a name "
            "with a letter in it"
        )
    return name


def check_labels(labels: Any) -> list[str]:
    if not isinstance(labels, list) or not all(isinstance(x, str) for x in labels):
        raise BadModel(f"set_labels() requires a list of strings as input but got: {labels}")
    return list(dict.fromkeys(labels))


def check_metadata(metadata: Any) -> dict[str, Any]:
    if not isinstance(metadata, dict) or not all(isinstance(k, str) for k in metadata):
        raise BadModel("model metadata must be a JSON object (a dict with string keys)")
    return metadata


class ModelRegistry:
    """The models and model_versions tables (the Store owns the connection)."""

    def __init__(self, db: Db) -> None:
        self.db = db
        self.conn = db.conn

    # ------------------------------------------------------------------ reads
    def _rows(self, sql: str, args: Sequence[Any] = ()) -> list[Any]:
        try:
            return self.conn.execute(sql, args).fetchall()
        except sqlite3.OperationalError as err:  # a database written before the registry
            if "no such table" in str(err):
                return []
            raise

    def get(self, identifier: str | int) -> ModelRecord:
        """A model by name, or by id (an int, or a string of digits)."""
        if isinstance(identifier, int) or str(identifier).isdigit():
            rows = self._rows(
                f"SELECT {_MODEL_COLS} FROM models m WHERE m.id=?", (int(identifier),)
            )
        else:
            rows = self._rows(f"SELECT {_MODEL_COLS} FROM models m WHERE m.name=?", (identifier,))
        if not rows:
            raise NotFoundError(
                f"model {identifier!r} not found; `det-local model list` shows the models"
            )
        return _model(rows[0])

    def select(
        self, *, name: str = "", description: str = "", archived: bool | None = None
    ) -> list[ModelRecord]:
        """Models whose name/description contain the given text, by name."""
        where, args = ["m.name LIKE ?", "m.description LIKE ?"], [f"%{name}%", f"%{description}%"]
        if archived is not None:
            where.append("m.archived=?")
            args.append(str(int(archived)))
        sql = f"SELECT {_MODEL_COLS} FROM models m WHERE {' AND '.join(where)} ORDER BY m.name"
        return [_model(r) for r in self._rows(sql, args)]

    def versions(self, model_id: int) -> list[VersionRecord]:
        """The model's versions, oldest first."""
        sql = (
            f"SELECT {_VERSION_COLS} FROM model_versions v JOIN models m ON m.id = v.model_id "
            "WHERE v.model_id=? ORDER BY v.version"
        )
        return [_version(r) for r in self._rows(sql, (model_id,))]

    def version(self, model_id: int, version: int) -> VersionRecord:
        sql = (
            f"SELECT {_VERSION_COLS} FROM model_versions v JOIN models m ON m.id = v.model_id "
            "WHERE v.model_id=? AND v.version=?"
        )
        rows = self._rows(sql, (model_id, version))
        if not rows:
            raise NotFoundError(
                f"model {model_id} has no version {version}; "
                f"`det-local model list-versions {model_id}` shows them"
            )
        return _version(rows[0])

    def versions_of_checkpoint(self, uuid: str) -> list[VersionRecord]:
        sql = (
            f"SELECT {_VERSION_COLS} FROM model_versions v JOIN models m ON m.id = v.model_id "
            "WHERE v.checkpoint_uuid=? ORDER BY m.name, v.version"
        )
        return [_version(r) for r in self._rows(sql, (uuid,))]

    def registered(self) -> set[str]:
        """Every checkpoint a model version points at."""
        return {
            str(r[0]) for r in self._rows("SELECT DISTINCT checkpoint_uuid FROM model_versions")
        }

    def checkpoint_owner(self, uuid: str, experiment_id: int) -> str | None:
        """Who may change a checkpoint: its experiment's owner; its experiment deleted, its
        creator as recorded then; None when neither is known (an experiment deleted before
        det-local recorded creators: the admin group's alone)."""
        rows = self._rows("SELECT user FROM experiments WHERE id=?", (experiment_id,))
        if not rows:
            rows = self._rows("SELECT user FROM checkpoint_creators WHERE uuid=?", (uuid,))
        return str(rows[0][0]) if rows else None

    def unregistered_orphans(self, uuids: Sequence[str]) -> list[str]:
        """Those of ``uuids`` no version points at any more whose experiment is gone."""
        registered = self.registered()
        return [
            u
            for u in uuids
            if u not in registered
            and self._rows(
                "SELECT 1 FROM checkpoints c WHERE c.uuid=? AND c.state != 'DELETED' AND NOT "
                "EXISTS (SELECT 1 FROM experiments e WHERE e.id = c.experiment_id)",
                (u,),
            )
        ]

    # ------------------------------------------------------------------ writes (the engine)
    def record_creator(self, uuid: str, user: str) -> None:
        """The creator of a checkpoint whose experiment goes (it stays: registered)."""
        self.db.write(
            "INSERT OR IGNORE INTO checkpoint_creators(uuid, user) VALUES (?, ?)", (uuid, user)
        )

    def create(
        self, name: str, *, description: str, metadata: dict[str, Any], labels: list[str], user: str
    ) -> ModelRecord:
        check_name(name)
        if self._rows("SELECT 1 FROM models WHERE name=?", (name,)):
            raise BadModel(
                f"a model named {name!r} already exists; `det-local model describe {name}` shows it"
            )
        now = time.time()
        self.db.write(
            "INSERT INTO models(name, description, labels, metadata, user, archived, created_at,"
            " updated_at) VALUES (?, ?, ?, ?, ?, 0, ?, ?)",
            (name, description, dumps(labels), dumps(metadata), user, now, now),
        )
        return self.get(name)

    def update(self, model_id: int, **fields: Any) -> None:
        """Set description, labels, metadata or archived."""
        sets, args = [], []
        for key, value in fields.items():
            assert key in ("description", "labels", "metadata", "archived"), key
            sets.append(f"{key}=?")
            args.append(dumps(value) if key in ("labels", "metadata") else value)
        sets.append("updated_at=?")
        args += [time.time(), model_id]
        self.db.write(f"UPDATE models SET {', '.join(sets)} WHERE id=?", args)

    def add_version(self, model_id: int, checkpoint_uuid: str, *, user: str) -> int:
        """The next version of the model, pointing at the checkpoint; its number."""
        row = self.conn.execute(
            "SELECT COALESCE(MAX(version), 0) FROM model_versions WHERE model_id=?", (model_id,)
        ).fetchone()
        number = int(row[0]) + 1
        now = time.time()
        self.db.write(
            "INSERT INTO model_versions(model_id, version, checkpoint_uuid, name, comment, notes,"
            " labels, metadata, user, created_at) VALUES (?, ?, ?, '', '', '', '[]', '{}', ?, ?)",
            (model_id, number, checkpoint_uuid, user, now),
        )
        self.db.write("UPDATE models SET updated_at=? WHERE id=?", (now, model_id))
        return number

    def update_version(self, model_id: int, version: int, **fields: Any) -> None:
        """Set a version's name or notes."""
        for key, value in fields.items():
            assert key in ("name", "notes", "comment"), key
            self.db.write(
                f"UPDATE model_versions SET {key}=? WHERE model_id=? AND version=?",
                (str(value), model_id, version),
            )

    def delete_version(self, model_id: int, version: int) -> None:
        self.db.write(
            "DELETE FROM model_versions WHERE model_id=? AND version=?", (model_id, version)
        )

    def delete(self, model_id: int) -> None:
        with Savepoint(self.db, "delete_model"):
            self.db.write("DELETE FROM model_versions WHERE model_id=?", (model_id,))
            self.db.write("DELETE FROM models WHERE id=?", (model_id,))

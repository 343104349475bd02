"""What the store's tables share: the connection with its write guard, transactions, JSON."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Sequence
from typing import Any


def dumps(value: Any) -> str:
    """JSON as the store keeps it (compact; NaN and infinities allowed)."""
    return json.dumps(value, allow_nan=True, separators=(",", ":"))


class Db:
    """The store's one connection, as its tables use it: reads through ``conn``, writes
    through :meth:`write` and :meth:`transaction` (refused on a read-only store)."""

    def __init__(self, conn: sqlite3.Connection, *, readonly: bool) -> None:
        self.conn = conn
        self.readonly = readonly

    def write(self, sql: str, args: Sequence[Any] = ()) -> sqlite3.Cursor:
        assert not self.readonly, "the store was opened read-only"
        return self.conn.execute(sql, args)

    def transaction(self) -> Txn:
        assert not self.readonly, "the store was opened read-only"
        return Txn(self.conn)


class Txn:
    """``BEGIN IMMEDIATE`` ... ``COMMIT`` (``ROLLBACK`` when the block raises)."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn

    def __enter__(self) -> Txn:
        self.conn.execute("BEGIN IMMEDIATE")
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        self.conn.execute("ROLLBACK" if exc_type else "COMMIT")


class Savepoint:
    """``SAVEPOINT`` ... ``RELEASE`` (``ROLLBACK TO`` when the block raises): atomic inside a
    spool request's transaction (which a ``BEGIN`` cannot nest in) and outside one alike."""

    def __init__(self, db: Db, name: str) -> None:
        assert not db.readonly, "the store was opened read-only"
        self.conn = db.conn
        self.name = name

    def __enter__(self) -> Savepoint:
        self.conn.execute(f"SAVEPOINT {self.name}")
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        if exc_type:
            self.conn.execute(f"ROLLBACK TO {self.name}")
        self.conn.execute(f"RELEASE {self.name}")

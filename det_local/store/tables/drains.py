"""Drained slots and the drained node (`slot disable`, `cluster node disable`): kept across
daemon restarts. One row per drained target: ``slot:N`` (this machine's slot N) or ``node``
(this machine takes no new work from peers)."""

from __future__ import annotations

import sqlite3
import time

SCHEMA = """
CREATE TABLE IF NOT EXISTS drains (
    target TEXT PRIMARY KEY,
    by_user TEXT NOT NULL,
    at REAL NOT NULL
);
"""

NODE = "node"


def slot_target(index: int) -> str:
    return f"slot:{int(index)}"


class DrainTable:
    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn

    def mark(self, target: str, disabled: bool, user: str) -> bool:
        """Drain (or undrain) `target`; whether anything changed."""
        if disabled:
            cur = self.conn.execute(
                "INSERT OR IGNORE INTO drains(target, by_user, at) VALUES (?, ?, ?)",
                (target, user, time.time()),
            )
        else:
            cur = self.conn.execute("DELETE FROM drains WHERE target=?", (target,))
        return cur.rowcount > 0

    def all(self) -> dict[str, tuple[str, float]]:
        """target -> (who drained it, when)."""
        try:
            rows = self.conn.execute("SELECT target, by_user, at FROM drains").fetchall()
        except sqlite3.OperationalError:  # a read-only store from before this table
            return {}
        return {t: (u, a) for t, u, a in rows}

    def slots(self) -> set[int]:
        return {int(t.split(":", 1)[1]) for t in self.all() if t.startswith("slot:")}

    def node(self) -> bool:
        return NODE in self.all()

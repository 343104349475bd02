"""Log policies a trial's output matched (Determined 0.38's `log_policies`): the policy's
name, shown on the trial, and its action (cancel_retries, exclude_node or none)."""

from __future__ import annotations

import sqlite3

SCHEMA = """
CREATE TABLE IF NOT EXISTS trial_log_policies (
    trial_id INTEGER NOT NULL,
    name TEXT NOT NULL,
    action TEXT NOT NULL DEFAULT '',
    PRIMARY KEY (trial_id, name)
);
"""


class LogPolicyTable:
    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn

    def add(self, trial_id: int, name: str, action: str) -> None:
        self.conn.execute(
            "INSERT OR IGNORE INTO trial_log_policies(trial_id, name, action) VALUES (?, ?, ?)",
            (trial_id, name, action),
        )

    def matched(self, trial_id: int) -> list[tuple[str, str]]:
        """(name, action) of the policies the trial's output matched, in name order."""
        try:
            rows = self.conn.execute(
                "SELECT name, action FROM trial_log_policies WHERE trial_id=? ORDER BY name",
                (trial_id,),
            ).fetchall()
        except sqlite3.OperationalError:  # a read-only store from before this table
            return []
        return [(n, a) for n, a in rows]

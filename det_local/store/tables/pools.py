"""The resource pool of each job that runs outside this machine's slots (`cmd run --pool`;
a trial's pool is its experiment's config's): one row per such job, none for this machine's."""

from __future__ import annotations

import sqlite3

from det_local.store.sql import Db

SCHEMA = """
CREATE TABLE IF NOT EXISTS job_pools (
    job_id INTEGER PRIMARY KEY,
    pool TEXT NOT NULL,
    slots INTEGER NOT NULL
);
"""


class JobPoolTable:
    def __init__(self, db: Db) -> None:
        self.db = db

    def set(self, job_id: int, pool: str, slots: int) -> None:
        self.db.write(
            "INSERT OR REPLACE INTO job_pools(job_id, pool, slots) VALUES (?, ?, ?)",
            (job_id, pool, slots),
        )

    def get(self, job_id: int) -> tuple[str, int] | None:
        """(pool, slots asked of it), or None: the job runs on this machine's slots."""
        try:
            row = self.db.conn.execute(
                "SELECT pool, slots FROM job_pools WHERE job_id=?", (job_id,)
            ).fetchone()
        except sqlite3.OperationalError:  # a database from before the table (read-only)
            return None
        return None if row is None else (str(row[0]), int(row[1]))

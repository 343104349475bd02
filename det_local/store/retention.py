"""Which ended experiments' logs `retention_policy.log_retention_days` says should go."""

from __future__ import annotations

import sqlite3

_DAYS = "json_extract(config, '$.retention_policy.log_retention_days')"


def expired(conn: sqlite3.Connection, now: float) -> list[int]:
    """Ids of experiments that ended more than their log_retention_days ago (-1 or none:
    kept forever), oldest first."""
    rows = conn.execute(
        f"SELECT id FROM experiments WHERE ended_at IS NOT NULL AND {_DAYS} >= 0"
        f" AND ended_at + {_DAYS} * 86400 <= ? ORDER BY ended_at",
        (now,),
    )
    return [int(r[0]) for r in rows]

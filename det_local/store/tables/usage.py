"""Who held which slots, and how well they used them: allocation records, system samples, idle
reservations (issue 30).

* ``allocations``: one row per time a job held slots (a trial's run, a command, a notebook, a
  shell, a share of another machine's gang), opened when the job moves to SCHEDULED or
  RESERVED and closed when it leaves them (``JobTable._move`` calls :func:`on_job_move`: every
  kind of job, with no call site to forget). ``util_sum``/``util_n`` add up the utilisation the
  sampler saw during it, so a usage report reads one row per allocation, never the samples.
* ``system_samples``: what the daemon's sampler (`det_local/usage/sampler.py`) read of a
  running job: one flat JSON object of numbers per sample (``span`` 0), or the mean of the
  samples of ``span`` seconds once downsampled (:meth:`UsageTable.downsample`).
* ``job_idle``: a command's ``idle_timeout`` and what the sampler found: since when its slots
  have been idle, when it was flagged, what was done.
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from det_local.store.sql import Db, dumps

SCHEMA = """
CREATE TABLE IF NOT EXISTS allocations (
    id INTEGER PRIMARY KEY,
    job_id INTEGER NOT NULL,
    run_id INTEGER NOT NULL,
    kind TEXT NOT NULL,
    user TEXT NOT NULL,
    experiment_id INTEGER,
    trial_id INTEGER,
    slots TEXT NOT NULL,
    n_slots INTEGER NOT NULL,
    started_at REAL NOT NULL,
    ended_at REAL,
    ended TEXT,
    util_sum REAL NOT NULL DEFAULT 0,
    util_n INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS allocations_by_end ON allocations(ended_at);
CREATE INDEX IF NOT EXISTS allocations_open ON allocations(job_id) WHERE ended_at IS NULL;
-- what a usage report reads, in its GROUP BY order: one scan of this index, no sort
CREATE INDEX IF NOT EXISTS allocations_usage ON allocations(user, kind, experiment_id,
    n_slots, started_at, ended_at, util_sum, util_n);
CREATE TABLE IF NOT EXISTS system_samples (
    id INTEGER PRIMARY KEY,
    job_id INTEGER NOT NULL,
    run_id INTEGER NOT NULL,
    trial_id INTEGER,
    time REAL NOT NULL,
    span REAL NOT NULL DEFAULT 0,
    metrics TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS system_samples_by_job ON system_samples(job_id, time);
CREATE INDEX IF NOT EXISTS system_samples_by_age ON system_samples(span, time);
CREATE INDEX IF NOT EXISTS system_samples_by_trial ON system_samples(trial_id, time)
    WHERE trial_id IS NOT NULL;
CREATE TABLE IF NOT EXISTS job_idle (
    job_id INTEGER PRIMARY KEY,
    timeout REAL,
    idle_since REAL,
    flagged_at REAL,
    action TEXT
);
"""

# why an allocation ended, by the state its job moved to
ENDED_BY_STATE = {"QUEUED": "requeued", "DONE": "ended", "CANCELED": "canceled"}
HOLDING = ("SCHEDULED", "RESERVED")

_OPEN = (
    "INSERT INTO allocations(job_id, run_id, kind, user, experiment_id, trial_id, slots,"
    " n_slots, started_at)"
    " SELECT id, run_id, kind, user, experiment_id, trial_id, slots, json_array_length(slots),"
    " COALESCE(started_at, ?) FROM jobs WHERE id=?"
    " AND NOT EXISTS (SELECT 1 FROM allocations WHERE job_id=? AND ended_at IS NULL)"
)
_CLOSE = "UPDATE allocations SET ended_at=?, ended=? WHERE job_id=? AND ended_at IS NULL"


def on_job_move(conn: sqlite3.Connection, job_id: int, new_state: str) -> None:
    """Keep the allocation records in step with a job's state change (the writer only)."""
    now = time.time()
    if new_state in HOLDING:
        conn.execute(_OPEN, (now, job_id, job_id))
    elif new_state in ENDED_BY_STATE:
        conn.execute(_CLOSE, (now, ENDED_BY_STATE[new_state], job_id))


@dataclass
class Allocation:
    id: int
    job_id: int
    run_id: int
    kind: str
    user: str
    experiment_id: int | None
    trial_id: int | None
    slots: list[int]
    started_at: float
    ended_at: float | None
    ended: str | None
    util_sum: float
    util_n: int

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class IdleState:
    job_id: int
    timeout: float | None  # the job's idle_timeout in seconds (None: not asked for)
    idle_since: float | None  # when its slots were last seen busy, while idle now
    flagged_at: float | None  # when it was found idle past its timeout (or the threshold)
    action: str | None  # "notified" | "stopped"


_ALLOC_COLS = (
    "id, job_id, run_id, kind, user, experiment_id, trial_id, slots, started_at, ended_at,"
    " ended, util_sum, util_n"
)


def _alloc(r: Sequence[Any]) -> Allocation:
    return Allocation(
        int(r[0]),
        int(r[1]),
        int(r[2]),
        str(r[3]),
        str(r[4]),
        r[5],
        r[6],
        json.loads(r[7]),
        float(r[8]),
        None if r[9] is None else float(r[9]),
        r[10],
        float(r[11]),
        int(r[12]),
    )


class UsageTable:
    """Allocations, system samples and idle states (the Store owns the connection)."""

    def __init__(self, db: Db) -> None:
        self.db = db
        self.conn = db.conn

    # -- allocations ----------------------------------------------------------------------
    def add_allocation(
        self,
        *,
        job_id: int,
        kind: str,
        user: str,
        slots: Sequence[int],
        started_at: float,
        ended_at: float | None,
        ended: str | None = "ended",
        run_id: int = 1,
        experiment_id: int | None = None,
        trial_id: int | None = None,
        util_sum: float = 0.0,
        util_n: int = 0,
    ) -> int:
        """One allocation record as given (imports, tests, benchmarks: the engine's come from
        job moves)."""
        cur = self.db.write(
            "INSERT INTO allocations(job_id, run_id, kind, user, experiment_id, trial_id, slots,"
            " n_slots, started_at, ended_at, ended, util_sum, util_n)"
            " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                job_id,
                run_id,
                kind,
                user,
                experiment_id,
                trial_id,
                json.dumps(list(slots)),
                len(slots),
                started_at,
                ended_at,
                None if ended_at is None else ended,
                util_sum,
                util_n,
            ),
        )
        return int(cur.lastrowid or 0)

    def aggregate(self, since: float, until: float, by: str) -> list[tuple[Any, ...]]:
        """The allocations' part inside since..until, summed per (key, kind, user):
        (key, kind, user, allocations, slot_seconds, sampled_slot_seconds, used_slot_seconds).
        `by`: user | experiment | kind | slot (one row per slot an allocation held).

        Summed in SQL (handing 10^5 rows to Python costs ten times the sums) in one scan of
        the covering index allocations_usage, in its order (``+ended_at``: not through
        allocations_by_end, whose OR with IS NULL would look up every row it finds). Per
        slot: summed per set of slots, then spread over them here (few distinct sets)."""
        span = "(MIN(COALESCE(ended_at, :until), :until) - MAX(started_at, :since))"
        # grouped in the order of the allocations_usage index (no sort), keyed as asked
        key, group = {
            "user": ("user", "user, kind"),
            "kind": ("kind", "user, kind"),
            "experiment": ("experiment_id", "user, kind, experiment_id"),
            "slot": ("slots", "user, kind, slots"),
        }[by]
        sql = (
            f"SELECT {key}, kind, user, count(*), sum({span} * n_slots),"
            f" sum(CASE WHEN util_n > 0 THEN {span} * n_slots ELSE 0 END),"
            f" sum(CASE WHEN util_n > 0 THEN {span} * n_slots * util_sum / util_n / 100.0"
            " ELSE 0 END), n_slots"
            " FROM allocations WHERE (+ended_at IS NULL OR +ended_at > :since)"
            f" AND +started_at < :until GROUP BY {group}"
        )
        rows = self.conn.execute(sql, {"since": since, "until": until}).fetchall()
        if by != "slot":
            return [tuple(r[:7]) for r in rows]
        spread: dict[tuple[Any, str, str], list[float]] = {}
        for key, kind, user, count, secs, sampled, used, _ in rows:
            slots = json.loads(key)
            if not slots:
                continue
            share = 1.0 / len(slots)  # each slot held for the same time
            for slot in slots:
                a = spread.setdefault((int(slot), kind, user), [0, 0.0, 0.0, 0.0])
                a[0] += count
                a[1] += secs * share
                a[2] += sampled * share
                a[3] += used * share
        return [(k[0], k[1], k[2], *v) for k, v in spread.items()]

    def list_allocations(self, job_id: int) -> list[Allocation]:
        rows = self.conn.execute(
            f"SELECT {_ALLOC_COLS} FROM allocations WHERE job_id=? ORDER BY id", (job_id,)
        )
        return [_alloc(r) for r in rows]

    def add_utilisation(self, values: Iterable[tuple[int, float]]) -> None:
        """(job id, utilisation %) of one sample each, into their open allocations."""
        self.conn.executemany(
            "UPDATE allocations SET util_sum=util_sum+?, util_n=util_n+1"
            " WHERE job_id=? AND ended_at IS NULL",
            [(float(u), j) for j, u in values],
        )

    # -- system samples -------------------------------------------------------------------
    def add_samples(
        self, rows: Iterable[tuple[int, int, int | None, float, dict[str, float]]]
    ) -> None:
        """(job id, run id, trial id, time, metrics) rows, written as they come (the caller
        holds the transaction)."""
        self.conn.executemany(
            "INSERT INTO system_samples(job_id, run_id, trial_id, time, span, metrics)"
            " VALUES (?, ?, ?, ?, 0, ?)",
            [(j, r, t, ts, dumps(m)) for j, r, t, ts, m in rows],
        )

    def samples(
        self, *, job_id: int | None = None, trial_id: int | None = None, since: float = 0.0
    ) -> list[tuple[int, float, float, dict[str, Any]]]:
        """(run id, time, span, metrics) of a job's (or a trial's) samples, oldest first."""
        where = "trial_id=?" if trial_id is not None else "job_id=?"
        key = trial_id if trial_id is not None else job_id
        rows = self.conn.execute(
            f"SELECT run_id, time, span, metrics FROM system_samples WHERE {where} AND time>=?"
            " ORDER BY time, id",
            (key, since),
        )
        return [(int(r[0]), float(r[1]), float(r[2]), json.loads(r[3])) for r in rows]

    def count_samples(self, job_id: int) -> int:
        row = self.conn.execute(
            "SELECT count(*) FROM system_samples WHERE job_id=?", (job_id,)
        ).fetchone()
        return int(row[0])

    def has_samples(self, trial_id: int) -> bool:
        row = self.conn.execute(
            "SELECT 1 FROM system_samples WHERE trial_id=? LIMIT 1", (trial_id,)
        ).fetchone()
        return row is not None

    def downsample(
        self,
        now: float,
        tiers: Sequence[tuple[float, float]],
        max_rows: int,
        jobs: Iterable[int] = (),
        budget: int = 5000,
    ) -> int:
        """Merge old samples into means: for each (age, span) tier, rows older than `age`
        seconds and finer than `span` become one row per `span` seconds (the mean of each
        number, the bucket's last time); then each of `jobs` (the running ones: only they
        grow) keeps at most `max_rows` rows (its oldest go). At most `budget` rows are read
        per call (the caller comes back). Every read is an index seek (system_samples_by_age,
        _by_job), never a scan of the table.
        Returns how many rows were merged or dropped."""
        done = 0
        for age, span in tiers:
            # a bucket the cutoff cuts through is merged in two parts (two means of one span):
            # bounded all the same, and the newest samples keep their full rate for `age`
            cutoff = now - age
            rows = self.conn.execute(
                "SELECT id, job_id, run_id, trial_id, time, metrics FROM system_samples"
                " WHERE span < ? AND time < ? ORDER BY job_id, time LIMIT ?",
                (span, cutoff, budget),
            ).fetchall()
            if not rows:
                continue
            buckets: dict[tuple[int, int, float], list[Any]] = {}
            for r in rows:
                key = (int(r[1]), int(r[2]), float(r[4]) // span)
                buckets.setdefault(key, []).append(r)
            merged = []
            for (job_id, run_id, _), members in buckets.items():
                merged.append(
                    (
                        job_id,
                        run_id,
                        members[0][3],
                        float(members[-1][4]),
                        span,
                        dumps(mean_of([json.loads(m[5]) for m in members])),
                    )
                )
            with self.db.transaction():
                self.conn.executemany(
                    "DELETE FROM system_samples WHERE id=?", [(r[0],) for r in rows]
                )
                self.conn.executemany(
                    "INSERT INTO system_samples(job_id, run_id, trial_id, time, span, metrics)"
                    " VALUES (?, ?, ?, ?, ?, ?)",
                    merged,
                )
            done += len(rows)
        for job_id in jobs:
            n = self.count_samples(job_id)
            if n <= max_rows:
                continue
            with self.db.transaction():
                self.conn.execute(
                    "DELETE FROM system_samples WHERE id IN (SELECT id FROM system_samples"
                    " WHERE job_id=? ORDER BY time, id LIMIT ?)",
                    (job_id, int(n) - max_rows),
                )
            done += int(n) - max_rows
        return done

    # -- idle reservations ----------------------------------------------------------------
    def set_idle_timeout(self, job_id: int, timeout: float) -> None:
        self.db.write(
            "INSERT INTO job_idle(job_id, timeout) VALUES (?, ?)"
            " ON CONFLICT(job_id) DO UPDATE SET timeout=excluded.timeout",
            (job_id, timeout),
        )

    def set_idle(
        self, job_id: int, idle_since: float | None, flagged_at: float | None, action: str | None
    ) -> None:
        self.db.write(
            "INSERT INTO job_idle(job_id, idle_since, flagged_at, action) VALUES (?, ?, ?, ?)"
            " ON CONFLICT(job_id) DO UPDATE SET idle_since=excluded.idle_since,"
            " flagged_at=excluded.flagged_at, action=excluded.action",
            (job_id, idle_since, flagged_at, action),
        )

    def idle_states(self, job_ids: Iterable[int] | None = None) -> dict[int, IdleState]:
        sql = "SELECT job_id, timeout, idle_since, flagged_at, action FROM job_idle"
        rows = self.conn.execute(sql).fetchall()
        wanted = None if job_ids is None else set(job_ids)
        return {
            int(r[0]): IdleState(int(r[0]), r[1], r[2], r[3], r[4])
            for r in rows
            if wanted is None or int(r[0]) in wanted
        }


def mean_of(samples: Sequence[dict[str, Any]]) -> dict[str, float]:
    """The mean of each number over the samples that have it (keys in first-seen order)."""
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    for s in samples:
        for k, v in s.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                sums[k] = sums.get(k, 0.0) + float(v)
                counts[k] = counts.get(k, 0) + 1
    return {k: round(sums[k] / counts[k], 3) for k in sums}

"""The job queue's records: one row per schedulable job (a trial, a command, a shell...).

A job is QUEUED (waiting for slots) or SCHEDULED (holding slots, its process running); a job
that ended is DONE (CANCELED: removed while queued) and kept for `job list --all` and its exit
status. The allocation (slots, pid, the process's start time, the run id) is written before a
process is spawned and completed after, so a restarted daemon can tell which processes are its
own.

The states and the moves allowed between them are :class:`~det_local.store.states.JobState`
and its table: a state change is one UPDATE whose WHERE clause admits only the states the move
may start from; a move the table lacks changes nothing and raises StateError (a bug).

Every user can read the database: nothing secret goes in it. The `token` and `env` columns
are left from det-local versions that kept a trial's token and a command's environment here;
they stay NULL (`store/private.py` holds both now, in files only the daemon reads), and
:meth:`JobTable.take_secrets` moves what an older version left there out at the first start.

The writer keeps the active jobs in memory as well (:class:`ActiveJobs`), so that a scheduling
pass reads no SQL: every change goes through this table, writes its row and puts the row that
SQLite returns (``RETURNING``) into the copy. The copy is dropped and read again from SQL when
a transaction rolls back (:meth:`JobTable.reload`) or another connection commits to the
database (``PRAGMA data_version``). Read-only clients read SQL.
"""

from __future__ import annotations

import json
import sqlite3
import time
from bisect import bisect_left, insort
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from det_local.errors import NotFoundError, StateError
from det_local.store.states import (
    JOB_ACTIVE,
    JOB_SOURCES,
    JobKind,
    JobState,
    check_job_transition,
)
from det_local.store.tables.usage import SCHEMA as USAGE_SCHEMA
from det_local.store.tables.usage import on_job_move

# a scheduled job whose run waits in its pool's own queue (a Slurm job PENDING) and why
WAITS_SCHEMA = """
CREATE TABLE IF NOT EXISTS job_waits (job_id INTEGER PRIMARY KEY, reason TEXT NOT NULL)
"""

SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    kind TEXT NOT NULL,
    name TEXT NOT NULL,
    user TEXT NOT NULL,
    uid INTEGER NOT NULL,
    priority INTEGER NOT NULL,
    position REAL NOT NULL,
    slots_needed INTEGER NOT NULL,
    state TEXT NOT NULL,
    experiment_id INTEGER,
    trial_id INTEGER,
    slots TEXT NOT NULL DEFAULT '[]',
    pid INTEGER,
    pid_start REAL,
    token TEXT,
    run_id INTEGER NOT NULL DEFAULT 0,
    submitted_at REAL NOT NULL,
    started_at REAL,
    ended_at REAL,
    argv TEXT,
    cwd TEXT,
    env TEXT,
    exit_code INTEGER,
    message TEXT,
    preempt_acked INTEGER NOT NULL DEFAULT 0,
    umask INTEGER,
    gang TEXT,
    anywhere INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS jobs_by_state ON jobs(state);
CREATE INDEX IF NOT EXISTS jobs_by_position ON jobs(position);
CREATE UNIQUE INDEX IF NOT EXISTS jobs_by_trial ON jobs(trial_id) WHERE trial_id IS NOT NULL;
CREATE TABLE IF NOT EXISTS requests (
    id TEXT PRIMARY KEY,
    time REAL NOT NULL,
    result TEXT NOT NULL
);
"""

# JobState's members under the names the scheduler imports today
QUEUED = JobState.QUEUED
RESERVED = JobState.RESERVED
SCHEDULED = JobState.SCHEDULED
DONE = JobState.DONE
_STATE_OF = {s.value: s for s in JobState}  # a stored string -> its member (faster than a call)
_KIND_OF = {k.value: k for k in JobKind}
CANCELED = JobState.CANCELED
ENDED = (DONE, CANCELED)

_COLS = (
    "id, kind, name, user, uid, priority, position, slots_needed, state, experiment_id, "
    "trial_id, slots, pid, pid_start, run_id, submitted_at, started_at, ended_at, argv, "
    "cwd, exit_code, message, preempt_acked, umask, gang, anywhere"
)
_LIST_COLS = _COLS
# the scheduling pass skips argv (`get` reads the whole row when a job starts)
_ACTIVE_COLS = _LIST_COLS.replace("ended_at, argv,", "ended_at, NULL,")
_ACTIVE = "state IN ({})".format(", ".join(f"'{s.value}'" for s in sorted(JOB_ACTIVE)))
# a move to each state: the states it may start from (the WHERE clause of its UPDATE)
_FROM = {
    new: "state IN ({})".format(", ".join(f"'{s.value}'" for s in sorted(old)))
    for new, old in JOB_SOURCES.items()
}
_ORDER = " ORDER BY position, id"  # what the position index gives (ties: by id)


@dataclass
class JobRecord:
    id: int
    kind: JobKind
    name: str
    user: str
    uid: int
    priority: int
    position: float
    slots_needed: int
    state: JobState
    experiment_id: int | None
    trial_id: int | None
    slots: list[int]
    pid: int | None
    pid_start: float | None
    run_id: int
    submitted_at: float
    started_at: float | None
    ended_at: float | None
    argv: list[str] | None = None
    cwd: str | None = None
    exit_code: int | None = None
    message: str | None = None
    # the running trial acknowledged a preemption (kept for a daemon that restarts before it
    # exits: its exit then means "requeue me", not "done")
    preempt_acked: bool = False
    umask: int | None = None  # the submitter's umask (None: submitted before it was recorded)
    # a share of a gang across machines (federate/): what this node's part of it is
    gang: dict[str, Any] | None = None
    # it may run wholly on an idle peer when this machine is full (resources.federate,
    # --anywhere); its `gang` then says which peer runs it
    anywhere: bool = False

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["state"] = self.state.value
        return d


def _real(v: Any) -> float | None:
    # REAL columns: SQLite keeps a whole number as an integer on disk and a RETURNING clause
    # hands it over as such (a SELECT gives a float)
    return None if v is None else float(v)


def _state(value: str) -> JobState:
    try:
        return _STATE_OF[value]
    except KeyError:
        raise StateError(
            f"a job in the database has the unknown state {value!r}; "
            f"the states are {', '.join(_STATE_OF)}"
        ) from None


def _row(r: Sequence[Any]) -> JobRecord:
    return JobRecord(
        id=r[0],
        kind=_KIND_OF[r[1]],
        name=r[2],
        user=r[3],
        uid=r[4],
        priority=r[5],
        position=float(r[6]),
        slots_needed=r[7],
        state=_state(r[8]),
        experiment_id=r[9],
        trial_id=r[10],
        slots=json.loads(r[11]),
        pid=r[12],
        pid_start=_real(r[13]),
        run_id=r[14],
        submitted_at=float(r[15]),
        started_at=_real(r[16]),
        ended_at=_real(r[17]),
        argv=json.loads(r[18]) if r[18] else None,
        cwd=r[19],
        exit_code=r[20],
        message=r[21],
        preempt_acked=bool(r[22]),
        umask=r[23],
        gang=json.loads(r[24]) if r[24] else None,
        anywhere=bool(r[25]),
    )


def _queue_key(job: JobRecord) -> tuple[int, float, int]:
    return (job.priority, job.position, job.id)


class ActiveJobs:
    """The QUEUED and SCHEDULED jobs as :meth:`JobTable.active` reads them (argv left out),
    held by the writer: by id, the running ones apart, and the queued ones' ids in
    (priority, position, id) order (an index, as SQL would keep one), so that a scheduling
    pass reads as far into a long queue as it needs and no further. Records are replaced,
    never changed in place: a record handed out stays what it was when read."""

    def __init__(self, rows: Iterable[JobRecord] = ()) -> None:
        self.jobs: dict[int, JobRecord] = {}
        self.running: dict[int, JobRecord] = {}
        self.queue: list[tuple[int, float, int]] = []  # (priority, position, id), sorted
        self.zero_slot = 0  # queued jobs that need no slot
        for job in rows:
            self.put(job)

    def put(self, job: JobRecord) -> None:
        """Add or replace ``job`` (a row just read); an ended job leaves."""
        self.drop(job.id)
        if job.state == SCHEDULED or job.state == RESERVED:
            self.running[job.id] = job
        elif job.state == QUEUED:
            insort(self.queue, _queue_key(job))
            if job.slots_needed <= 0:
                self.zero_slot += 1
        else:
            return
        self.jobs[job.id] = job

    def drop(self, job_id: int) -> None:
        old = self.jobs.pop(job_id, None)
        if old is None:
            return
        if old.state == SCHEDULED or old.state == RESERVED:
            del self.running[job_id]
            return
        key = _queue_key(old)
        i = bisect_left(self.queue, key)
        assert self.queue[i] == key, f"job {job_id} missing from the queue index"
        del self.queue[i]
        if old.slots_needed <= 0:
            self.zero_slot -= 1

    def in_position_order(self) -> list[JobRecord]:
        return sorted(self.jobs.values(), key=lambda j: (j.position, j.id))

    def queued_in_order(self) -> Iterator[JobRecord]:
        jobs = self.jobs
        for key in self.queue:
            yield jobs[key[2]]


class JobTable:
    """Job rows in the store's database (the Store owns the connection)."""

    def __init__(self, conn: sqlite3.Connection, *, readonly: bool) -> None:
        self.conn = conn
        # the writer's copy of the active jobs (None: read from SQL when next needed); a reader
        # never has one
        self._mirrored = not readonly
        self._mirror: ActiveJobs | None = None
        self._data_version: int | None = None
        if not readonly:
            conn.executescript(SCHEMA)
            conn.executescript(USAGE_SCHEMA)
            columns = {r[1] for r in conn.execute("PRAGMA table_info(jobs)")}
            if "preempt_acked" not in columns:  # a database from before the column
                conn.execute("ALTER TABLE jobs ADD COLUMN preempt_acked INTEGER NOT NULL DEFAULT 0")
            if "umask" not in columns:  # a database from before the column
                conn.execute("ALTER TABLE jobs ADD COLUMN umask INTEGER")
            if "gang" not in columns:  # a database from before the column
                conn.execute("ALTER TABLE jobs ADD COLUMN gang TEXT")
            if "anywhere" not in columns:  # a database from before the column
                conn.execute("ALTER TABLE jobs ADD COLUMN anywhere INTEGER NOT NULL DEFAULT 0")
            conn.execute(WAITS_SCHEMA)

    # -- the writer's copy of the active jobs ----------------------------------------------
    def reload(self) -> None:
        """Forget the in-memory copy; the next read takes it from SQL again. Call it when a
        transaction that may have changed jobs rolls back."""
        self._mirror = None

    def _active_jobs(self) -> ActiveJobs:
        """The copy, checked first: another connection's commit (a test, a repair by hand)
        changes ``data_version`` and the copy is read again."""
        version = self.conn.execute("PRAGMA data_version").fetchone()[0]
        mirror = self._mirror
        if mirror is None or version != self._data_version:
            rows = self.conn.execute(f"SELECT {_ACTIVE_COLS} FROM jobs WHERE {_ACTIVE}{_ORDER}")
            mirror = self._mirror = ActiveJobs(_row(r) for r in rows)
            self._data_version = version
        return mirror

    def _changed(self, rows: list[Any]) -> None:
        """Rows that a change returned (``RETURNING`` the active columns): into the copy."""
        mirror = self._mirror
        if mirror is None:
            return
        for r in rows:
            mirror.put(_row(r))

    def _update(self, sql: str, args: Sequence[Any]) -> int:
        """One UPDATE of the jobs table (ending in its WHERE clause), mirrored; returns the
        number of rows it changed."""
        if self._mirror is None:
            return self.conn.execute(sql, args).rowcount
        rows = self.conn.execute(f"{sql} RETURNING {_ACTIVE_COLS}", args).fetchall()
        self._changed(rows)
        return len(rows)

    def _move(self, job_id: int, new: JobState, sets: str, args: Sequence[Any]) -> None:
        """Put the job in state ``new`` and ``SET sets`` (its ``args``), in one UPDATE that
        only a state the move may start from matches. A job in another state is left as it
        is: StateError (a bug), naming both states; no such job: NotFoundError."""
        changed = self._update(
            f"UPDATE jobs SET state=?, {sets} WHERE id=? AND {_FROM[new]}",
            (new.value, *args, job_id),
        )
        if changed:
            if self._mirrored:  # the writer: the allocation records follow (store/tables/usage.py)
                on_job_move(self.conn, job_id, new.value)
            return
        r = self.conn.execute("SELECT state FROM jobs WHERE id=?", (job_id,)).fetchone()
        if r is None:
            raise NotFoundError(f"job {job_id} not found; `det-local job list` shows the queue")
        check_job_transition(job_id, _state(r[0]), new)
        raise AssertionError(f"job {job_id}: moving to {new.value} changed no row")

    def create(
        self,
        *,
        kind: JobKind,
        name: str,
        user: str,
        uid: int,
        priority: int,
        slots_needed: int,
        experiment_id: int | None = None,
        trial_id: int | None = None,
        argv: list[str] | None = None,
        cwd: str | None = None,
        umask: int | None = None,
        gang: dict[str, Any] | None = None,
        anywhere: bool = False,
    ) -> int:
        now = time.time()
        cur = self.conn.execute(
            "INSERT INTO jobs(kind, name, user, uid, priority, position, slots_needed, state,"
            " experiment_id, trial_id, submitted_at, argv, cwd, umask, gang, anywhere)"
            " VALUES (?, ?, ?, ?, ?, (SELECT COALESCE(MAX(position), 0) + 1 FROM jobs),"
            f" ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) RETURNING {_ACTIVE_COLS}",
            (
                kind,
                name,
                user,
                uid,
                priority,
                slots_needed,
                QUEUED,
                experiment_id,
                trial_id,
                now,
                json.dumps(argv) if argv is not None else None,
                cwd,
                umask,
                json.dumps(gang) if gang is not None else None,
                int(anywhere),
            ),
        )
        rows = cur.fetchall()
        self._changed(rows)
        return int(rows[0][0])

    def get(self, job_id: int) -> JobRecord:
        r = self.conn.execute(f"SELECT {_COLS} FROM jobs WHERE id=?", (job_id,)).fetchone()
        if r is None:
            raise NotFoundError(f"job {job_id} not found; `det-local job list` shows the queue")
        return _row(r)

    def peek(self, job_id: int) -> JobRecord:
        """An active job as the scheduler sees it (argv left out), from the
        writer's copy; any other job as :meth:`get` reads it."""
        if self._mirrored:
            job = self._active_jobs().jobs.get(job_id)
            if job is not None:
                return job
        return self.get(job_id)

    def for_trial(self, trial_id: int) -> JobRecord | None:
        r = self.conn.execute(f"SELECT {_COLS} FROM jobs WHERE trial_id=?", (trial_id,)).fetchone()
        return _row(r) if r else None

    def active(self) -> list[JobRecord]:
        """QUEUED and SCHEDULED jobs, in position order (argv left out)."""
        if self._mirrored:
            return self._active_jobs().in_position_order()
        rows = self.conn.execute(f"SELECT {_ACTIVE_COLS} FROM jobs WHERE {_ACTIVE}{_ORDER}")
        return [_row(r) for r in rows]

    def scheduling_view(self) -> ActiveJobs:
        """The active jobs for a scheduling pass: the writer's copy (a reader gets one read
        now). Read it before changing any job: a change updates it in place."""
        if self._mirrored:
            return self._active_jobs()
        return ActiveJobs(self.active())

    def list(self, *, include_done: bool = False, limit: int | None = None) -> list[JobRecord]:
        """Jobs in queue order for `job list`."""
        sql = f"SELECT {_LIST_COLS} FROM jobs"
        if not include_done:
            sql += f" WHERE {_ACTIVE}"
        sql += " ORDER BY position"
        if limit is not None:
            sql += f" LIMIT {int(limit)}"
        return [_row(r) for r in self.conn.execute(sql)]

    # -- state changes --------------------------------------------------------------------
    def requeue(self, job_id: int, *, priority: int | None = None) -> None:
        self._move(
            job_id,
            JobState.QUEUED,
            "slots='[]', pid=NULL, pid_start=NULL, priority=COALESCE(?, priority),"
            " ended_at=NULL, exit_code=NULL, preempt_acked=0",
            (priority,),
        )

    def allocate(self, job_id: int, slots: Iterable[int], run_id: int) -> None:
        """Durable before acting: the allocation is recorded before the process is spawned."""
        self._move(
            job_id,
            JobState.SCHEDULED,
            "slots=?, run_id=?, started_at=?, pid=NULL, pid_start=NULL, preempt_acked=0",
            (json.dumps(list(slots)), run_id, time.time()),
        )

    def reserve(self, job_id: int, slots: Iterable[int], run_id: int) -> None:
        """A gang's share holds its slots (durable) while the other machines get ready."""
        self._move(
            job_id,
            JobState.RESERVED,
            "slots=?, run_id=?, started_at=?, pid=NULL, pid_start=NULL, preempt_acked=0",
            (json.dumps(list(slots)), run_id, time.time()),
        )

    def commit(self, job_id: int) -> None:
        """A reserved share's gang is committed: its process is spawned next."""
        self._move(job_id, JobState.SCHEDULED, "started_at=?", (time.time(),))

    def set_gang(self, job_id: int, gang: dict[str, Any] | None, slots_needed: int) -> None:
        self._update(
            "UPDATE jobs SET gang=?, slots_needed=? WHERE id=?",
            (json.dumps(gang) if gang is not None else None, slots_needed, job_id),
        )

    def set_process(self, job_id: int, pid: int, pid_start: float) -> None:
        self._update("UPDATE jobs SET pid=?, pid_start=? WHERE id=?", (pid, pid_start, job_id))

    def set_waiting(self, job_id: int, reason: str | None) -> None:
        """A scheduled job's run that waits in its pool's own queue (a Slurm job PENDING):
        that queue's reason ("Resources", "Priority"); None: it runs, or has ended."""
        if reason is None:
            self.conn.execute("DELETE FROM job_waits WHERE job_id=?", (job_id,))
        else:
            self.conn.execute(
                "INSERT OR REPLACE INTO job_waits(job_id, reason) VALUES (?, ?)", (job_id, reason)
            )

    def waiting(self) -> dict[int, str]:
        """Job id -> why its run still waits in its pool's queue (`set_waiting`)."""
        try:
            rows = self.conn.execute("SELECT job_id, reason FROM job_waits").fetchall()
        except sqlite3.OperationalError:  # a database from before the table (read-only)
            return {}
        return {int(r[0]): str(r[1]) for r in rows}

    def finish(self, job_id: int, exit_code: int | None, message: str | None = None) -> None:
        """The job ended: its process exited (exit_code), or it could not start."""
        self._move(
            job_id,
            JobState.DONE,
            "slots='[]', ended_at=?, exit_code=?, message=?",
            (time.time(), exit_code, message),
        )

    def cancel(self, job_id: int, message: str) -> None:
        """A queued job removed from the queue on request: it never started."""
        self._move(
            job_id,
            JobState.CANCELED,
            "slots='[]', ended_at=?, exit_code=NULL, message=?",
            (time.time(), message),
        )

    def set_preempt_acked(self, job_id: int) -> None:
        self._update("UPDATE jobs SET preempt_acked=1 WHERE id=?", (job_id,))

    def set_priority(self, job_id: int, priority: int) -> None:
        self._update("UPDATE jobs SET priority=? WHERE id=?", (priority, job_id))

    def set_position(self, job_id: int, position: float) -> None:
        self._update("UPDATE jobs SET position=? WHERE id=?", (position, job_id))

    def neighbour_position(self, job_id: int, *, ahead: bool) -> float:
        """A position just ahead of (or behind) job_id among active jobs."""
        job = self.get(job_id)
        op, order = ("<", "DESC") if ahead else (">", "ASC")
        r = self.conn.execute(
            f"SELECT position FROM jobs WHERE {_ACTIVE} AND position {op} ? "
            f"ORDER BY position {order} LIMIT 1",
            (job.position,),
        ).fetchone()
        if r is None:
            return job.position - 1 if ahead else job.position + 1
        return (job.position + r[0]) / 2

    # -- secrets an older det-local kept here ----------------------------------------------
    def take_secrets(self) -> tuple[dict[int, tuple[int, str]], dict[int, dict[str, str]]]:
        """What an older det-local left in the token and env columns: the tokens of running
        jobs (job id -> (run id, token)) and the environments of queued ones (job id -> env),
        for the caller to keep in private files before :meth:`clear_secrets`."""
        tokens: dict[int, tuple[int, str]] = {}
        envs: dict[int, dict[str, str]] = {}
        rows = self.conn.execute(
            "SELECT id, state, run_id, token, env FROM jobs"
            " WHERE token IS NOT NULL OR env IS NOT NULL"
        )
        for job_id, state, run_id, token, env in rows:
            if token and state == SCHEDULED:
                tokens[int(job_id)] = (int(run_id), str(token))
            if env and state in (QUEUED, SCHEDULED):
                try:
                    envs[int(job_id)] = {str(k): str(v) for k, v in json.loads(env).items()}
                except (ValueError, AttributeError):
                    pass  # unreadable: the command runs with an empty environment
        return tokens, envs

    def clear_secrets(self) -> bool:
        """Empty the token and env columns (True when there was something to clear)."""
        cur = self.conn.execute(
            "UPDATE jobs SET token=NULL, env=NULL WHERE token IS NOT NULL OR env IS NOT NULL"
        )
        return cur.rowcount > 0

    # -- processed spool requests (idempotent replay after a crash) ------------------------
    def request_result(self, request_id: str) -> dict[str, Any] | None:
        r = self.conn.execute("SELECT result FROM requests WHERE id=?", (request_id,)).fetchone()
        return json.loads(r[0]) if r else None

    def record_request(self, request_id: str, result: dict[str, Any]) -> None:
        self.conn.execute(
            "INSERT OR REPLACE INTO requests(id, time, result) VALUES (?, ?, ?)",
            (request_id, time.time(), json.dumps(result)),
        )

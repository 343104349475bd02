"""The SQLite store (WAL mode): experiments, trials, checkpoints, metrics, events, jobs.

Only the daemon (or the embedded runner acting as it) opens it for writing. The CLI opens it
read-only and can read while a run writes (WAL readers never block the writer).

:class:`Store` is the connection and the tables on it, one module each under ``tables/``:
``experiments.py``, ``trials.py``, ``checkpoint_table.py``, ``metrics.py`` (metrics and
events), ``jobs.py``.
Callers use the Store's methods (``store.add_metrics(...)``), each one table's method; a table
is also at hand as ``store.experiments``, ``store.trials``, ``store.checkpoints``,
``store.metrics``, ``store.events`` and ``store.jobs``.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from pathlib import Path

from det_local.store.sql import Db, Txn
from det_local.store.tables import (
    checkpoint_table,
    drains,
    experiments,
    lifecycle,
    logpolicies,
    metrics,
    pools,
    registry,
    trials,
    trialstarts,
    usage,
)
from det_local.store.tables.checkpoint_table import CheckpointTable
from det_local.store.tables.experiments import GC_DONE, GC_SKIPPED, ExperimentTable, current_user
from det_local.store.tables.jobs import JobTable
from det_local.store.tables.lifecycle import LifecycleTable
from det_local.store.tables.metrics import EventTable, MetricTable
from det_local.store.tables.pools import JobPoolTable
from det_local.store.tables.registry import ModelRegistry
from det_local.store.tables.trials import TrialTable
from det_local.store.tables.trialstarts import TrialStartTable
from det_local.store.tables.usage import UsageTable

__all__ = ["GC_DONE", "GC_SKIPPED", "SCHEMA", "SCHEMA_VERSION", "Store", "current_user"]

SCHEMA_VERSION = 1

SCHEMA = (
    "CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);\n"
    + experiments.SCHEMA
    + trials.SCHEMA
    + checkpoint_table.SCHEMA
    + metrics.SCHEMA
    + trialstarts.SCHEMA
    + usage.SCHEMA
    + drains.SCHEMA
    + logpolicies.SCHEMA
    + registry.SCHEMA
    + lifecycle.SCHEMA
    + pools.SCHEMA
)


class Store:
    """Records under DET_LOCAL_HOME. ``readonly=True`` for clients; the writer is the daemon."""

    def __init__(self, db_path: Path, *, readonly: bool = False) -> None:
        self.path = db_path
        self.readonly = readonly
        if readonly:
            conn = None
            if db_path.exists():
                conn = sqlite3.connect(
                    f"file:{db_path}?mode=ro", uri=True, check_same_thread=False, timeout=10
                )
                ready = conn.execute(
                    "SELECT 1 FROM sqlite_master WHERE type='table' AND name='jobs'"
                ).fetchone()
                if not ready:  # the writer has created the file but not its tables yet
                    conn.close()
                    conn = None
            if conn is None:  # nothing recorded yet: an empty store
                conn = sqlite3.connect(":memory:", check_same_thread=False)
                conn.executescript(SCHEMA)
                self.conn = conn
                self.jobs = JobTable(conn, readonly=False)
            else:
                self.conn = conn
                self.jobs = JobTable(conn, readonly=True)
            self.db = Db(self.conn, readonly=True)
        else:
            db_path.parent.mkdir(parents=True, exist_ok=True)
            self.conn = sqlite3.connect(
                str(db_path), check_same_thread=False, timeout=30, isolation_level=None
            )
            self.conn.execute("PRAGMA journal_mode=WAL")
            self.conn.execute("PRAGMA synchronous=NORMAL")
            self.conn.executescript(SCHEMA)
            self.conn.execute(
                "INSERT OR IGNORE INTO meta(key, value) VALUES ('schema_version', ?)",
                (str(SCHEMA_VERSION),),
            )
            self.db = Db(self.conn, readonly=False)
            experiments.migrate(self.db)
            self.jobs = JobTable(self.conn, readonly=False)

        self.experiments = e = ExperimentTable(self.db)
        self.create_experiment = e.create
        self.get_experiment = e.get
        self.list_experiments = e.select
        self.experiment_searchers = e.searchers
        self.set_experiment_state = e.set_state
        self.get_experiment_umask = e.get_umask
        self.set_experiment_context = e.set_context
        self.set_experiment_progress = e.set_progress
        self.set_labels = e.set_labels
        self.set_experiment_priority = e.set_priority
        self.get_experiment_priority = e.get_priority
        self.set_searcher_state = e.set_searcher_state
        self.get_searcher_state = e.get_searcher_state
        self.checkpoint_gc_due = e.checkpoint_gc_due
        self.checkpoint_gc_pending = e.checkpoint_gc_pending
        self.get_checkpoint_gc = e.get_checkpoint_gc
        self.set_checkpoint_gc = e.set_checkpoint_gc

        self.trials = t = TrialTable(self.db)
        self.create_trial = t.create
        self.get_trial = t.get
        self.list_trials = t.select
        self.trial_summaries = t.summaries
        self.set_trial_state = t.set_state
        self.next_trial_run = t.next_run
        self.add_restart = t.add_restart
        self.set_trial_steps = t.set_steps
        self.set_best_validation = t.set_best_validation
        self.warm_start_checkpoints = t.warm_start_checkpoints

        self.checkpoints = c = CheckpointTable(self.db)
        self.add_checkpoint = c.add
        self.get_checkpoint = c.get
        self.list_checkpoints = c.select
        self.mark_checkpoint_deleted = c.mark_deleted
        self.mark_checkpoints_deleted = c.mark_many_deleted
        self.add_incomplete_checkpoint = c.add_incomplete
        self.list_incomplete_checkpoints = c.list_incomplete
        self.drop_incomplete_checkpoints = c.drop_incomplete

        self.metrics = m = MetricTable(self.db)
        self.add_metrics = m.add
        self.list_metrics = m.select
        self.metric_groups = m.groups
        self.list_validations = m.list_validations
        self.latest_metrics = m.latest
        self.sample_metrics = m.sample
        self.last_metric_id = m.last_id
        self.last_experiment_metric_id = m.last_id_of_experiment
        self.newest_metric_id = m.newest_id

        self.events = ev = EventTable(self.db)
        self.add_event = ev.add
        self.list_events = ev.select

        self.trial_starts = ts = TrialStartTable(self.db)
        self.add_trial_start = ts.add
        self.list_trial_starts = ts.select

        # allocations, system samples, idle reservations (issue 30)
        self.usage = UsageTable(self.db)
        self.drains = drains.DrainTable(self.conn)
        self.log_policies = logpolicies.LogPolicyTable(self.conn)
        self.models = ModelRegistry(self.db)  # the model registry (`store/tables/registry.py`)
        self.lifecycle = LifecycleTable(self.db)  # archived experiments, deletions
        self.job_pools = JobPoolTable(self.db)  # commands run in a resource pool (cmd --pool)

    def transaction(self) -> Txn:
        return self.db.transaction()

    def close(self) -> None:
        self.conn.close()

    def move_secrets_out(
        self,
        keep: Callable[[dict[int, tuple[int, str]], dict[int, dict[str, str]]], None],
    ) -> bool:
        """A database an older det-local wrote holds trial tokens and commands' environments
        (which every user can read): hand those of live jobs to ``keep`` (private files,
        written durably), then clear the columns, zero the freed bytes and empty the WAL.
        Returns True when there was anything to move."""
        found = self.conn.execute(
            "SELECT 1 FROM jobs WHERE token IS NOT NULL OR env IS NOT NULL LIMIT 1"
        ).fetchone()
        if not found:
            return False
        tokens, envs = self.jobs.take_secrets()
        keep(tokens, envs)  # kept first: a crash now leaves them in both places, not in none
        # every user can read the file: the old values are zeroed, not left in free space for
        # a byte-level read
        self.conn.execute("PRAGMA secure_delete=ON")
        try:
            with self.transaction():
                self.jobs.clear_secrets()
        finally:
            self.conn.execute("PRAGMA secure_delete=OFF")
        self.jobs.reload()
        # the old values are zeroed in the pages (secure_delete); the WAL frames that still
        # hold the pages as they were go too
        self.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        return True

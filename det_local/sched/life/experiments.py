"""The engine's picture of experiments and their live trial runs, and how it is kept.

An :class:`ExperimentRun` is an experiment the engine drives: its config, its searcher and the
searcher's bookkeeping (which request is which trial, the operations each trial has left).
That bookkeeping is saved in the store after every searcher action (:func:`searcher_snapshot`)
and read back by :func:`load_experiment` when an experiment comes back (after a restart, or
when a paused one is activated). A :class:`TrialRun` is one live process (run) of a trial.
"""

from __future__ import annotations

import asyncio
import math
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from det_local.search import Searcher, make_searcher
from det_local.search.actions import Shutdown
from det_local.store.db import Store
from det_local.store.paths import Paths
from det_local.store.states import Stopping, check_stopping

if TYPE_CHECKING:
    from det_local.config.experiment import ExperimentConfig


@dataclass
class TrialRun:
    """One live process (run) of a trial."""

    trial_id: int
    experiment_id: int
    request_id: str
    run_id: int
    token: str
    job_id: int
    pid: int
    ports: dict[str, int] = field(default_factory=dict)  # rendezvous ports of this run
    writers: list[asyncio.StreamWriter] = field(default_factory=list)
    preempt_sent: bool = False
    acked: bool = False
    invalid_hp: bool = False
    kill_requested: bool = False
    stop_requested: bool = False
    requeue_requested: bool = False
    failed: str | None = None  # which of its processes failed first (a multi-node Slurm job)
    timers: list[asyncio.TimerHandle] = field(default_factory=list)
    # how its start is measured (`sched/warm/starttimes.py`): when the daemon began starting its
    # process (time.monotonic()), whether it was forked from a zygote, whether it said hello
    spawned_at: float | None = None
    warm: bool = False
    greeted: bool = False


class Notes(Protocol):
    """What a component needs to record an event (the engine's `note`)."""

    def note(
        self,
        message: str,
        *,
        experiment_id: int | None = None,
        trial_id: int | None = None,
        level: str = "INFO",
    ) -> None: ...


@dataclass
class ExperimentRun:
    id: int
    config: ExperimentConfig
    searcher: Searcher
    checkpoint_dir: Path
    trial_of: dict[str, int] = field(default_factory=dict)  # request id -> trial id
    request_of: dict[int, str] = field(default_factory=dict)
    ops: dict[str, deque[int]] = field(default_factory=dict)
    closed: set[str] = field(default_factory=set)
    stopping: Stopping | None = None  # why its running trials are being stopped (None: not)
    shutdown: Shutdown | None = None
    best: float | None = None
    progress: dict[int, float] = field(default_factory=dict)
    test_mode: bool = False  # `run --test`: one batch, validate, checkpoint, then a restore run
    waiting: set[str] = field(default_factory=set)  # promotion ASHA: out of ops, may be promoted


def set_stopping(exp: ExperimentRun, reason: Stopping | None) -> None:
    """Change why the experiment's running trials are being stopped, as the Stopping table
    allows (a kill outranks a pause or a failure; nothing outranks a kill)."""
    check_stopping(exp.id, exp.stopping, reason)
    exp.stopping = reason


def checkpoint_dir_for(paths: Paths, config: dict[str, Any]) -> Path:
    storage = config.get("checkpoint_storage") or {}
    kind = storage.get("type")
    if kind == "shared_fs":
        host = Path(storage["host_path"])
        sub = storage.get("storage_path")
        return host / sub if sub else host
    if kind == "directory":
        return Path(storage["container_path"])
    return paths.checkpoints


def searcher_snapshot(exp: ExperimentRun) -> dict[str, Any]:
    """What the store keeps of an experiment's searcher and its bookkeeping."""
    return {
        "searcher": exp.searcher.snapshot(),
        "trial_of": exp.trial_of,
        "ops": {k: list(v) for k, v in exp.ops.items()},
        "closed": sorted(exp.closed),
        "shutdown": None if exp.shutdown is None else exp.shutdown.__dict__,
        "test_mode": exp.test_mode,
        "waiting": sorted(exp.waiting),
    }


def better(value: float, best: float | None) -> float | None:
    """Best is kept as a smaller-is-better number (negated when larger is better); NaN and
    the infinities are never the best (they rank worst, in either direction)."""
    if not math.isfinite(value):
        return best
    return value if best is None or value < best else best


def load_experiment(store: Store, paths: Paths, experiment_id: int) -> ExperimentRun:
    """A stored experiment (paused, or from an earlier process) as the engine drives it."""
    from det_local.config import parse_config

    rec = store.get_experiment(experiment_id)
    cfg = parse_config(rec.config, source=f"experiment {experiment_id}")
    searcher = make_searcher(cfg)
    exp = ExperimentRun(experiment_id, cfg, searcher, checkpoint_dir_for(paths, rec.config))
    snap = store.get_searcher_state(experiment_id)
    if snap:
        searcher.restore(snap["searcher"])
        exp.trial_of = {k: int(v) for k, v in snap["trial_of"].items()}
        exp.request_of = {v: k for k, v in exp.trial_of.items()}
        exp.ops = {k: deque(v) for k, v in snap["ops"].items()}
        exp.closed = set(snap["closed"])
        exp.shutdown = Shutdown(**snap["shutdown"]) if snap["shutdown"] else None
        exp.test_mode = bool(snap.get("test_mode"))
        exp.waiting = set(snap.get("waiting") or [])
    sign = 1.0 if cfg.searcher.smaller_is_better else -1.0
    for t in store.list_trials(experiment_id):
        if t.best_validation is not None:
            exp.best = better(sign * t.best_validation, exp.best)
    return exp

"""Checkpoint GC at the end of an experiment: the selection rule (pure), the store side
(pairing with validations, marks, the migration, resuming an interrupted GC)."""

from __future__ import annotations

import math
import random
import sqlite3
import uuid as uuidlib
from pathlib import Path
from typing import Any

import pytest

from det_local.sched.life.ckpt_gc import (
    Candidate,
    GcPolicy,
    candidates_of,
    collect,
    select_for_deletion,
)
from det_local.store.db import GC_DONE, GC_SKIPPED, Store
from det_local.store.records import CheckpointRecord
from det_local.store.states import State
from tests.support.world import wait_for


def C(name: str, trial: int, steps: int, metric: float | None = None, vid: int = 0) -> Candidate:
    return Candidate(name, trial, steps, metric, vid)


def doomed(cands: list[Candidate], *args: int, sib: bool = True, protect: tuple[str, ...] = ()):
    e, t, latest = args
    policy = GcPolicy(e, t, latest, sib)
    return select_for_deletion(cands, policy, protect)


# ---------------------------------------------------------------------------- the rule
def test_defaults_keep_the_trials_best_and_latest() -> None:
    cands = [C("a", 1, 5, 0.5, 1), C("b", 1, 10, 0.3, 2), C("c", 1, 15, 0.4, 3), C("d", 1, 20)]
    assert GcPolicy() == GcPolicy(0, 1, 1, True)
    # best: b (0.3); latest: d (no validation, kept only as the latest)
    assert doomed(cands, 0, 1, 1) == ["a", "c"]


def test_larger_is_better_flips_the_best() -> None:
    cands = [C("a", 1, 5, 0.5, 1), C("b", 1, 10, 0.3, 2), C("c", 1, 15, 0.4, 3)]
    assert doomed(cands, 0, 1, 1, sib=False) == ["b"]  # a is best, c latest
    assert doomed(cands, 0, 1, 0, sib=False) == ["b", "c"]
    assert doomed(cands, 0, 2, 0, sib=False) == ["b"]  # a and c are the two best


def test_all_zero_deletes_everything_not_protected() -> None:
    cands = [C("a", 1, 5, 0.5, 1), C("b", 2, 10), C("c", 2, 15, 0.1, 2)]
    assert doomed(cands, 0, 0, 0) == ["a", "b", "c"]
    assert doomed(cands, 0, 0, 0, protect=("b",)) == ["a", "c"]


def test_large_numbers_keep_everything_validated_or_latest() -> None:
    cands = [C("a", 1, 5, 0.5, 1), C("b", 1, 10), C("c", 1, 15, 0.1, 2)]
    # b has no validation: never "best", and it is not the latest
    assert doomed(cands, 100, 100, 1) == ["b"]
    assert doomed(cands, 100, 100, 2) == []


def test_latest_only() -> None:
    cands = [C(f"k{s}", 1, s) for s in (3, 6, 9, 12)]
    assert doomed(cands, 0, 0, 1) == ["k3", "k6", "k9"]
    assert doomed(cands, 0, 0, 3) == ["k3"]
    assert doomed(cands, 0, 1, 0) == ["k3", "k6", "k9", "k12"]  # none has a validation


def test_experiment_best_across_trials_is_a_union_with_each_trials_own() -> None:
    cands = [
        C("t1a", 1, 5, 0.10, 1),
        C("t1b", 1, 10, 0.20, 4),
        C("t2a", 2, 5, 0.15, 2),
        C("t2b", 2, 10, 0.50, 5),
        C("t3a", 3, 5, 0.90, 3),
        C("t3b", 3, 10, 0.80, 6),
    ]
    # experiment's best 2: t1a, t2a; no per-trial best, no latest
    assert doomed(cands, 2, 0, 0) == ["t1b", "t2b", "t3a", "t3b"]
    # + each trial's best: t3b joins
    assert doomed(cands, 2, 1, 0) == ["t1b", "t2b", "t3a"]
    # + each trial's latest: t1b, t2b, t3b
    assert doomed(cands, 2, 1, 1) == ["t3a"]
    # experiment's best 3 is t1a, t2a, t1b
    assert doomed(cands, 3, 0, 0) == ["t2b", "t3a", "t3b"]


def test_metric_ties_break_by_validation_order() -> None:
    cands = [C("late", 1, 10, 0.5, 7), C("early", 2, 10, 0.5, 3), C("worse", 3, 10, 0.6, 1)]
    assert doomed(cands, 1, 0, 0) == ["late", "worse"]
    assert doomed(cands, 2, 0, 0) == ["worse"]
    assert doomed(cands, 1, 0, 0, sib=False) == ["late", "early"]


def test_checkpoints_sharing_a_validation_tie_and_both_stay() -> None:
    # two checkpoints of one trial at the same steps (one validation) share rank 1
    cands = [C("x", 1, 10, 0.2, 5), C("y", 1, 10, 0.2, 5), C("z", 1, 20, 0.1, 6)]
    assert doomed(cands, 0, 1, 0) == ["x", "y"]  # z is best
    assert doomed(cands, 0, 2, 0) == []  # x and y share rank 2: both are within the best 2
    cands = [C("x", 1, 10, 0.1, 5), C("y", 1, 10, 0.1, 5), C("z", 1, 20, 0.2, 6)]
    assert doomed(cands, 0, 1, 0) == ["z"]


def test_same_steps_tie_as_latest() -> None:
    cands = [C("a", 1, 5), C("b", 1, 10), C("c", 1, 10)]
    assert doomed(cands, 0, 0, 1) == ["a"]


def test_latest_is_ranked_within_each_trial() -> None:
    # Determined's SQL partitions recency by the validation's trial (NULL for checkpoints with
    # no validation); det-local ranks each trial's own checkpoints
    cands = [C("t1-5", 1, 5), C("t1-10", 1, 10), C("t2-5", 2, 5), C("t2-50", 2, 50)]
    assert doomed(cands, 0, 0, 1) == ["t1-5", "t2-5"]


def test_checkpoints_without_a_validation_are_never_best() -> None:
    cands = [C("a", 1, 5), C("b", 1, 10, 0.9, 1), C("c", 1, 15)]
    assert doomed(cands, 5, 5, 0) == ["a", "c"]
    assert doomed(cands, 0, 0, 0) == ["a", "b", "c"]


def test_nan_ranks_after_every_number() -> None:
    nan = math.nan
    cands = [C("n", 1, 5, nan, 1), C("good", 1, 10, 0.9, 2), C("n2", 2, 5, nan, 3)]
    for sib in (True, False):
        assert doomed(cands, 1, 0, 0, sib=sib) == ["n", "n2"]
    # a NaN is still a validation: it is its trial's best when it is all the trial has
    assert doomed(cands, 0, 1, 0) == ["n"]


def test_infinities_rank_after_every_number_in_either_direction() -> None:
    """A diverged trial's -inf (smaller is better) or +inf (larger is better) is never the best
    checkpoint: like NaN, both infinities rank after every number, whichever is better."""
    cands = [
        C("inf", 1, 5, math.inf, 1),
        C("ninf", 1, 10, -math.inf, 2),
        C("good", 1, 15, 0.5, 3),
        C("other", 2, 5, 0.7, 4),
    ]
    for sib in (True, False):
        assert doomed(cands, 1, 1, 0, sib=sib) == ["inf", "ninf"]
        assert doomed(cands, 0, 1, 0, sib=sib) == ["inf", "ninf"]
    # still validations: among themselves they rank by recording order (a trial's only ones)
    assert doomed(cands[:2], 0, 1, 0) == ["ninf"]


def test_protected_checkpoints_stay() -> None:
    cands = [C("warm", 1, 5, 0.9, 1), C("b", 1, 10, 0.1, 2)]
    assert doomed(cands, 0, 0, 0, protect=("warm",)) == ["b"]


def test_no_checkpoints() -> None:
    assert doomed([], 0, 1, 1) == []


def test_policy_from_config() -> None:
    assert GcPolicy.from_config({}) == GcPolicy(0, 1, 1, True)
    cfg = {
        "checkpoint_storage": {"save_experiment_best": 2, "save_trial_best": 0},
        "searcher": {"metric": "acc", "smaller_is_better": False},
    }
    assert GcPolicy.from_config(cfg) == GcPolicy(2, 0, 1, False)


_ORACLE_SQL = """
WITH ranked AS (
    SELECT c.uuid, c.metric,
        rank() OVER (ORDER BY c.metric IS NULL, :sign * c.metric, c.vid) AS experiment_rank,
        rank() OVER (PARTITION BY c.trial ORDER BY c.metric IS NULL, :sign * c.metric, c.vid)
            AS trial_rank,
        rank() OVER (PARTITION BY c.trial ORDER BY c.steps DESC) AS trial_order_rank
    FROM c
)
SELECT uuid FROM ranked
WHERE ((experiment_rank > :e AND trial_rank > :t) OR metric IS NULL) AND trial_order_rank > :l
"""


@pytest.mark.parametrize("seed", range(40))
def test_matches_determineds_sql_on_random_experiments(seed: int) -> None:
    """Against Determined's query run by SQLite (window functions; latest partitioned by the
    checkpoint's trial), on random experiments with ties, shared validations and gaps."""
    rng = random.Random(seed)
    cands = []
    vid = 0
    for trial in range(1, rng.randint(1, 5) + 1):
        steps = 0
        for _ in range(rng.randint(0, 6)):
            if rng.random() < 0.8:
                steps += rng.choice([1, 5, 10])  # else a second checkpoint at the same steps
            metric = None
            if rng.random() < 0.7:
                vid += 1
                metric = float(rng.choice([0.1, 0.2, 0.3, 0.5, rng.random()]))
            cands.append(
                C(str(uuidlib.uuid4()), trial, steps, metric, 0 if metric is None else vid)
            )
    db = sqlite3.connect(":memory:")
    db.execute("CREATE TABLE c (uuid, trial, steps, metric, vid)")
    db.executemany(
        "INSERT INTO c VALUES (?, ?, ?, ?, ?)",
        [(c.uuid, c.trial_id, c.steps_completed, c.metric, c.validation_id) for c in cands],
    )
    policies = [(0, 1, 1, True)] + [
        (rng.randint(0, 4), rng.randint(0, 3), rng.randint(0, 3), rng.random() < 0.5)
        for _ in range(6)
    ]
    for e, t, latest, sib in policies:
        args = {"sign": 1 if sib else -1, "e": e, "t": t, "l": latest}
        want = {r[0] for r in db.execute(_ORACLE_SQL, args)}
        got = select_for_deletion(cands, GcPolicy(e, t, latest, sib))
        assert set(got) == want, (e, t, latest, sib, cands)
        assert len(got) == len(set(got))


# ---------------------------------------------------------------------------- the store side
def _ckpt(store: Store, storage: Path, exp: int, trial: int, steps: int) -> CheckpointRecord:
    uuid = str(uuidlib.uuid4())
    path = storage / uuid
    path.mkdir(parents=True)
    (path / "state").write_text(str(steps))
    rec = CheckpointRecord(uuid, exp, trial, steps, "COMPLETED", str(path), {}, {}, float(steps))
    store.add_checkpoint(rec)
    return rec


def _world(tmp_path: Path, storage_cfg: dict | None = None) -> tuple[Store, int, int, Path]:
    store = Store(tmp_path / "db.sqlite")
    config = {"searcher": {"name": "single", "metric": "loss"}}
    if storage_cfg is not None:
        config["checkpoint_storage"] = storage_cfg
    exp = store.create_experiment(name="e", config=config)
    trial = store.create_trial(exp, hparams={}, seed=1)
    return store, exp, trial, tmp_path / "ckpts"


def _end(store: Store, exp: int, trial: int) -> None:
    store.set_trial_state(trial, State.COMPLETED)
    store.set_experiment_state(exp, State.COMPLETED)


def test_candidates_pair_each_checkpoint_with_the_validation_at_its_steps(tmp_path: Path) -> None:
    store, exp, trial, storage = _world(tmp_path)
    a = _ckpt(store, storage, exp, trial, 5)
    b = _ckpt(store, storage, exp, trial, 10)
    c = _ckpt(store, storage, exp, trial, 15)
    d = _ckpt(store, storage, exp, trial, 20)
    store.add_metrics(
        trial,
        1,
        [
            ("training", 5, {"loss": 0.0}, 1.0, None),  # training: not a validation
            ("validation", 10, {"loss": 0.7}, 2.0, None),
            ("validation", 10, {"loss": 0.4}, 3.0, None),  # validated again (a restart): last
            ("validation", 15, {"acc": 1.0}, 4.0, None),  # no searcher metric
            ("validation", 20, {"loss": True}, 5.0, None),  # not a number
        ],
    )
    got = {x.uuid: (x.steps_completed, x.metric) for x in candidates_of(store, exp, "loss")}
    assert got == {a.uuid: (5, None), b.uuid: (10, 0.4), c.uuid: (15, None), d.uuid: (20, None)}


def test_collect_marks_then_removes_and_runs_once(tmp_path: Path) -> None:
    store, exp, trial, storage = _world(tmp_path)
    ckpts = [_ckpt(store, storage, exp, trial, s) for s in (5, 10, 15)]
    store.add_metrics(trial, 1, [("validation", 5, {"loss": 0.1}, 1.0, None)])
    assert not store.checkpoint_gc_due(exp)  # still ACTIVE
    _end(store, exp, trial)
    assert store.checkpoint_gc_due(exp) and store.checkpoint_gc_pending() == [exp]
    result = collect(store, exp)
    assert result.deleted == result.removed == [ckpts[1].uuid] and result.kept == 2
    states = [c.state for c in store.list_checkpoints(experiment_id=exp)]
    assert states == ["COMPLETED", "DELETED", "COMPLETED"]
    assert [Path(c.path).exists() for c in ckpts] == [True, False, True]
    assert store.get_checkpoint_gc(exp) == GC_DONE and not store.checkpoint_gc_due(exp)
    assert store.checkpoint_gc_pending() == []
    # metrics stay
    assert len(store.list_metrics(trial, "validation")) == 1


def test_an_interrupted_gc_finishes_when_run_again(tmp_path: Path) -> None:
    store, exp, trial, storage = _world(tmp_path, {"save_trial_best": 0})
    ckpts = [_ckpt(store, storage, exp, trial, s) for s in (5, 10, 15)]
    _end(store, exp, trial)
    # a crash after the marks were committed, before any file went
    store.mark_checkpoints_deleted([ckpts[0].uuid, ckpts[1].uuid])
    assert store.checkpoint_gc_pending() == [exp]
    result = collect(store, exp)
    assert result.deleted == []  # already marked
    assert sorted(result.removed) == sorted([ckpts[0].uuid, ckpts[1].uuid])
    assert [Path(c.path).exists() for c in ckpts] == [False, False, True]
    # and running it once more changes nothing
    assert collect(store, exp).removed == []


def test_the_selection_is_stable_once_checkpoints_are_deleted(tmp_path: Path) -> None:
    # DELETED checkpoints keep their place in the ranking, as in Determined's query
    store, exp, trial, storage = _world(tmp_path, {"save_trial_latest": 2, "save_trial_best": 0})
    ckpts = [_ckpt(store, storage, exp, trial, s) for s in (5, 10, 15)]
    store.mark_checkpoint_deleted(ckpts[2].uuid)  # e.g. by the trial itself
    _end(store, exp, trial)
    result = collect(store, exp)
    assert result.deleted == [ckpts[0].uuid]
    assert [c.state for c in store.list_checkpoints(experiment_id=exp)] == [
        "DELETED",
        "COMPLETED",
        "DELETED",
    ]


def test_warm_start_sources_are_never_deleted(tmp_path: Path) -> None:
    store, exp, trial, storage = _world(tmp_path, {"save_trial_latest": 0, "save_trial_best": 0})
    src = _ckpt(store, storage, exp, trial, 5)
    other = _ckpt(store, storage, exp, trial, 10)
    exp2 = store.create_experiment(name="warm", config={"searcher": {"metric": "loss"}})
    store.create_trial(exp2, hparams={}, seed=1, warm_start_checkpoint=src.uuid)
    _end(store, exp, trial)
    assert collect(store, exp).deleted == [other.uuid]
    assert Path(src.path).exists()


def test_a_record_not_named_by_its_uuid_is_marked_but_its_path_left_alone(
    tmp_path: Path,
) -> None:
    store, exp, trial, storage = _world(tmp_path, {"save_trial_latest": 0, "save_trial_best": 0})
    precious = tmp_path / "precious"
    precious.mkdir()
    rec = CheckpointRecord(
        str(uuidlib.uuid4()), exp, trial, 5, "COMPLETED", str(precious), {}, {}, 1.0
    )
    store.add_checkpoint(rec)
    _end(store, exp, trial)
    result = collect(store, exp)
    assert result.deleted == [rec.uuid] and result.removed == []
    assert len(result.failed) == 1 and "not <storage>/<uuid>" in result.failed[0]
    assert precious.exists()


def test_old_databases_leave_experiments_that_already_ended_alone(tmp_path: Path) -> None:
    db = tmp_path / "old.db"
    store = Store(db)
    ended = store.create_experiment(name="ended", config={})
    store.set_experiment_state(ended, State.COMPLETED)
    running = store.create_experiment(name="running", config={})
    store.close()
    # a database from before the column
    conn = sqlite3.connect(db)
    conn.execute("ALTER TABLE experiments DROP COLUMN checkpoint_gc")
    conn.commit()
    conn.close()
    store = Store(db)
    assert store.get_checkpoint_gc(ended) == GC_SKIPPED
    assert store.get_checkpoint_gc(running) is None
    assert store.checkpoint_gc_pending() == []
    store.set_experiment_state(running, State.CANCELED)
    assert store.checkpoint_gc_pending() == [running]
    store.close()
    Store(db).close()  # opening again migrates nothing


# ---------------------------------------------------------------------------- in the engine
def test_the_engine_removes_files_off_its_event_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Deleting large checkpoints takes a while: the engine marks them on its loop, removes the
    files on a worker thread and goes on answering requests meanwhile; the experiment counts as
    work in progress (an embedded run waits) until GC is recorded done. The real removal runs,
    held at its start until the test has seen the engine answer."""
    import asyncio
    import threading

    from det_local.sched.engine import Engine
    from det_local.sched.intake import spool
    from det_local.sched.life import ckpt_gc
    from det_local.store.paths import Paths

    monkeypatch.setenv("DET_LOCAL_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("DET_LOCAL_CPU_SLOTS", "1")
    monkeypatch.setenv("DET_LOCAL_FAKE_GPUS", "0")
    paths = Paths.from_env()
    engine = Engine(paths, offline=True, out=lambda line: None)
    store = engine.store
    exp = store.create_experiment(name="e", config={"searcher": {"name": "single", "metric": "x"}})
    trial = store.create_trial(exp, hparams={}, seed=1)
    storage = tmp_path / "ckpts"
    ckpts = [_ckpt(store, storage, exp, trial, s) for s in (5, 10, 15)]
    _end(store, exp, trial)  # no validation: only the latest (15) is kept

    started, gate = threading.Event(), threading.Event()
    real = ckpt_gc.remove_targets
    threads: list[str] = []

    def held(targets: Any) -> Any:
        threads.append(threading.current_thread().name)
        started.set()
        assert gate.wait(60), "the test never opened the gate"
        return real(targets)

    monkeypatch.setattr(ckpt_gc, "remove_targets", held)
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()

    async def main() -> None:
        await engine.start()  # finds the ended experiment's GC due and starts it
        await stop.wait()
        await engine.stop()

    runner = threading.Thread(target=loop.run_until_complete, args=(main(),), name="engine")
    runner.start()
    try:
        assert started.wait(30), "GC never started"
        assert threads != ["engine"]
        # the marks are committed, the files are still there, and the engine answers
        reader = Store(paths.db, readonly=True)
        states = [c.state for c in reader.list_checkpoints(experiment_id=exp)]
        assert states == ["DELETED", "DELETED", "COMPLETED"]
        assert all(Path(c.path).exists() for c in ckpts)
        payload = {"argv": ["true"], "cwd": "/", "env": {"PATH": "/bin:/usr/bin"}, "slots": 1}
        job_id = spool.request(paths, "cmd_run", payload, timeout=30)
        assert isinstance(job_id, int)
        assert reader.get_checkpoint_gc(exp) is None and exp in engine.gc.running
        gate.set()
        wait_for(lambda: reader.get_checkpoint_gc(exp) == GC_DONE, what="GC recorded done")
        assert [Path(c.path).exists() for c in ckpts] == [False, False, True]
        assert exp not in engine.gc.running
        reader.close()
    finally:
        gate.set()
        loop.call_soon_threadsafe(stop.set)
        runner.join(30)
        loop.close()
    assert not runner.is_alive()

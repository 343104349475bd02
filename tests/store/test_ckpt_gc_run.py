"""Checkpoint GC through `det-local run`: what the store shows and what is left on disk when an
experiment ends (COMPLETED, CANCELED), not while it is PAUSED, not in test mode, and after a
restart that finds a GC unfinished."""

from __future__ import annotations

import signal
import sqlite3
from pathlib import Path
from typing import Any

from det_local.store.db import GC_DONE, GC_SKIPPED, Store
from det_local.store.states import State
from tests.support.trials.testmode import SCRIPT as TEST_MODE_SCRIPT
from tests.support.trials.testmode import script_config
from tests.support.world import Env, wait_for

# Trains `batches` batches, checkpoints every `every`, and validates (before the checkpoint)
# at the steps listed in `vals` ("steps:loss,..."), adding `offset` to each value.
SCRIPT = """\
import determined as det
from determined import core

info = det.get_cluster_info()
hp = info.trial.hparams
vals = dict(p.split(":") for p in hp["vals"].split(",") if p)
with core.init() as ctx:
    for step in range(1, int(hp["batches"]) + 1):
        ctx.train.report_training_metrics(steps_completed=step, metrics={"loss": 1.0})
        if step % int(hp["every"]) == 0:
            if str(step) in vals:
                value = float(vals[str(step)]) + float(hp.get("offset", 0))
                ctx.train.report_validation_metrics(
                    steps_completed=step, metrics={"loss": value}
                )
            with ctx.checkpoint.store_path({"steps_completed": step}) as (path, _):
                (path / "weights").write_text(str(step))
"""


def _context(dl: Env, hparams: dict[str, Any], config: dict[str, Any] | None = None) -> Any:
    return dl.context(SCRIPT, {"hyperparameters": hparams, **(config or {})})


def _by_steps(ckpts: list[dict[str, Any]], trial_id: int | None = None) -> dict[int, str]:
    return {
        c["steps_completed"]: c["state"]
        for c in ckpts
        if trial_id is None or c["trial_id"] == trial_id
    }


def _on_disk(ckpts: list[dict[str, Any]]) -> dict[str, bool]:
    return {c["uuid"]: Path(c["path"]).is_dir() for c in ckpts}


def _check_files_follow_states(ckpts: list[dict[str, Any]]) -> None:
    for c in ckpts:
        assert Path(c["path"]).exists() == (c["state"] == "COMPLETED"), c


def _status(dl: Env, exp_id: int) -> str | None:
    s = dl.store()
    try:
        return s.get_checkpoint_gc(exp_id)
    finally:
        s.close()


# ---------------------------------------------------------------------------- at the end
def test_defaults_keep_the_best_and_the_latest_in_default_storage(dl: Env) -> None:
    cfg, ctx = _context(dl, {"batches": 20, "every": 5, "vals": "5:0.5,10:0.2,15:0.4"})
    r = dl.det("run", cfg, ctx)
    assert r.rc == 0, r
    ckpts = dl.json("checkpoint", "list", "1")
    # save_trial_best 1: steps 10 (loss 0.2); save_trial_latest 1: steps 20 (no validation)
    assert _by_steps(ckpts) == {5: "DELETED", 10: "COMPLETED", 15: "DELETED", 20: "COMPLETED"}
    _check_files_follow_states(ckpts)
    for c in ckpts:  # det-local's default storage, under DET_LOCAL_HOME
        assert Path(c["path"]).parent == dl.paths.checkpoints
    assert sorted(p.name for p in dl.paths.checkpoints.iterdir()) == sorted(
        c["uuid"] for c in ckpts if c["state"] == "COMPLETED"
    )
    described = dl.json("experiment", "describe", "1")
    assert _by_steps(described["checkpoints"]) == _by_steps(ckpts)
    assert "checkpoints: 2, latest" in r.out  # the summary counts what is left
    assert "experiment 1: checkpoint GC deleted 2 checkpoints, kept 2" in "\n".join(dl.events(1))
    # every metric stays
    assert [m.steps_completed for m in dl.metrics(1, "validation")] == [5, 10, 15]
    assert _status(dl, 1) == GC_DONE
    # a DELETED checkpoint cannot be downloaded; a kept one can
    deleted = next(c["uuid"] for c in ckpts if c["state"] == "DELETED")
    r = dl.det("checkpoint", "download", deleted, "--output", dl.tmp / "dl")
    assert r.rc != 0 and "DELETED" in r.err and "Traceback" not in r.err
    best = dl.json("experiment", "best", "1")
    assert best["checkpoint"]["steps_completed"] == 10


def test_a_warm_start_from_a_deleted_checkpoint_is_refused(dl: Env) -> None:
    cfg, ctx = _context(dl, {"batches": 10, "every": 5, "vals": "5:0.5,10:0.2"})
    assert dl.det("run", cfg, ctx).rc == 0
    ckpts = dl.json("checkpoint", "list", "1")
    assert _by_steps(ckpts) == {5: "DELETED", 10: "COMPLETED"}
    deleted = next(c["uuid"] for c in ckpts if c["state"] == "DELETED")
    kept = next(c["uuid"] for c in ckpts if c["state"] == "COMPLETED")
    searcher = {"name": "single", "metric": "loss", "max_length": 5}
    hp = {"batches": 1, "every": 1, "vals": ""}
    cfg2, ctx2 = dl.context(
        SCRIPT,
        {"hyperparameters": hp, "searcher": {**searcher, "source_checkpoint_uuid": deleted}},
        name="warm",
    )
    r = dl.det("run", cfg2, ctx2)
    assert r.rc != 0 and "Traceback" not in r.err
    line = r.err.strip()
    assert "\n" not in line, line
    assert f"searcher.source_checkpoint_uuid: checkpoint {deleted} (trial 1)" in line
    assert "deleted by checkpoint GC when experiment 1 ended" in line
    assert len(dl.json("experiment", "list")) == 1  # nothing was created
    cfg3, ctx3 = dl.context(
        SCRIPT,
        {"hyperparameters": hp, "searcher": {**searcher, "source_checkpoint_uuid": kept}},
        name="warm-kept",
    )
    assert dl.det("run", cfg3, ctx3).rc == 0


def test_experiment_best_across_trials_in_shared_fs_storage(dl: Env) -> None:
    host = dl.tmp / "shared"
    storage = {
        "type": "shared_fs",
        "host_path": str(host),
        "storage_path": "ckpts",
        "save_experiment_best": 1,
        "save_trial_best": 0,
        "save_trial_latest": 0,
    }
    cfg, ctx = _context(
        dl,
        {
            "batches": 15,
            "every": 5,
            "vals": "5:0.5,10:0.2,15:0.3",
            "offset": {"type": "categorical", "vals": [0.3, 0.0, 0.1]},
        },
        {
            "checkpoint_storage": storage,
            "searcher": {"name": "grid", "metric": "loss", "max_length": 15},
        },
    )
    dl.env["DET_LOCAL_CPU_SLOTS"] = "2"
    r = dl.det("run", "-q", cfg, ctx, timeout=120)
    assert r.rc == 0, r
    trials = dl.json("trial", "list", "1")
    assert len(trials) == 3
    best_trial = next(t["id"] for t in trials if t["hparams"]["offset"] == 0.0)
    ckpts = dl.json("checkpoint", "list", "1")
    assert len(ckpts) == 9
    kept = [c for c in ckpts if c["state"] == "COMPLETED"]
    assert [(c["trial_id"], c["steps_completed"]) for c in kept] == [(best_trial, 10)]
    _check_files_follow_states(ckpts)
    assert [p.name for p in (host / "ckpts").iterdir()] == [kept[0]["uuid"]]


def test_larger_is_better_and_nothing_to_delete(dl: Env) -> None:
    storage = {"save_trial_best": 2, "save_trial_latest": 1}
    cfg, ctx = _context(
        dl,
        {"batches": 20, "every": 5, "vals": "5:0.5,10:0.2,15:0.4,20:0.1"},
        {
            "checkpoint_storage": storage,
            "searcher": {
                "name": "single",
                "metric": "loss",
                "smaller_is_better": False,
                "max_length": 20,
            },
        },
    )
    r = dl.det("run", cfg, ctx)
    assert r.rc == 0, r
    ckpts = dl.json("checkpoint", "list", "1")
    # the two largest (5: 0.5, 15: 0.4) and the latest (20)
    assert _by_steps(ckpts) == {5: "COMPLETED", 10: "DELETED", 15: "COMPLETED", 20: "COMPLETED"}
    _check_files_follow_states(ckpts)

    # a second experiment whose policy keeps everything: nothing deleted, nothing noted
    storage = {"save_trial_best": 10, "save_trial_latest": 10}
    cfg, ctx = _context(
        dl,
        {"batches": 10, "every": 5, "vals": ""},
        {"checkpoint_storage": storage, "name": "keep"},
    )
    assert dl.det("run", cfg, ctx).rc == 0
    assert _by_steps(dl.json("checkpoint", "list", "2")) == {5: "COMPLETED", 10: "COMPLETED"}
    assert not any("checkpoint GC" in e for e in dl.events(2))
    assert _status(dl, 2) == GC_DONE


# ---------------------------------------------------------------------------- pause, kill, test
def test_paused_keeps_every_checkpoint_and_kill_collects(dl: Env) -> None:
    dl.daemon_start(DET_LOCAL_CPU_SLOTS="1")
    hp = {"batches": 40, "ckpt_every": 2, "hold_at": 6}
    cfg, ctx = dl.trainer(hp)
    r = dl.det("run", "--detach", cfg, ctx)
    assert r.rc == 0, r
    wait_for(
        lambda: 6 in [m.steps_completed for m in dl.metrics(1, "training")],
        what="the trial to reach batch 6",
    )
    assert dl.det("experiment", "pause", 1).rc == 0
    wait_for(lambda: dl.trial(1).state == State.PAUSED, what="trial 1 to pause")
    ckpts = dl.json("checkpoint", "list", "1")
    assert _by_steps(ckpts) == {2: "COMPLETED", 4: "COMPLETED", 6: "COMPLETED"}
    assert all(_on_disk(ckpts).values())
    assert _status(dl, 1) is None
    # killed while paused, through the daemon (the request's own transaction commits first)
    assert dl.det("experiment", "kill", 1).rc == 0
    assert dl.experiment(1).state == State.CANCELED
    wait_for(lambda: _status(dl, 1) == GC_DONE, what="the checkpoint GC of experiment 1")
    ckpts = dl.json("checkpoint", "list", "1")
    # the trainer validates only at its end: only the latest checkpoint is kept
    assert _by_steps(ckpts) == {2: "DELETED", 4: "DELETED", 6: "COMPLETED"}
    _check_files_follow_states(ckpts)


def test_kill_with_no_engine_running_collects(dl: Env) -> None:
    cfg, ctx = dl.trainer({"batches": 40, "ckpt_every": 2, "hold_at": 4})
    run = dl.start("run", cfg, ctx)
    wait_for(
        lambda: dl.paths.db.exists() and 4 in [m.steps_completed for m in dl.metrics(1)],
        what="the trial to reach batch 4",
    )
    run.signal(signal.SIGINT)
    assert run.wait().rc == 3
    assert all(c.state == "COMPLETED" for c in dl.checkpoints(1))
    r = dl.det("experiment", "kill", 1)
    assert (r.rc, r.out.strip()) == (0, "experiment 1 killed"), r
    ckpts = dl.json("checkpoint", "list", "1")
    assert _by_steps(ckpts) == {2: "DELETED", 4: "COMPLETED"}
    _check_files_follow_states(ckpts)


def test_test_mode_keeps_its_checkpoints(dl: Env) -> None:
    # test mode sets every save_* to 0 (Determined's rewrite), which would delete them all;
    # det-local keeps them: the report points at the checkpoint it wrote
    cfg, ctx = dl.context(TEST_MODE_SCRIPT, script_config())
    r = dl.det("run", "--test", cfg, ctx)
    assert r.rc == 0, r
    ckpts = dl.json("checkpoint", "list", "1")
    assert _by_steps(ckpts) == {1: "COMPLETED", 2: "COMPLETED"}
    assert all(_on_disk(ckpts).values())
    assert _status(dl, 1) == GC_SKIPPED


# ---------------------------------------------------------------------------- restarts
def test_a_restart_finishes_an_interrupted_gc(dl: Env) -> None:
    storage = {"save_trial_best": 0, "save_trial_latest": 1}
    cfg, ctx = _context(
        dl, {"batches": 20, "every": 5, "vals": ""}, {"checkpoint_storage": storage}
    )
    assert dl.det("run", cfg, ctx).rc == 0
    ckpts = dl.json("checkpoint", "list", "1")
    assert _by_steps(ckpts) == {5: "DELETED", 10: "DELETED", 15: "DELETED", 20: "COMPLETED"}
    s5, s10 = (Path(c["path"]) for c in ckpts[:2])
    # The state two crashes would leave: the end committed but no mark yet (5), and the marks
    # committed but the files not yet removed (10).
    s5.mkdir()
    (s5 / "weights").write_text("5")
    s10.mkdir()
    conn = sqlite3.connect(dl.paths.db)
    with conn:
        conn.execute("UPDATE experiments SET checkpoint_gc=NULL WHERE id=1")
        conn.execute("UPDATE checkpoints SET state='COMPLETED' WHERE uuid=?", (ckpts[0]["uuid"],))
    conn.close()
    assert _status(dl, 1) is None
    dl.daemon_start()  # an engine starts: it finishes the GC
    wait_for(lambda: _status(dl, 1) == GC_DONE, what="the GC to finish")
    after = dl.json("checkpoint", "list", "1")
    assert _by_steps(after) == _by_steps(ckpts)
    assert not s5.exists() and not s10.exists()
    _check_files_follow_states(after)


def test_store_migration_spares_experiments_that_ended_before(dl: Env) -> None:
    cfg, ctx = _context(dl, {"batches": 10, "every": 5, "vals": ""})
    # an experiment run by a det-local from before checkpoint GC: the column does not exist
    store = Store(dl.paths.db)
    store.close()
    conn = sqlite3.connect(dl.paths.db)
    with conn:
        conn.execute("ALTER TABLE experiments DROP COLUMN checkpoint_gc")
        conn.execute(
            "INSERT INTO experiments(name, state, user, created_at, config)"
            " VALUES ('old', 'COMPLETED', 'u', 0, '{}')"
        )
    conn.close()
    assert dl.det("run", cfg, ctx).rc == 0  # experiment 2
    assert _status(dl, 1) == GC_SKIPPED
    assert _by_steps(dl.json("checkpoint", "list", "2")) == {5: "DELETED", 10: "COMPLETED"}

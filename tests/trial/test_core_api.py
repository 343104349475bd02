"""Determined's Core API as trial code sees it under det-local: scripts written the way
Determined's tutorials are (`import determined as det`, `with core.init() as core_context:`),
run by the real `det-local run`, and the same scripts run off-cluster as plain `python3`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from det_local.store.states import State
from tests.support.paths import COMPAT
from tests.support.world import Env, wait_for

# ---------------------------------------------------------------------------- reports + info
TUTORIAL = """
import json, logging, os, sys
import determined as det
from determined import core

logging.basicConfig(level=logging.INFO, format=det.LOG_FORMAT)
out = sys.argv[1]
info = det.get_cluster_info()
assert info is not None
logging.getLogger("tutorial").info("hello from the trial")

with core.init() as core_context:
    facts = {
        "trial_id": info.trial.trial_id,
        "experiment_id": info.trial.experiment_id,
        "hparams": info.trial.hparams,
        "trial_seed": info.trial.trial_seed,
        "latest_checkpoint": info.latest_checkpoint,
        "config": info.trial._config,
        "steps_completed": info.trial._steps_completed,
        "trial_run_id": info.trial._trial_run_id,
        "container_addrs": info.container_addrs,
        "container_rank": info.container_rank,
        "task_type": info.task_type,
        "user_data": info.user_data,
        "context_info_trial": core_context.info.trial.trial_id,
        "rank_size": [core_context.distributed.rank, core_context.distributed.size],
        "log_format": det.LOG_FORMAT,
        "units": str(core_context.searcher.get_configured_units()),
        "env": {k: os.environ.get(k) for k in (
            "DET_EXPERIMENT_ID", "DET_TRIAL_ID", "DET_TRIAL_SEED", "DET_HPARAMS",
            "DET_STEPS_COMPLETED", "DET_TRIAL_RUN_ID", "DET_TASK_TYPE", "DET_LATEST_CHECKPOINT",
        )},
        "best_before": core_context.train.get_experiment_best_validation(),
        "ops": [],
    }
    for op in core_context.searcher.operations():
        facts["ops"].append(op.length)
        for step in range(1, op.length + 1):
            core_context.train.report_training_metrics(
                steps_completed=step, metrics={"loss": 1.0 / step}
            )
            op.report_progress(step)
            if core_context.preempt.should_preempt():
                raise SystemExit("unexpected preemption")
        core_context.train.report_validation_metrics(
            steps_completed=op.length, metrics={"loss": 0.25, "accuracy": 0.875}
        )
        core_context.train.report_metrics("inference", op.length, {"latency_ms": 3.5})
        facts["best_after"] = core_context.train.get_experiment_best_validation()
        op.report_completed(0.25)
    with open(out, "w") as f:
        json.dump(facts, f)
"""


def test_tutorial_reports_cluster_info_and_searcher_op(dl: Env) -> None:
    out = dl.tmp / "facts.json"
    config = {
        "name": "tutorial",
        "entrypoint": f"python3 train.py {out}",
        "hyperparameters": {"lr": 0.1, "model": {"width": 8, "kind": "mlp"}},
        "data": {"url": "file:///data"},
        "searcher": {"name": "single", "metric": "loss", "max_length": {"batches": 4}},
    }
    cfg, ctx = dl.context(TUTORIAL, config)
    r = dl.det("run", cfg, ctx)
    assert r.rc == 0, r
    facts = json.loads(out.read_text())
    trial = dl.trial(1)
    assert facts["trial_id"] == trial.id == facts["context_info_trial"]
    assert facts["experiment_id"] == 1
    assert facts["hparams"] == {"lr": 0.1, "model": {"width": 8, "kind": "mlp"}}
    assert facts["trial_seed"] == trial.seed
    assert facts["latest_checkpoint"] is None
    assert facts["config"]["searcher"]["max_length"] == {"batches": 4}
    assert facts["config"]["name"] == "tutorial"
    assert facts["steps_completed"] == 0 and facts["trial_run_id"] == 1
    assert facts["container_addrs"] and facts["container_rank"] == 0
    assert facts["task_type"] == "TRIAL"
    assert facts["user_data"] == {"url": "file:///data"}
    assert facts["rank_size"] == [0, 1]
    assert facts["log_format"] == "%(levelname)s: [%(process)s] %(name)s: %(message)s"
    assert facts["units"] == "Unit.BATCHES"
    env = facts["env"]
    assert env["DET_EXPERIMENT_ID"] == "1" and env["DET_TRIAL_ID"] == str(trial.id)
    assert env["DET_TRIAL_SEED"] == str(trial.seed)
    assert json.loads(env["DET_HPARAMS"]) == facts["hparams"]
    assert env["DET_STEPS_COMPLETED"] == "0" and env["DET_TRIAL_RUN_ID"] == "1"
    assert env["DET_TASK_TYPE"] == "TRIAL" and env["DET_LATEST_CHECKPOINT"] is None
    assert facts["ops"] == [4]
    assert facts["best_before"] is None and facts["best_after"] == 0.25

    # metrics landed in the store, by group
    assert [(m.steps_completed, m.metrics) for m in dl.metrics(1, "training")] == [
        (1, {"loss": 1.0}),
        (2, {"loss": 0.5}),
        (3, {"loss": 1 / 3}),
        (4, {"loss": 0.25}),
    ]
    assert [(m.steps_completed, m.metrics) for m in dl.metrics(1, "validation")] == [
        (4, {"loss": 0.25, "accuracy": 0.875})
    ]
    assert [(m.steps_completed, m.metrics) for m in dl.metrics(1, "inference")] == [
        (4, {"latency_ms": 3.5})
    ]
    assert trial.best_validation == 0.25 and trial.steps_completed == 4
    # LOG_FORMAT lines in the trial's log
    assert f"INFO: [{_trial_pid_from(dl.log(1, 1))}] tutorial: hello from the trial" in dl.log(1, 1)


def _trial_pid_from(log: str) -> str:
    line = next(ln for ln in log.splitlines() if "hello from the trial" in ln)
    return line.split("[", 1)[1].split("]", 1)[0]


BARE_OPS = """
import determined as det
from determined import core
with det.core.init() as core_context:
    print("units", core_context.searcher.get_configured_units())
    for op in core_context.searcher.operations():
        print("op", op.length)
        core_context.train.report_validation_metrics(op.length, {"loss": 1.0})
        op.report_completed(1.0)
    print("out of ops")
"""


def test_searcher_operations_with_a_bare_int_max_length(dl: Env) -> None:
    cfg, ctx = dl.context(
        BARE_OPS, {"searcher": {"name": "single", "metric": "loss", "max_length": 7}}
    )
    r = dl.det("run", cfg, ctx)
    assert r.rc == 0, r
    assert "units None\nop 7\nout of ops\n" in r.out
    assert dl.trial(1).steps_completed == 7


MISSING_SEARCHER = """
from determined import core
with core.init() as core_context:
    try:
        for op in core_context.searcher.operations():
            print("got an op", op.length)
    except ValueError as err:
        print("ValueError:", err)
    core_context.train.report_validation_metrics(10, {"loss": 0.5})
"""


def test_038_config_without_max_length_has_no_searcher_api(dl: Env) -> None:
    config = {"searcher": {"name": "single", "metric": "loss"}}
    cfg, ctx = dl.context(MISSING_SEARCHER, config)
    r = dl.det("run", cfg, ctx)
    assert r.rc == 0, r
    line = next(ln for ln in r.out.splitlines() if ln.startswith("ValueError:"))
    assert "searcher.max_length" in line and "deprecated" in line and "0.38" in line
    assert "got an op" not in r.out
    assert dl.trial(1).state == State.COMPLETED


# ---------------------------------------------------------------------------- progress
PROGRESS = """
import pathlib, sys, time
from determined import core
go = pathlib.Path(sys.argv[1])
with core.init() as core_context:
    core_context.train.report_progress(0.5)
    core_context.train.get_experiment_best_validation()  # a round trip: progress is recorded
    print("reported", flush=True)
    deadline = time.monotonic() + 60
    while not go.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    try:
        core_context.train.report_progress(1.5)
    except ValueError as err:
        print("ValueError:", err)
"""


def test_report_progress_sets_experiment_progress(dl: Env) -> None:
    go = dl.tmp / "go"
    cfg, ctx = dl.context(PROGRESS, {"entrypoint": f"python3 train.py {go}"})
    run = dl.start("run", cfg, ctx)
    wait_for(lambda: "reported" in run.out, what="the progress report")
    assert dl.experiment(1).progress == 0.5
    assert dl.json("experiment", "list")[0]["progress"] == 0.5
    go.touch()
    r = run.wait()
    assert r.rc == 0, r
    assert "ValueError: report_progress: progress must be between 0 and 1, found 1.5" in r.out
    assert dl.experiment(1).progress == 1.0


# ---------------------------------------------------------------------------- checkpoints
CHECKPOINTS = """
import json, pathlib, sys
import determined as det
from determined import core

with core.init() as core_context:
    with core_context.checkpoint.store_path({"steps_completed": 3, "framework": "numpy"}) as (
        path, storage_id
    ):
        (path / "model.txt").write_text("weights")
        (path / "sub").mkdir()
        (path / "sub" / "opt.txt").write_text("moments!")
    print("stored", storage_id, path)
    with core_context.checkpoint.restore_path(storage_id) as restored:
        print("restored", (restored / "model.txt").read_text(), restored == path)
    print("metadata", json.dumps(core_context.checkpoint.get_metadata(storage_id)))

    src = pathlib.Path("to_upload")
    src.mkdir()
    (src / "a.bin").write_text("abc")
    uploaded = core_context.checkpoint.upload(src, {"steps_completed": 5})
    target = pathlib.Path("downloaded")
    core_context.checkpoint.download(uploaded, target)
    print("uploaded", uploaded, sorted(p.name for p in target.iterdir()))
    try:
        with core_context.checkpoint.store_path({"epoch": 1}) as (path, _):
            pass
    except Exception as err:
        print(f"{type(err).__name__}: {err}")
    core_context.train.report_validation_metrics(5, {"loss": 1.0})
"""


def test_checkpoints_in_determined_layout_on_shared_fs(dl: Env) -> None:
    host = dl.tmp / "ckpts"
    storage = {"type": "shared_fs", "host_path": str(host), "storage_path": "s"}
    # keep both checkpoints at the end (by default GC deletes the one at 3: neither the
    # latest nor validated)
    config = {"checkpoint_storage": {**storage, "save_trial_latest": 2}}
    cfg, ctx = dl.context(CHECKPOINTS, config)
    r = dl.det("run", cfg, ctx)
    assert r.rc == 0, r
    stored = next(ln for ln in r.out.splitlines() if ln.startswith("stored ")).split()
    uuid, path = stored[1], Path(stored[2])
    assert path == host / "s" / uuid
    assert (path / "model.txt").read_text() == "weights"
    assert (path / "sub" / "opt.txt").read_text() == "moments!"
    assert json.loads((path / "metadata.json").read_text()) == {
        "steps_completed": 3,
        "framework": "numpy",
    }
    assert "restored weights True" in r.out
    assert 'metadata {"steps_completed": 3, "framework": "numpy"}' in r.out
    uploaded = next(ln for ln in r.out.splitlines() if ln.startswith("uploaded ")).split()[1]
    assert "['a.bin', 'metadata.json']" in r.out
    assert json.loads((host / "s" / uploaded / "metadata.json").read_text()) == {
        "steps_completed": 5
    }
    err = next(ln for ln in r.out.splitlines() if ln.startswith("CheckpointError: "))
    assert "'steps_completed'" in err
    # nothing half-made is left behind by the refused checkpoint
    assert sorted(p.name for p in (host / "s").iterdir()) == sorted([uuid, uploaded])

    ckpts = dl.checkpoints(1)
    assert [(c.uuid, c.steps_completed, c.state) for c in ckpts] == [
        (uuid, 3, "COMPLETED"),
        (uploaded, 5, "COMPLETED"),
    ]
    first = ckpts[0]
    assert first.path == str(path)
    assert first.metadata == {"steps_completed": 3, "framework": "numpy"}
    assert first.resources["model.txt"] == 7 and first.resources["sub/opt.txt"] == 8
    assert "sub/" in first.resources and "metadata.json" in first.resources
    assert dl.trial(1).latest_checkpoint == uploaded
    described = dl.json("checkpoint", "describe", uuid)
    assert described["path"] == str(path)


# ---------------------------------------------------------------------------- InvalidHP
INVALID_HP = """
import determined as det
from determined import core
with core.init() as core_context:
    core_context.train.report_training_metrics(1, {"loss": 9.0})
    if core_context.info.trial.hparams["lr"] > 1:
        raise det.InvalidHP("lr is too large")
    print("not reached")
"""


def test_invalid_hp_ends_the_trial_early(dl: Env) -> None:
    cfg, ctx = dl.context(INVALID_HP, {"hyperparameters": {"lr": 5}})
    r = dl.det("run", cfg, ctx)
    assert r.rc == 0, r
    assert "not reached" not in r.out
    assert "det-local: InvalidHP: lr is too large; the trial ends early" in dl.log(1, 1)
    assert "trial 1: COMPLETED" in r.out
    assert "ended early: invalid hyperparameters" in r.out  # the summary says why
    assert "Experiment 1 (ctx) COMPLETED" in r.out
    trials = dl.json("trial", "list", 1)
    assert trials[0]["state"] == "COMPLETED"
    assert "invalid hyperparameters" in trials[0]["message"]
    assert dl.experiment(1).state == State.COMPLETED
    assert len(dl.metrics(1, "training")) == 1


# ---------------------------------------------------------------------------- import_from_path
IMPORT_FROM_PATH = """
import pathlib
import determined as det
from determined import core
import mymod
with core.init() as core_context:
    with core_context.checkpoint.store_path({"steps_completed": 0}) as (path, _):
        (path / "code").mkdir()
        (path / "code" / "mymod.py").write_text("VALUE = 'from checkpoint'")
    with det.import_from_path(path / "code"):
        import mymod as stored
        print("inside:", stored.VALUE)
        try:
            with det.import_from_path(path):
                pass
        except RuntimeError as err:
            print("nested:", err)
    import mymod as again
    print("after:", again.VALUE, again is mymod)
"""


def test_import_from_path(dl: Env) -> None:
    files = {"mymod.py": "VALUE = 'from context'"}
    cfg, ctx = dl.context(IMPORT_FROM_PATH, {}, files=files)
    r = dl.det("run", cfg, ctx)
    assert r.rc == 0, r
    assert "inside: from checkpoint" in r.out
    assert "nested: import_from_path is not re-entrant" in r.out
    assert "after: from context True" in r.out


# ---------------------------------------------------------------------------- off-cluster
OFF_CLUSTER = """
import json, sys
import determined as det
from determined import core

print("info", det.get_cluster_info())
with core.init(checkpoint_storage=sys.argv[1]) as core_context:
    print("units", core_context.searcher.get_configured_units())
    for op in core_context.searcher.operations():
        print("op", op.length)
        core_context.train.report_training_metrics(1, {"loss": 1.0})
        core_context.train.report_validation_metrics(1, {"loss": 1.0})
        op.report_completed(1.0)
    print("preempt", core_context.preempt.should_preempt())
    print("best", core_context.train.get_experiment_best_validation())
    with core_context.checkpoint.store_path({"steps_completed": 1}) as (path, storage_id):
        (path / "w").write_text("w")
    print("ckpt", storage_id, path)
with core.init() as core_context:
    with core_context.checkpoint.store_path({"epoch": 1}) as (path, storage_id):
        pass
    print("default", path)
"""


def test_same_script_runs_off_cluster(dl: Env) -> None:
    ctx = dl.tmp / "plain"
    ctx.mkdir()
    (ctx / "train.py").write_text(OFF_CLUSTER)
    storage = dl.tmp / "offcluster"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DET_", "PYTHONPATH"))}
    env["PYTHONPATH"] = str(COMPAT)
    env["XDG_DATA_HOME"] = str(dl.tmp / "xdg")
    p = subprocess.run(
        [sys.executable, "train.py", str(storage)],
        cwd=ctx,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 0, p.stderr
    out = p.stdout
    assert "info None" in out
    assert "units Unit.EPOCHS" in out
    assert "op 1\n" in out and out.count("op ") == 1
    assert "preempt False" in out and "best None" in out
    ckpt = next(ln for ln in out.splitlines() if ln.startswith("ckpt ")).split()
    assert Path(ckpt[2]) == storage / ckpt[1]
    assert (storage / ckpt[1] / "w").read_text() == "w"
    assert json.loads((storage / ckpt[1] / "metadata.json").read_text()) == {"steps_completed": 1}
    default = Path(next(ln for ln in out.splitlines() if ln.startswith("default ")).split()[1])
    assert default.parent == dl.tmp / "xdg" / "determined"
    assert not (dl.home / "det-local.db").exists()  # nothing talked to det-local


def test_hparams_reach_the_trial_as_typed_values(dl: Env) -> None:
    script = (
        "import determined as det\n"
        "h = det.get_cluster_info().trial.hparams\n"
        "print(repr(h['n']), repr(h['f']), repr(h['s']), repr(h['c']))\n"
    )
    hp = {"n": 3, "f": 0.5, "s": "adam", "c": {"type": "const", "val": 7}}
    cfg, ctx = dl.context(script, {"hyperparameters": hp})
    r = dl.det("run", cfg, ctx)
    assert r.rc == 0, r
    assert "3 0.5 'adam' 7" in r.out

"""Test mode (`det-local run --test`, `pytest --det-configs`) on Core API scripts that train to
a fixed length of their own, checkpoint on the way and resume from a checkpoint: the shape of
Determined's `core_api/2_checkpoints` tutorial and of its e2e `noop` fixture. Step 4 restores
the checkpoint step 3 judged (the first run's first), so the resumed script has training left."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from det_local.store.states import State
from tests.support.world import Env

# A tutorial-style script, written for these tests: the "model weight" x and the batch count
# live in the checkpoint; a new trial keeps the weight but restarts the count; the script trains
# to its own MAX_LENGTH whatever the searcher says, and validates once at the end.
TUTORIAL = """\
import logging
import pathlib

import determined as det

MAX_LENGTH = 30
EVERY = 10


def save_state(x, steps_completed, trial_id, directory):
    (directory / "state").write_text(f"{x},{steps_completed},{trial_id}")


def load_state(trial_id, directory):
    text = (pathlib.Path(directory) / "state").read_text()
    x, steps_completed, ckpt_trial_id = (int(v) for v in text.split(","))
    return (x, steps_completed) if ckpt_trial_id == trial_id else (x, 0)


def main(core_context, latest_checkpoint, trial_id, increment_by):
    x = 0
    starting_batch = 0
    if latest_checkpoint is not None:
        with core_context.checkpoint.restore_path(latest_checkpoint) as path:
            x, starting_batch = load_state(trial_id, path)
        logging.info(f"resumed at batch {starting_batch} with x={x}")

    for batch in range(starting_batch, MAX_LENGTH):
        x += increment_by
        steps_completed = batch + 1
        if steps_completed % EVERY == 0:
            core_context.train.report_training_metrics(
                steps_completed=steps_completed, metrics={"x": x}
            )
            core_context.train.report_progress(steps_completed / MAX_LENGTH)
            with core_context.checkpoint.store_path({"steps_completed": steps_completed}) as (
                path,
                uuid,
            ):
                save_state(x, steps_completed, trial_id, path)
            if core_context.preempt.should_preempt():
                return

    # like the tutorial: steps_completed is the loop's (unbound if nothing was left to train)
    core_context.train.report_validation_metrics(steps_completed=steps_completed, metrics={"x": x})


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format=det.LOG_FORMAT)
    info = det.get_cluster_info()
    assert info is not None, "this script runs on a det-local cluster"
    with det.core.init() as core_context:
        main(core_context, info.latest_checkpoint, info.trial.trial_id, increment_by=1)
"""

TUTORIAL_CONFIG = {
    "name": "fixed-length",
    "searcher": {"name": "single", "metric": "x", "max_length": {"batches": 30}},
    "max_restarts": 0,
}

# The e2e noop fixture's shape, written for these tests: a list of actions in hparams, the
# index of the last one done in the checkpoint, resumed after it.
NOOP = """\
import logging
import pathlib
import sys

import determined as det
from determined import core


def main(core_context, trial_id, actions, latest_checkpoint):
    start, steps = 0, 0
    if latest_checkpoint is not None:
        with core_context.checkpoint.restore_path(latest_checkpoint) as path:
            last, steps, ckpt_trial = (int(v) for v in (path / "state").read_text().split(","))
        start = last + 1 if ckpt_trial == trial_id else 0
    for i, action in enumerate(actions[start:], start=start):
        kind = action["action"]
        if kind == "report":
            if action["group"] == "training":
                steps += 1
            core_context.train.report_metrics(
                group=action["group"], steps_completed=steps, metrics=action["metrics"]
            )
        elif kind == "checkpoint":
            with core_context.checkpoint.store_path({"steps_completed": steps}) as (path, _):
                (path / "state").write_text(f"{i},{steps},{trial_id}")
        elif kind == "exit":
            sys.exit(action.get("code", 0))
        if core_context.preempt.should_preempt():
            break


if __name__ == "__main__":
    logging.basicConfig(level=logging.DEBUG, format=det.LOG_FORMAT)
    info = det.get_cluster_info()
    hp = info.trial.hparams["actions"]
    actions = [hp[k] for k in sorted(hp, key=int)]
    with core.init() as core_context:
        main(core_context, info.trial.trial_id, actions, info.latest_checkpoint)
"""


def _noop_config(rounds: int) -> dict:
    actions = []
    for i in range(rounds):  # a train-validate-checkpoint loop, `rounds` times
        actions += [
            {"action": "report", "group": "training", "metrics": {"x": float(i)}},
            {"action": "report", "group": "validation", "metrics": {"x": float(i)}},
            {"action": "checkpoint"},
        ]
    return {
        "name": "noop",
        "hyperparameters": {"actions": {str(i): a for i, a in enumerate(actions, start=1)}},
        "searcher": {"name": "single", "metric": "x"},
        "max_restarts": 0,
    }


STEP4 = "restore the checkpoint in a new process and train one more batch"


def test_fixed_length_script_passes_test_mode(dl: Env) -> None:
    cfg, ctx = dl.context(TUTORIAL, TUTORIAL_CONFIG)
    r = dl.det("run", "--test", cfg, ctx)
    assert r.rc == 0, r.out + r.err
    assert "PASS  train one batch: training metrics at steps_completed=10" in r.out
    assert "PASS  validate: x=30" in r.out
    trial = dl.trial(1)
    first = dl.checkpoints(trial.id)[0]
    assert f"PASS  checkpoint: {first.uuid} at steps_completed=10" in r.out
    assert (
        f"PASS  {STEP4}: trained to steps_completed=30 from the checkpoint at steps_completed=10"
        in r.out
    )
    assert r.out.rstrip().endswith("Test mode: PASSED")
    assert trial.state == State.COMPLETED and trial.run_id == 2
    # the second run resumed from that checkpoint: its batch count and its weight went on
    run2 = [(m.steps_completed, m.metrics["x"]) for m in dl.metrics(trial.id, "training")]
    assert run2 == [(10, 10), (20, 20), (30, 30), (20, 20), (30, 30)]
    assert "resumed at batch 10 with x=10" in dl.log(1, trial.id)
    # its info said so too: the checkpoint it was given is the first one, not the latest
    info = (dl.paths.trial_info_dir(1, trial.id, 2) / "cluster.json").read_text()
    assert first.uuid in info


def test_noop_style_script_passes_test_mode(dl: Env) -> None:
    cfg, ctx = dl.context(NOOP, _noop_config(rounds=3))
    r = dl.det("run", "--test", cfg, ctx)
    assert r.rc == 0, r.out + r.err
    assert "PASS  checkpoint" in r.out and "at steps_completed=1" in r.out
    assert f"PASS  {STEP4}: trained to steps_completed=3 from the checkpoint at" in r.out
    trial = dl.trial(1)
    by_run = [(m.run_id, m.steps_completed) for m in dl.metrics(trial.id, "training")]
    assert by_run == [(1, 1), (1, 2), (1, 3), (2, 2), (2, 3)]


def test_nothing_left_after_the_first_checkpoint_is_named(dl: Env) -> None:
    """A fixed-length script whose first checkpoint is at its very end has nothing to resume:
    step 4 fails, and says why."""
    cfg, ctx = dl.context(NOOP, _noop_config(rounds=1))
    r = dl.det("run", "--test", cfg, ctx)
    assert r.rc == 1, r.out + r.err
    assert "PASS  checkpoint" in r.out
    assert (
        f"FAIL  {STEP4}: the restored run reported no training past the checkpoint at "
        "steps_completed=1: a script that trains to a fixed length needs training left after "
        "its first checkpoint" in r.out
    )


def test_pytest_det_configs_on_a_fixed_length_script(dl: Env) -> None:
    cfg, ctx = dl.context(TUTORIAL, TUTORIAL_CONFIG, name="tutorial")
    noop_cfg, noop_ctx = dl.context(NOOP, _noop_config(rounds=2), name="noop")
    suite = dl.tmp / "suite"
    suite.mkdir()
    (suite / "test_fixed.py").write_text(
        "def test_fixed_length(det_local_test_mode):\n"
        f"    report = det_local_test_mode({str(cfg)!r}, {str(ctx)!r})\n"
        "    assert report.passed, report.format()\n"
        "    assert [m['steps_completed'] for m in report.training] == [10, 20, 30, 20, 30]\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("DET_LOCAL")}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(suite)]
        + ["--det-configs", str(cfg), str(noop_cfg)],
        cwd=suite,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "3 passed" in out, out
    assert Path(noop_ctx).is_dir()

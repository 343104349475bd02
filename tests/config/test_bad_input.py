"""Bad input to `det-local run` and friends: each case gets the one-line message a person can
act on (what, where, what to do), never a traceback; trial-side mistakes end up in the trial's
log and the run's summary."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from det_local.store.states import State
from tests.support.world import Env, Result, wait_for

GOOD = "name: x\nentrypoint: python3 train.py\nsearcher: {name: single, metric: loss}\n"


def one_line_error(r: Result, *fragments: str) -> str:
    """stderr is exactly one line starting with 'error: ' and holding every fragment."""
    assert r.rc == 1, r
    assert "Traceback" not in r.err + r.out, r
    err = r.err.strip()
    assert "\n" not in err, err
    assert err.startswith("error: "), err
    for fragment in fragments:
        assert fragment in err, err
    return err


def assert_nothing_created(dl: Env) -> None:
    if dl.paths.db.exists():
        assert dl.json("experiment", "list") == []


# ---------------------------------------------------------------------------- config files
@pytest.mark.parametrize(
    ("text", "fragments"),
    [
        pytest.param(
            "name: x\nentrypoint: python3 train.py\nsearcher: {name: single, metric: loss\n",
            ["config.yaml:4:1", "malformed YAML", "line 4, column 1"],
            id="malformed-yaml",
        ),
        pytest.param(
            "name: x\nentrypoint: python3 train.py\nsearcher:\n  name: single\n  metric: loss\n"
            "max_restart: 3\n",
            ["unknown field 'max_restart'", "config.yaml", "did you mean 'max_restarts'?"],
            id="unknown-key",
        ),
        pytest.param(
            "name: x\nentrypoint: python3 train.py\nsearcher:\n  name: single\n  metirc: loss\n",
            ["searcher.metirc", "config.yaml", "did you mean 'metric'?"],
            id="unknown-nested-key",
        ),
        pytest.param(
            GOOD + "max_restarts: lots\n",
            ["max_restarts", "config.yaml", "expected an integer >= 0, found 'lots'"],
            id="wrong-type",
        ),
        pytest.param(
            "name: x\nsearcher: {name: single, metric: loss}\n",
            ["entrypoint is missing", "config.yaml", "entrypoint: python3 train.py"],
            id="missing-entrypoint",
        ),
        pytest.param(
            "name: x\nentrypoint: python3 nope.py\nsearcher: {name: single, metric: loss}\n",
            ["script 'nope.py' is not in the context directory", "config.yaml", "CONTEXT"],
            id="script-not-in-context",
        ),
        pytest.param(
            "name: x\nentrypoint: frobnicate-xyz --fast\nsearcher: {name: single, metric: loss}\n",
            ["program 'frobnicate-xyz' was not found on PATH", "config.yaml", "install it"],
            id="program-not-on-path",
        ),
    ],
)
def test_bad_config_is_one_line(dl: Env, text: str, fragments: list[str]) -> None:
    cfg, ctx = dl.context("print('never runs')", text)
    one_line_error(dl.det("run", cfg, ctx), *fragments)
    assert_nothing_created(dl)


def test_missing_config_file(dl: Env) -> None:
    _, ctx = dl.context("print(1)", GOOD)
    one_line_error(dl.det("run", ctx / "nope.yaml", ctx), "nope.yaml not found", "check the path")


def test_missing_context_dir(dl: Env) -> None:
    cfg, _ = dl.context("print(1)", GOOD)
    missing = dl.tmp / "no-such-dir"
    one_line_error(
        dl.det("run", cfg, missing), f"context directory {missing} does not exist", "pass the"
    )
    assert_nothing_created(dl)
    assert not list(dl.home.glob("experiments/*"))  # no snapshot left behind


def test_oversized_context(dl: Env) -> None:
    cfg, ctx = dl.context("print(1)", GOOD)
    with open(ctx / "weights.bin", "wb") as f:
        f.truncate(96 * 1024 * 1024)  # sparse: costs no disk
    one_line_error(
        dl.det("run", cfg, ctx), str(ctx), "over the 95.0 MiB limit", "weights.bin", ".detignore"
    )
    assert_nothing_created(dl)


@pytest.mark.parametrize(
    "args",
    [
        ["experiment", "describe", 99],
        ["experiment", "pause", 99],
        ["experiment", "kill", 99],
        ["experiment", "activate", 99],
    ],
    ids=lambda a: a[1],
)
def test_unknown_experiment_id(dl: Env, args: list[object]) -> None:
    one_line_error(dl.det(*args), "experiment 99 not found", "det-local experiment list")


@pytest.mark.parametrize(
    "args", [["trial", "describe", 42], ["trial", "logs", 42]], ids=lambda a: a[1]
)
def test_unknown_trial_id(dl: Env, args: list[object]) -> None:
    one_line_error(dl.det(*args), "trial 42 not found")


def test_changing_a_finished_experiment(dl: Env) -> None:
    cfg, ctx = dl.context("print('done')", {})
    assert dl.det("run", cfg, ctx).rc == 0
    one_line_error(
        dl.det("experiment", "activate", 1),
        "experiment 1 is COMPLETED; only PAUSED experiments can be activated",
    )
    one_line_error(
        dl.det("experiment", "pause", 1),
        "experiment 1 is COMPLETED; only ACTIVE experiments can be paused",
    )
    assert dl.experiment(1).state == State.COMPLETED


def test_entrypoint_script_excluded_by_detignore(dl: Env) -> None:
    files = {".detignore": "*.py\n"}
    cfg, ctx = dl.context("print('never runs')", GOOD, files=files)
    one_line_error(dl.det("run", cfg, ctx), "'train.py'", ".detignore", str(ctx / ".detignore"))
    assert_nothing_created(dl)


def test_unknown_experiment_id_while_an_engine_runs(dl: Env) -> None:
    """The same message comes back over the socket from a running engine."""
    go = dl.tmp / "go"
    script = (
        "import pathlib, sys, time\n"
        "print('up', flush=True)\n"
        "d = time.monotonic() + 60\n"
        "while not pathlib.Path(sys.argv[1]).exists() and time.monotonic() < d:\n"
        "    time.sleep(0.01)\n"
    )
    cfg, ctx = dl.context(script, {"entrypoint": f"python3 train.py {go}"})
    run = dl.start("run", cfg, ctx)
    wait_for(lambda: "up" in run.out, what="the trial")
    for action in ("pause", "kill", "activate"):
        one_line_error(dl.det("experiment", action, 99), "experiment 99 not found")
    go.touch()
    assert run.wait().rc == 0


# ---------------------------------------------------------------------------- trial failures
def test_crashing_trial(dl: Env) -> None:
    script = "print('about to fail', flush=True)\nraise RuntimeError('boom')\n"
    cfg, ctx = dl.context(script, {})
    r = dl.det("run", cfg, ctx)
    assert r.rc == 1, r
    expected = "trial 1 exited with code 1; see `det-local trial logs 1`"
    assert "Experiment 1 (ctx) ERROR" in r.out
    assert expected in r.out  # in the summary
    assert f"det-local: {expected}" in r.err
    assert "Traceback" not in r.err  # the trial's traceback is in its log (and streamed output)
    assert "RuntimeError: boom" in dl.log(1, 1)
    assert dl.trial(1).state == State.ERROR
    assert dl.experiment(1).state == State.ERROR


def test_trial_killed_by_a_signal(dl: Env) -> None:
    script = "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n"
    cfg, ctx = dl.context(script, {})
    r = dl.det("run", cfg, ctx)
    assert r.rc == 1, r
    # the shell running the entrypoint reports it as 128 + 9
    assert "trial 1 exited with code 137 (killed by SIGKILL); see `det-local trial logs 1`" in r.out
    assert dl.trial(1).state == State.ERROR


def test_nan_metric_warns_once_and_is_stored(dl: Env) -> None:
    script = (
        "from determined import core\n"
        "with core.init() as c:\n"
        "    for step in (1, 2):\n"
        "        c.train.report_training_metrics(step, {'loss': float('nan')})\n"
        "    c.train.report_validation_metrics(2, {'loss': float('nan'), 'acc': 0.5})\n"
    )
    cfg, ctx = dl.context(script, {})
    r = dl.det("run", cfg, ctx)
    assert r.rc == 0, r
    log = dl.log(1, 1)
    warnings = [ln for ln in log.splitlines() if "warning" in ln]
    assert len(warnings) == 2, log  # once per group and metric, one line each
    assert warnings[0].startswith("det-local: warning: training metric 'loss' is nan")
    assert "steps_completed=1" in warnings[0]
    training = dl.metrics(1, "training")
    assert len(training) == 2 and all(m.metrics["loss"] != m.metrics["loss"] for m in training)
    assert dl.metrics(1, "validation")[0].metrics["acc"] == 0.5
    assert "loss=nan" in r.out  # the summary shows it as reported
    assert dl.trial(1).state == State.COMPLETED


NOT_A_NUMBER = """
from determined import core
class Weird:
    pass
with core.init() as c:
    c.train.report_training_metrics(1, {"loss": 0.5})
    c.train.report_training_metrics(2, {"loss": 0.25})
    c.train.report_training_metrics(3, {"loss": 0.1, "acc": Weird()})
"""

TENSOR = """
import torch
from determined import core
with core.init() as c:
    c.train.report_training_metrics(1, {"loss": 0.5})
    c.train.report_training_metrics(2, {"loss": 0.25})
    c.train.report_training_metrics(3, {"loss": torch.tensor(0.1)})
"""


@pytest.mark.parametrize(
    ("script", "fragment"),
    [
        pytest.param(
            NOT_A_NUMBER,
            "MetricError: training metric 'acc' at steps_completed=3 has type Weird, "
            "which is not a number",
            id="object",
        ),
        pytest.param(
            TENSOR,
            "MetricError: training metric 'loss' at steps_completed=3 is a Tensor; report a "
            "Python number instead (e.g. loss.item()",
            id="torch-tensor",
        ),
    ],
)
def test_non_numeric_metric_fails_the_trial(dl: Env, script: str, fragment: str) -> None:
    if "torch" in script:
        pytest.importorskip("torch")
    cfg, ctx = dl.context(script, {})
    r = dl.det("run", cfg, ctx)
    assert r.rc == 1, r
    log = dl.log(1, 1)
    assert fragment in log, log
    assert "trial 1 exited with code 1" in r.out
    # what was reported before the bad value is in the store
    assert [m.steps_completed for m in dl.metrics(1, "training")] == [1, 2]
    assert dl.trial(1).state == State.ERROR


# ---------------------------------------------------------------------------- vanished checkpoints
def _pause_with_checkpoints(dl: Env) -> list[Path]:
    """Run the trainer until it pauses at batch 7 (checkpoints at 3, 6 and 7)."""
    hp = {"batches": 12, "ckpt_every": 3, "hold_at": 7, "record": str(dl.record_path)}
    cfg, ctx = dl.trainer(hp)
    run = dl.start("run", cfg, ctx)
    wait_for(lambda: "run 1 starts" in run.out, what="the trial")
    wait_for(lambda: 7 in [m.steps_completed for m in dl.metrics(1, "training")], what="batch 7")
    run.signal(signal.SIGINT)
    assert run.wait().rc == 3
    ckpts = dl.checkpoints(1)
    assert [c.steps_completed for c in ckpts] == [3, 6, 7]
    return [Path(c.path) for c in ckpts]


def test_vanished_latest_checkpoint_resumes_from_the_previous_one(dl: Env) -> None:
    dirs = _pause_with_checkpoints(dl)
    shutil.rmtree(dirs[-1])
    r = dl.det("experiment", "activate", 1)
    assert r.rc == 0, r
    warning = next(ln for ln in r.err.splitlines() if "gone from disk" in ln)
    assert warning == (
        f"det-local: trial 1: checkpoint {dirs[-1].name} is gone from disk; resuming from "
        f"{dirs[-2].name} (steps_completed=6)"
    )
    assert any("gone from disk" in e for e in dl.events(1))
    second = dl.records()[1]
    assert second["start"] == second["env_steps"] == 6 and second["latest"] == dirs[-2].name
    assert dl.trial(1).state == State.COMPLETED
    assert dl.metrics(1, "validation")[-1].metrics["x"] == sum(range(12))
    states = {c.uuid: c.state for c in dl.checkpoints(1)}
    assert states[dirs[-1].name] == "DELETED"


def test_all_checkpoints_vanished_is_a_trial_error(dl: Env) -> None:
    dirs = _pause_with_checkpoints(dl)
    for d in dirs:
        shutil.rmtree(d)
    r = dl.det("experiment", "activate", 1)
    assert r.rc == 1, r
    expected = (
        f"trial 1: its checkpoints (latest {dirs[-1].name}) are gone from disk, so it cannot "
        "resume where it stopped; restore the checkpoint directory or kill the experiment"
    )
    assert expected in r.err
    assert expected in r.out  # the summary
    assert "Traceback" not in r.err
    trial = dl.trial(1)
    assert trial.state == State.ERROR and expected in (trial.message or "")
    assert dl.experiment(1).state == State.ERROR
    assert len(dl.records()) == 1  # nothing was started


def test_store_path_without_steps_completed(dl: Env) -> None:
    script = (
        "from determined import core\n"
        "with core.init() as c:\n"
        "    with c.checkpoint.store_path({'epoch': 1}) as (path, uuid):\n"
        "        (path / 'w').write_text('w')\n"
    )
    cfg, ctx = dl.context(script, {})
    r = dl.det("run", cfg, ctx)
    assert r.rc == 1, r
    assert "CheckpointError: checkpoint metadata must contain 'steps_completed'" in dl.log(1, 1)
    assert dl.checkpoints(1) == []


def test_detach_without_engine_is_refused(tmp_path: Path) -> None:
    ctx = tmp_path / "ctx"
    ctx.mkdir()
    (ctx / "c.yaml").write_text(
        'name: d\nentrypoint: python3 -c "print(1)"\nsearcher: {name: single, metric: x}\n'
    )
    env = dict(os.environ, DET_LOCAL_HOME=str(tmp_path / "home"))
    proc = subprocess.run(
        [sys.executable, "-m", "det_local.cli.main", "run", "--detach", "c.yaml", "."],
        cwd=ctx,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1
    assert "--detach" in proc.stderr and "none is running" in proc.stderr
    assert "Traceback" not in proc.stderr


# ---------------------------------------------------------------------------- slots
def test_more_slots_than_the_machine_names_cpu_slots(dl: Env) -> None:
    """A config asking for more slots than a machine without GPUs has: the message names the
    field, the limit, and DET_LOCAL_CPU_SLOTS=N, which then runs the same config unchanged."""
    script = "import os\nprint('slots', os.environ['DET_SLOT_IDS'])\n"
    cfg, ctx = dl.context(script, {"resources": {"slots_per_trial": 3}})
    dl.setenv(DET_LOCAL_FAKE_GPUS="0", DET_LOCAL_CPU_SLOTS=None)  # a machine without GPUs
    one_line_error(
        dl.det("run", cfg, ctx),
        "resources.slots_per_trial 3 is more than this machine's 1 slot; set it to 1 or less, "
        "or set DET_LOCAL_CPU_SLOTS=3 to run it unchanged on 3 CPU slots",
    )
    assert_nothing_created(dl)
    # what the message says works
    dl.setenv(DET_LOCAL_CPU_SLOTS="3")
    r = dl.det("run", cfg, ctx)
    assert r.rc == 0, r
    assert dl.trial(1).state == State.COMPLETED
    assert "slots [0, 1, 2]" in dl.log(1, 1)


def test_more_slots_than_the_daemon_names_its_cpu_slots(dl: Env) -> None:
    cfg, ctx = dl.context("", {"resources": {"slots_per_trial": 2}})
    dl.daemon_start(DET_LOCAL_FAKE_GPUS="0", DET_LOCAL_CPU_SLOTS=None)
    one_line_error(
        dl.det("run", cfg, ctx),
        "resources.slots_per_trial 2 is more than this machine's 1 slot; set it to 1 or less, "
        "or restart the daemon with DET_LOCAL_CPU_SLOTS=2 to run it unchanged on 2 CPU slots",
    )
    one_line_error(
        dl.det("cmd", "run", "--slots", "2", "--", "true"),
        "--slots 2 is more than this machine's 1 slot; set it to 1 or less, or restart the "
        "daemon with DET_LOCAL_CPU_SLOTS=2",
    )


def test_more_slots_than_the_settings_file_gives(dl: Env) -> None:
    cfg, ctx = dl.context("", {"resources": {"slots_per_trial": 4}})
    dl.settings({"slots": {"cpu_slots": 2}})
    dl.setenv(DET_LOCAL_FAKE_GPUS="0", DET_LOCAL_CPU_SLOTS="8")  # the file wins over the env
    one_line_error(
        dl.det("run", cfg, ctx),
        "resources.slots_per_trial 4 is more than this machine's 2 slots; set it to 2 or less, "
        f"or set slots.cpu_slots: 4 in {dl.paths.settings} to run it unchanged on 4 CPU slots",
    )

"""examples/digits_pytorch: the PyTorchTrial example runs as Determined's tutorials do, as a
0.38 Trainer script (const.yaml), as a 0.37 Trial-class entrypoint (const_legacy.yaml), in test
mode, off-cluster with `python3 train.py`, and its search and distributed configs validate."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from det_local.config import load_config
from det_local.store.states import State
from tests.support.paths import REPO
from tests.support.world import Env, Result

EXAMPLE = REPO / "examples" / "digits_pytorch"


@pytest.fixture
def example(tmp_path: Path) -> Path:
    """A copy of the example (running it writes __pycache__ and local checkpoints)."""
    dest = tmp_path / "digits_pytorch"
    shutil.copytree(EXAMPLE, dest, ignore=shutil.ignore_patterns("__pycache__"))
    return dest


def experiment_id(r: Result) -> int:
    found = re.search(r"Created experiment (\d+)", r.out)
    assert found, r
    return int(found.group(1))


def run_both(dl: Env, example: Path, *flags: str) -> dict[str, tuple[Result, int]]:
    """`det-local run` const.yaml and const_legacy.yaml at the same time (one engine runs both
    experiments, the other command follows its own); {name: (result, experiment id)}."""
    const = dl.start("run", *flags, example / "const.yaml", example)
    legacy = dl.det("run", *flags, example / "const_legacy.yaml", example)
    const_result = const.wait()
    return {
        "const": (const_result, experiment_id(const_result)),
        "const_legacy": (legacy, experiment_id(legacy)),
    }


def test_const_and_const_legacy_train_to_accuracy(dl: Env, example: Path) -> None:
    for name, (r, exp_id) in run_both(dl, example).items():
        assert r.rc == 0, (name, r)
        assert dl.experiment(exp_id).state == State.COMPLETED, name
        trial = dl.trial(exp_id)
        assert trial.state == State.COMPLETED and trial.steps_completed == 300, name
        # validation every 100 batches: fit(validation_period) / min_validation_period
        validation = dl.metrics(trial.id, "validation")
        assert [m.steps_completed for m in validation] == [100, 200, 300], name
        assert validation[-1].metrics["accuracy"] > 0.8, (name, validation[-1].metrics)
        assert trial.best_validation == min(m.metrics["validation_loss"] for m in validation)
        checkpoints = dl.checkpoints(trial.id)
        assert checkpoints and checkpoints[-1].steps_completed == 300, name
        assert (Path(checkpoints[-1].path) / "state_dict.pth").exists(), name
        log = dl.log(exp_id, trial.id)
        assert ("legacy entrypoint format (model_def:DigitsTrial)" in log) == (
            name == "const_legacy"
        ), name
        # reporting: the Trainer's default Batch(100), or scheduling_unit 50 for the harness
        every = 50 if name == "const_legacy" else 100
        training = [m.steps_completed for m in dl.metrics(trial.id, "training")]
        assert training == list(range(every, 301, every)), name


def test_test_mode_passes_for_both(dl: Env, example: Path) -> None:
    for name, (r, _) in run_both(dl, example, "--test").items():
        assert r.rc == 0, (name, r)
        assert "Test mode: PASSED" in r.out, (name, r.out)


def test_train_py_runs_off_cluster(example: Path, tmp_path: Path) -> None:
    # no det-local, no PYTHONPATH: the installed package provides the `determined` name
    env = {k: v for k, v in os.environ.items() if not k.startswith("DET_") and k != "PYTHONPATH"}
    env["XDG_DATA_HOME"] = str(tmp_path / "xdg")  # where local training keeps checkpoints
    p = subprocess.run(
        [sys.executable, "train.py", "--batches", "30"],
        cwd=example,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 0, p.stderr
    assert "report_validation_metrics(steps_completed=30" in p.stderr, p.stderr
    assert "'accuracy':" in p.stderr
    stored = list((tmp_path / "xdg" / "determined").iterdir())
    assert len(stored) == 1 and (stored[0] / "state_dict.pth").exists()


@pytest.mark.parametrize(
    ("config", "not_yet"),
    [
        pytest.param("adaptive.yaml", "searcher.name 'adaptive_asha'", id="adaptive"),
        pytest.param("distributed.yaml", "launchers (torch_distributed", id="distributed"),
    ],
)
def test_search_and_distributed_configs_validate(
    dl: Env, example: Path, config: str, not_yet: str
) -> None:
    cfg = load_config(example / config)  # Determined's schema: no error
    assert cfg.searcher.metric == "validation_loss"
    r = dl.det("config", "check", example / config, example)
    if r.rc != 0:  # this det-local version does not run them yet, and says so in one line
        err = r.err.strip()
        assert "\n" not in err and "Traceback" not in err, err
        assert not_yet in err and "not supported by this det-local version yet" in err, err
    else:
        assert f"{example / config}: valid" in r.out

"""`det-local config check`: the filled-in config and the launch plan, nothing run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from det_local.sched.run.launchplan import STOP_TRAPS

CONFIG = """\
name: cc
entrypoint: python3 train.py
hyperparameters:
  lr: {type: double, minval: 0.01, maxval: 0.1}
  layers: 3
searcher: {name: single, metric: loss, max_length: {batches: 10}}
reproducibility: {experiment_seed: 7}
environment:
  environment_variables: ["FOO=bar"]
"""


def _check(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, DET_LOCAL_HOME=str(tmp_path / "home"))
    return subprocess.run(
        [sys.executable, "-m", "det_local.cli.main", "config", "check", *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_config_check_prints_filled_config_and_plan(tmp_path: Path) -> None:
    (tmp_path / "c.yaml").write_text(CONFIG)
    (tmp_path / "train.py").write_text("print('hi')\n")
    proc = _check(tmp_path, "c.yaml", ".", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["config"]["max_restarts"] == 5
    assert out["config"]["searcher"]["smaller_is_better"] is True
    plan = out["plan"]
    assert plan["argv"] == ["sh", "-c", f"{STOP_TRAPS}\npython3 train.py"]
    assert plan["trials"] == 1 and plan["slots_per_trial"] == 1
    assert plan["env"]["FOO"] == "bar"
    assert json.loads(plan["env"]["DET_HPARAMS"])["layers"] == 3
    assert 0.01 <= plan["hparams"]["lr"] <= 0.1
    assert plan["env"]["PYTHONPATH"].split(os.pathsep)[0].endswith("compat")
    # nothing was run or recorded
    assert not (tmp_path / "home" / "det-local.db").exists()
    # the same seed gives the same sampled hparams
    again = json.loads(_check(tmp_path, "c.yaml", ".", "--json").stdout)
    assert again["plan"]["hparams"] == plan["hparams"]


def test_config_check_human_output(tmp_path: Path) -> None:
    (tmp_path / "c.yaml").write_text(CONFIG)
    (tmp_path / "train.py").write_text("print('hi')\n")
    proc = _check(tmp_path, "c.yaml", ".")
    assert proc.returncode == 0, proc.stderr
    assert "# c.yaml: valid" in proc.stdout
    assert "# launch plan" in proc.stdout
    assert "DET_TRIAL_SEED=" in proc.stdout


def test_config_check_startup_hook_wraps_entrypoint(tmp_path: Path) -> None:
    (tmp_path / "c.yaml").write_text(CONFIG)
    (tmp_path / "train.py").write_text("print('hi')\n")
    (tmp_path / "startup-hook.sh").write_text("export X=1\n")
    out = json.loads(_check(tmp_path, "c.yaml", ".", "--json").stdout)
    argv = out["plan"]["argv"]
    assert argv[0] == "bash" and ". ./startup-hook.sh" in argv[2] and "python3 train.py" in argv[2]


def test_config_check_missing_script(tmp_path: Path) -> None:
    (tmp_path / "c.yaml").write_text(CONFIG)
    proc = _check(tmp_path, "c.yaml", ".")
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    assert "script 'train.py' is not in the context directory" in proc.stderr


def test_config_check_legacy_trial_entrypoint_runs_the_harness(tmp_path: Path) -> None:
    (tmp_path / "c.yaml").write_text(CONFIG.replace("python3 train.py", "model_def:MyTrial"))
    (tmp_path / "model_def.py").write_text("class MyTrial: pass\n")
    out = json.loads(_check(tmp_path, "c.yaml", ".", "--json").stdout)
    assert out["plan"]["argv"][-3:] == ["-m", "det_local.trial.harness", "model_def:MyTrial"]
    proc = _check(tmp_path, "c.yaml", str(tmp_path / "elsewhere"))
    assert proc.returncode != 0 and "Traceback" not in proc.stderr

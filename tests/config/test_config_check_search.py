"""`det-local config check` shows how many trials the search will create: ASHA brackets and
their rungs, grid size and axes, random max_trials; in text and in --json."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

from tests.support import paths

REPO = paths.REPO
ADAPTIVE = REPO / "examples" / "digits_pytorch" / "adaptive.yaml"


def _check(tmp_path: Path, config: dict | Path, *args: str) -> subprocess.CompletedProcess[str]:
    if isinstance(config, dict):
        path = tmp_path / "c.yaml"
        path.write_text(yaml.safe_dump(config))
    else:
        path = config
    env = dict(os.environ, DET_LOCAL_HOME=str(tmp_path / "home"))
    proc = subprocess.run(
        [sys.executable, "-m", "det_local.cli.main", "config", "check", str(path), *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    return proc


def _config(searcher: dict, hparams: dict | None = None) -> dict:
    return {
        "name": "cc",
        "entrypoint": "python3 train.py",
        "hyperparameters": hparams or {"lr": {"type": "double", "minval": 0.1, "maxval": 1.0}},
        "searcher": {"metric": "loss", **searcher},
    }


def test_adaptive_asha_brackets_and_rungs(tmp_path: Path) -> None:
    out = json.loads(_check(tmp_path, ADAPTIVE, "--json").stdout)
    plan = out["plan"]
    # adaptive.yaml: max_trials 16, max_time 600 batches, standard mode, divisor 4
    assert plan["trials"] == 16
    assert plan["initial_trials"] == 12  # bracket 1 creates 8 at once, bracket 2 its 4
    search = plan["search"]
    assert search["generation"] == "stopping" and search["time_metric"] == "batches"
    assert [
        (b["num_rungs"], b["max_trials"], b["max_concurrent_trials"], b["rungs"])
        for b in search["brackets"]
    ] == [(3, 12, 8, [37, 150, 600]), (2, 4, 8, [150, 600])]

    text = _check(tmp_path, ADAPTIVE).stdout
    assert "# search plan" in text
    assert "trials: 16 in 2 brackets, 12 created at the start" in text
    assert "bracket 1: 12 trials (up to 8 at once), 3 rungs at 37, 150, 600 batches" in text
    assert "bracket 2: 4 trials (up to 8 at once), 2 rungs at 150, 600 batches" in text


def test_grid_size_and_axes(tmp_path: Path) -> None:
    cfg = _config(
        {"name": "grid", "max_concurrent_trials": 2, "max_length": {"batches": 50}},
        {
            "lr": {"type": "log", "base": 10, "minval": -3, "maxval": -1, "count": 3},
            "opt": {"type": "categorical", "vals": ["sgd", "adam"]},
            "model": {"layers": {"type": "int", "minval": 1, "maxval": 4, "count": 4}},
            "seed_const": 5,
        },
    )
    plan = json.loads(_check(tmp_path, cfg, "--json").stdout)["plan"]
    assert plan["trials"] == 24  # more than max_concurrent_trials: the whole grid
    assert plan["initial_trials"] == 2
    assert plan["search"]["grid"] == [
        {"name": "lr", "values": 3},
        {"name": "model.layers", "values": 4},
        {"name": "opt", "values": 2},
    ]
    text = _check(tmp_path, cfg).stdout
    assert "trials: 24 grid points (lr 3 x model.layers 4 x opt 2), up to 2 at once" in text
    assert "each trial: max_length 50 batches" in text


def test_random_and_single(tmp_path: Path) -> None:
    cfg = _config({"name": "random", "max_trials": 40, "max_concurrent_trials": 3})
    plan = json.loads(_check(tmp_path, cfg, "--json").stdout)["plan"]
    assert (plan["trials"], plan["initial_trials"]) == (40, 3)
    assert "trials: 40 random trials, up to 3 at once" in _check(tmp_path, cfg).stdout

    cfg = _config({"name": "random", "max_trials": 5, "max_concurrent_trials": 0})
    assert "trials: 5 random trials, no limit at once" in _check(tmp_path, cfg).stdout

    cfg = _config({"name": "single", "max_length": 10})
    plan = json.loads(_check(tmp_path, cfg, "--json").stdout)["plan"]
    assert plan["trials"] == 1 and plan["search"]["name"] == "single"
    text = _check(tmp_path, cfg).stdout
    assert "\ntrials: 1\neach trial: max_length 10\n" in text and "at once" not in text


def test_legacy_asha_and_async_halving(tmp_path: Path) -> None:
    cfg = _config(
        {
            "name": "async_halving",
            "num_rungs": 3,
            "max_trials": 9,
            "divisor": 3,
            "max_length": {"batches": 90},
            "max_concurrent_trials": 4,
        }
    )
    plan = json.loads(_check(tmp_path, cfg, "--json").stdout)["plan"]
    assert plan["trials"] == 9 and plan["initial_trials"] == 4
    assert plan["search"]["generation"] == "promotion"
    assert plan["search"]["brackets"] == [
        {"num_rungs": 3, "max_trials": 9, "max_concurrent_trials": 4, "rungs": [10, 30, 90]}
    ]
    text = _check(tmp_path, cfg).stdout
    assert "searcher: async_halving (<=0.37, promotion-based)" in text
    assert "trials: 9 in 1 bracket, 4 created at the start" in text
    assert "3 rungs at 10, 30, 90 batches; the best 1 in 3 go on at each rung" in text

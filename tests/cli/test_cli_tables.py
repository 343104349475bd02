"""Tables that fit (issue 15, item 4): every table command through the real CLI with wide
content (long names, hyperparameters, messages) at COLUMNS=100, on a pipe (plain, 100 columns
by default) and on a terminal (a pty: its width, colour unless NO_COLOR); --json unchanged;
the compact end-of-run summary of a many-trial search."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import uuid as uuidlib
from typing import Any, NamedTuple

import pytest

from det_local.store.db import Store
from det_local.store.paths import Paths
from det_local.store.records import CheckpointRecord
from det_local.store.states import State
from det_local.tables import fit, table
from tests.support.tty import cli_on_pty
from tests.support.world import Env, wait_for

ANSI = re.compile(r"\x1b\[[0-9;]*m")
LONG_NAME = "resnet50-imagenet-finetune-cosine-schedule-with-warmup-and-label-smoothing-v7"
LONG_HPARAMS = {
    "learning_rate": 0.000123456,
    "optimizer": {"name": "adamw", "betas": [0.9, 0.999], "weight_decay": 0.05},
    "augmentation": {"policy": "randaugment-n2-m9-with-mixup-and-cutmix", "prob": 0.8},
    "hidden_sizes": [1024, 1024, 512, 256, 128],
    "dropout": 0.1,
}
LONG_MESSAGE = (
    "trial 2 exited with code 1 after 3 restarts; see `det-local trial logs 2`: "
    "CUDA out of memory while allocating 2.00 GiB in layer4.2.conv3 during the backward pass"
)


class World(NamedTuple):
    env: dict[str, str]
    exp: int
    trials: list[int]
    ckpts: list[str]


def _widest(text: str) -> int:
    return max((len(ANSI.sub("", ln)) for ln in text.splitlines()), default=0)


@pytest.fixture
def world(dl: Env) -> World:
    """An experiment with a long name, long labels and description, three trials with wide
    hyperparameters and metrics (one ERROR with a long message) and their checkpoints."""
    p = Paths(dl.home).ensure()
    store = Store(p.db)
    config = {
        "name": LONG_NAME,
        "entrypoint": "python3 -m determined.launch.torch_distributed -- python3 train.py "
        "--data /datasets/imagenet/ilsvrc2012/train --epochs 90 --amp",
        "searcher": {
            "name": "random",
            "metric": "validation_top1_error",
            "smaller_is_better": True,
            "max_trials": 3,
            "max_length": {"batches": 100000},
        },
        "resources": {"slots_per_trial": 8},
    }
    exp = store.create_experiment(
        name=LONG_NAME,
        config=config,
        labels=["imagenet", "baseline-reproduction", "cosine-lr", "label-smoothing"],
        description="reproduce the torchvision recipe " * 6,
    )
    trials, ckpts = [], []
    now = time.time()
    for i in range(3):
        hp = {**LONG_HPARAMS, "learning_rate": 0.000123456 * (i + 1)}
        t = store.create_trial(exp, hparams=hp, seed=i)
        metrics = {
            "validation_top1_error": 0.25 - i / 100,
            "validation_top5_error": 0.07,
            "validation_loss": 1.2345678,
            "throughput_images_per_second": 2345.6,
        }
        store.add_metrics(t, 1, [("validation", 100000, metrics, now)])
        store.set_best_validation(t, metrics["validation_top1_error"])
        uid = str(uuidlib.uuid4())
        d = p.checkpoints / uid
        d.mkdir(parents=True)
        (d / "model-weights-with-a-rather-long-file-name-for-the-ema-copy.safetensors").write_bytes(
            b"w" * 100
        )
        store.add_checkpoint(
            CheckpointRecord(
                uid,
                exp,
                t,
                100000,
                "COMPLETED",
                str(d),
                {"framework": "torch-2.4.0+cu124", "note": LONG_MESSAGE},
                {"model-weights-with-a-rather-long-file-name-for-the-ema-copy.safetensors": 100},
                now,
            )
        )
        trials.append(t)
        ckpts.append(uid)
    store.set_trial_state(trials[0], State.COMPLETED)
    store.set_trial_state(trials[1], State.ERROR, message=LONG_MESSAGE)
    store.close()
    env = {**dl.env, "COLUMNS": "100"}
    return World(env, exp, trials, ckpts)


def _cli(env: dict[str, str], *args: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "det_local.cli.main", *(str(a) for a in args)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def _fits(env: dict[str, str], *args: Any, width: int = 100) -> str:
    r = _cli(env, *args)
    assert r.returncode == 0, r.stderr
    assert _widest(r.stdout) <= width, "\n" + r.stdout
    assert not ANSI.search(r.stdout)  # no colour on a pipe
    return r.stdout


def _words(out: str) -> str:
    """The text with its line breaks and indents gone (wrapped values read whole)."""
    return " ".join(out.split())


def _row(out: str, first_cell: str) -> list[str]:
    line = next(ln for ln in out.splitlines() if ln.split(" | ")[0].strip() == first_cell)
    return [c.strip() for c in line.split(" | ")]


# ---------------------------------------------------------------------------- store tables
def test_experiment_tables_fit_100_columns(world: World) -> None:
    out = _fits(world.env, "experiment", "list")
    row = _row(out, str(world.exp))
    assert row[2] == "ACTIVE" and row[1].startswith("resnet50-imagenet")
    assert row[1].endswith("...")  # the long name is cut, on one line (ASCII on a pipe)

    out = _fits(world.env, "experiment", "describe", world.exp)
    assert f"Experiment {world.exp}: {LONG_NAME}" in out or LONG_NAME[:60] in out
    # wrapped fields lose no word: the whole description is there
    assert _words(out).count("reproduce the torchvision recipe") == 6
    for t, state in zip(world.trials, ("COMPLETED", "ERROR", "ACTIVE"), strict=True):
        assert _row(out, str(t))[1] == state
    for uid in world.ckpts:  # whole, in the checkpoints table
        assert uid in out


def test_trial_and_checkpoint_tables_fit_100_columns(world: World) -> None:
    out = _fits(world.env, "trial", "list", world.exp)
    for t, state in zip(world.trials, ("COMPLETED", "ERROR", "ACTIVE"), strict=True):
        row = _row(out, str(t))
        assert row[1] == state
        assert "learning_rate=" in out
    out = _fits(world.env, "trial", "describe", world.trials[1])
    assert "State:             ERROR" in out
    assert LONG_MESSAGE in _words(out)  # wrapped, not cut
    out = _fits(world.env, "checkpoint", "list", world.exp)
    for uid in world.ckpts:
        assert _row(out, uid)[3] == "COMPLETED"
    out = _fits(world.env, "checkpoint", "describe", world.ckpts[0])
    assert world.ckpts[0] in out and LONG_MESSAGE in _words(out)


def test_wider_columns_show_more_and_json_is_unchanged(world: World) -> None:
    narrow = _fits(world.env, "trial", "list", world.exp)
    wide = _fits({**world.env, "COLUMNS": "400"}, "trial", "list", world.exp, width=400)
    assert "Started" not in narrow.splitlines()[0] and "Started" in wide.splitlines()[0]
    assert world.ckpts[0] in wide  # the whole UUID when there is room
    # no COLUMNS on a pipe: 100
    env = {k: v for k, v in world.env.items() if k != "COLUMNS"}
    assert _fits(env, "trial", "list", world.exp) == narrow
    for args in (("experiment", "list"), ("trial", "list", world.exp)):
        a = _cli({**world.env, "COLUMNS": "40"}, *args, "--json").stdout
        b = _cli({**world.env, "COLUMNS": "400"}, *args, "--json").stdout
        assert a == b and json.loads(a)


# ---------------------------------------------------------------------------- queue tables
def test_job_cmd_and_slots_tables_fit_100_columns(dl: Env) -> None:
    dl.daemon_start(DET_LOCAL_FAKE_GPUS="2")
    long_name = "nightly-evaluation-of-every-checkpoint-of-the-imagenet-sweep-on-the-holdout-set"
    job = dl.cmd(*dl.held("hold"), name=long_name)
    wait_for(lambda: dl.order() == ["hold"], what="the command to start")
    queued = dl.cmd("true", slots=2, name=long_name + "-queued")
    env = {**dl.env, "COLUMNS": "100"}
    try:
        out = _fits(env, "job", "list")
        row = _row(out, "1")
        assert row[1] == str(job) and row[7] == "SCHEDULED" and row[3].startswith("nightly")
        assert _row(out, "2")[7] == "QUEUED"
        out = _fits(env, "cmd", "list")
        assert _row(out, str(job))[1] == "SCHEDULED" and _row(out, str(queued))[1] == "QUEUED"
        out = _fits(env, "slots")
        assert _row(out, "0")[1] == "gpu"
    finally:
        dl.release("hold")


# ---------------------------------------------------------------------------- a terminal
def _in_pty(env: dict[str, str], cols: int, *args: Any) -> str:
    """Run the CLI on a pseudo-terminal `cols` wide; returns what it wrote."""
    return cli_on_pty(env, cols, *args)


def test_on_a_terminal_its_width_and_colour(world: World) -> None:
    env = {k: v for k, v in world.env.items() if k not in ("COLUMNS", "NO_COLOR")}
    env["TERM"] = "xterm-256color"
    for cols in (80, 120):
        out = _in_pty(env, cols, "trial", "list", world.exp)
        assert ANSI.search(out)  # colour on a terminal
        assert "\x1b[31mERROR" in out  # states in colour (ERROR red)
        plain = ANSI.sub("", out)
        assert _widest(plain) <= cols, "\n" + plain
        for t in world.trials:
            assert re.search(rf"^{t}\s", plain, re.M)
    # wide cells fold onto more lines instead of being cut: every hyperparameter is there
    assert _words(plain).count("optimizer.weight_decay=0.05") == 3

    no_colour = _in_pty({**env, "NO_COLOR": "1"}, 120, "trial", "list", world.exp)
    assert not ANSI.search(no_colour) and _widest(no_colour) <= 120


# ---------------------------------------------------------------------------- the fitting
def test_fit_shrinks_wide_columns_then_drops_optional_ones() -> None:
    headers = ["ID", "State", "Hyperparameters", "Started", "Ended"]
    natural = [3, 9, 200, 19, 19]
    for width in (60, 80, 100, 150, 300):
        layout = fit(headers, natural, width, flex={2}, optional=[4, 3])
        shown = len(layout.columns)
        assert sum(layout.widths) + 3 * (shown - 1) <= width
        assert layout.widths[:2] == (3, 9)  # ids and states stay whole
    assert fit(headers, natural, 300, {2}, [4, 3]).columns == (0, 1, 2, 3, 4)
    assert fit(headers, natural, 90, {2}, [4, 3]).widths == (3, 9, 28, 19, 19)
    assert fit(headers, natural, 80, {2}, [4, 3]).columns == (0, 1, 2, 3)  # Ended first
    assert fit(headers, natural, 60, {2}, [4, 3]).columns == (0, 1, 2)
    # what fits is left alone
    assert fit(headers, [3, 9, 20, 19, 19], 100, {2}, [4, 3]).widths == (3, 9, 20, 19, 19)
    text = table(headers, [[1, "ACTIVE", "x" * 200, "t", "t"]], width=60, optional=["Ended"])
    assert _widest(text) <= 60 and text.splitlines()[2].startswith("1  | ACTIVE")


# ---------------------------------------------------------------------------- run's summary
SEARCH = """
import determined as det
from determined import core
with core.init() as core_context:
    lr = core_context.info.trial.hparams["lr"]
    loss = abs(lr - 0.5)
    core_context.train.report_validation_metrics(1, {"loss": loss})
    with core_context.checkpoint.store_path({"steps_completed": 1}) as (path, _):
        (path / "w").write_text(str(lr))
"""


def test_run_summary_of_a_search_is_compact(dl: Env) -> None:
    trials = 14
    config = {
        "searcher": {
            "name": "random",
            "metric": "loss",
            "max_trials": trials,
            "max_concurrent_trials": 4,
            "max_length": 1,
        },
        "hyperparameters": {
            "lr": {"type": "double", "minval": 0.0, "maxval": 1.0},
            "description": "a-long-constant-hyperparameter-" * 4,
        },
    }
    cfg, ctx = dl.context(SEARCH, config)
    dl.setenv(DET_LOCAL_CPU_SLOTS="4", COLUMNS="100")
    r = dl.det("run", "-q", cfg, ctx, timeout=240)
    assert r.rc == 0, r
    summary = r.out[r.out.index("Experiment 1 (ctx) COMPLETED") :].splitlines()
    assert _widest("\n".join(summary)) <= 100, "\n".join(summary)
    assert summary[1] == f"  {trials} trials, best loss first (smaller is better):"
    rows = [ln for ln in summary[4:] if re.match(r"  \d+ +\| ", ln)]
    assert len(rows) == 10
    more = f"  … {trials - 10} more: `det-local experiment describe 1` lists them all"
    assert summary[4 + 10] == more
    by_loss = sorted(dl.trials(1), key=lambda t: (t.best_validation, t.id))
    assert [int(ln.split("|")[0]) for ln in rows] == [t.id for t in by_loss[:10]]
    best = by_loss[0]
    (ckpt,) = dl.checkpoints(best.id)
    assert summary[-1] == (
        f"  best: trial {best.id} loss={best.best_validation:.6g} checkpoint {ckpt.uuid} "
        "(steps_completed=1)"
    )
    assert len(summary) == 4 + 10 + 2  # head, count, table head and rule, rows, more, best
    # the hyperparameters that vary between trials; not the constant one
    assert all(re.search(r"\| lr=0\.\d+$", ln) for ln in rows), rows
    assert "description" not in "\n".join(summary)

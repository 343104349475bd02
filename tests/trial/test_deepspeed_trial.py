"""determined.pytorch.deepspeed with real DeepSpeed engines on CPU (gloo) under the real
`det-local run`: a legacy DeepSpeedTrial entrypoint paused and resumed (the engines' own
checkpoint files, the loop's counters and the data position continue), train_batch() called
gradient_accumulation_steps times per batch, the 0.38 Trainer-API script with
disable_auto_grad_accumulation() and overwrite_deepspeed_config(). Skipped without deepspeed
(`pip install deepspeed`, in the `test` extra)."""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any

import pytest

from det_local.store.states import State
from tests.support.trials.deepspeed import (
    config,
    context,
    load_in_new_process,
    records,
)
from tests.support.world import Env, steps, wait_for

pytest.importorskip("deepspeed")


def test_legacy_deepspeed_trial_pauses_and_resumes(dl: Env) -> None:
    marker = dl.tmp / "holding"
    cfg, ctx = context(dl, config(dl, "model_def:LinearDS", 6, hold_at=3, marker=str(marker)))
    run = dl.start("run", cfg, ctx)
    wait_for(marker.exists, timeout=60, what="the trial to hold at batch 3")
    assert dl.det("experiment", "pause", 1).rc == 0
    r = run.wait()
    assert r.rc == 3, (r, dl.log(1, 1)[-3000:])  # PAUSED
    trial = dl.trial(1)
    assert trial.state == State.PAUSED and trial.steps_completed == 3
    r = dl.det("experiment", "activate", 1)
    assert r.rc == 0, (r, dl.log(1, 1)[-3000:])
    trial = dl.trial(1)
    assert trial.state == State.COMPLETED and trial.steps_completed == 6

    rows = records(dl)
    # train_batch() ran gradient_accumulation_steps (2) times per batch, each batch once
    assert [r["batch"] for r in rows] == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5]
    assert [r["run"] for r in rows] == ["1"] * 6 + ["2"] * 6
    # DeepSpeed stepped its optimizer once per batch, and the resumed engine went on from the
    # checkpoint's global_steps (load_checkpoint ran), not from 0
    assert [r["global_steps"] for r in rows] == [0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6]
    # the resumed loader skipped exactly the micro-batches drawn: 24 distinct records of the
    # first epoch (32 records, 8 batches of 2 x 2), none twice
    drawn = [i for r in rows for i in r["drawn"]]
    assert len(drawn) == 24 and len(set(drawn)) == 24
    assert {r["epoch"] for r in rows} == {0}

    assert steps(dl, 1, "validation") == [3, 6]
    assert steps(dl, 1, "training")[-1] == 6
    ckpts = dl.checkpoints(1)
    assert [c.steps_completed for c in ckpts] == [3, 6]
    last = Path(ckpts[-1].path)
    names = {p.name for p in last.iterdir()}
    assert {"model0", "det_state_dict_rank0.pth", "trial_state.pkl", "load_data.json"} <= names
    assert {"code", "metadata.json"} <= names and "state_dict.pth" not in names
    assert any((last / "model0").iterdir())  # DeepSpeed's own files, under tag model0
    state = pickle.loads((last / "trial_state.pkl").read_bytes())
    assert state["batches_trained"] == 6 and state["det_local_loader_batches"] == 12
    load_data = json.loads((last / "load_data.json").read_text())
    assert load_data["trial_type"] == "DeepSpeedTrial"
    assert load_data["trial_cls_spec"] == "model_def:LinearDS" and "is_trainer" not in load_data


@pytest.mark.parametrize("entrypoint", ["model_def:LinearDS", "python3 model_def.py"])
def test_load_trial_from_checkpoint_path_rebuilds_a_deepspeed_trial(
    dl: Env, entrypoint: str
) -> None:
    # a legacy Trial-class checkpoint and a Trainer-API one (its class defined in the
    # entrypoint script, imported back from code/model_def.py)
    cfg, ctx = context(dl, config(dl, entrypoint, 3, record=""))
    r = dl.det("run", cfg, ctx)
    assert r.rc == 0, (r, dl.log(1, 1)[-3000:])
    # the config's defaulted optimizations.* (tensor_fusion_cycle_time: 1, ...) warn about nothing
    assert "is ignored: it does not apply" not in dl.log(1, 1)
    last = Path(dl.checkpoints(1)[-1].path)
    load_data = json.loads((last / "load_data.json").read_text())
    assert load_data["trial_type"] == "DeepSpeedTrial"
    assert load_data.get("trial_in_main", False) == (entrypoint == "python3 model_def.py")
    loaded = load_in_new_process(dl, last)
    assert loaded["class"] == "LinearDS" and loaded["context"]
    # the engine's weights are the checkpoint's, and evaluate to the loss the trial reported
    # at that step
    assert loaded["keys"] and loaded["equal"], loaded
    [reported] = [m.metrics["val_loss"] for m in dl.metrics(1, "validation")]
    assert loaded["val_loss"] == pytest.approx(reported, rel=1e-5), (loaded, reported)


def test_load_trial_from_checkpoint_path_refuses_the_wrong_trial_type(tmp_path: Path) -> None:
    from det_local.errors import CheckpointError
    from det_local.trial import pytorch

    class NotDeepSpeed(pytorch.PyTorchTrial):
        def __init__(self, context: Any) -> None:
            raise AssertionError("not built: the checkpoint is refused first")

    (tmp_path / "load_data.json").write_text(
        json.dumps({"trial_type": "DeepSpeedTrial", "trial_cls_spec": "model_def:LinearDS"})
    )
    with pytest.raises(CheckpointError, match="was written by a DeepSpeedTrial") as err:
        pytorch.load_trial_from_checkpoint_path(tmp_path, trial_class=NotDeepSpeed)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("entrypoint", ["model_def:LinearDS", "python3 model_def.py"])
def test_run_test_mode_trains_validates_checkpoints_and_restores(dl: Env, entrypoint: str) -> None:
    # `det-local run --test`: one batch (gradient_accumulation_steps train_batch() calls),
    # validation, a checkpoint of DeepSpeed's files; then a new process loads that checkpoint
    # into the engine and trains one batch more
    cfg, ctx = context(dl, config(dl, entrypoint, 50))
    r = dl.det("run", "--test", cfg, ctx)
    assert r.rc == 0, (r, dl.log(1, 1)[-3000:])
    assert "Test mode: PASSED" in r.out, r.out
    assert steps(dl, 1, "training") == steps(dl, 1, "validation") == [1, 2]
    ckpts = dl.checkpoints(1)
    assert [c.steps_completed for c in ckpts] == [1, 2]
    assert all((Path(c.path) / "model0").is_dir() for c in ckpts)
    rows = records(dl)
    assert [(r["run"], r["batch"], r["global_steps"]) for r in rows] == [
        ("1", 0, 0),
        ("1", 0, 1),
        ("2", 1, 1),  # the restored engine goes on from the checkpoint's step
        ("2", 1, 2),
    ]
    assert "Traceback" not in dl.log(1, 1)


def test_pytest_plugin_runs_a_deepspeed_config_in_test_mode(dl: Env) -> None:
    from tests.support.trials.testmode import run_pytest

    cfg, _ = context(dl, config(dl, "model_def:LinearDS", 50))
    proc = run_pytest(dl.tmp, "--det-configs", str(cfg), "--rootdir", str(dl.tmp))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "1 passed" in out, out
    assert [(r["run"], r["batch"]) for r in records(dl)] == [("1", 0), ("1", 0), ("2", 1), ("2", 1)]


@pytest.mark.parametrize(
    "field", ["searcher.max_length", "min_validation_period", "min_checkpoint_period"]
)
def test_epoch_lengths_without_records_per_epoch_fail_in_the_trial_in_one_line(
    dl: Env, field: str
) -> None:
    # Determined (0.37 and 0.38) accepts such a config at submission: `config check` does too.
    # A legacy DeepSpeedTrial class then needs records_per_epoch to count epochs (0.37's
    # workload sequencer raised "records_per_epoch must be specified ..." in the trial): the
    # trial fails with one line naming the field, before any engine trains.
    cfg_dict = config(dl, "model_def:LinearDS", 6)
    if field == "searcher.max_length":
        cfg_dict["searcher"]["max_length"] = {"epochs": 1}
    else:
        cfg_dict[field] = {"epochs": 1}
    cfg, ctx = context(dl, cfg_dict)
    r = dl.det("config", "check", cfg, ctx)
    assert r.rc == 0, r
    r = dl.det("run", cfg, ctx)
    assert r.rc == 1, r
    assert dl.trial(1).state == State.ERROR
    log = dl.log(1, 1)
    errors = [line for line in log.splitlines() if "det-local: error:" in line]
    assert len(errors) == 1, log[-3000:]
    assert errors[0].endswith(
        f"det-local: error: {field} is {{epochs: 1}}: a DeepSpeedTrial class counts epochs in "
        "records, so the config needs records_per_epoch (e.g. 'records_per_epoch: 50000'), or "
        "give the length in batches"
    ), errors
    assert "Traceback" not in log and not (dl.tmp / "record.jsonl").exists()


def test_trainer_api_script_manual_accumulation_and_overwritten_config(dl: Env) -> None:
    # overwrite_deepspeed_args changes two leaves (3 micro-batches of 2 per batch) and keeps
    # the rest of ds_config.json (micro-batch size, optimizer)
    overwrite = {"gradient_accumulation_steps": 3, "train_batch_size": 6}
    cfg, ctx = context(
        dl,
        config(
            dl,
            "python3 model_def.py",
            4,
            manual_accumulation=True,
            overwrite_deepspeed_args=overwrite,
        ),
    )
    r = dl.det("run", cfg, ctx)
    assert r.rc == 0, (r, dl.log(1, 1)[-3000:])
    assert dl.trial(1).state == State.COMPLETED and dl.trial(1).steps_completed == 4
    rows = records(dl)
    # disable_auto_grad_accumulation(): one call per batch, drawing all 3 micro-batches itself
    assert [r["batch"] for r in rows] == [0, 1, 2, 3]
    assert [len(r["drawn"]) for r in rows] == [6] * 4
    assert [r["global_steps"] for r in rows] == [1, 2, 3, 4]
    assert steps(dl, 1, "validation") == [3, 4]
    load_data = json.loads((Path(dl.checkpoints(1)[-1].path) / "load_data.json").read_text())
    assert load_data["is_trainer"] is True and load_data["trial_type"] == "DeepSpeedTrial"


def test_overwrite_deepspeed_config_merges_leaves(tmp_path: Path) -> None:
    from det_local.trial.pytorch._errors import InvalidTrialError
    from det_local.trial.pytorch.deepspeed import overwrite_deepspeed_config

    base = {
        "train_batch_size": 16,
        "optimizer": {"type": "Adam", "params": {"lr": 0.1, "betas": [0.8, 0.9]}},
        "zero_optimization": {"stage": 1},
    }
    over = {
        "optimizer": {"params": {"lr": 0.01}},
        "fp16": {"enabled": True},
        "zero_optimization": 2,
    }
    merged = overwrite_deepspeed_config(base, over)
    assert merged == {
        "train_batch_size": 16,
        "optimizer": {"type": "Adam", "params": {"lr": 0.01, "betas": [0.8, 0.9]}},
        "zero_optimization": 2,
        "fp16": {"enabled": True},
    }
    assert base["optimizer"]["params"]["lr"] == 0.1  # the inputs are left as they were
    merged["optimizer"]["params"]["betas"].append(1)
    assert base["optimizer"]["params"]["betas"] == [0.8, 0.9]
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(base))
    assert overwrite_deepspeed_config(str(path), over) == overwrite_deepspeed_config(base, over)
    assert overwrite_deepspeed_config(str(path), {}) == base
    path.write_text('{"a": 1, "a": 2}')
    with pytest.raises(InvalidTrialError, match="duplicate key 'a'"):
        overwrite_deepspeed_config(str(path), {})
    with pytest.raises(InvalidTrialError, match="cannot read the DeepSpeed config 'missing.json'"):
        overwrite_deepspeed_config("missing.json", {})
    with pytest.raises(TypeError, match="expected the path of a DeepSpeed config file or a dict"):
        overwrite_deepspeed_config(3, {})  # type: ignore[arg-type]

"""Legacy Trial-class entrypoints (`entrypoint: model_def:OneVarTrial`) under the real
`det-local run`: the harness trains for searcher.max_length, honours min_validation_period,
min_checkpoint_period, scheduling_unit and perform_initial_validation as Determined's does,
resumes after a pause, passes --test, and names each bad entrypoint in one line."""

from __future__ import annotations

import json
import pickle
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from det_local.errors import ConfigError
from det_local.sched.run.launchplan import check_entrypoint, entrypoint_argv
from det_local.store.states import State
from tests.support.paths import COMPAT
from tests.support.world import Env, steps, wait_for

# Determined's OneVarTrial fixture, trimmed: one weight w (starting at 0) fit to (1, 1) pairs
# with SGD, so after n batches w = 1 - (1 - 2 * LR) ** n whatever the batch size.
MODEL_DEF = """
import os, pathlib, time

import torch

from determined import pytorch

LR = 0.01


class OnesDataset(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, index):
        return torch.Tensor([1.0]), torch.Tensor([1.0])


class OneVarTrial(pytorch.PyTorchTrial):
    def __init__(self, context):
        self.context = context
        self.hparams = context.get_hparams()
        model = torch.nn.Linear(1, 1, False)
        model.weight.data.fill_(0)
        self.model = context.wrap_model(model)
        self.opt = context.wrap_optimizer(torch.optim.SGD(self.model.parameters(), LR))
        self.loss_fn = torch.nn.MSELoss()
        if self.hparams.get("crash_in_init"):
            raise RuntimeError("boom in __init__")

    def train_batch(self, batch, epoch_idx, batch_idx):
        data, label = batch
        loss = self.loss_fn(self.model(data), label)
        self.context.backward(loss)
        self.context.step_optimizer(self.opt)
        if self.hparams.get("hold_at") == batch_idx + 1 and os.environ["DET_TRIAL_RUN_ID"] == "1":
            pathlib.Path(self.hparams["marker"]).write_text("holding")
            deadline = time.monotonic() + 60
            preempt = self.context._core.preempt
            while not preempt.should_preempt(auto_ack=False) and time.monotonic() < deadline:
                time.sleep(0.01)
        return {"loss": loss, "w": self.model.weight.data.item()}

    def evaluate_batch(self, batch):
        data, label = batch
        return {"val_loss": self.loss_fn(self.model(data), label)}

    def build_training_data_loader(self):
        return pytorch.DataLoader(OnesDataset(), batch_size=self.context.get_per_slot_batch_size())

    def build_validation_data_loader(self):
        return pytorch.DataLoader(OnesDataset(), batch_size=self.context.get_per_slot_batch_size())


class NotATrial(torch.nn.Module):
    pass
"""

LR = 0.01
EPOCH = 4  # 64 records in batches of 16


def w_after(batches: int) -> float:
    return 1 - (1 - 2 * LR) ** batches


def config(max_length: Any, entrypoint: str = "model_def:OneVarTrial", **fields: Any) -> dict:
    return {
        "name": "onevar",
        "entrypoint": entrypoint,
        "hyperparameters": {"global_batch_size": 16, **fields.pop("hparams", {})},
        "searcher": {"name": "single", "metric": "val_loss", "max_length": max_length},
        "max_restarts": 0,
        **fields,
    }


def legacy_context(dl: Env, cfg: dict[str, Any], name: str = "ctx") -> tuple[Path, Path]:
    return dl.context("", cfg, name=name, files={"model_def.py": MODEL_DEF})


def checkpoint_steps(dl: Env, trial_id: int) -> list[int]:
    return [c.steps_completed for c in dl.checkpoints(trial_id)]


def final_weight(dl: Env, trial_id: int) -> float:
    path = Path(dl.checkpoints(trial_id)[-1].path) / "state_dict.pth"
    state = torch.load(path, weights_only=False)
    return float(state["models_state_dict"][0]["weight"].item())


# ---------------------------------------------------------------------------- training
def test_batches_length_and_the_legacy_periods(dl: Env) -> None:
    cfg, ctx = legacy_context(
        dl,
        config(
            {"batches": 10},
            min_validation_period={"batches": 4},
            min_checkpoint_period={"batches": 3},
            scheduling_unit=2,
            perform_initial_validation=True,
            checkpoint_policy="none",
        ),
    )
    r = dl.det("run", cfg, ctx)
    assert r.rc == 0, r
    trial = dl.trial(1)
    assert trial.state == State.COMPLETED and trial.steps_completed == 10
    # perform_initial_validation at 0, then every 4 batches, and at the end
    assert steps(dl, 1, "validation") == [0, 4, 8, 10]
    # every 3 batches and at the end (policy none: no checkpoint because of a validation)
    assert checkpoint_steps(dl, 1) == [3, 6, 9, 10]
    # training metrics every scheduling_unit batches, and at every other boundary
    assert steps(dl, 1, "training") == [2, 3, 4, 6, 8, 9, 10]
    training = dl.metrics(1, "training")
    assert training[-1].metrics["w"] == pytest.approx(w_after(10), abs=1e-6)
    assert final_weight(dl, 1) == pytest.approx(w_after(10), abs=1e-6)
    log = dl.log(1, 1)
    assert "FutureWarning: Support for legacy entrypoint format (model_def:OneVarTrial)" in log
    assert "Configuring `max_length`" not in log  # no fit() advice for a Trial class
    # a pre-Trainer checkpoint, loadable by Determined's tools
    ckpt = Path(dl.checkpoints(1)[-1].path)
    load_data = json.loads((ckpt / "load_data.json").read_text())
    assert load_data["trial_cls_spec"] == "model_def:OneVarTrial"
    assert "is_trainer" not in load_data
    assert (ckpt / "code" / "model_def.py").read_text() == MODEL_DEF
    state = pickle.loads((ckpt / "trial_state.pkl").read_bytes())
    assert state["batches_trained"] == 10 and state["epochs_trained"] == 2


def test_records_length_through_determined_exec_harness(dl: Env) -> None:
    # `python3 -m determined.exec.harness X` (what Determined's launchers run) works too;
    # records become batches of global_batch_size: 96 records = 6 batches, 48 = every 3
    cfg, ctx = legacy_context(
        dl,
        config(
            {"records": 96},
            entrypoint="python3 -m determined.exec.harness model_def:OneVarTrial",
            min_validation_period={"records": 48},
            min_checkpoint_period={"epochs": 1},
        ),
    )
    r = dl.det("run", cfg, ctx)
    assert r.rc == 0, r
    assert dl.trial(1).steps_completed == 6
    assert steps(dl, 1, "validation") == [3, 6]
    # epoch 1 ends after batch 4; policy best checkpoints after improving validations (3, 6)
    assert checkpoint_steps(dl, 1) == [3, 4, 6]
    # scheduling_unit defaults to 100: training is reported only at those boundaries
    assert steps(dl, 1, "training") == [3, 4, 6]
    assert final_weight(dl, 1) == pytest.approx(w_after(6), abs=1e-6)
    assert "legacy entrypoint format" not in dl.log(1, 1)  # not a legacy entrypoint


def test_pause_and_activate_resume_from_the_checkpoint(dl: Env) -> None:
    marker = dl.tmp / "holding"
    cfg, ctx = legacy_context(
        dl,
        config(
            {"batches": 12},
            min_validation_period={"batches": 4},
            hparams={"hold_at": 6, "marker": str(marker)},
        ),
    )
    run = dl.start("run", cfg, ctx)
    wait_for(marker.exists, what="the trial to hold at batch 6")
    assert dl.det("experiment", "pause", 1).rc == 0
    r = run.wait()
    assert r.rc == 3, r  # PAUSED
    paused = dl.trial(1)
    assert paused.state == State.PAUSED and paused.steps_completed == 6
    assert checkpoint_steps(dl, 1)[-1] == 6
    r = dl.det("experiment", "activate", 1)
    assert r.rc == 0, r
    trial = dl.trial(1)
    assert trial.state == State.COMPLETED and trial.steps_completed == 12
    assert steps(dl, 1, "validation") == [4, 8, 12]
    assert "Restoring trial from checkpoint" in dl.log(1, 1)
    # the resumed run went on from batch 7 with the saved weight
    assert final_weight(dl, 1) == pytest.approx(w_after(12), abs=1e-6)


def test_run_test_mode_passes_for_a_trial_class(dl: Env) -> None:
    cfg, ctx = legacy_context(dl, config({"epochs": 50}))
    r = dl.det("run", "--test", cfg, ctx)
    assert r.rc == 0, r
    assert "Test mode: PASSED" in r.out, r.out
    assert steps(dl, 1, "training") == steps(dl, 1, "validation") == [1, 2]
    assert checkpoint_steps(dl, 1) == [1, 2]


# ---------------------------------------------------------------------------- bad input
def test_missing_module_file_is_refused_at_submission(dl: Env) -> None:
    cfg, ctx = dl.context("", config({"batches": 2}, entrypoint="models.trial:OneVarTrial"))
    r = dl.det("run", cfg, ctx)
    assert r.rc == 1, r
    err = r.err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    assert (
        f"entrypoint 'models.trial:OneVarTrial' in {cfg}: module 'models.trial' is not in the "
        f"context directory {ctx}: expected models/trial.py (or models/trial/__init__.py) there"
    ) in err
    assert not dl.paths.db.exists() or dl.json("experiment", "list") == []


@pytest.mark.parametrize(
    ("entrypoint", "message"),
    [
        pytest.param(
            "model_def:OneVarTrail",
            "entrypoint 'model_def:OneVarTrail': model_def.py has no class 'OneVarTrail'; "
            "did you mean 'OneVarTrial'?",
            id="no-such-class",
        ),
        pytest.param(
            "model_def:NotATrial",
            "entrypoint 'model_def:NotATrial': class NotATrial in model_def.py derives from "
            "torch.nn.modules.module.Module, not determined.pytorch.PyTorchTrial",
            id="not-a-pytorchtrial",
        ),
    ],
)
def test_bad_trial_class_fails_the_trial_in_one_line(
    dl: Env, entrypoint: str, message: str
) -> None:
    cfg, ctx = legacy_context(dl, config({"batches": 2}, entrypoint=entrypoint))
    r = dl.det("run", cfg, ctx)
    assert r.rc == 1, r
    assert dl.trial(1).state == State.ERROR
    log = dl.log(1, 1)
    assert f"det-local: error: {message}" in log
    assert "Traceback" not in log


def test_an_error_in_the_trial_code_shows_its_traceback(dl: Env) -> None:
    cfg, ctx = legacy_context(dl, config({"batches": 2}, hparams={"crash_in_init": True}))
    r = dl.det("run", cfg, ctx)
    assert r.rc == 1, r
    log = dl.log(1, 1)
    assert "Traceback (most recent call last)" in log
    assert 'model_def.py", line' in log and "RuntimeError: boom in __init__" in log
    assert "det-local: error" not in log


# ---------------------------------------------------------------------------- in-process
def test_plan_runs_the_harness_or_the_launcher(tmp_path: Path) -> None:
    assert entrypoint_argv("model_def:OneVarTrial", tmp_path) == [
        sys.executable, "-m", "det_local.trial.harness", "model_def:OneVarTrial",
    ]  # fmt: skip
    (tmp_path / "startup-hook.sh").write_text("export X=1\n")
    argv = entrypoint_argv("model_def:OneVarTrial", tmp_path)
    assert argv[:2] == ["bash", "-c"] and ". ./startup-hook.sh" in argv[2]
    assert argv[-4:] == [sys.executable, "-m", "det_local.trial.harness", "model_def:OneVarTrial"]
    # more slots: torch_distributed around the harness, one per slot (as Determined)
    multi = entrypoint_argv("model_def:OneVarTrial", tmp_path, slots_per_trial=2)
    assert multi[-5:] == [
        sys.executable, "-m", "det_local.launch.torch_distributed", "--trial",
        "model_def:OneVarTrial",
    ]  # fmt: skip
    # a dotted module is a package path; model_def/__init__.py counts as model_def
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "trials.py").write_text("")
    check_entrypoint("pkg.trials:T", tmp_path, "c.yaml")
    (tmp_path / "model_def").mkdir()
    (tmp_path / "model_def" / "__init__.py").write_text("")
    check_entrypoint("model_def:T", tmp_path, "c.yaml")
    with pytest.raises(ConfigError, match=r"expected other\.py \(or other/__init__\.py\)"):
        check_entrypoint("other:T", tmp_path, "c.yaml")


def test_load_trial_class_names_what_it_found(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from det_local.trial.harness import load_trial_class

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # load_trial_class adds the cwd
    monkeypatch.syspath_prepend(str(COMPAT))
    try:
        (tmp_path / "ds_model.py").write_text(
            "from determined import pytorch\n"
            "class DeepSpeedTrial:\n    pass\n"
            "class Linear(DeepSpeedTrial):\n    pass\n"
            "def make_trial():\n    pass\n"
            "class Needs(pytorch.PyTorchTrial):\n"
            "    def __init__(self, context, hparams):\n        pass\n"
        )
        # a class merely named DeepSpeedTrial is not determined.pytorch.deepspeed's
        with pytest.raises(ConfigError, match="class Linear in ds_model.py derives from ds_model"):
            load_trial_class("ds_model:Linear")
        with pytest.raises(ConfigError, match="names a function in ds_model.py, not a Trial class"):
            load_trial_class("ds_model:make_trial")
        with pytest.raises(ConfigError, match=r"builds the trial as Needs\(context\), but its "):
            load_trial_class("ds_model:Needs")
        with pytest.raises(ConfigError, match="no module 'absent' in "):
            load_trial_class("absent:T")
        (tmp_path / "broken.py").write_text("import no_such_dependency_xyz\n")
        with pytest.raises(ModuleNotFoundError):  # the module's own import: its traceback
            load_trial_class("broken:T")
    finally:
        for name in ("ds_model", "broken"):
            sys.modules.pop(name, None)

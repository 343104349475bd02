"""pytorch.Trainer under the real `det-local run`: a Trainer-API train.py written the way
Determined's PyTorch tutorial is, its metrics and checkpoints in the store, pause/resume that
continues on exactly the same batches, test mode, and client.get_checkpoint().download()."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
import torch

from det_local.store.states import State
from tests.support.paths import COMPAT
from tests.support.trials.pytorch import TRAIN, config, final_state
from tests.support.world import Env, steps, wait_for


def test_trainer_script_runs_under_det_local(
    dl: Env, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    cfg, ctx = dl.context(TRAIN, config("trainer", {"epochs": 3}))  # 4 batches an epoch
    r = dl.det("run", cfg, ctx)
    assert r.rc == 0, r
    trial = dl.trial(1)
    assert trial.state == State.COMPLETED and trial.steps_completed == 12
    log = dl.log(1, 1)
    assert f"seeded with {trial.seed} trial seed {trial.seed}" in log
    assert "FutureWarning: Configuring `max_length` from the `searcher.max_length`" in log
    # default reporting_period Batch(100): training metrics are reported at each validation
    assert steps(dl, 1, "training") == [4, 8, 12]
    assert steps(dl, 1, "validation") == [4, 8, 12]
    validation = dl.metrics(1, "validation")
    assert [sorted(m.metrics) for m in validation] == [["batches", "epochs", "val_loss"]] * 3
    assert [(m.metrics["batches"], m.metrics["epochs"]) for m in validation] == [
        (4, 1), (8, 2), (12, 3),
    ]  # fmt: skip
    assert trial.best_validation == min(m.metrics["val_loss"] for m in validation)
    assert dl.experiment(1).progress == 1.0

    ckpts = dl.checkpoints(1)
    assert ckpts[-1].steps_completed == 12 and trial.latest_checkpoint == ckpts[-1].uuid
    ckpt = Path(ckpts[-1].path)
    assert {p.name for p in ckpt.iterdir()} == {
        "code", "load_data.json", "metadata.json", "state_dict.pth", "trial_state.pkl",
    }  # fmt: skip
    assert (ckpt / "code" / "train.py").read_text() == TRAIN
    load_data = json.loads((ckpt / "load_data.json").read_text())
    assert load_data["trial_cls_spec"] == "train:Net" and load_data["trial_in_main"] is True
    assert load_data["hparams"] == {"lr": 0.01, "global_batch_size": 6}
    assert load_data["experiment_config"]["searcher"]["max_length"] == {"epochs": 3}
    state = pickle.loads((ckpt / "trial_state.pkl").read_bytes())
    assert state["trial_id"] == trial.id and state["batches_trained"] == 12
    assert ckpts[-1].metadata["framework"] == f"torch-{torch.__version__}"

    # the SDK: download it (to checkpoints/<uuid> by default) and load the trial from it
    from det_local.compat.determined.experimental import client

    monkeypatch.syspath_prepend(str(COMPAT))
    monkeypatch.chdir(tmp_path)
    checkpoint = client.get_checkpoint(ckpts[-1].uuid)
    assert checkpoint.training is not None and checkpoint.training.trial_id == trial.id
    assert checkpoint.training.hparams == {"lr": 0.01, "global_batch_size": 6}
    path = checkpoint.download()
    assert path == str(tmp_path / "checkpoints" / ckpts[-1].uuid)
    assert (Path(path) / "metadata.json").exists() and (Path(path) / "code" / "train.py").exists()
    from det_local.trial import pytorch

    loaded = pytorch.load_trial_from_checkpoint_path(path)
    assert type(loaded).__name__ == "Net"
    saved = torch.load(Path(path) / "state_dict.pth", weights_only=False)["models_state_dict"][0]
    for name, value in loaded.model.state_dict().items():
        assert torch.equal(value, saved[name]), name
    # a directory that already holds metadata.json is left alone
    (Path(path) / "state_dict.pth").unlink()
    assert checkpoint.download() == path and not (Path(path) / "state_dict.pth").exists()
    other = checkpoint.download(str(tmp_path / "elsewhere"))
    assert (Path(other) / "state_dict.pth").exists()


def test_pause_and_resume_continue_on_exactly_the_same_batches(dl: Env) -> None:
    # experiment 1 trains straight through; experiment 2 (same seed) is paused at batch 6
    cfg, ctx = dl.context(TRAIN, config("straight", {"batches": 12}), name="straight")
    assert dl.det("run", cfg, ctx).rc == 0
    marker = dl.tmp / "holding"
    cfg2, ctx2 = dl.context(
        TRAIN, config("paused", {"batches": 12}, hold_at=6, marker=str(marker)), name="paused"
    )
    run = dl.start("run", cfg2, ctx2)
    wait_for(marker.exists, what="the trial to hold at batch 6")
    assert dl.det("experiment", "pause", 2).rc == 0
    r = run.wait()
    assert r.rc == 3, r  # PAUSED
    paused = dl.trial(2)
    assert paused.state == State.PAUSED and paused.steps_completed == 6
    assert [c.steps_completed for c in dl.checkpoints(2)][-1] == 6
    r = dl.det("experiment", "activate", 2)
    assert r.rc == 0, r
    assert dl.trial(2).state == State.COMPLETED
    # the stop reported batches 5-6 at once, the resumed run went on from batch 7
    assert steps(dl, 2, "training") == [4, 6, 8, 12]
    assert steps(dl, 2, "validation") == steps(dl, 1, "validation") == [4, 8, 12]
    a, b = final_state(dl, 1), final_state(dl, 2)
    for name, value in a["models_state_dict"][0].items():
        assert torch.equal(value, b["models_state_dict"][0][name]), name
    assert [m.metrics for m in dl.metrics(1, "validation")] == [
        m.metrics for m in dl.metrics(2, "validation")
    ]


def test_a_missing_searcher_metric_fails_the_trial_naming_it(dl: Env) -> None:
    cfg_dict = config("typo", {"records": 48}, validate_every=100)  # 48 records = 8 batches
    cfg_dict["searcher"]["metric"] = "accuracy"
    cfg, ctx = dl.context(TRAIN, cfg_dict)
    r = dl.det("run", cfg, ctx)
    assert r.rc == 1, r
    log = dl.log(1, 1)
    assert (
        "MetricError: the searcher metric 'accuracy' (searcher.metric) is not among the "
        "validation metrics ['val_loss'] of Net; return 'accuracy' from evaluate_batch()/"
        "evaluate_full_dataset() or set searcher.metric to one of them"
    ) in log
    assert dl.trial(1).state == State.ERROR
    assert steps(dl, 1, "training") == [8] and dl.checkpoints(1) == []


def test_run_test_mode_trains_validates_checkpoints_and_restores(dl: Env) -> None:
    # `det-local run --test` sets DET_LOCAL_TEST_MODE=1: one batch, validate, checkpoint; then a
    # new process restores that checkpoint and trains one batch more
    cfg, ctx = dl.context(TRAIN, config("smoke", {"epochs": 50}))
    r = dl.det("run", "--test", cfg, ctx)
    assert r.rc == 0, r
    assert "Test mode: PASSED" in r.out, r.out
    assert steps(dl, 1, "training") == steps(dl, 1, "validation") == [1, 2]
    assert [c.steps_completed for c in dl.checkpoints(1)] == [1, 2]
    assert "FutureWarning" not in dl.log(1, 1)

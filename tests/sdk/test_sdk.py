"""The Python SDK (`determined.experimental.client`, det_local/sdk/): Determined 0.38's
documented flows, each written from its docs (docs/reference/python-sdk/example-workflows.rst,
docs/model-dev-guide/model-management/checkpoints.rst), run unchanged against det-local.

The notebook flow runs with no daemon (create_experiment starts an engine in the background)
and with one (a spool request as the caller)."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from det_local.errors import DetLocalError
from tests.support.trials.core import CORE, core_config
from tests.support.trials.pytorch import TRAIN
from tests.support.trials.pytorch import config as pytorch_config
from tests.support.world import Env, wait_for


def test_notebook_flow_end_to_end_with_no_daemon(dl: Env, client: Any, tmp_path: Path) -> None:
    """create_experiment -> exp.wait() -> exp.list_checkpoints()[0] -> ckpt.download() ->
    pytorch.load_trial_from_checkpoint_path(path) (checkpoints.rst, "PyTorch Checkpoints")."""
    from determined import pytorch

    cfg, ctx = dl.context(TRAIN, pytorch_config("nb", {"batches": 8}, validate_every=2))
    exp = client.create_experiment(config=str(cfg), model_dir=str(ctx))
    assert exp.id == 1 and exp.config["name"] == "nb"
    exit_status = exp.wait(interval=0.1)
    assert exit_status == client.ExperimentState.COMPLETED
    assert exp.state == client.ExperimentState.COMPLETED

    best = exp.list_checkpoints()[0]
    validations = {m.steps_completed: m.metrics["val_loss"] for m in dl.metrics(1, "validation")}
    kept = {c.steps_completed for c in dl.checkpoints(1) if c.state == "COMPLETED"}
    assert best.steps_completed == min((s for s in kept), key=lambda s: validations[s])
    assert best.state == client.CheckpointState.COMPLETED
    assert (
        best.training.validation_metrics["avgMetrics"]["val_loss"]
        == validations[best.steps_completed]
    )
    path = best.download()
    assert path == str(tmp_path / "checkpoints" / best.uuid)
    trial = pytorch.load_trial_from_checkpoint_path(path)
    assert type(trial).__name__ == "Net"
    saved = torch.load(Path(path) / "state_dict.pth", weights_only=False)["models_state_dict"][0]
    for name, value in trial.model.state_dict().items():
        assert torch.equal(value, saved[name]), name


def test_notebook_flow_through_a_running_daemon(dl: Env, client: Any) -> None:
    """The same flow with a daemon: the submission is a spool request as the caller."""
    dl.daemon_start(DET_LOCAL_FAKE_GPUS="0", DET_LOCAL_CPU_SLOTS="1")
    cfg, ctx = dl.context(CORE, core_config())
    exp = client.create_experiment(str(cfg), model_dir=str(ctx))
    assert exp.wait(interval=0.1) == client.ExperimentState.COMPLETED
    best = exp.list_checkpoints()[0]
    assert best.steps_completed == 4  # val is smallest there
    assert (Path(best.download()) / "w").read_text() == "4"


def test_find_the_top_performing_checkpoint_and_sort_checkpoints(dl: Env, client: Any) -> None:
    """example-workflows.rst and checkpoints.rst: list_checkpoints() with neither argument
    sorts by the searcher metric (better first); by a metric name; by CheckpointSortBy."""
    from determined.experimental import checkpoint

    cfg, ctx = dl.context(CORE, core_config(hyperparameters={"steps": 8, "best_at": 6}))
    assert dl.det("run", "-q", cfg, ctx).rc == 0
    exp = client.get_experiment(1)
    steps = [c.steps_completed for c in exp.list_checkpoints()]
    assert steps == [6, 4, 8, 2]  # val 0, 2, 2, 4: ties in report order
    by_accuracy = exp.list_checkpoints(sort_by="accuracy", order_by=client.OrderBy.DESC)
    assert [c.steps_completed for c in by_accuracy] == [8, 6, 4, 2]
    by_trial = exp.list_checkpoints(
        sort_by=checkpoint.CheckpointSortBy.TRIAL_ID, order_by=client.OrderBy.DESC
    )
    assert {c.training.trial_id for c in by_trial} == {1}
    top2 = exp.list_checkpoints(max_results=2)
    assert [c.steps_completed for c in top2] == [6, 4]

    # larger is better: the order flips
    cfg2, ctx2 = dl.context(
        CORE,
        core_config(searcher={"name": "single", "metric": "accuracy", "max_length": 8,
                              "smaller_is_better": False},
                    hyperparameters={"steps": 4, "best_at": 2}),
        name="larger",
    )  # fmt: skip
    assert dl.det("run", "-q", cfg2, ctx2).rc == 0
    assert [c.steps_completed for c in client.get_experiment(2).list_checkpoints()] == [4, 2]
    done = client.list_experiments(states=[client.ExperimentState.COMPLETED])
    assert [e.id for e in done] == [1, 2] and done[1].config["searcher"]["metric"] == "accuracy"
    assert [e.id for e in client.list_experiments(users=["nobody-here"])] == []
    assert [e.id for e in client.list_experiments(order_by=client.OrderBy.DESC)] == [2, 1]

    with pytest.raises(AssertionError, match="^sort_by and order_by must be either both set"):
        exp.list_checkpoints(sort_by="accuracy")
    with pytest.raises(AssertionError, match="^sort_by and order_by must be either both set"):
        exp.list_checkpoints(order_by=client.OrderBy.ASC)
    with pytest.raises(ValueError, match="^sort_by must be of type CheckpointSortBy or str$"):
        exp.list_checkpoints(sort_by=3, order_by=client.OrderBy.ASC)

    # the deprecated ways, with Determined's FutureWarnings
    with pytest.warns(FutureWarning, match=r"Experiment.top_checkpoint\(\) has been deprecated"):
        assert exp.top_checkpoint().steps_completed == 6
    with pytest.warns(FutureWarning, match=r"top_n_checkpoints\(\) has been deprecated"):
        assert [c.steps_completed for c in exp.top_n_checkpoints(3)] == [6]  # one per trial
    with pytest.warns(FutureWarning, match=r"Experiment.get_trials\(\) has been deprecated"):
        assert [t.id for t in exp.get_trials()] == [1]


def test_trials_metrics_logs_and_checkpoint_selection(dl: Env, client: Any) -> None:
    """checkpoints.rst's Trial flows, iter_metrics/TrialMetrics, stream_* (deprecated), logs."""
    from determined.experimental import checkpoint

    cfg, ctx = dl.context(CORE, core_config())
    assert dl.det("run", "-q", cfg, ctx).rc == 0
    trial = client.get_trial(1)
    assert trial.experiment_id == 1 and trial.hparams == {"steps": 6, "best_at": 4}
    assert trial.state == client.TrialState.COMPLETED
    assert trial.get_experiment().id == 1

    most_recent = trial.list_checkpoints(
        sort_by=checkpoint.CheckpointSortBy.END_TIME, order_by=client.OrderBy.DESC, max_results=1
    )[0]
    assert most_recent.steps_completed == 6
    most_accurate = trial.list_checkpoints(
        sort_by="accuracy", order_by=client.OrderBy.DESC, max_results=1
    )[0]
    assert most_accurate.steps_completed == 6
    assert trial.list_checkpoints()[0].steps_completed == 4
    with pytest.warns(FutureWarning, match=r"Trial.select_checkpoint\(\) has been deprecated"):
        assert trial.select_checkpoint(latest=True).steps_completed == 6
    with pytest.warns(FutureWarning), pytest.raises(AssertionError, match="^Exactly one of"):
        trial.select_checkpoint(latest=True, best=True)
    with pytest.warns(FutureWarning, match=r"Trial.top_checkpoint\(\) has been deprecated"):
        assert trial.top_checkpoint().steps_completed == 4

    vals = list(trial.iter_metrics("validation"))
    assert [type(m).__name__ for m in vals] == ["TrialMetrics"] * 3
    assert [(m.trial_id, m.steps_completed, m.group) for m in vals] == [
        (1, 2, "validation"), (1, 4, "validation"), (1, 6, "validation"),
    ]  # fmt: skip
    assert vals[1].metrics == {"val": 0, "accuracy": 40}
    training = list(client.iter_trials_metrics([1], group="training"))
    assert [m.steps_completed for m in training] == [1, 2, 3, 4, 5, 6]
    with pytest.warns(FutureWarning, match="stream_trials_training_metrics is deprecated"):
        legacy = list(client.stream_trials_training_metrics([1]))
    assert [type(m).__name__ for m in legacy] == ["TrainingMetrics"] * 6
    with pytest.warns(FutureWarning, match="Trial.stream_validation_metrics is deprecated"):
        assert len(list(trial.stream_validation_metrics())) == 3

    lines = list(trial.iter_logs())
    assert "trained 6 steps\n" in lines
    assert list(trial.iter_logs(search_text="trained")) == ["trained 6 steps\n"]
    assert list(trial.iter_logs(tail=1)) == lines[-1:]
    with pytest.warns(FutureWarning, match=r"Trial.logs\(\) has been deprecated"):
        assert list(trial.logs(head=1)) == lines[:1]
    with pytest.raises(DetLocalError, match="^trial 9 not found"):
        client.get_trial(9)


def test_create_and_follow_logs_and_checkpoint_metadata(dl: Env, client: Any) -> None:
    """example-workflows.rst "Create an Experiment and Follow its Logs" (a dict config) and
    checkpoints.rst's metadata flow; the Checkpoint's state is a CheckpointState."""
    gate = dl.tmp / "gate"
    _, ctx = dl.context(CORE, core_config())
    exp = client.create_experiment(
        core_config(hyperparameters={"steps": 4, "best_at": 2, "gate": str(gate)}),
        model_dir=str(ctx),
    )
    trial = exp.await_first_trial(interval=0.05)
    assert trial.id == 1
    gate.touch()
    lines = list(trial.iter_logs(follow=True))
    assert lines[-1] == "trained 4 steps\n"
    assert exp.wait(interval=0.1) == client.ExperimentState.COMPLETED

    ckpt = client.get_experiment(exp.id).list_checkpoints()[0]
    ckpt.add_metadata({"environment": "production"})
    ckpt.add_metadata({"metrics": {"loss": 0.12}})
    ckpt.add_metadata({"metrics": {"acc": 0.92}})
    assert ckpt.metadata["metrics"] == {"acc": 0.92}
    again = client.get_checkpoint(ckpt.uuid)
    assert again.metadata["environment"] == "production"
    assert again.metadata["metrics"] == {"acc": 0.92}
    again.remove_metadata(["environment"])
    assert "environment" not in client.get_checkpoint(ckpt.uuid).metadata
    assert isinstance(again.state, client.CheckpointState)

    specific = ckpt.download(path=str(dl.tmp / "specific-checkpoint-path"))
    assert (Path(specific) / "w").read_text() == "2"
    ckpt.delete()
    gone = client.get_checkpoint(ckpt.uuid)
    assert gone.state == client.CheckpointState.DELETED
    with pytest.raises(DetLocalError, match="^Only COMPLETED or PARTIALLY_DELETED checkpoints"):
        gone.download(str(dl.tmp / "again"))


def test_experiment_control_and_bad_input(dl: Env, client: Any) -> None:
    """kill / archive / unarchive / delete from the SDK; wait() returns the state; the
    arguments det-local cannot honour are named."""
    gate = dl.tmp / "gate"
    _, ctx = dl.context(CORE, core_config())
    exp = client.create_experiment(
        core_config(hyperparameters={"steps": 4, "best_at": 2, "gate": str(gate)}),
        model_dir=str(ctx),
    )
    exp.await_first_trial(interval=0.05)
    with pytest.raises(DetLocalError, match=f"^experiment {exp.id} is ACTIVE; it cannot be del"):
        exp.delete()
    exp.kill()
    assert exp.wait(interval=0.1) == client.ExperimentState.CANCELED
    exp.archive()
    assert exp.archived and client.get_experiment(exp.id).archived
    assert dl.json("experiment", "list", "--json") == []
    exp.unarchive()
    assert [e["id"] for e in dl.json("experiment", "list", "--json")] == [exp.id]
    exp.delete()
    with pytest.raises(DetLocalError, match=f"^experiment {exp.id} not found"):
        client.get_experiment(exp.id)
    assert not dl.paths.experiment_dir(exp.id).exists()

    with pytest.raises(DetLocalError, match="^create_experiment\\(template='t'\\): det-local has"):
        client.create_experiment(core_config(), model_dir=str(ctx), template="t")
    with pytest.raises(ValueError, match="^config parameter must be dictionary or path$"):
        client.create_experiment(42, model_dir=str(ctx))
    with pytest.raises(DetLocalError, match="searcher"):
        client.create_experiment({"entrypoint": "python3 train.py"}, model_dir=str(ctx))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        client.login(master="http://localhost:8080", user="determined", password="")
    assert not caught  # harmless


def test_wait_on_a_paused_experiment_raises_as_determined_does(dl: Env, client: Any) -> None:
    dl.daemon_start(DET_LOCAL_FAKE_GPUS="0", DET_LOCAL_CPU_SLOTS="1")
    gate = dl.tmp / "gate"
    _, ctx = dl.context(CORE, core_config())
    exp = client.create_experiment(
        core_config(hyperparameters={"steps": 4, "best_at": 2, "gate": str(gate)}),
        model_dir=str(ctx),
    )
    exp.await_first_trial(interval=0.05)
    exp.pause()
    gate.touch()
    wait_for(lambda: client.get_experiment(exp.id).state == client.ExperimentState.PAUSED)
    with pytest.raises(ValueError, match=f"^Experiment {exp.id} is in paused state"):
        exp.wait(interval=0.05)
    exp.activate()
    assert exp.wait(interval=0.1) == client.ExperimentState.COMPLETED

"""A DeepSpeedTrial on two ranks with real DeepSpeed on CPU (gloo), started by det-local's
DeepSpeed launcher (`python3 -m determined.launch.deepspeed --trial model_def:LinearDS`) under
the real `det-local run` with two CPU slots: each rank trains on its own shard, both write
their part of the checkpoint; paused and resumed, both ranks go on from it and end where an
uninterrupted run ends. Skipped without deepspeed."""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch

from det_local.store.states import State
from tests.support.trials.deepspeed import (
    DS_CONFIG,
    config,
    context,
    load_in_new_process,
    records,
    run_loader,
)
from tests.support.world import Env, steps, wait_for

pytest.importorskip("deepspeed")

pytestmark = pytest.mark.slow


def test_two_ranks_through_the_deepspeed_launcher(dl: Env) -> None:
    dl.setenv(DET_LOCAL_CPU_SLOTS="2")
    cfg_dict = config(
        dl,
        "python3 -m determined.launch.deepspeed --trial model_def:LinearDS",
        6,
        overwrite_deepspeed_args={"train_batch_size": 8},  # 2 micro x 2 steps x 2 ranks
    )
    cfg_dict["resources"] = {"slots_per_trial": 2}
    cfg, ctx = context(dl, cfg_dict)
    r = dl.det("run", cfg, ctx, timeout=90)
    assert r.rc == 0, (r, dl.log(1, 1)[-3000:])
    trial = dl.trial(1)
    assert trial.state == State.COMPLETED and trial.steps_completed == 6
    log = dl.log(1, 1)
    assert "[rank=0]" in log and "[rank=1]" in log

    rows = records(dl)
    for rank in (0, 1):
        mine = [r for r in rows if r["rank"] == rank]
        assert [r["batch"] for r in mine] == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5]
        assert [r["global_steps"] for r in mine] == [0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6]
        # 16 records a rank an epoch: 8 micro-batches, 4 batches
        assert [r["epoch"] for r in mine][::2] == [0, 0, 0, 0, 1, 1]
    first_epoch = {
        rank: {i for r in rows if r["rank"] == rank and r["epoch"] == 0 for i in r["drawn"]}
        for rank in (0, 1)
    }
    assert len(first_epoch[0]) == len(first_epoch[1]) == 16
    assert not first_epoch[0] & first_epoch[1]  # each rank its own shard

    assert steps(dl, 1, "validation") == [3, 6]
    last = Path(dl.checkpoints(1)[-1].path)
    names = {p.name for p in last.iterdir()}
    assert {"det_state_dict_rank0.pth", "det_state_dict_rank1.pth", "model0"} <= names
    assert {"trial_state.pkl", "load_data.json", "metadata.json"} <= names
    state = pickle.loads((last / "trial_state.pkl").read_bytes())
    assert state["batches_trained"] == 6 and state["det_local_loader_batches"] == 12
    assert json.loads((last / "load_data.json").read_text())["trial_type"] == "DeepSpeedTrial"

    # its DeepSpeed config fixes train_batch_size for two ranks: no engine in one process
    loader = run_loader(dl, last)
    assert loader.returncode == 1
    assert (
        f"CheckpointError: checkpoint {last.name}: LinearDS cannot build its DeepSpeed engine in "
        "this world of 1 process(es) (Check batch related parameters."
    ) in loader.stderr, loader.stderr[-3000:]
    assert "leave train_batch_size out of the DeepSpeed config" in loader.stderr


def two_rank_context(dl: Env, record: str, **hparams: Any) -> tuple[Path, Path]:
    """A 2-rank experiment whose DeepSpeed config leaves train_batch_size for DeepSpeed to
    derive (2 micro x 2 steps x the world size), so that its checkpoints load in one process."""
    cfg = config(
        dl,
        "python3 -m determined.launch.deepspeed --trial model_def:LinearDS",
        6,
        record=record,
        deepspeed_config="ds_any_world.json",
        **hparams,
    )
    cfg["resources"] = {"slots_per_trial": 2}
    cfg_path, ctx = context(dl, cfg)
    any_world = {k: v for k, v in DS_CONFIG.items() if k != "train_batch_size"}
    (ctx / "ds_any_world.json").write_text(json.dumps(any_world))
    return cfg_path, ctx


def final_weights(dl: Env, trial_id: int) -> dict[str, torch.Tensor]:
    last = Path(dl.checkpoints(trial_id)[-1].path)
    states = torch.load(last / "model0" / "mp_rank_00_model_states.pt", weights_only=False)
    return dict(states["module"])


def test_two_ranks_pause_and_resume_from_the_checkpoint(dl: Env) -> None:
    dl.setenv(DET_LOCAL_CPU_SLOTS="2")
    marker = dl.tmp / "holding"
    paused = str(dl.tmp / "paused.jsonl")
    cfg, ctx = two_rank_context(dl, paused, hold_at=3, marker=str(marker))
    run = dl.start("run", cfg, ctx)
    wait_for(marker.exists, timeout=90, what="the ranks to hold at batch 3")
    assert dl.det("experiment", "pause", 1).rc == 0
    r = run.wait()
    assert r.rc == 3, (r, dl.log(1, 1)[-3000:])  # PAUSED
    trial = dl.trial(1)
    assert trial.state == State.PAUSED and trial.steps_completed == 3
    ckpt = Path(dl.checkpoints(1)[-1].path)
    names = {p.name for p in ckpt.iterdir()}
    assert {"det_state_dict_rank0.pth", "det_state_dict_rank1.pth", "model0"} <= names
    r = dl.det("experiment", "activate", 1, timeout=120)
    assert r.rc == 0, (r, dl.log(1, 1)[-3000:])
    trial = dl.trial(1)
    assert trial.state == State.COMPLETED and trial.steps_completed == 6

    # the same experiment, never interrupted
    cfg, ctx = two_rank_context(dl, str(dl.tmp / "straight.jsonl"))
    r = dl.det("run", cfg, ctx, timeout=90)
    assert r.rc == 0, (r, dl.log(2, 2)[-3000:])

    rows = [json.loads(line) for line in Path(paused).read_text().splitlines()]
    straight = [json.loads(line) for line in (dl.tmp / "straight.jsonl").read_text().splitlines()]
    for rank in (0, 1):
        mine = [r for r in rows if r["rank"] == rank]
        # each batch trained once, by the first run up to the checkpoint, then by the second
        assert [r["batch"] for r in mine] == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5]
        assert [r["run"] for r in mine] == ["1"] * 6 + ["2"] * 6
        # both ranks' engines went on from the checkpoint's global_steps (model0 loaded)
        assert [r["global_steps"] for r in mine] == [0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6]
        # and each rank's data went on with the micro-batches it had not drawn yet
        assert [r["drawn"] for r in mine] == [r["drawn"] for r in straight if r["rank"] == rank]
    assert steps(dl, 1, "validation") == steps(dl, 2, "validation") == [3, 6]
    assert steps(dl, 1, "training")[-1] == 6
    assert [c.steps_completed for c in dl.checkpoints(1)] == [3, 6]

    resumed, uninterrupted = final_weights(dl, 1), final_weights(dl, 2)
    assert resumed.keys() == uninterrupted.keys()
    for name, value in resumed.items():
        torch.testing.assert_close(value, uninterrupted[name], rtol=1e-6, atol=1e-7)
    val = [m.metrics["val_loss"] for m in dl.metrics(1, "validation")]
    assert val == pytest.approx([m.metrics["val_loss"] for m in dl.metrics(2, "validation")])

    # the 2-rank checkpoint loads into one process
    loaded = load_in_new_process(dl, Path(dl.checkpoints(1)[-1].path))
    assert loaded["class"] == "LinearDS" and loaded["equal"], loaded
    assert loaded["val_loss"] == pytest.approx(val[-1], rel=1e-5)

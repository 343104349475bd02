"""A DeepSpeedTrial on two ranks with real DeepSpeed on CPU (gloo), started by det-local's
DeepSpeed launcher (`python3 -m determined.launch.deepspeed --trial model_def:LinearDS`) under
the real `det-local run` with two CPU slots: each rank trains on its own shard, both write
their part of the checkpoint. Skipped without deepspeed."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
from conftest import Env
from test_deepspeed_trial import config, context, records, steps

from det_local.store.states import State

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

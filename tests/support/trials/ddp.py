"""What a DDP trial learned: the weights in its last checkpoint."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.support.world import Env

STEPS = [8, 16, 24]  # tests/fixtures/ddp_trial.py validates every 8 batches, for 24


def final_weights(dl: Env, trial_id: int) -> dict[str, torch.Tensor]:
    """The model's weights in the trial's last checkpoint, without DDP's `module.` prefix."""
    ckpt = dl.checkpoints(trial_id)[-1]
    assert ckpt.steps_completed == STEPS[-1], ckpt
    state = torch.load(Path(ckpt.path) / "state_dict.pth", weights_only=False)
    (model,) = state["models_state_dict"]
    return {k.removeprefix("module."): v for k, v in model.items()}

"""The trial context a trial is built with outside training, to load a checkpoint into it: one
slot, a core context that touches nothing (no storage directory, no daemon), models left where
they are built. Shared by the PyTorchTrial and DeepSpeedTrial loaders."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch

from det_local.trial.pytorch._context import PyTorchTrialContext


def _dummy_core() -> Any:
    """A core Context that touches nothing (no storage directory, no daemon)."""
    from det_local.trial.core._checkpoint import CheckpointContext
    from det_local.trial.core._context import Context
    from det_local.trial.core._distributed import DummyDistributedContext
    from det_local.trial.core._preempt import DummyPreemptContext
    from det_local.trial.core._searcher import DummySearcherContext
    from det_local.trial.core._train import TrainContext

    dist = DummyDistributedContext()
    return Context(
        checkpoint=CheckpointContext(dist, Path(tempfile.gettempdir()) / "determined-unused"),
        distributed=dist,
        preempt=DummyPreemptContext(dist),
        train=TrainContext(None),
        searcher=DummySearcherContext(dist),
        info=None,
        session=None,
    )


class CheckpointLoadContext(PyTorchTrialContext):
    """A PyTorchTrialContext for building a trial outside training (to load a checkpoint into
    it): nothing is reported, models stay where they are built."""

    def __init__(
        self, hparams: dict[str, Any] | None = None, exp_conf: dict[str, Any] | None = None
    ) -> None:
        super().__init__(**load_context_args(hparams, exp_conf), aggregation_frequency=1)


def load_context_args(
    hparams: dict[str, Any] | None, exp_conf: dict[str, Any] | None
) -> dict[str, Any]:
    """A trial context's arguments for building a trial outside training (PyTorch or
    DeepSpeed): one slot, nothing reported, models left where they are built."""
    return {
        "core_context": _dummy_core(),
        "trial_seed": 0,
        "hparams": hparams,
        "slots_per_trial": 1,
        "num_gpus": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "exp_conf": exp_conf,
        "steps_completed": 0,
        "managed_training": False,
        "debug_enabled": False,
    }

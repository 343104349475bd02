"""context.experimental: opt-in behaviours of the PyTorch API."""

from __future__ import annotations

import logging
from typing import Any

import torch

logger = logging.getLogger("determined.pytorch")


class PyTorchExperimentalContext:
    def __init__(self, parent: Any) -> None:
        self._parent = parent
        self._auto_amp = False
        self._data_repro_checks_disabled = False
        self._auto_to_device = True
        self._async_checkpointing = False

    def use_amp(self) -> None:
        """Automatic mixed precision with a default GradScaler: forward passes of models wrapped
        afterwards run under autocast, losses are scaled in backward(), gradients unscaled before
        clipping, optimizers stepped through the scaler, which is updated after each batch.
        Call before wrap_model(). On a CPU device autocast and scaling stay off (as in
        Determined, whose AMP is CUDA-only)."""
        cuda = self._parent.device.type == "cuda"
        self._parent.wrap_scaler(torch.amp.GradScaler("cuda", enabled=cuda))
        self._auto_amp = True

    def disable_dataset_reproducibility_checks(self) -> None:
        """Allow build_*_data_loader() to return any torch DataLoader (you then own shuffling,
        sharding and skipping; see pytorch.samplers)."""
        self._data_repro_checks_disabled = True
        logger.info("disabled dataset reproducibility checks")

    def disable_auto_to_device(self) -> None:
        """Do not move batches to the device before train_batch()/evaluate_batch()."""
        self._auto_to_device = False
        logger.info("disabled automatically moving data to device")

    def enable_async_checkpointing(self) -> None:
        """Write checkpoints in the background (a det-local extension: Determined's are
        synchronous). Training stops only while the state is copied to host memory; a background
        thread then writes and fsyncs the files and reports the checkpoint. One write is in
        flight at a time: the next checkpoint, the end of fit() and a preemption exit wait for
        it, and a failed write raises on the training thread there. Costs host memory for one
        copy of the checkpointed state while it is written."""
        self._async_checkpointing = True
        logger.info("enabled asynchronous checkpointing")

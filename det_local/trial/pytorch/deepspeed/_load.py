"""A DeepSpeedTrial rebuilt from one of its checkpoints, outside training: what
``pytorch.load_trial_from_checkpoint_path`` does with a checkpoint a DeepSpeedTrial wrote.

Determined 0.38's loader handles PyTorchTrial checkpoints only (on a DeepSpeedTrial's it warns,
builds the trial with a PyTorchTrialContext and fails); det-local builds the trial with a
DeepSpeedTrialContext in a world of this process alone (DeepSpeed needs a process group to
build an engine) and loads each engine's weights from the checkpoint's ``model<i>`` tag."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from det_local.errors import CheckpointError
from det_local.trial.pytorch.checkpoints._load_context import load_context_args
from det_local.trial.pytorch.deepspeed._context import DeepSpeedTrialContext
from det_local.trial.pytorch.deepspeed._init import _local_distributed
from det_local.trial.pytorch.deepspeed._trial import DeepSpeedTrial, load_engine

logger = logging.getLogger("determined.pytorch.deepspeed")


class _CheckpointLoadContext(DeepSpeedTrialContext):
    """A DeepSpeedTrialContext for building a trial outside training: nothing is reported."""


def checkpoint_load_context(
    hparams: dict[str, Any] | None, exp_conf: dict[str, Any] | None
) -> DeepSpeedTrialContext:
    """The context to build a DeepSpeedTrial with, after making sure DeepSpeed has a process
    group (the launcher's world when this process runs under one, else a world of one)."""
    _local_distributed()
    return _CheckpointLoadContext(**load_context_args(hparams, exp_conf))


@contextlib.contextmanager
def in_dir(path: Path) -> Iterator[None]:
    """`path` as the working directory meanwhile (nothing changes when it is not a directory:
    a checkpoint written without code/)."""
    if not path.is_dir():
        yield
        return
    before = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(before)


@contextlib.contextmanager
def building(cls: type, exp_conf: dict[str, Any] | None, where: str) -> Iterator[None]:
    """Around the trial's constructor: DeepSpeed's refusal of a config whose train_batch_size
    was fixed for the world the trial trained in becomes one line saying what to change."""
    try:
        yield
    except AssertionError as err:
        text = " ".join(str(err).split())
        if "train_batch_size is not equal to" not in text:
            raise
        import torch.distributed as dist

        world = dist.get_world_size() if dist.is_initialized() else 1
        slots = ((exp_conf or {}).get("resources") or {}).get("slots_per_trial") or "its"
        raise CheckpointError(
            f"{where}: {cls.__name__} cannot build its DeepSpeed engine in this world of {world} "
            f"process(es) ({text}): its DeepSpeed config fixes train_batch_size for the {slots} "
            "slots it trained on; leave train_batch_size out of the DeepSpeed config (DeepSpeed "
            "derives it from train_micro_batch_size_per_gpu, gradient_accumulation_steps and "
            "the world size)"
        ) from None


def load_weights(trial: Any, context: DeepSpeedTrialContext, ckpt_dir: Path, where: str) -> None:
    """Each wrapped engine's module weights from ckpt_dir/model<i> (the optimizer and LR
    scheduler are left as built, as the PyTorchTrial loader does); a trial that overrides
    load() restores its own way, with load(context, ckpt_dir)."""
    if not context.models:
        raise CheckpointError(
            f"{where}: {type(trial).__name__} wrapped no model engine when built; its __init__ "
            "must call context.wrap_model_engine(engine)"
        )
    if type(trial).load is not DeepSpeedTrial.load:
        trial.load(context, ckpt_dir)
        return
    for i, engine in enumerate(context.models):
        if not (ckpt_dir / f"model{i}").is_dir():
            found = sorted(p.name for p in ckpt_dir.iterdir() if p.name.startswith("model"))
            raise CheckpointError(
                f"{where} has no model{i} (it holds {found or 'no model<i> tags'}): it was "
                f"written by a trial with fewer engines than the {len(context.models)} "
                f"{type(trial).__name__} wraps"
            )
        load_engine(
            engine,
            i,
            ckpt_dir,
            load_optimizer_states=False,
            load_lr_scheduler_states=False,
            load_module_only=True,
        )

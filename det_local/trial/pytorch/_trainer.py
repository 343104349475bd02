"""pytorch.Trainer, the public surface of the training loop: fit()'s arguments checked and
completed from the experiment config (FitSettings), then a TrialController (_loop) run over the
parts of a PyTorchTrial (its batch step, data, evaluator, checkpointer). deepspeed.Trainer is
this with a DeepSpeedTrial's parts. pytorch.init() is in _init."""

from __future__ import annotations

import logging
import os
import sys
import warnings
from typing import Any

from det_local.trial.pytorch._errors import InvalidTrialError
from det_local.trial.pytorch._evaluate import Evaluator
from det_local.trial.pytorch._fit import FitSettings, TrialEnv, build_callbacks
from det_local.trial.pytorch._loop import Parts, TrialController
from det_local.trial.pytorch._train_step import PyTorchStep, check_pytorch_trial
from det_local.trial.pytorch._training_data import TrainingData
from det_local.trial.pytorch._trial import evaluate_batch_defined
from det_local.trial.pytorch._units import (
    Batch,
    Epoch,
    TrainUnit,
    from_searcher_max_length,
    is_length,
)
from det_local.trial.pytorch.checkpoints._checkpointer import PyTorchCheckpointer
from det_local.wire.trialinfo import get_cluster_info

logger = logging.getLogger("determined.pytorch")

TEST_MODE_ENV = "DET_LOCAL_TEST_MODE"
_POLICIES = ("best", "all", "none")


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


class Trainer:
    """Trains a PyTorchTrial: ``Trainer(trial, context).fit(max_length=pytorch.Epoch(1))``."""

    def _parts(self, settings: FitSettings) -> Parts:
        """The parts of the loop for this kind of trial (checked first)."""
        trial, context = self._trial, self._context
        check_pytorch_trial(trial, context)
        env = TrialEnv(trial, context, build_callbacks(trial), settings)
        data = TrainingData(env, eval_by_batch=evaluate_batch_defined(trial))
        return Parts(
            env=env,
            step=PyTorchStep(trial, context),
            data=data,
            evaluator=Evaluator(env, data),
            checkpointer=PyTorchCheckpointer(env, self.checkpoint_timings),
        )

    def __init__(self, trial: Any, context: Any) -> None:
        self._trial = trial
        self._context = context
        self._core = context._core
        self._info = get_cluster_info()
        self._local_training = self._info is None or self._info.task_type != "TRIAL"
        #: one entry per checkpoint this trainer wrote: uuid, steps_completed, async,
        #: block_ms (training blocked), and for async ones d2h_ms (the host copy) and write_ms
        #: (the background write, once it has finished)
        self.checkpoint_timings: list[dict[str, Any]] = []

    def configure_profiler(self, *args: Any, **kwargs: Any) -> None:
        logger.error(
            "`trainer.configure_profiler` has been replaced with "
            "`fit(..., profiling_enabled=True)` and will be removed in a future release."
        )

    def fit(
        self,
        checkpoint_period: TrainUnit | None = None,
        validation_period: TrainUnit | None = None,
        max_length: TrainUnit | None = None,
        reporting_period: TrainUnit = Batch(100),  # noqa: B008
        checkpoint_policy: str = "best",
        latest_checkpoint: str | None = None,
        step_zero_validation: bool = False,
        test_mode: bool = False,
        profiling_enabled: bool = False,
    ) -> None:
        """Train until ``max_length``, validating every ``validation_period``, checkpointing every
        ``checkpoint_period`` and after validations (``checkpoint_policy``: best, all, none),
        reporting training metrics every ``reporting_period``; resume from
        ``latest_checkpoint`` (a uuid, usually ``det.get_cluster_info().latest_checkpoint``).

        ``test_mode`` (or DET_LOCAL_TEST_MODE=1, set by ``det-local run --test``) trains one
        batch, validates on one batch and checkpoints."""
        test_mode = bool(test_mode) or _truthy(os.environ.get(TEST_MODE_ENV))
        checkpoint_period = checkpoint_period or Batch(sys.maxsize)
        validation_period = validation_period or Batch(sys.maxsize)
        for arg, value in (
            ("checkpoint_period", checkpoint_period),
            ("validation_period", validation_period),
            ("reporting_period", reporting_period),
        ):
            if not isinstance(value, TrainUnit):
                raise InvalidTrialError(
                    f"fit({arg}={value!r}): expected pytorch.Batch(...) or pytorch.Epoch(...)"
                )
        if checkpoint_policy not in _POLICIES:
            raise InvalidTrialError(
                f"fit(checkpoint_policy={checkpoint_policy!r}): expected one of {list(_POLICIES)}"
            )

        searcher_metric: str | None = None
        smaller_is_better = True
        trial_id = 0
        if self._local_training:
            if checkpoint_policy == "best":
                logger.warning(
                    "checkpoint_policy='best' is not supported in local training mode. "
                    "Falling back to 'all'."
                )
                checkpoint_policy = "all"
            if max_length is None and test_mode:
                max_length = Batch(1)
            if max_length is None:
                raise InvalidTrialError(
                    "fit(max_length=...) is required off-cluster: pass pytorch.Batch(N) or "
                    "pytorch.Epoch(N)"
                )
            if profiling_enabled:
                logger.warning("Profiling is not supported in local training mode.")
                profiling_enabled = False
        else:
            info = self._info
            assert info is not None
            if latest_checkpoint is None and info.latest_checkpoint is not None:
                logger.warning(
                    "latest_checkpoint has not been configured. Pause/resume training will not "
                    "be able to continue from latest checkpoint. Did you mean to set "
                    "`fit(latest_checkpoint=info.latest_checkpoint)'?"
                )
            config = info.trial._config
            searcher = config.get("searcher") or {}
            smaller_is_better = bool(searcher.get("smaller_is_better", True))
            searcher_metric = searcher.get("metric")
            trial_id = int(info.trial.trial_id)
            if max_length is None:
                gbs = info.trial.hparams.get("global_batch_size")
                max_length = from_searcher_max_length(
                    searcher.get("max_length"), int(gbs) if gbs else None
                )
                if max_length is not None and not test_mode:
                    warnings.warn(
                        "Configuring `max_length` from the `searcher.max_length` experiment "
                        "config, which was deprecated in 0.38.0 and will be removed in a future "
                        "release. Please set `fit(max_length=X)` with your desired training "
                        "length directly.",
                        FutureWarning,
                        stacklevel=2,
                    )
            if max_length is None and test_mode:
                max_length = Batch(1)
            if max_length is None:
                raise InvalidTrialError(
                    "fit(max_length=...) is required: pass pytorch.Batch(N) or pytorch.Epoch(N) "
                    "(the experiment config has no searcher.max_length to fall back on)"
                )
            if is_length(max_length):
                _check_searcher_length(searcher, max_length)
        if not is_length(max_length):
            raise InvalidTrialError(
                f"fit(max_length={max_length!r}): expected pytorch.Batch(int) or pytorch.Epoch(int)"
            )
        assert max_length is not None
        settings = FitSettings(
            max_length=max_length,
            checkpoint_period=checkpoint_period,
            validation_period=validation_period,
            reporting_period=reporting_period,
            checkpoint_policy=checkpoint_policy,
            smaller_is_better=smaller_is_better,
            searcher_metric=searcher_metric,
            latest_checkpoint=latest_checkpoint,
            step_zero_validation=step_zero_validation,
            test_mode=test_mode,
            trial_id=trial_id,
            profiling_enabled=profiling_enabled,
        )
        TrialController(self._parts(settings)).run()


def _check_searcher_length(searcher: dict[str, Any], max_length: TrainUnit) -> None:
    """Warn when fit(max_length) disagrees with searcher.time_metric/max_time (ASHA's length)."""
    time_metric = searcher.get("time_metric")
    max_time = searcher.get("max_time")
    if time_metric is None or max_time is None:
        return
    expected: TrainUnit | None = None
    if time_metric == "batches":
        expected = Batch(max_time)
    elif time_metric == "epochs":
        expected = Epoch(max_time)
    else:
        logger.warning(
            f"`searcher.time_metric` must be either 'batches' or 'epochs' for training with "
            f"PyTorchTrials, but got {time_metric}. Training will proceed with {max_length} but "
            "may result in unexpected behavior."
        )
        return
    if max_length != expected:
        logger.warning(
            f"`max_length` passed into `fit()` method ({max_length}) does not match "
            f"`searcher.max_time` and `searcher.time_metric` from the experiment config "
            f"({expected}). This may result in unexpected hyperparameter search behavior."
        )

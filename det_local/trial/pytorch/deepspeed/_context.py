"""DeepSpeedTrialContext: what a DeepSpeedTrial uses to register its DeepSpeed engines."""

from __future__ import annotations

import logging
import warnings
from typing import Any

from det_local.trial.pytorch._context import TrialContextBase
from det_local.trial.pytorch._errors import InvalidTrialError
from det_local.trial.pytorch.deepspeed._mpu import ModelParallelUnit, make_data_parallel_mpu

logger = logging.getLogger("determined.pytorch.deepspeed")

# optimizations.* a DeepSpeedTrial ignores, with their expconf defaults (DeepSpeed's config has
# its own): a config with its defaults filled in warns about none of them
_IGNORED_OPTIMIZATIONS = {
    "average_aggregated_gradients": True,
    "gradient_compression": False,
    "tensor_fusion_threshold": 64,
    "tensor_fusion_cycle_time": 1,
    "auto_tune_tensor_fusion": False,
}


def _is_pipeline_engine(engine: Any) -> bool:
    try:
        from deepspeed import PipelineEngine
    except ImportError:  # pragma: no cover - an engine exists, so deepspeed does too
        return type(engine).__name__ == "PipelineEngine"
    return isinstance(engine, PipelineEngine)


class DeepSpeedTrialContext(TrialContextBase):
    """Made by ``deepspeed.init()``. In the trial's ``__init__``: build the engine with
    ``deepspeed.initialize(...)`` and register it with ``wrap_model_engine()``; optionally
    ``set_mpu()``, ``disable_auto_grad_accumulation()``,
    ``disable_dataset_reproducibility_checks()``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        TrialContextBase.__init__(self, *args, **kwargs)
        self._mpu: ModelParallelUnit = make_data_parallel_mpu(self.distributed)
        self._called_set_mpu = False
        self._train_micro_batch_size_per_gpu: int | None = None
        self._num_micro_batches_per_slot: int | None = None
        self._use_pipeline_parallel = False
        self._data_repro_checks_disabled = False
        self._manual_grad_accumulation = False
        self._scaler = None  # DeepSpeed scales fp16 losses itself
        self._check_optimizations()

    def _check_optimizations(self) -> None:
        """optimizations.* that cannot apply: DeepSpeed's own config says these things."""
        optimizations = (self._exp_conf or {}).get("optimizations") or {}
        if int(optimizations.get("aggregation_frequency") or 1) > 1:
            raise InvalidTrialError(
                "optimizations.aggregation_frequency is "
                f"{optimizations['aggregation_frequency']}, but a DeepSpeedTrial accumulates "
                "gradients as its DeepSpeed config says: set gradient_accumulation_steps there "
                "and remove optimizations.aggregation_frequency"
            )
        if (optimizations.get("mixed_precision") or "O0") != "O0":
            raise InvalidTrialError(
                f"optimizations.mixed_precision is {optimizations['mixed_precision']!r}, but a "
                "DeepSpeedTrial takes mixed precision from its DeepSpeed config (fp16/bf16 "
                "sections): remove optimizations.mixed_precision"
            )
        for name, default in _IGNORED_OPTIMIZATIONS.items():
            value = optimizations.get(name, default)
            if value != default:
                logger.warning(
                    f"optimizations.{name}={value} is ignored: it does not apply to a "
                    "DeepSpeedTrial"
                )

    # ------------------------------------------------------------------ engines
    def wrap_model_engine(self, model: Any) -> Any:
        """Register a DeepSpeed engine (checkpointed with save_checkpoint/load_checkpoint,
        switched between train and eval). The first engine sets the micro-batch size and the
        number of micro-batches per batch; a PipelineEngine brings its own MPU."""
        for method in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
            if not callable(getattr(model, method, None)):
                raise InvalidTrialError(
                    f"wrap_model_engine() got a {type(model).__name__}, which has no {method}(); "
                    "pass the engine deepspeed.initialize() returned (its first element)"
                )
        model = model.to(self.device)
        if _is_pipeline_engine(model):
            self._use_pipeline_parallel = True
            if not self.models:
                from det_local.trial.pytorch.deepspeed._mpu import make_deepspeed_mpu

                self._mpu = make_deepspeed_mpu(model.mpu)
            else:
                logger.warning("Using the MPU of the first wrapped model engine.")
        micro = int(model.train_micro_batch_size_per_gpu())
        if not self.models:
            self._train_micro_batch_size_per_gpu = micro
            self._num_micro_batches_per_slot = int(model.gradient_accumulation_steps())
        elif micro != self._train_micro_batch_size_per_gpu:
            logger.warning(
                f"model engine {len(self.models) + 1} has train_micro_batch_size_per_gpu {micro}, "
                f"the first one {self._train_micro_batch_size_per_gpu}; the loop and the records "
                "counts follow the first engine"
            )
        self.models.append(model)
        return model

    def set_mpu(self, mpu: ModelParallelUnit) -> None:
        """Use a custom model-parallel layout (after wrap_model_engine(), at most once)."""
        if not self.models:
            raise InvalidTrialError(
                "set_mpu() before any wrap_model_engine(): register the engine first"
            )
        if self._called_set_mpu:
            raise InvalidTrialError("set_mpu() may be called only once")
        if not isinstance(mpu, ModelParallelUnit):
            raise InvalidTrialError(
                f"set_mpu() got a {type(mpu).__name__}; pass a "
                "determined.pytorch.deepspeed.ModelParallelUnit"
            )
        self._called_set_mpu = True
        self._mpu = mpu

    def disable_auto_grad_accumulation(self) -> None:
        """Call train_batch() once per batch instead of gradient_accumulation_steps times: it
        then trains on all the micro-batches of the batch itself."""
        self._manual_grad_accumulation = True

    def disable_dataset_reproducibility_checks(self) -> None:
        """Allow build_*_data_loader() to return any loader (you then own shuffling, sharding,
        skipping on resume, and a training loader that never runs out)."""
        self._data_repro_checks_disabled = True

    @property
    def use_pipeline_parallel(self) -> bool:
        return self._use_pipeline_parallel

    def get_train_micro_batch_size_per_gpu(self) -> int:
        if self._train_micro_batch_size_per_gpu is None:
            raise InvalidTrialError(
                "get_train_micro_batch_size_per_gpu(): no engine yet; call wrap_model_engine() "
                "first"
            )
        return self._train_micro_batch_size_per_gpu

    def get_num_micro_batches_per_slot(self) -> int:
        if self._num_micro_batches_per_slot is None:
            raise InvalidTrialError(
                "get_num_micro_batches_per_slot(): no engine yet; call wrap_model_engine() first"
            )
        return self._num_micro_batches_per_slot

    @property
    def train_micro_batch_size_per_gpu(self) -> int:
        warnings.warn(
            "DeepSpeedTrialContext.train_micro_batch_size_per_gpu is deprecated; use "
            "get_train_micro_batch_size_per_gpu()",
            FutureWarning,
            stacklevel=2,
        )
        return self.get_train_micro_batch_size_per_gpu()

    @property
    def num_micro_batches_per_slot(self) -> int:
        warnings.warn(
            "DeepSpeedTrialContext.num_micro_batches_per_slot is deprecated; use "
            "get_num_micro_batches_per_slot()",
            FutureWarning,
            stacklevel=2,
        )
        return self.get_num_micro_batches_per_slot()

"""ModelParallelUnit: which ranks read data and report metrics when a model is split."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass
class ModelParallelUnit:
    """The data-parallel position of this rank, and whether it builds the data loaders and
    reports metrics. Subclass or fill it for custom model parallelism and hand it to
    ``context.set_mpu()``."""

    data_parallel_rank: int
    data_parallel_world_size: int
    #: whether this rank's train_batch()/evaluate_batch() answers are metrics to report (the
    #: last pipeline stage, usually)
    should_report_metrics: bool
    #: whether this rank builds the data loaders (the first and last pipeline stages, usually)
    should_build_data_loader: bool


def make_data_parallel_mpu(dist_context: Any) -> ModelParallelUnit:
    """Plain data parallelism: every rank reads its own shard and reports."""
    return ModelParallelUnit(
        data_parallel_rank=dist_context.get_rank(),
        data_parallel_world_size=dist_context.get_size(),
        should_report_metrics=True,
        should_build_data_loader=True,
    )


def make_deepspeed_mpu(topology: Any) -> ModelParallelUnit:
    """From DeepSpeed's pipeline grid (``engine.mpu``, a PipelineParallelGrid): the data
    loaders are built on the first and last pipeline stages of the first model slice."""
    stage = topology.get_pipe_parallel_rank()
    last_stage = topology.get_pipe_parallel_world_size() - 1
    return ModelParallelUnit(
        data_parallel_rank=topology.get_data_parallel_rank(),
        data_parallel_world_size=topology.get_data_parallel_world_size(),
        should_report_metrics=True,
        should_build_data_loader=topology.get_slice_parallel_rank() == 0
        and stage in (0, last_stage),
    )

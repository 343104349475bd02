"""Determined's Core API, importable as ``determined.core`` inside det-local trials."""

from det_local.trial.core._checkpoint import CheckpointContext, DownloadMode
from det_local.trial.core._context import Context, ProfilerContext, TensorboardMode, init
from det_local.trial.core._distributed import DistributedContext, DummyDistributedContext
from det_local.trial.core._preempt import DummyPreemptContext, PreemptContext, PreemptMode
from det_local.trial.core._searcher import (
    DummySearcherContext,
    SearcherContext,
    SearcherContextMissing,
    SearcherMode,
    SearcherOperation,
    Unit,
)
from det_local.trial.core._train import EarlyExitReason, TrainContext

__all__ = [
    "CheckpointContext",
    "Context",
    "DistributedContext",
    "DownloadMode",
    "DummyDistributedContext",
    "DummyPreemptContext",
    "DummySearcherContext",
    "EarlyExitReason",
    "PreemptContext",
    "PreemptMode",
    "ProfilerContext",
    "SearcherContext",
    "SearcherContextMissing",
    "SearcherMode",
    "SearcherOperation",
    "TensorboardMode",
    "TrainContext",
    "Unit",
    "init",
]

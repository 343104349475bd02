"""core.init() and core.Context: a Context of small sub-contexts, with off-cluster stand-ins."""

from __future__ import annotations

import enum
import logging
import os
import sys
from pathlib import Path
from types import TracebackType
from typing import Any

from det_local.trial.core import _metric_lines as metric_lines
from det_local.trial.core._checkpoint import CheckpointContext
from det_local.trial.core._distributed import DistributedContext, DummyDistributedContext
from det_local.trial.core._preempt import DummyPreemptContext, PreemptContext, PreemptMode
from det_local.trial.core._searcher import (
    DummySearcherContext,
    SearcherContext,
    SearcherContextMissing,
)
from det_local.trial.core._train import EarlyExitReason, TrainContext
from det_local.trial.session import Session, get_session
from det_local.wire.trialinfo import ClusterInfo, get_cluster_info

logger = logging.getLogger("determined.core")

CHECKPOINT_DIR_ENV = "DET_LOCAL_CHECKPOINT_DIR"


class TensorboardMode(enum.Enum):
    AUTO = "AUTO"
    MANUAL = "MANUAL"


class ProfilerContext:
    """System-metrics profiling is not collected by det-local; on()/off() are accepted."""

    def on(self, sampling_interval: int = 1, samples_per_report: int = 10) -> None:
        logger.info("det-local does not collect system profiling metrics; profiler.on() ignored")

    def off(self) -> None:
        pass


class _Experimental:
    def report_task_using_checkpoint(self, checkpoint: Any) -> None:
        pass

    def report_task_using_model_version(self, model_version: Any) -> None:
        pass


class Context:
    def __init__(
        self,
        checkpoint: CheckpointContext,
        distributed: DistributedContext,
        preempt: PreemptContext,
        train: TrainContext,
        searcher: Any,
        info: ClusterInfo | None,
        session: Session | None,
    ) -> None:
        self.checkpoint = checkpoint
        self.distributed = distributed
        self.preempt = preempt
        self.train = train
        self.searcher = searcher
        self.info = info
        self.profiler = ProfilerContext()
        self.experimental = _Experimental()
        self._session = session

    def __enter__(self) -> Context:
        return self

    def __exit__(
        self,
        typ: type[BaseException] | None,
        value: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        from det_local.trial import InvalidHP

        if isinstance(value, InvalidHP):
            self.train.report_early_exit(EarlyExitReason.INVALID_HP)
            self.close()
            # in the trial's log whatever logging is set up: why the trial ended
            print(
                f"det-local: InvalidHP: {value}; the trial ends early and the searcher is told",
                file=sys.stderr,
                flush=True,
            )
            sys.exit(0)
        self.close()

    def close(self) -> None:
        self.train._close()
        if self._session is not None:
            self._session.flush()
        self.distributed.close()

    def alert(
        self, title: str | None = None, description: str | None = None, level: str = "info"
    ) -> None:
        logger.log(
            logging.WARNING if level in ("warn", "error") else logging.INFO,
            f"alert: {title}: {description}",
        )


def _storage_from_arg(checkpoint_storage: str | dict[str, Any] | None) -> Path:
    if checkpoint_storage is None:
        xdg = os.environ.get("XDG_DATA_HOME") or os.path.join(
            os.path.expanduser("~"), ".local", "share"
        )
        return Path(xdg) / "determined"
    if isinstance(checkpoint_storage, dict):
        if checkpoint_storage.get("type") == "shared_fs":
            raise ValueError(
                "checkpoint_storage of type shared_fs is not allowed here; pass a path string"
            )
        path = checkpoint_storage.get("container_path") or checkpoint_storage.get("host_path")
        if not path:
            raise ValueError(
                f"unsupported checkpoint_storage {checkpoint_storage!r}; pass a path string"
            )
        return Path(path)
    if checkpoint_storage.startswith("file://"):
        return Path(checkpoint_storage[len("file://") :])
    if "://" in checkpoint_storage:
        raise ValueError(
            f"checkpoint_storage {checkpoint_storage!r}: only local paths are supported"
        )
    return Path(checkpoint_storage)


def init(
    *,
    distributed: DistributedContext | None = None,
    checkpoint_storage: str | dict[str, Any] | None = None,
    preempt_mode: PreemptMode = PreemptMode.WorkersAskChief,
    tensorboard_mode: TensorboardMode = TensorboardMode.AUTO,
) -> Context:
    """Build the Core API context; use it as ``with core.init() as core_context:``."""
    info = get_cluster_info()
    if info is None or info.task_type != "TRIAL":
        dist = distributed or DummyDistributedContext()
        storage = _storage_from_arg(checkpoint_storage)
        storage.mkdir(parents=True, exist_ok=True)
        return Context(
            checkpoint=CheckpointContext(dist, storage, None),
            distributed=dist,
            preempt=DummyPreemptContext(dist, preempt_mode),
            train=TrainContext(None),
            searcher=DummySearcherContext(dist),
            info=info,
            session=None,
        )
    if distributed is None:
        if len(info.slot_ids) > 1 or len(info.container_addrs) > 1:
            raise ValueError(
                "you must provide a valid DistributedContext for a multi-slot task "
                "(e.g. core.DistributedContext.from_torch_distributed())"
            )
        distributed = DummyDistributedContext()
    session = get_session()
    config = info.trial._config
    storage = Path(os.environ.get(CHECKPOINT_DIR_ENV) or _storage_from_arg(checkpoint_storage))
    has_ops = (config.get("searcher") or {}).get("max_length") is not None
    searcher: Any = (
        SearcherContext(session, distributed, config) if has_ops else SearcherContextMissing()
    )
    tb_path = os.environ.get("DET_LOCAL_TENSORBOARD_DIR")
    return Context(
        checkpoint=CheckpointContext(distributed, storage, session),
        distributed=distributed,
        preempt=PreemptContext(session, distributed, preempt_mode),
        train=TrainContext(session, tb_path, metric_lines.for_rank(distributed.rank)),
        searcher=searcher,
        info=info,
        session=session,
    )

"""TrainContext: metric reports, progress, early exit, best validation."""

from __future__ import annotations

import enum
import logging
import os
from typing import Any

from det_local.trial.core._metric_lines import MetricLines
from det_local.trial.core._metrics import check_metrics
from det_local.trial.session import Session

logger = logging.getLogger("determined.core")


class EarlyExitReason(enum.Enum):
    INVALID_HP = "EXITED_REASON_INVALID_HP"
    USER_REQUESTED_STOP = "EXITED_REASON_USER_REQUESTED_STOP"


class TrainContext:
    def __init__(
        self,
        session: Session | None,
        tensorboard_path: str | None = None,
        lines: MetricLines | None = None,
    ) -> None:
        self._session = session
        self._tb_path = tensorboard_path
        self._lines = lines  # each report as a line in the trial's output (the chief's)

    def _report(
        self,
        group: str,
        steps_completed: int,
        metrics: dict[str, Any],
        batch_metrics: list[dict[str, Any]] | None = None,
        allow_none: bool = True,
    ) -> None:
        checked = check_metrics(group, steps_completed, metrics, allow_none=allow_none)
        if self._session is None:
            logger.info(
                f"report_{group}_metrics(steps_completed={steps_completed}, metrics={checked})"
            )
            return
        self._session.report(group, int(steps_completed), checked, batch_metrics)
        if self._lines is not None:
            self._lines.report(group, int(steps_completed), checked)

    def _close(self) -> None:
        """The trial is done reporting: the latest reports not shown yet are written."""
        if self._lines is not None:
            self._lines.flush()

    def report_training_metrics(
        self,
        steps_completed: int,
        metrics: dict[str, Any],
        batch_metrics: list[dict[str, Any]] | None = None,
    ) -> None:
        self._report("training", steps_completed, metrics, batch_metrics)

    def report_validation_metrics(self, steps_completed: int, metrics: dict[str, Any]) -> None:
        metrics = {k: v for k, v in metrics.items() if not isinstance(v, bytes)}
        self._report("validation", steps_completed, metrics, allow_none=False)

    def report_metrics(self, group: str, steps_completed: int, metrics: dict[str, Any]) -> None:
        if "." in group or not group:
            raise ValueError(f"metric group {group!r}: names must be non-empty and contain no '.'")
        self._report(group, steps_completed, metrics)

    def report_progress(self, progress: float) -> None:
        if not 0 <= progress <= 1:
            raise ValueError(f"report_progress: progress must be between 0 and 1, found {progress}")
        if self._session is not None:
            self._session.send("progress", progress=float(progress))

    def report_early_exit(self, reason: EarlyExitReason) -> None:
        if self._session is not None:
            self._session.request("early_exit", reason=reason.name)
        else:
            logger.info(f"report_early_exit({reason})")

    def get_experiment_best_validation(self) -> float | None:
        if self._session is None:
            return None
        value = self._session.request("best_val")
        return None if value is None else float(value)

    def _get_last_validation(self) -> int | None:
        """steps_completed of the trial's latest validation (any run), None if it has none."""
        if self._session is None:
            return None
        value = self._session.request("last_val")
        return None if value is None else int(value)

    def set_status(self, status: str) -> None:
        if self._session is not None:
            self._session.send("status", status=str(status))

    def get_tensorboard_path(self) -> str:
        return self._tb_path or os.path.join(os.getcwd(), "tensorboard")

    def upload_tensorboard_files(self, *args: Any, **kwargs: Any) -> None:
        """TensorBoard files stay where they were written (the trial's directory)."""

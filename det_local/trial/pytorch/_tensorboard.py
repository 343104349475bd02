"""The TensorBoard side of a Trainer's loop: the reported metrics written as scalars under
``Determined/`` (per batch for training, once for validation) and the event files uploaded at
each boundary, as Determined's loop does. Nothing happens when the context turned it off, nor
without the tensorboard package: then `det-local tensorboard start` writes the trial's curves
from its reported metrics (client/tbexport.py), and it is that command that says, once, when
TensorBoard is not installed (not every trial of a search)."""

from __future__ import annotations

import importlib.util
import logging
from typing import Any

logger = logging.getLogger("determined.pytorch")


class TensorBoardLog:
    def __init__(self, context: Any, core: Any) -> None:
        self.context = context
        self.core = core
        self._warned = False

    @property
    def enabled(self) -> bool:
        return bool(self.context.get_enable_tensorboard_logging())

    def writer(self) -> Any:
        """The context's SummaryWriter; None when TensorBoard logging is off or unavailable."""
        if not self.context.get_enable_tensorboard_logging():
            return None
        if self.context._tbd_writer is None and importlib.util.find_spec("tensorboard") is None:
            if not self._warned:
                self._warned = True
                logger.debug("tensorboard is not installed: this trial writes no event files")
            return None
        return self.context.get_tensorboard_writer()

    def log(
        self,
        kind: str,
        steps: int,
        metrics: dict[str, Any],
        batch_metrics: list[dict[str, Any]] | None,
    ) -> None:
        """Write `metrics` ("train" or "val", at batch `steps`); a training report's
        `batch_metrics` (the batches up to `steps`) are written one step each, and its averages
        only for the names they do not hold."""
        writer = self.writer()
        if writer is None:
            return
        seen: set[str] = set()
        for i, row in enumerate(batch_metrics or []):
            at = steps - len(batch_metrics or []) + i
            for name, value in row.items():
                if _is_scalar(value):
                    writer.add_scalar("Determined/" + name, value, at)
                seen.add(name)
        for name, value in metrics.items():
            if name in seen:
                continue
            tag = name if kind != "val" or name.startswith("val") else "val_" + name
            if _is_scalar(value):
                writer.add_scalar("Determined/" + tag, value, steps)

    def upload(self) -> None:
        """Flush the writer to new event files and have core upload them."""
        self.context._maybe_reset_tbd_writer()
        self.core.train.upload_tensorboard_files()


def _is_scalar(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)

"""PyTorchCallback: hooks the training loop calls (all no-ops by default)."""

from __future__ import annotations

from typing import Any


class PyTorchCallback:
    """Subclass and override the hooks you need; return callbacks from build_callbacks().

    A stateful callback should override state_dict()/load_state_dict(): the state is saved in
    every checkpoint under the name build_callbacks() gave it. In distributed training each rank
    runs its own copy (on_checkpoint_write_end only on the chief)."""

    def on_trial_startup(self, first_batch_idx: int, checkpoint_uuid: str | None) -> None:
        """Before data loaders are built and any checkpoint is loaded."""

    def on_trial_shutdown(self) -> None:
        """When fit() returns or raises (the trial may only be pausing)."""

    def on_training_start(self) -> None:
        """After the checkpoint (if any) is loaded, before the first batch."""

    def on_training_epoch_start(self, epoch_idx: int) -> None:
        """Before the first batch of an epoch."""

    def on_training_epoch_end(self, epoch_idx: int) -> None:
        """After the last batch of an epoch."""

    def on_training_workload_end(self, avg_metrics: dict[str, Any], batch_metrics: Any) -> None:
        """After the training metrics of a reporting period are aggregated."""

    def on_validation_start(self) -> None:
        """Before every validation."""

    def on_validation_epoch_start(self) -> None:
        """Before the first evaluate_batch() of a validation."""

    def on_validation_epoch_end(self, outputs: list[Any]) -> None:
        """After the last evaluate_batch(), with every batch's metrics."""

    def on_validation_end(self, metrics: dict[str, Any]) -> None:
        """After every validation, with the reduced metrics."""

    def on_checkpoint_load_start(self, checkpoint: dict[str, Any]) -> None:
        """Before the loaded state_dict.pth contents are restored."""

    def on_checkpoint_save_start(self, checkpoint: dict[str, Any]) -> None:
        """Before state_dict.pth is written (the dict may still be changed)."""

    def on_checkpoint_end(self, checkpoint_dir: str) -> None:
        """Deprecated: use on_checkpoint_write_end."""

    def on_checkpoint_write_end(self, checkpoint_dir: str) -> None:
        """After the checkpoint's files are written (chief only)."""

    def on_checkpoint_upload_end(self, uuid: str) -> None:
        """After the checkpoint is stored and reported."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        pass

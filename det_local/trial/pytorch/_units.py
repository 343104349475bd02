"""Training lengths and periods: Batch(n) / Epoch(n), or explicit schedules (Batch([5, 30]))."""

from __future__ import annotations

from collections import abc
from typing import Any

from det_local.trial.pytorch._errors import InvalidTrialError


class TrainUnit:
    """A length or period in batches or epochs.

    ``value`` is an int (a period: "every value"; a value below 1 means "always") or a container of
    ints (an explicit schedule: "after these")."""

    def __init__(self, value: int | abc.Container[int]) -> None:
        self.value = value

    def should_stop(self, step_num: int) -> bool:
        """Whether `step_num` (batches or epochs done, counted from 1) is on this period."""
        if isinstance(self.value, int):
            if self.value < 1:
                return True
            return step_num != 0 and step_num % self.value == 0
        return step_num in self.value

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.value!r})"

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other) and self.value == other.value  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash((type(self).__name__, repr(self.value)))


class Epoch(TrainUnit):
    """Epochs: Epoch(2) is every second epoch, Epoch([1, 5]) after epochs 1 and 5.

    Epoch ends are counted in batches (len of the training data loader), as in Determined."""


class Batch(TrainUnit):
    """Batches: Batch(100) is every 100 batches, Batch([5, 30, 45]) after those batches."""

    @staticmethod
    def _from_records(records: int, global_batch_size: int) -> Batch:
        return Batch(max(records // global_batch_size, 1))


def is_length(unit: Any) -> bool:
    """A valid max_length: Batch(int) or Epoch(int)."""
    return (
        isinstance(unit, (Batch, Epoch))
        and isinstance(unit.value, int)
        and not isinstance(unit.value, bool)
    )


def from_searcher_max_length(
    max_length: Any, global_batch_size: int | None, where: str = "searcher.max_length"
) -> TrainUnit | None:
    """The deprecated ``searcher.max_length`` as a TrainUnit (None when unset).

    ``{epochs: N}`` is Epoch(N), ``{batches: N}`` Batch(N), ``{records: N}`` Batch(N // global
    batch size); a bare int counts batches (Determined refuses it for the Trainer; det-local
    reads it the way the 0.37 searchers did for a Trial class)."""
    if max_length is None:
        return None
    if isinstance(max_length, bool):
        raise InvalidTrialError(f"{where}: expected a length, found {max_length!r}")
    if isinstance(max_length, int):
        return Batch(max_length)
    if isinstance(max_length, dict) and len(max_length) == 1:
        ((unit, value),) = max_length.items()
        if isinstance(value, int) and not isinstance(value, bool):
            if unit == "batches":
                return Batch(value)
            if unit == "epochs":
                return Epoch(value)
            if unit == "records":
                if not global_batch_size:
                    raise InvalidTrialError(
                        f"{where} is {{records: {value}}}, which needs the global_batch_size "
                        "hyperparameter to be converted to batches; add global_batch_size to "
                        "hyperparameters or pass fit(max_length=pytorch.Batch(N))"
                    )
                return Batch._from_records(value, global_batch_size)
    raise InvalidTrialError(
        f"{where} is {max_length!r}; expected {{batches: N}}, {{epochs: N}} or {{records: N}}"
    )

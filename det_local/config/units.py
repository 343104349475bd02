"""Training lengths: `{batches: N}`, `{records: N}`, `{epochs: N}`, or a bare (unitless) int.

A batch is one global batch (`hyperparameters.global_batch_size` records). records -> batches is
`max(records // global_batch_size, 1)` (0 stays 0); epochs need the number of records (or
batches) in an epoch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from det_local.config import check
from det_local.config.check import Ctx, join
from det_local.errors import ConfigError

Unit = Literal["batches", "records", "epochs"]
UNITS: tuple[Unit, ...] = ("batches", "records", "epochs")


@dataclass(frozen=True)
class Length:
    """A training length; `unit` None is a bare int (the trial decides what it counts)."""

    unit: Unit | None
    value: int

    @classmethod
    def batches(cls, n: int) -> Length:
        return cls("batches", n)

    @classmethod
    def records(cls, n: int) -> Length:
        return cls("records", n)

    @classmethod
    def epochs(cls, n: int) -> Length:
        return cls("epochs", n)

    @classmethod
    def unitless(cls, n: int) -> Length:
        return cls(None, n)

    def to_dict(self) -> dict[str, int] | int:
        """`{"batches": N}`, or the bare int when unitless (Determined's JSON form)."""
        if self.unit is None:
            return self.value
        return {self.unit: self.value}

    def __str__(self) -> str:
        return str(self.value) if self.unit is None else f"{self.value} {self.unit}"

    def to_batches(
        self,
        global_batch_size: int | None = None,
        records_per_epoch: int | None = None,
        *,
        batches_per_epoch: int | None = None,
    ) -> int:
        """This length in batches. Unitless lengths are returned as they are.

        records need `global_batch_size`; epochs need `batches_per_epoch` (e.g. len(loader)) or
        `records_per_epoch` and `global_batch_size`. Raises ConfigError when what is needed
        is missing."""
        if self.unit is None or self.unit == "batches":
            return self.value
        if self.value == 0:
            return 0
        if self.unit == "epochs" and batches_per_epoch is not None:
            return self.value * batches_per_epoch
        if not global_batch_size or global_batch_size < 1:
            raise ConfigError(
                f"a length of {self} needs hyperparameters.global_batch_size (an integer >= 1) "
                "to be converted to batches; add it to hyperparameters or give the length "
                "in batches"
            )
        if self.unit == "records":
            return max(self.value // global_batch_size, 1)
        if not records_per_epoch or records_per_epoch < 1:
            raise ConfigError(
                f"a length of {self} needs records_per_epoch (or the number of batches in an "
                "epoch) to be converted to batches; set records_per_epoch or give the length "
                "in batches"
            )
        return max(self.value * records_per_epoch // global_batch_size, 1)


_EXAMPLE = "{batches: 1000}"


def parse_length(
    ctx: Ctx, value: Any, path: str, *, minimum: int = 0, allow_bare: bool = False
) -> Length:
    """A length object (exactly one of batches/records/epochs, int >= minimum) or, where
    allowed, a bare int >= 0."""
    if allow_bare and check.is_int(value):
        return Length(None, check.as_int(ctx, value, path, lo=0))
    if not isinstance(value, dict):
        also = " or a bare integer" if allow_bare else ""
        ctx.wrong_type(
            path, f"a length such as {_EXAMPLE} (one of batches, records, epochs){also}", value
        )
    for key in value:
        if key not in UNITS:
            ctx.unknown(path, key, UNITS)
    if len(value) != 1:
        keys = ", ".join(str(k) for k in value) or "none"
        ctx.fail(
            path,
            f"a length has exactly one of batches, records or epochs, found {keys}; "
            f"write e.g. {_EXAMPLE}",
        )
    ((unit, n),) = value.items()
    return Length(unit, check.as_int(ctx, n, join(path, unit), lo=minimum))

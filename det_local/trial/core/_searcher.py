"""SearcherContext: the <=0.37 operations() loop, and its 0.38 stand-in.

With ``searcher.max_length`` in the config, ``operations()`` asks the daemon's searcher for
operations: the single searcher gives one of max_length; ASHA gives each rung's length in turn.
Without it (0.38 configs), ``core_context.searcher`` raises on use, as Determined's does.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from typing import Any

from det_local.trial.core._distributed import DistributedContext
from det_local.trial.session import Session


class Unit(enum.Enum):
    EPOCHS = "EPOCHS"
    RECORDS = "RECORDS"
    BATCHES = "BATCHES"


class SearcherMode(enum.Enum):
    WorkersAskChief = "WORKERS_ASK_CHIEF"
    ChiefOnly = "CHEIF_ONLY"


class SearcherOperation:
    def __init__(self, searcher: SearcherContext, is_chief: bool, length: int) -> None:
        self._searcher = searcher
        self._is_chief = is_chief
        self._length = length
        self._completed = False

    @property
    def length(self) -> int:
        return self._length

    def report_progress(self, length: float) -> None:
        if not self._is_chief:
            raise RuntimeError("you must only call op.report_progress() from the chief worker")
        if self._completed and length != self._length:
            raise RuntimeError("you must not call op.report_progress() after op.report_completed()")
        self._searcher._report_progress(length)

    def report_completed(self, searcher_metric: Any) -> None:
        if not self._is_chief:
            raise RuntimeError("you must only call op.report_completed() from the chief worker")
        if self._completed:
            raise RuntimeError("you may only call op.report_completed() once")
        self._completed = True
        self._searcher._report_completed(self._length, searcher_metric)


def _units(config: dict[str, Any]) -> Unit | None:
    length = (config.get("searcher") or {}).get("max_length")
    if isinstance(length, dict):
        for key, unit in (
            ("batches", Unit.BATCHES),
            ("records", Unit.RECORDS),
            ("epochs", Unit.EPOCHS),
        ):
            if key in length:
                return unit
    return None


class SearcherContext:
    def __init__(
        self, session: Session | None, dist: DistributedContext, config: dict[str, Any]
    ) -> None:
        self._session = session
        self._dist = dist
        self._config = config
        self._max_length = (config.get("searcher") or {}).get("max_length")

    def _next_length(self) -> int | None:
        if self._session is None:
            return None
        value = self._session.request("op_next")
        return None if value is None else int(value)

    def _report_progress(self, length: float) -> None:
        if self._session is not None and self._max_length is not None:
            total = _length_value(self._max_length)
            if total:
                self._session.send("progress", progress=min(max(float(length) / total, 0.0), 1.0))

    def _report_completed(self, length: int, metric: Any) -> None:
        if self._session is not None:
            self._session.request("op_done", length=length, metric=_plain(metric))

    def operations(
        self, searcher_mode: SearcherMode = SearcherMode.WorkersAskChief, auto_ack: bool = True
    ) -> Iterator[SearcherOperation]:
        is_chief = self._dist.rank == 0
        if not is_chief and searcher_mode == SearcherMode.ChiefOnly:
            raise RuntimeError("searcher_mode=ChiefOnly but operations() called on a worker")
        while True:
            length = self._next_length() if is_chief else None
            if searcher_mode == SearcherMode.WorkersAskChief:
                length = self._dist.broadcast(length)
            if length is None:
                break
            op = SearcherOperation(self, is_chief, length)
            yield op
            if not op._completed and is_chief:
                raise RuntimeError("you must call op.report_completed() on each operation")
        if auto_ack:
            self.acknowledge_out_of_ops()

    def acknowledge_out_of_ops(self) -> None:
        """Out of operations: the daemon keeps the trial (ASHA may promote it later) or ends it."""
        if self._session is not None and self._dist.rank == 0:
            self._session.request("out_of_ops")

    def get_configured_units(self) -> Unit | None:
        return _units(self._config)


def _length_value(length: Any) -> int:
    if isinstance(length, dict):
        return int(next(iter(length.values()), 0))
    return int(length or 0)


def _plain(metric: Any) -> Any:
    if hasattr(metric, "item") and getattr(metric, "ndim", 0) == 0:
        return metric.item()
    return metric


class DummySearcherContext(SearcherContext):
    """Off det-local: one operation of length 1, as Determined's off-cluster stand-in."""

    def __init__(self, dist: DistributedContext, length: int = 1) -> None:
        super().__init__(None, dist, {})
        self._length = length

    def operations(
        self, searcher_mode: SearcherMode = SearcherMode.WorkersAskChief, auto_ack: bool = True
    ) -> Iterator[SearcherOperation]:
        op = SearcherOperation(self, self._dist.rank == 0, self._length)
        yield op
        if not op._completed and self._dist.rank == 0:
            raise RuntimeError("you must call op.report_completed() on each operation")

    def get_configured_units(self) -> Unit | None:
        return Unit.EPOCHS


class SearcherContextMissing:
    """0.38 configs without searcher.max_length: the searcher API is gone, as in Determined."""

    def __getattr__(self, name: str) -> Any:
        raise ValueError(
            f"core_context.searcher.{name}() needs searcher.max_length in the experiment config; "
            "in Determined 0.38 the searcher API is deprecated: train for a length you choose "
            "(e.g. from hparams) and report validation metrics instead"
        )

"""Metric values between the trial's code and the reports: kept on the device per batch, moved to
the host in one transfer per (device, dtype) at a reporting boundary, then averaged.

Nothing here reads a device tensor per batch: `MetricsBuffer.add` only detaches."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch


def _np() -> Any:
    try:
        import numpy

        return numpy
    except ImportError:  # pragma: no cover
        return None


def to_python(value: Any) -> Any:
    """A metric value as plain Python: tensors and numpy values become numbers or (nested) lists."""
    if isinstance(value, torch.Tensor):
        value = value.detach()
        if value.device.type != "cpu":
            value = value.cpu()
        return value.item() if value.dim() == 0 else value.tolist()
    if isinstance(value, dict):
        return {k: to_python(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_python(v) for v in value]
    np = _np()
    if np is not None and isinstance(value, (np.ndarray, np.generic)):
        return value.item() if value.ndim == 0 else value.tolist()
    return value


def to_host(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Convert a list of metric dicts to plain Python, moving all their tensors to the host with
    one copy per (device, dtype) group (one device synchronisation, not one per value)."""
    out = [dict(row) for row in rows]
    groups: dict[tuple[torch.device, torch.dtype], list[tuple[int, str, torch.Tensor]]] = {}
    for r, row in enumerate(rows):
        for key, value in row.items():
            if isinstance(value, torch.Tensor):
                groups.setdefault((value.device, value.dtype), []).append((r, key, value))
            elif not isinstance(value, (int, float, str, bool)) and value is not None:
                out[r][key] = to_python(value)
    for (device, _dtype), entries in groups.items():
        if all(t.dim() == 0 for _, _, t in entries):  # losses: one stack, one copy, one list
            with torch.no_grad():
                values = torch.stack([t for _, _, t in entries])
            if device.type != "cpu":
                values = values.cpu()
            for (r, key, _), value in zip(entries, values.tolist(), strict=True):
                out[r][key] = value
            continue
        flats = [t.detach().reshape(-1) for _, _, t in entries]
        flat = torch.cat(flats) if len(flats) > 1 else flats[0]
        if device.type != "cpu":
            flat = flat.cpu()
        offset = 0
        for r, key, t in entries:
            n = t.numel()
            chunk = flat[offset : offset + n]
            offset += n
            out[r][key] = (
                chunk.reshape(t.shape).item() if t.dim() == 0 else (chunk.reshape(t.shape).tolist())
            )
    return out


def _flatten_numbers(value: Any, into: list[float]) -> bool:
    if isinstance(value, bool):
        into.append(float(value))
        return True
    if isinstance(value, (int, float)):
        into.append(float(value))
        return True
    if isinstance(value, list):
        return all(_flatten_numbers(v, into) for v in value)
    return False


def average(values: Sequence[Any]) -> float | None:
    """The mean of every number in `values` (nested lists flattened, None skipped), as Determined
    averages batch metrics; None when some value is not numeric."""
    flat: list[float] = []
    for v in values:
        if v is None:
            continue
        if not _flatten_numbers(v, flat):
            return None
    if not flat:
        return None
    if any(math.isnan(x) for x in flat):
        return math.nan
    total = math.fsum(flat)
    return total / len(flat)


def average_batches(batch_metrics: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """{name: mean over the batches} (keys in first-seen order; None if not averageable)."""
    keys: dict[str, None] = {}
    for row in batch_metrics:
        keys.update(dict.fromkeys(row))
    return {k: average([row[k] for row in batch_metrics if k in row]) for k in keys}


def average_across_ranks(per_rank: Sequence[Sequence[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per batch, the mean of each metric over the ranks that trained it (rank 0 sets the keys)."""
    np = _np()
    ranks = [list(r) for r in per_rank if r]
    if not ranks:
        return []
    out: list[dict[str, Any]] = []
    for i, first in enumerate(ranks[0]):
        row: dict[str, Any] = {}
        for key, value in first.items():
            vals = [r[i][key] for r in ranks if i < len(r) and r[i].get(key) is not None]
            if vals and all(isinstance(v, (int, float)) for v in vals):
                row[key] = math.fsum(float(v) for v in vals) / len(vals)
            elif vals and np is not None:
                try:
                    row[key] = np.mean(np.array(vals, dtype=float), axis=0).tolist()
                except (TypeError, ValueError):
                    row[key] = value
            else:
                row[key] = value
        out.append(row)
    return out


def first_nan(batch_idxs: Sequence[int], batch_metrics: Sequence[dict[str, Any]], key: str) -> int:
    """The batch index of the first NaN `key` value, or -1."""
    for idx, row in zip(batch_idxs, batch_metrics, strict=True):
        v = row.get(key)
        if isinstance(v, float) and math.isnan(v):
            return idx
        if isinstance(v, list):
            flat: list[float] = []
            if _flatten_numbers(v, flat) and any(math.isnan(x) for x in flat):
                return idx
    return -1


class MetricsBuffer:
    """Training metrics of the batches since the last report. Tensors stay on their device
    (detached) until `drain()`, which runs only at a reporting boundary."""

    def __init__(self) -> None:
        self._idxs: list[int] = []
        self._rows: list[dict[str, Any]] = []

    def add(self, batch_idx: int, metrics: dict[str, Any]) -> None:
        self._idxs.append(batch_idx)
        self._rows.append(
            {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in metrics.items()}
        )

    def adder(self) -> Callable[[int, dict[str, Any]], None]:
        """`add` for a loop's hot path, valid until the next `drain()`: the common answer (one
        tensor, the loss) costs no Python call of its own."""
        idxs, rows = self._idxs, self._rows
        add_idx, add_row = idxs.append, rows.append
        tensor = torch.Tensor

        def add(batch_idx: int, metrics: dict[str, Any]) -> None:
            add_idx(batch_idx)
            if len(metrics) == 1 and "loss" in metrics and type(metrics["loss"]) is tensor:
                add_row({"loss": metrics["loss"].detach()})
            else:
                add_row({k: v.detach() if isinstance(v, tensor) else v for k, v in metrics.items()})

        return add

    def __len__(self) -> int:
        return len(self._rows)

    def drain(self) -> tuple[list[int], list[dict[str, Any]]]:
        idxs, rows = self._idxs, self._rows
        self._idxs, self._rows = [], []
        return idxs, to_host(rows)

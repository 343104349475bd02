"""`det-local usage`: slot-hours allocated and used, per user (experiment, slot), from the
store's allocation records (`store/tables/usage.py`).

For each allocation, the part of it inside the report's window (``since``..``until``) counts:
``slot_seconds`` = its slots x those seconds. ``used_slot_seconds`` = that x the mean
utilisation the sampler saw during the allocation (GPU utilisation on GPU slots, CPU use over
the slot's share of the cores on CPU slots), over the allocations that have samples
(``sampled_slot_seconds``); ``mean_util_pct`` = used / sampled x 100 (null without samples).
An allocation still open counts up to now.

The JSON (``usage --json``) is :func:`report`'s value: ``since``, ``until`` (Unix seconds),
``by`` (user | experiment | slot | kind), ``rows`` (one per key, most slot-hours first) and
``total``; each row and the total have ``key``, ``allocations``, ``slot_seconds``,
``slot_hours``, ``sampled_slot_seconds``, ``used_slot_seconds``, ``used_slot_hours``,
``mean_util_pct``, ``users`` (the users in it) and ``kinds`` (slot-seconds per kind of job).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from det_local.errors import DetLocalError

if TYPE_CHECKING:
    from det_local.store.tables.usage import UsageTable

BY = ("user", "experiment", "slot", "kind")
KEYS = (
    "key",
    "allocations",
    "slot_seconds",
    "slot_hours",
    "sampled_slot_seconds",
    "used_slot_seconds",
    "used_slot_hours",
    "mean_util_pct",
    "users",
    "kinds",
)


class _Acc:
    __slots__ = ("allocations", "kinds", "sampled", "seconds", "used", "users")

    def __init__(self) -> None:
        self.allocations = 0
        self.seconds = 0.0
        self.sampled = 0.0
        self.used = 0.0
        self.users: set[str] = set()
        self.kinds: dict[str, float] = {}

    def add(self, row: tuple[Any, ...]) -> None:
        _, kind, user, count, secs, sampled, used = row
        self.allocations += int(count)
        self.seconds += float(secs or 0)
        self.sampled += float(sampled or 0)
        self.used += float(used or 0)
        self.users.add(str(user))
        self.kinds[str(kind)] = self.kinds.get(str(kind), 0.0) + float(secs or 0)

    def row(self, key: Any) -> dict[str, Any]:
        return {
            "key": key,
            "allocations": self.allocations,
            "slot_seconds": round(self.seconds, 3),
            "slot_hours": round(self.seconds / 3600.0, 4),
            "sampled_slot_seconds": round(self.sampled, 3),
            "used_slot_seconds": round(self.used, 3),
            "used_slot_hours": round(self.used / 3600.0, 4),
            "mean_util_pct": round(self.used / self.sampled * 100.0, 1) if self.sampled else None,
            "users": sorted(self.users),
            "kinds": {k: round(v, 3) for k, v in sorted(self.kinds.items())},
        }


def report(
    table: UsageTable, *, since: float, until: float | None = None, by: str = "user"
) -> dict[str, Any]:
    """The report over the store's allocation records (summed in SQL: `UsageTable.aggregate`;
    10^5 allocations take well under a second)."""
    if by not in BY:
        raise DetLocalError(f"--by {by!r}: expected one of {', '.join(BY)}")
    end_of = time.time() if until is None else until
    groups: dict[Any, _Acc] = {}
    for row in table.aggregate(since, end_of, by):
        groups.setdefault(row[0], _Acc()).add(row)
    total = _Acc()
    for row in table.aggregate(since, end_of, "kind") if by == "slot" else ():
        total.add(row)
    if by != "slot":
        for acc in groups.values():
            total.allocations += acc.allocations
            total.seconds += acc.seconds
            total.sampled += acc.sampled
            total.used += acc.used
            total.users |= acc.users
            for k, v in acc.kinds.items():
                total.kinds[k] = total.kinds.get(k, 0.0) + v
    out = [acc.row(key) for key, acc in groups.items()]
    out.sort(key=lambda r: (-r["slot_seconds"], str(r["key"])))
    return {"since": since, "until": end_of, "by": by, "rows": out, "total": total.row("total")}


def parse_since(text: str, now: float | None = None) -> float:
    """`30d`, `12h`, `90m` before now, or a date `2026-11-01` -> Unix seconds."""
    from det_local.usage.settings import parse_duration

    now = time.time() if now is None else now
    text = text.strip()
    if len(text) == 10 and text[4] == "-" and text[7] == "-":
        import datetime as dt

        try:
            return dt.datetime.strptime(text, "%Y-%m-%d").timestamp()
        except ValueError:
            pass
    try:
        return now - parse_duration(text, where="--since", allow_zero=True)
    except DetLocalError:
        raise DetLocalError(
            f"--since {text!r}: expected how long ago (30d, 12h, 90m) or a date (2026-11-01)"
        ) from None

"""CPU, memory and disk I/O of one job: its cgroup where it has one, else its process tree.

Counters are cumulative (CPU seconds, bytes read and written); :class:`TreeMeter` keeps the
previous reading of each job and turns two into rates: ``cpu_util_pct`` (100 = one core busy),
``read_mb_s``, ``write_mb_s``, with ``rss_mb`` as read now.

* cgroup v2 (``cpu.stat``'s ``usage_usec``; ``memory.stat``'s ``anon``; ``io.stat``): every
  process the job ever started counts, those that have exited too (their CPU time stays in
  the cgroup). Files a hybrid hierarchy lacks (memory, io on v1) fall back to the tree.
* the process tree (psutil): the job's leader and its descendants now; a child that exited
  takes its counters with it (rates are clamped at 0, never negative).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_MB = 1024.0 * 1024.0


@dataclass
class Counters:
    t: float  # time.monotonic() of the reading
    cpu_s: float | None
    rss_mb: float | None
    read_b: float | None
    write_b: float | None
    pids: tuple[int, ...] = ()


def _cgroup_cpu(path: Path) -> float | None:
    try:
        for line in (path / "cpu.stat").read_text().splitlines():
            if line.startswith("usage_usec "):
                return int(line.split()[1]) / 1e6
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_rss(path: Path) -> float | None:
    try:
        for line in (path / "memory.stat").read_text().splitlines():
            if line.startswith("anon "):
                return int(line.split()[1]) / _MB
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_io(path: Path) -> tuple[float, float] | None:
    try:
        text = (path / "io.stat").read_text()
    except OSError:
        return None
    r = w = 0.0
    for line in text.splitlines():
        for part in line.split()[1:]:
            k, _, v = part.partition("=")
            if k == "rbytes":
                r += float(v)
            elif k == "wbytes":
                w += float(v)
    return r, w


def _tree(pid: int) -> list[Any]:
    import psutil

    try:
        leader = psutil.Process(pid)
        return [leader, *leader.children(recursive=True)]
    except (psutil.Error, OSError):
        return []


def read_counters(pid: int | None, cgroup: Path | None) -> Counters:
    """One job's cumulative counters now (None: not readable)."""
    import psutil

    now = time.monotonic()
    cpu = rss = rd = wr = None
    if cgroup is not None and cgroup.is_dir():
        cpu = _cgroup_cpu(cgroup)
        rss = _cgroup_rss(cgroup)
        io = _cgroup_io(cgroup)
        if io is not None:
            rd, wr = io
    procs = _tree(pid) if pid and pid > 0 else []
    if procs and (cpu is None or rss is None or rd is None):
        t_cpu = t_rss = t_rd = t_wr = 0.0
        io_ok = True
        for p in procs:
            try:
                with p.oneshot():
                    ct = p.cpu_times()
                    t_cpu += ct.user + ct.system
                    t_rss += p.memory_info().rss / _MB
                    if io_ok:
                        try:
                            ioc = p.io_counters()
                            t_rd += ioc.read_bytes
                            t_wr += ioc.write_bytes
                        except (psutil.AccessDenied, AttributeError, NotImplementedError):
                            io_ok = False
            except (psutil.Error, OSError):
                continue
        cpu = t_cpu if cpu is None else cpu
        rss = t_rss if rss is None else rss
        if rd is None and io_ok:
            rd, wr = t_rd, t_wr
    return Counters(now, cpu, rss, rd, wr, tuple(p.pid for p in procs))


class TreeMeter:
    """Rates between two readings of each job (keyed by (job id, run id))."""

    def __init__(self) -> None:
        self._last: dict[tuple[int, int], Counters] = {}

    def measure(
        self, key: tuple[int, int], pid: int | None, cgroup: Path | None
    ) -> tuple[dict[str, float], tuple[int, ...]]:
        """(metrics, the pids of its tree) of one job now; the rates need a previous
        reading, so a job's first call gives rss_mb only."""
        c = read_counters(pid, cgroup)
        prev = self._last.get(key)
        self._last[key] = c
        out: dict[str, float] = {}
        if c.rss_mb is not None:
            out["rss_mb"] = round(c.rss_mb, 1)
        if prev is not None:
            dt = c.t - prev.t
            if dt > 0:
                if c.cpu_s is not None and prev.cpu_s is not None:
                    out["cpu_util_pct"] = round(max(0.0, c.cpu_s - prev.cpu_s) / dt * 100.0, 1)
                if c.read_b is not None and prev.read_b is not None:
                    out["read_mb_s"] = round(max(0.0, c.read_b - prev.read_b) / dt / _MB, 3)
                if c.write_b is not None and prev.write_b is not None:
                    out["write_mb_s"] = round(max(0.0, c.write_b - prev.write_b) / dt / _MB, 3)
        return out, c.pids

    def forget(self, keep: set[tuple[int, int]]) -> None:
        for key in [k for k in self._last if k not in keep]:
            del self._last[key]


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1

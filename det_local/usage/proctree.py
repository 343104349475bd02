"""CPU, memory and disk I/O of one job: its cgroup where it has one, else its process tree.

Counters are cumulative (CPU seconds, bytes read and written); :class:`TreeMeter` keeps the
previous reading of each job and turns two into rates: ``cpu_util_pct`` (100 = one core busy),
``read_mb_s``, ``write_mb_s``, with ``rss_mb`` as read now.

* cgroup v2 (``cpu.stat``'s ``usage_usec``; ``memory.stat``'s ``anon``; ``io.stat``): every
  process the job ever started counts, those that have exited too (their CPU time stays in
  the cgroup). Files a hybrid hierarchy lacks (memory, io on v1) fall back to the tree.
* the process tree (/proc: the kernel's children lists, then each process's stat, statm and
  io): the job's leader and its descendants now, with the CPU time of children they reaped; a
  child whose reaper is outside the tree takes its counters with it (rates are clamped at 0).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

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


_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def tree_pids(pid: int) -> list[int]:
    """The process and its descendants, from the kernel's children lists
    (/proc/PID/task/TID/children: no scan of every process on the machine, which a psutil walk
    does once per job)."""
    out: list[int] = []
    stack = [pid]
    seen: set[int] = set()
    while stack:
        p = stack.pop()
        if p in seen:
            continue
        seen.add(p)
        try:
            tasks = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        out.append(p)
        for tid in tasks:
            try:
                with open(f"/proc/{p}/task/{tid}/children", "rb") as f:
                    stack.extend(int(c) for c in f.read().split())
            except (OSError, ValueError):
                continue
    return out


def _proc_counters(pid: int) -> tuple[float, float, float | None, float | None] | None:
    """(CPU seconds with its reaped children's, RSS MiB, bytes read, bytes written) of one
    process from /proc (None: it is gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rpartition(b")")[2].split()
        with open(f"/proc/{pid}/statm", "rb") as f:
            rss_pages = int(f.read().split()[1])
    except (OSError, ValueError, IndexError):
        return None
    # utime stime cutime cstime: a descendant reaped inside the tree is counted once, in its
    # reaper's c-times, so the tree's CPU time does not drop when a child exits
    cpu = sum(int(x) for x in fields[11:15]) / _TICK
    rd = wr = None
    try:
        with open(f"/proc/{pid}/io", "rb") as f:
            for line in f.read().splitlines():
                if line.startswith(b"read_bytes:"):
                    rd = float(line.split()[1])
                elif line.startswith(b"write_bytes:"):
                    wr = float(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return cpu, rss_pages * _PAGE / _MB, rd, wr


def read_counters(pid: int | None, cgroup: Path | None) -> Counters:
    """One job's cumulative counters now (None: not readable)."""
    now = time.monotonic()
    cpu = rss = rd = wr = None
    if cgroup is not None and cgroup.is_dir():
        cpu = _cgroup_cpu(cgroup)
        rss = _cgroup_rss(cgroup)
        io = _cgroup_io(cgroup)
        if io is not None:
            rd, wr = io
    pids = tree_pids(pid) if pid and pid > 0 else []
    if pids and (cpu is None or rss is None or rd is None):
        t_cpu = t_rss = t_rd = t_wr = 0.0
        io_ok = True
        for p in pids:
            c = _proc_counters(p)
            if c is None:
                continue
            t_cpu += c[0]
            t_rss += c[1]
            if c[2] is None or c[3] is None:
                io_ok = False
            else:
                t_rd += c[2]
                t_wr += c[3]
        cpu = t_cpu if cpu is None else cpu
        rss = t_rss if rss is None else rss
        if rd is None and io_ok:
            rd, wr = t_rd, t_wr
    return Counters(now, cpu, rss, rd, wr, tuple(pids))


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

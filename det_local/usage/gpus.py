"""GPU readings for the sampler and `slots`: per device utilisation and memory, and per process
memory (and utilisation where the driver gives it).

Real GPUs: NVML (``nvmlDeviceGetUtilizationRates``, ``nvmlDeviceGetMemoryInfo``,
``nvmlDeviceGetComputeRunningProcesses`` for memory per process, and
``nvmlDeviceGetProcessUtilization`` for utilisation per process where the driver supports it).
NVML is initialised once per :class:`GpuReader` and kept open, so a sample costs a few calls,
not an ``nvmlInit``.

Fake GPUs (``DET_LOCAL_FAKE_GPUS=N``, the hardware edge tests fake): ``DET_LOCAL_FAKE_GPU_USAGE``
names a JSON file the test writes (and rewrites) with what NVML would say::

    {"devices": {"0": {"util": 80, "mem_mb": 4000}},
     "processes": [{"pid": 1234, "slot": 0, "mem_mb": 2000, "util": 75}]}

Devices (and fields) it leaves out read 0 % and 0 MiB; an unreadable file reads as all idle
(it may be half-written: tests replace it atomically).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any

from det_local.sched.queue import hardware as hardware
from det_local.store.states import JobState

log = logging.getLogger(__name__)

FAKE_USAGE_ENV = "DET_LOCAL_FAKE_GPU_USAGE"
_MIB = 1024 * 1024


@dataclass
class GpuReading:
    util_pct: float | None = None
    mem_used_mb: float | None = None
    # pid -> (memory MiB or None, utilisation % or None): the processes NVML lists on it
    procs: dict[int, tuple[float | None, float | None]] = field(default_factory=dict)


def fake_readings(n: int) -> dict[int, GpuReading]:
    """What DET_LOCAL_FAKE_GPU_USAGE scripts for fake GPUs 0..n-1."""
    out = {i: GpuReading(0.0, 0.0) for i in range(n)}
    path = os.environ.get(FAKE_USAGE_ENV, "")
    if not path:
        return out
    try:
        with open(path, "rb") as f:
            data: Any = json.loads(f.read(1 << 20))
    except (OSError, ValueError):
        return out
    if not isinstance(data, dict):
        return out
    devices = data.get("devices") or {}
    if isinstance(devices, dict):
        for key, dev in devices.items():
            try:
                i = int(key)
            except ValueError:
                continue
            if i in out and isinstance(dev, dict):
                out[i].util_pct = _num(dev.get("util")) or 0.0
                out[i].mem_used_mb = _num(dev.get("mem_mb")) or 0.0
    for proc in data.get("processes") or []:
        if not isinstance(proc, dict):
            continue
        slot, pid = proc.get("slot"), proc.get("pid")
        if isinstance(slot, int) and isinstance(pid, int) and slot in out:
            out[slot].procs[pid] = (_num(proc.get("mem_mb")), _num(proc.get("util")))
    return out


def _num(v: Any) -> float | None:
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return float(v)
    return None


class GpuReader:
    """Reads every GPU slot of an inventory; keeps NVML open between reads (close())."""

    def __init__(self, inventory: hardware.Inventory) -> None:
        self.inventory = inventory
        self._nv: Any = None
        self._errors: tuple[type[BaseException], ...] = (OSError,)
        self._handles: dict[int, Any] = {}
        self._per_process_util = True

    def read(self) -> dict[int, GpuReading]:
        inv = self.inventory
        if inv.source == hardware.SOURCE_FAKE:
            return fake_readings(inv.size())
        if inv.source != hardware.SOURCE_NVML:
            return {}
        if self._nv is None and not self._open():
            return {}
        nv, errors = self._nv, self._errors
        out: dict[int, GpuReading] = {}
        for slot in inv.slots:
            handle = self._handles.get(slot.index)
            if handle is None:
                continue
            reading = GpuReading()
            try:
                reading.util_pct = float(nv.nvmlDeviceGetUtilizationRates(handle).gpu)
            except errors:
                pass
            try:
                reading.mem_used_mb = int(nv.nvmlDeviceGetMemoryInfo(handle).used) / _MIB
            except errors:
                pass
            try:
                for p in nv.nvmlDeviceGetComputeRunningProcesses(handle):
                    used = getattr(p, "usedGpuMemory", None)
                    mem = None if not isinstance(used, int) else used / _MIB
                    reading.procs[int(p.pid)] = (mem, None)
            except errors:
                pass
            if self._per_process_util and reading.procs:
                try:
                    for u in nv.nvmlDeviceGetProcessUtilization(handle, 0):
                        pid = int(u.pid)
                        if pid in reading.procs:
                            reading.procs[pid] = (reading.procs[pid][0], float(u.smUtil))
                except errors:
                    self._per_process_util = False  # not supported here: per device only
                except AttributeError:
                    self._per_process_util = False
            out[slot.index] = reading
        return out

    def _open(self) -> bool:
        try:
            import pynvml as nv
        except ImportError:
            return False
        self._errors = hardware._nvml_errors(nv)
        try:
            nv.nvmlInit()
        except self._errors as err:
            log.warning("system metrics: NVML: %s", err)
            return False
        self._nv = nv
        for slot in self.inventory.slots:
            if slot.uuid:
                try:
                    self._handles[slot.index] = nv.nvmlDeviceGetHandleByUUID(slot.uuid)
                except self._errors:
                    pass
        return True

    def close(self) -> None:
        if self._nv is not None:
            try:
                self._nv.nvmlShutdown()
            except self._errors:
                pass
            self._nv = None
            self._handles.clear()


def with_fake_usage(inv: hardware.Inventory) -> hardware.Inventory:
    """Fake GPUs with what DET_LOCAL_FAKE_GPU_USAGE scripts (their utilisation and memory in
    use), as `slots.read_usage` reads real ones; other inventories as they are."""
    if inv.source != hardware.SOURCE_FAKE:
        return inv
    from dataclasses import replace

    readings = fake_readings(inv.size())
    slots = []
    for s in inv.slots:
        r = readings.get(s.index)
        if r is None:
            slots.append(s)
            continue
        slots.append(
            replace(
                s,
                utilization_pct=None if r.util_pct is None else int(r.util_pct),
                memory_used_mb=None if r.mem_used_mb is None else int(r.mem_used_mb),
            )
        )
    return replace(inv, slots=tuple(slots))


def slot_jobs(jobs: Any, idle: Any, now: float) -> dict[int, dict[str, Any]]:
    """slot index -> the job holding it, since when, and whether its slots are idle (from
    the sampler's `job_idle` rows): what `det-local slots` adds to each held slot."""
    out: dict[int, dict[str, Any]] = {}
    for job in jobs:
        if job.state != JobState.SCHEDULED:
            continue
        st = idle.get(job.id)
        idle_since = None if st is None else st.idle_since
        info = {
            "job_id": job.id,
            "job_kind": job.kind,
            "held_since": job.started_at,
            "held_for_s": None if job.started_at is None else round(now - job.started_at, 1),
            "idle_for_s": None if idle_since is None else round(now - idle_since, 1),
            "idle_flagged": bool(st is not None and st.flagged_at is not None),
        }
        for i in job.slots:
            out[int(i)] = info
    return out

"""The daemon's sampler: system metrics of every running job, and idle reservations reclaimed.

An extension of the daemon (`sched/extensions.py`), so it works for anything det-local runs
(trials, commands, notebooks, shells, shares of other machines' gangs), whether or not it
imports determined. Each tick:

1. off the event loop (``asyncio.to_thread``, one at a time): the GPUs (`gpus.GpuReader`, NVML
   kept open) and each due job's cgroup or process tree (`proctree.TreeMeter`);
2. on the loop: one transaction with a ``system_samples`` row per job and its utilisation
   added to its open allocation (`store/tables/usage.py`), then the idle rule below.

A job is sampled every ``system_metrics.interval`` seconds (5 by default); a trial whose config
says ``profiling: {enabled: true}`` every ``profiling_interval`` (1 s). Old samples are merged
into means now and then (`UsageTable.downsample`: full rate for ``keep_full``, then 1-minute,
after a day 10-minute means; at most ``max_rows_per_run`` rows a job).

Idle: a job holding slots whose GPUs all show at most ``idle_threshold`` % (default 5) and
whose processes use under 2 % of a core is idle since the first such sample. Past its
``idle_timeout`` (commands, notebooks, shells that asked for one) it is flagged (daemon log,
``job_idle`` row that `cmd list`, `slots` and the dashboard show) and, where daemon.yaml's
``idle_policy`` for its kind says ``stop``, ended. Trials are never stopped, only flagged (after
`TRIAL_FLAG_S` idle); any activity clears the flag.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from det_local.store.states import JobKind, JobState
from det_local.usage import gpus, proctree
from det_local.usage.settings import IDLE_CPU_PCT, STOP, UsageSettings, load_usage_settings

TRIAL_FLAG_S = 1800.0  # a trial (or a job without idle_timeout) idle this long is flagged
DOWNSAMPLE_EVERY_S = 60.0


@dataclass
class _Due:
    job: Any
    pid: int | None
    cgroup: Path | None


class Sampler:
    """The extension (see the module doc); `view` is the daemon's EngineView."""

    def __init__(self, view: Any, settings: UsageSettings) -> None:
        self.view = view
        self.settings = settings
        self.reader = gpus.GpuReader(view.inventory)
        self.meter = proctree.TreeMeter()
        self.next_due: dict[tuple[int, int], float] = {}
        self.idle_since: dict[int, float] = {}
        self.flagged: set[int] = set()
        self.profiled: dict[int | None, bool] = {}
        self.task: asyncio.Task[None] | None = None
        self.last_downsample = 0.0
        self.cpu_s = 0.0  # CPU time the sampler's reads took (the bench reads it)
        self.ticks = 0
        self.last_error = ""

    async def start(self) -> None:
        for line in self.settings.warnings:
            self.view.log(line)
        if not self.settings.enabled:
            self.view.log("system metrics are off (daemon.yaml system_metrics.enabled: false)")
            return
        for job_id, st in self.view.usage.idle_states().items():
            if st.idle_since is not None:
                self.idle_since[job_id] = float(st.idle_since)
            if st.flagged_at is not None:
                self.flagged.add(job_id)
        self.task = asyncio.create_task(self._run(), name="det-local system metrics")

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self.task
        self.reader.close()

    # ------------------------------------------------------------------ the loop
    def _interval(self, job: Any) -> float:
        if job.kind == JobKind.TRIAL and self._profiling(job):
            return min(self.settings.profiling_interval, self.settings.interval)
        return self.settings.interval

    def _profiling(self, job: Any) -> bool:
        """The trial's config asks for profiling (read once per experiment)."""
        exp = job.experiment_id
        if exp not in self.profiled:
            self.profiled[exp] = bool(self.view.profiling(job))
        return self.profiled[exp]

    async def _run(self) -> None:
        while True:
            try:
                wait = await self.tick()
            except asyncio.CancelledError:
                raise
            except Exception as err:  # a bad reading must not end sampling
                line = f"system metrics: a sample failed: {err!r}"
                if line != self.last_error:  # said once, not every tick
                    self.view.log(line)
                    self.last_error = line
                wait = self.settings.interval
            await asyncio.sleep(wait)

    async def tick(self) -> float:
        """Sample the jobs that are due; returns the seconds until the next is."""
        now = time.monotonic()
        due: list[_Due] = []
        running = [j for j in self.view.active_jobs() if j.state == JobState.SCHEDULED]
        keys = {(j.id, j.run_id) for j in running}
        for key in [k for k in self.next_due if k not in keys]:
            del self.next_due[key]
        self.meter.forget(keys)
        for job in running:
            key = (job.id, job.run_id)
            if self.next_due.get(key, 0.0) <= now:
                self.next_due[key] = now + self._interval(job)
                cg = self.view.cgroup_dir(job)
                due.append(_Due(job, job.pid, Path(cg) if cg else None))
        if due:
            read = await asyncio.to_thread(self._read, due)
            self._record(read)
        wall = time.time()
        if wall - self.last_downsample >= min(DOWNSAMPLE_EVERY_S, self.settings.keep_full):
            self.last_downsample = wall
            self.view.usage.downsample(wall, self.settings.tiers(), self.settings.max_rows_per_run)
        self.ticks += 1
        nxt = min(self.next_due.values(), default=now + self.settings.interval)
        return max(0.05, nxt - time.monotonic())

    # ------------------------------------------------------------------ off the loop
    def _read(self, due: list[_Due]) -> list[tuple[Any, dict[str, float]]]:
        t0 = time.thread_time()
        devices = self.reader.read()
        out = []
        for d in due:
            metrics, pids = self.meter.measure((d.job.id, d.job.run_id), d.pid, d.cgroup)
            metrics.update(_gpu_metrics(d.job.slots, devices, set(pids)))
            out.append((d.job, metrics))
        self.cpu_s += time.thread_time() - t0
        return out

    # ------------------------------------------------------------------ on the loop
    def _record(self, read: list[tuple[Any, dict[str, float]]]) -> None:
        wall = time.time()
        rows = []
        utils = []
        inv = self.view.inventory
        for job, m in read:
            rows.append((job.id, job.run_id, job.trial_id, wall, m))
            u = _utilisation(job, m, inv)
            if u is not None:
                utils.append((job.id, u))
        self.view.record_system(rows, utils)
        for job, m in read:
            self._idle_rule(job, m, wall)

    def _idle_rule(self, job: Any, m: dict[str, float], wall: float) -> None:
        if not job.slots or "cpu_util_pct" not in m:
            return  # no slots to reclaim, or no rate yet (the first sample)
        gpu = [v for k, v in m.items() if k.startswith("slot") and k.endswith("_gpu_util_pct")]
        idle = all(v <= self.settings.idle_threshold for v in gpu) and (
            m["cpu_util_pct"] < IDLE_CPU_PCT
        )
        usage = self.view.usage
        if not idle:
            if job.id in self.idle_since:
                del self.idle_since[job.id]
                self.flagged.discard(job.id)
                usage.set_idle(job.id, None, None, None)
            return
        since = self.idle_since.get(job.id)
        if since is None:
            self.idle_since[job.id] = wall
            usage.set_idle(job.id, wall, None, None)
            return
        if job.id in self.flagged:
            return
        state = usage.idle_states([job.id]).get(job.id)
        timeout = state.timeout if state is not None else None
        limit = TRIAL_FLAG_S if timeout is None else float(timeout)
        if wall - since < limit:
            return
        self.flagged.add(job.id)
        kind = job.kind.lower()
        idle_for = _human(wall - since)
        what = f"{kind} {job.id} ({job.user})"
        if job.kind != JobKind.TRIAL and timeout is not None and self.settings.policy(kind) == STOP:
            why = (
                f"stopped: its slots {job.slots} were idle for {idle_for} "
                f"(idle_timeout {_human(float(timeout))}; idle_policy stop)"
            )
            usage.set_idle(job.id, since, wall, "stopped")
            self.view.log(f"{what} {why}")
            self.view.stop_idle(job, f"{kind} {job.id} {why}")
        else:
            usage.set_idle(job.id, since, wall, "notified")
            self.view.log(
                f"{what} has held slots {job.slots} idle for {idle_for} "
                f"(<= {self.settings.idle_threshold:g}% GPU, no CPU activity)"
            )


def _gpu_metrics(
    slots: list[int], devices: dict[int, gpus.GpuReading], pids: set[int]
) -> dict[str, float]:
    """Per slot gpu_util_pct and gpu_mem_used_mb (the job's processes' where NVML lists
    them, else the device's), and their mean and sum."""
    out: dict[str, float] = {}
    utils: list[float] = []
    mems: list[float] = []
    for i in slots:
        r = devices.get(i)
        if r is None:
            continue
        mine = [v for pid, v in r.procs.items() if pid in pids]
        util = r.util_pct
        mem = r.mem_used_mb
        if mine:
            pm = [v[0] for v in mine if v[0] is not None]
            pu = [v[1] for v in mine if v[1] is not None]
            if pm:
                mem = sum(pm)
            if pu:
                util = min(100.0, sum(pu))
        if util is not None:
            out[f"slot{i}_gpu_util_pct"] = round(util, 1)
            utils.append(util)
        if mem is not None:
            out[f"slot{i}_gpu_mem_used_mb"] = round(mem, 1)
            mems.append(mem)
    if utils:
        out["gpu_util_pct"] = round(sum(utils) / len(utils), 1)
    if mems:
        out["gpu_mem_used_mb"] = round(sum(mems), 1)
    return out


def _utilisation(job: Any, m: dict[str, float], inv: Any) -> float | None:
    """How well the job used its slots in this sample (0-100): its GPUs' mean utilisation;
    on CPU slots its CPU use over the cores its slots stand for."""
    if not job.slots:
        return None
    if "gpu_util_pct" in m:
        return float(m["gpu_util_pct"])
    if inv.source == "cpu" and "cpu_util_pct" in m:
        share = max(1.0, proctree.cores() * len(job.slots) / max(1, inv.size()))
        return min(100.0, m["cpu_util_pct"] / share)
    return None


def _human(secs: float) -> str:
    if secs < 120:
        return f"{secs:.0f}s"
    if secs < 7200:
        return f"{secs / 60:.0f}m"
    return f"{secs / 3600:.1f}h"


def extension(settings: UsageSettings | None = None) -> Any:
    """The daemon's factory (`cli/daemon.py`): settings read (and checked) before it starts."""

    def make(view: Any) -> Sampler:
        return Sampler(view, settings or load_usage_settings(view.paths.settings))

    return make

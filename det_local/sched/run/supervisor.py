"""Process supervision: spawn a job's plan, watch it, reap it, adopt it after a restart.

The supervisor owns the live runs (job id -> the launcher's handle) and nothing else: what a
run's exit means is the engine's (a trial's outcome) or the commands' (a command's status). It
records a run's process in the job table the moment it exists (rule 2 of `sched/run/launcher.py`),
watches it with the launcher's descriptor (a pidfd) on the event loop, or on a bounded tick
where there is none, and hands the exit on only once nothing of the run is left: its slots
stay held until then.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass

from det_local.sched.run.launcher import Launcher, Lost, RunHandle
from det_local.sched.run.launchplan import LaunchPlan
from det_local.store.tables.jobs import JobRecord, JobTable

KILL_GRACE = 10.0  # seconds between SIGTERM and SIGKILL
DRAIN_TICK_S = (0.005, 0.2)  # looking again at a job's cgroup after its leader ended: first, most
DRAIN_WARN_S = 10.0  # a cgroup not empty this long after SIGKILL is worth a line in the log
POLL_TICK_S = 0.05  # without a pidfd (old kernel): how often a run is looked at


@dataclass(frozen=True)
class Exit:
    """A run that is over: its leader's status, and why it could not be trusted."""

    job_id: int
    code: int
    problem: str | None
    lost: str | None = None  # the run ended for its pool's reasons, not the trial's
    unstarted: str | None = None  # its pool refused it (why, in one line): it never ran
    failed: str | None = None  # which of its processes failed first, where its launcher knows


class Supervisor:
    """Live runs of jobs. ``on_exit`` is called once per run, when it is wholly gone."""

    def __init__(
        self,
        launcher: Launcher,
        jobs: JobTable,
        *,
        note: Callable[..., None],
        on_exit: Callable[[Exit], None],
        journal: Callable[[str], None] | None = None,
    ) -> None:
        """journal: the daemon's log, for a line per job start (`sched/run/joblog.py`)."""
        self.launcher = launcher
        self.jobs = jobs
        self.note = note
        self.on_exit = on_exit
        self.journal = journal
        self.procs: dict[int, RunHandle] = {}  # job id -> live run
        self._pids: dict[int, int] = {}  # job id -> the pid recorded for its run
        self._waits: dict[int, str] = {}  # job id -> why its run waits in its pool's queue
        self.kill_grace = KILL_GRACE
        self.loop: asyncio.AbstractEventLoop | None = None

    def __contains__(self, job_id: int) -> bool:
        return job_id in self.procs

    def __bool__(self) -> bool:
        return bool(self.procs)

    def our_pids(self) -> list[int]:
        return [pid for p in self.procs.values() for pid in self.launcher.pids(p)]

    # ------------------------------------------------------------------ spawn and watch
    def spawn(self, job: JobRecord, plan: LaunchPlan) -> RunHandle:
        """Spawn and watch a job's run, its process recorded; TrialError when it cannot start."""
        job = self.jobs.peek(job.id)  # as allocated: its run id
        proc = self.launcher.spawn(job, plan)
        self.jobs.set_process(job.id, proc.pid, proc.started or time.time())
        self._watch(proc)
        if self.journal is not None:
            from det_local.sched.run.joblog import started

            self.journal(started(job, proc.pid))
        return proc

    def _watch(self, proc: RunHandle) -> None:
        self.procs[proc.job_id] = proc
        self._pids[proc.job_id] = proc.pid
        assert self.loop is not None
        fd = self.launcher.wait_fd(proc)
        if fd is not None:
            self.loop.add_reader(fd, self._on_leader_exit, proc.job_id)
        else:  # no pidfd (old kernel): a bounded supervision tick
            self.loop.call_later(POLL_TICK_S, self._tick, proc.job_id)

    def _tick(self, job_id: int) -> None:
        proc = self.procs.get(job_id)
        if proc is None:
            return
        code = self.launcher.poll(proc)
        if proc.pid != self._pids.get(job_id):  # known only now (a pool's queued submission)
            self._pids[job_id] = proc.pid
            self.jobs.set_process(job_id, proc.pid, proc.started or time.time())
        self._record_wait(job_id, None if code is not None else getattr(proc, "waiting", None))
        if code is not None:
            self._on_leader_exit(job_id)
        else:
            assert self.loop is not None
            self.loop.call_later(POLL_TICK_S, self._tick, job_id)

    def _record_wait(self, job_id: int, reason: str | None) -> None:
        """A pool's run still in that pool's queue (`waiting`: Slurm's PENDING reason):
        recorded when it changes, so `job list` shows it; gone once it runs or ends."""
        if reason == self._waits.get(job_id):
            return
        if reason is None:
            del self._waits[job_id]
        else:
            self._waits[job_id] = reason
        self.jobs.set_waiting(job_id, reason)

    def _on_leader_exit(self, job_id: int) -> None:
        proc = self.procs.get(job_id)
        if proc is None or proc.code is not None:
            return  # gone, or its leader has ended and the rest of it is being killed
        fd = self.launcher.wait_fd(proc)
        code = self.launcher.poll(proc)
        if code is None:
            return  # spurious wakeup
        proc.code = code
        assert self.loop is not None
        if fd is not None:
            self.loop.remove_reader(fd)
        self._reap(job_id, time.monotonic(), DRAIN_TICK_S[0])

    def _reap(self, job_id: int, since: float, delay: float) -> None:
        """The job's leader has ended: no orphans, the rest of it goes too (its whole cgroup,
        escaped processes included). Its slots stay held until its cgroup is empty."""
        proc = self.procs.get(job_id)
        if proc is None or proc.code is None:
            return
        if not self.launcher.drain(proc):
            assert self.loop is not None
            if since and time.monotonic() - since > DRAIN_WARN_S:
                self.note(
                    f"job {job_id}: processes of {self.launcher.where(proc)} "
                    f"are still there {DRAIN_WARN_S:.0f}s after SIGKILL (uninterruptible?); "
                    "its slots stay held until they are gone",
                    level="WARNING",
                )
                since = 0.0
            self.loop.call_later(delay, self._reap, job_id, since, min(delay * 2, DRAIN_TICK_S[1]))
            return
        del self.procs[job_id]
        self._pids.pop(job_id, None)
        self._record_wait(job_id, None)
        self.launcher.release(proc)
        if proc.problem is not None:
            self.note(f"job {job_id}: {proc.problem}", level="WARNING")
        self.on_exit(
            Exit(
                job_id,
                proc.code,
                proc.problem,
                getattr(proc, "lost", None),
                getattr(proc, "unstarted", None),
                getattr(proc, "failed", None),
            )
        )

    # ------------------------------------------------------------------ signals
    def signal(self, job_id: int, pid: int | None, sig: int) -> None:
        """sig to every process of the job's run (its process group when it is not watched)."""
        self.launcher.signal(self.procs.get(job_id), pid, sig)

    def terminate(self, job_id: int, pid: int | None) -> None:
        """SIGTERM the job's run (its cgroup, else its group), then SIGKILL after the grace
        period if that same run is still there.

        The SIGKILL is bound to the run signalled now (its handle), never to the job id: a
        run that ends within the grace period and whose job is started again (a requeued
        trial, a gang share re-run under the same job) leaves the new run alone."""
        proc = self.procs.get(job_id)
        if not pid and proc is None:
            return  # None, or 0: a run without a process (a gang owner that runs no ranks)
        self.signal(job_id, pid, signal.SIGTERM)
        if proc is None:
            return  # not watched: nothing of it to follow up
        assert self.loop is not None
        self.loop.call_later(self.kill_grace, self._kill_if_live, proc, pid)

    def _kill_if_live(self, proc: RunHandle, pid: int | None) -> None:
        """The grace period of a terminated run is over: SIGKILL it if it is still the live
        run of its job (not reaped yet); a later run of the same job is another handle."""
        if self.procs.get(proc.job_id) is proc:
            self.launcher.signal(proc, pid, signal.SIGKILL)

    def queued(self, job_id: int) -> str | None:
        """Where the job's run waits when it has not started yet (a pool's job still in its
        queue: nothing there to checkpoint); None when it runs, or is not watched."""
        proc = self.procs.get(job_id)
        if proc is None or not getattr(proc, "queued", False):
            return None
        return self.launcher.where(proc)

    # ------------------------------------------------------------------ restart
    def adopt(self, job: JobRecord) -> tuple[JobRecord, RunHandle | Lost]:
        """A job recorded as running, after a restart: its live run, watched from now on, or
        what is known of its end. The job as recorded now (a leader found only now is
        recorded first)."""
        found = self.launcher.adopt(job)
        pid = found.pid
        started = found.started
        if pid is not None and pid != job.pid and started is not None:
            self.jobs.set_process(job.id, pid, started)
            job = self.jobs.get(job.id)
        if not isinstance(found, Lost):
            self._watch(found)
        return job, found

    def run_key(self, job: JobRecord) -> str:
        return self.launcher.run_key(job)

    def cleanup(self, live: set[str]) -> None:
        self.launcher.cleanup(live)

"""The launcher seam: how a run's plan becomes processes, and how they are found again.

`sched/run/supervisor.py` supervises runs only through :class:`Launcher`. :class:`LocalLauncher`
is this machine's (`sched/run/executor.py` for processes, `sched/run/cgroups.py` for containment);
federation adds one that launches on another node, with the same rules.

Rules of a :class:`Launcher`:

1. **Plan, then act.** ``spawn(job, plan)`` carries out a
:class:`~det_local.sched.run.launchplan.LaunchPlan`
   and nothing else: its argv, as its user (``plan.uid``), in its cwd, with exactly its env
   and umask, output to its log. It is called only once the job's allocation (slots, run id)
   is committed, and it never touches the store.
2. **Started or not at all.** ``spawn`` returns once the run's leader exists, with its
   ``pid`` and start time (``started``), which the caller records at once (so a restart can
   tell it from a reused pid); or it raises :class:`~det_local.errors.TrialError` (one line)
   having left nothing running and nothing held.
3. **Every process of the run, none other.** ``signal(handle, pid, sig)`` reaches every
   process the run started (those that left its session too, where containment allows);
   with no handle (a run this engine does not watch) the process group ``pid`` leads.
4. **Exit status.** ``poll(handle)`` is None while the leader runs, then its status (negative:
   the signal that killed it). For a run adopted after a restart the status comes from a
   trusted record; -9 when there is none (``handle.problem`` says why when a record was
   refused). ``wait_fd(handle)`` is a descriptor that becomes readable when the leader ends,
   or None: the caller then polls on a bounded tick.
5. **No orphans.** Once the leader ended, ``drain(handle)`` kills what is left of the run;
   True when nothing is left. The run's slots stay held until then. ``release(handle)``
   frees what the launcher holds for the run (descriptors, cgroups); called once, last.
6. **Adopt after a restart.** ``adopt(job)`` for a job recorded as running: a live run is
   returned as a handle, watched like a spawned one; a dead one as :class:`Lost` (its exit
   status when known, whether it was started at all), with what it left killed first.
   ``adopt`` never starts anything. ``cleanup(live)`` then removes what runs that are not in
   ``live`` (their :meth:`run_key`) left behind.
7. **Per experiment.** ``experiment_stopped(id)``: no run of that experiment runs now (it
   ended or paused); what the launcher keeps for it (a zygote, `sched/warm/zygotes.py`) goes.
8. **Bounded.** No method blocks for long: the engine's event loop runs them.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from det_local.errors import TrialError
from det_local.sched.queue import hardware as hardware
from det_local.sched.run import cgroups, executor
from det_local.sched.run.launchplan import LaunchPlan
from det_local.sched.warm import zygotes
from det_local.store.paths import Paths
from det_local.store.tables.jobs import JobRecord

RECOVER_DRAIN_S = 2.0  # at a restart: how long to wait for a dead job's leftovers to die


class RunHandle(Protocol):
    """A launched run, as the supervisor sees it."""

    job_id: int
    pid: int
    started: float | None
    code: int | None  # the leader's exit status, once the supervisor has seen it end
    problem: str | None  # why the exit status could not be trusted


@dataclass(frozen=True)
class Lost:
    """A run recorded as running that is gone (found at a restart)."""

    code: int | None  # its exit status; None when unknown
    spawned: bool  # False: it never started (allocated, then the engine stopped)
    problem: str | None = None  # why its exit record was refused
    pid: int | None = None  # its leader, found now when the job had none recorded
    started: float | None = None
    at_once: bool = False  # found dead while being adopted: settle it before the others


class Launcher(Protocol):
    """Spawn a plan, signal it, read its exit status, adopt it after a restart (rules in the
    module doc)."""

    def start(self) -> None: ...

    def stop(self) -> None: ...

    def spawn(self, job: JobRecord, plan: LaunchPlan) -> RunHandle: ...

    def wait_fd(self, handle: RunHandle) -> int | None: ...

    def poll(self, handle: RunHandle) -> int | None: ...

    def signal(self, handle: RunHandle | None, pid: int | None, sig: int) -> None: ...

    def drain(self, handle: RunHandle) -> bool: ...

    def release(self, handle: RunHandle) -> None: ...

    def pids(self, handle: RunHandle) -> list[int]: ...

    def adopt(self, job: JobRecord) -> RunHandle | Lost: ...

    def run_key(self, job: JobRecord) -> str: ...

    def cleanup(self, live: set[str]) -> None: ...

    def experiment_stopped(self, experiment_id: int) -> None: ...

    def where(self, handle: RunHandle) -> str: ...


class LocalLauncher:
    """Runs on this machine: a wrapper process per run (`executor`), in a cgroup of its own
    where cgroups are available (`cgroups`), GPU-fenced to its own slots."""

    def __init__(
        self,
        paths: Paths,
        inventory: hardware.Inventory,
        cgroup_setting: str,
        note: Callable[..., None],
    ) -> None:
        self.paths = paths
        self.inventory = inventory
        self.cgroup_setting = cgroup_setting
        self.note = note
        # how jobs are contained: detected at start (it creates this home's cgroup subtree)
        self.containment = cgroups.Containment(cgroups.OFF, "the engine has not started")
        # warm starts (`sched/warm/zygotes.py`): None when the daemon's switch turns them off
        self.zygotes = (
            zygotes.ZygotePool(paths, note, self._zygote_cgroup)
            if zygotes.daemon_enabled()
            else None
        )

    def start(self) -> None:
        self.containment = cgroups.detect(self.paths.home, self.cgroup_setting)

    def stop(self) -> None:
        if self.zygotes is not None:
            self.zygotes.stop_all()
        self.containment.remove_base()  # when no job runs on in it

    # ------------------------------------------------------------------ rules 1, 2
    def spawn(self, job: JobRecord, plan: LaunchPlan) -> executor.JobProc:
        exit_file = self.paths.job_exit_file(job.id, job.run_id)
        try:
            cgroup = (
                self.containment.create(job.id, job.run_id, self._fenced_minors(plan.slots))
                if self._contains(plan)
                else None
            )
        except OSError as err:
            raise TrialError(
                f"could not create its cgroup under {self.containment.base}: {err.strerror}; "
                "`det-local daemon status` shows the containment mode (cgroups: false in "
                "daemon.yaml turns it off)"
            ) from None
        legacy = self.paths.legacy_job_exit_file(job.id, job.run_id)
        try:
            warm = self._fork(job, plan, exit_file, legacy, cgroup)
            if warm is not None:
                return warm
            proc = executor.spawn(
                job.id,
                plan,
                exit_file,
                cgroup=cgroup,
                legacy_exit_file=legacy,
            )
        except BaseException:
            if cgroup is not None:
                cgroup.remove()
            raise
        proc.started = executor.start_time(proc.pid) or time.time()
        return proc

    def _fork(
        self,
        job: JobRecord,
        plan: LaunchPlan,
        exit_file: Path,
        legacy: Path,
        cgroup: cgroups.JobCgroup | None,
    ) -> executor.JobProc | None:
        """The run forked from its experiment's zygote (a warm start); None: spawn it cold."""
        if self.zygotes is None or job.trial_id is None:
            return None
        spec = zygotes.warm_spec(plan)
        if isinstance(spec, zygotes.Cold):
            if job.experiment_id is not None:
                self.zygotes.cold(job.experiment_id, spec)
            return None
        return self.zygotes.fork(job.id, plan, spec, exit_file, legacy, cgroup)

    def _zygote_cgroup(self, plan: LaunchPlan, name: str) -> cgroups.JobCgroup | None:
        """A zygote's own cgroup, where its trial would get one: visible, killable, and denied
        every GPU (it must not touch one; its trials are moved into their jobs' cgroups)."""
        if not self._contains(plan):
            return None
        return self.containment.create_named(f"zygote-{name}", self._fenced_minors([]))

    def _contains(self, plan: LaunchPlan) -> bool:
        """Whether this run gets a cgroup: with `cgroups: auto`, a run that crosses a trust
        boundary (a root daemon running it as another user); with `v2`/`v1` set, every run.
        The daemon's own user's runs (root's, in system mode) are left out under auto: moving a
        process into a cgroup waits for an RCU grace period (~9 ms per start on this kernel),
        and a user-mode daemon (not root) contains nothing anyway."""
        if self.cgroup_setting != "auto":
            return True
        return plan.uid is not None and plan.uid != os.geteuid()

    def _fenced_minors(self, slots: list[int]) -> list[int]:
        """The GPU device minors a job on these slots must not open (GPU fencing): every GPU
        of this machine that is not its own; none where a GPU's device node is unknown."""
        inv = self.inventory
        if self.containment.devices is None or inv.source == "cpu":
            return []
        minors = {s.minor for s in inv.slots}
        if None in minors:
            return []
        own = {inv.slots[i].minor for i in slots}
        every = {m for m in minors if m is not None} | set(self.containment.gpu_minors)
        return sorted(every - own)

    # ------------------------------------------------------------------ rules 3, 4, 5
    def wait_fd(self, handle: RunHandle) -> int | None:
        assert isinstance(handle, executor.JobProc)
        return handle.pidfd

    def poll(self, handle: RunHandle) -> int | None:
        assert isinstance(handle, executor.JobProc)
        return executor.exit_code(handle)

    def signal(self, handle: RunHandle | None, pid: int | None, sig: int) -> None:
        assert handle is None or isinstance(handle, executor.JobProc)
        executor.signal_job(handle, pid, sig)

    def drain(self, handle: RunHandle) -> bool:
        assert isinstance(handle, executor.JobProc)
        executor.close(handle)
        return executor.kill_rest(handle)

    def release(self, handle: RunHandle) -> None:
        assert isinstance(handle, executor.JobProc)
        executor.close(handle)
        executor.release(handle)

    def pids(self, handle: RunHandle) -> list[int]:
        assert isinstance(handle, executor.JobProc)
        # with cgroups: those that left the run's session too
        return [handle.pid] + (handle.cgroup.pids() if handle.cgroup is not None else [])

    def where(self, handle: RunHandle) -> str:
        assert isinstance(handle, executor.JobProc)
        return f"its cgroup {handle.cgroup and handle.cgroup.path}"

    # ------------------------------------------------------------------ rule 6
    def run_key(self, job: JobRecord) -> str:
        return f"job-{job.id}-{job.run_id}"

    def adopt(self, job: JobRecord) -> executor.JobProc | Lost:
        exit_file = self.paths.job_exit_file(job.id, job.run_id)
        legacy = self.paths.legacy_job_exit_file(job.id, job.run_id)
        pid, started = job.pid, job.pid_start
        spawned = pid is not None
        if not spawned:  # allocated; maybe spawned just before a crash, pid unrecorded
            found = executor.find_wrapper(exit_file, legacy)
            at = executor.start_time(found) if found is not None else None
            if found is not None and at is not None:
                pid, started = found, at
            # the wrapper of this run (exit files are removed before a spawn) ran, or ran out
            spawned = pid is not None or os.path.lexists(exit_file) or os.path.lexists(legacy)
        found_pid = pid if pid != job.pid else None
        found_at = started if found_pid is not None else None
        cgroup = self.containment.job(job.id, job.run_id)
        if pid is not None and executor.is_same_process(pid, started):
            proc = executor.adopt(
                job.id,
                pid,
                exit_file,
                cgroup=cgroup if cgroup is not None and cgroup.exists() else None,
                legacy_exit_file=legacy,
                uid=job.uid,
            )
            if proc is not None:
                proc.started = started
                return proc
            self._drain_now(cgroup)
            return Lost(None, True, None, found_pid, found_at, at_once=True)
        # its leader is gone: so goes whatever it left in its cgroup, before its slots do
        self._drain_now(cgroup)
        code, problem = (
            executor.exit_status(exit_file, legacy, job.uid) if spawned else (None, None)
        )
        return Lost(code, spawned, problem, found_pid, found_at)

    def experiment_stopped(self, experiment_id: int) -> None:
        if self.zygotes is not None:
            self.zygotes.stop(experiment_id)

    def cleanup(self, live: set[str]) -> None:
        for cgroup in self.containment.leftovers(keep=live):  # runs that ended meanwhile
            self._drain_now(cgroup)
        # an earlier daemon's zygotes: empty ones go; one still recording the exit status of
        # a trial it forked stays until that trial ends (it exits then; the next restart or
        # the engine's stop removes its cgroup)
        for cgroup in self.containment.leftovers(keep=set(), prefix="zygote-"):
            cgroup.remove()

    def _drain_now(self, cgroup: cgroups.JobCgroup | None) -> None:
        """At a restart: SIGKILL what is left in a cgroup whose job is over, wait (a bounded
        time) until it is empty, remove it."""
        if cgroup is None or not cgroup.exists():
            return
        deadline = time.monotonic() + RECOVER_DRAIN_S
        while cgroup.populated():
            cgroup.kill()
            if time.monotonic() > deadline:
                self.note(
                    f"cgroup {cgroup.path} still holds processes after SIGKILL "
                    "(uninterruptible?); left in place",
                    level="WARNING",
                )
                return
            time.sleep(0.01)
        cgroup.remove()

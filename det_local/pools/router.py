"""The pool seam: one :class:`~det_local.sched.run.launcher.Launcher` that hands each run to its
pool's launcher (this machine's, or a Slurm pool's), so the supervisor and the engine see one
launcher and no pool's details.

A run's pool is its experiment's `resources.resource_pool` (``pool_of``), read when it is
spawned or adopted; its handle remembers which launcher has it.

A pool removed from daemon.yaml while its jobs ran (the daemon restarted without it): a job it
had submitted is adopted by its recorded id (``removed(name)``: a launcher that can watch and
cancel it, not submit) and followed to its end, so the work it does still counts; a run of that
pool that must start (a new trial, a requeue, an activate) is refused in one line naming the
missing pool, and the trial ERRORs.
"""

from __future__ import annotations

from collections.abc import Callable

from det_local.errors import TrialError
from det_local.sched.run.launcher import Launcher, Lost, RunHandle
from det_local.sched.run.launchplan import LaunchPlan
from det_local.store.tables.jobs import JobRecord


class PoolLauncher:
    def __init__(
        self,
        local: Launcher,
        backends: dict[str, Launcher],
        pool_of: Callable[[JobRecord], str],
        removed: Callable[[str], Launcher] | None = None,
        note: Callable[..., None] = lambda *a, **k: None,
        source: str = "daemon.yaml",
    ) -> None:
        self.local = local
        self.backends = backends
        self.pool_of = pool_of
        self.removed = removed
        self.note = note
        self.source = source
        self._removed: dict[str, Launcher] = {}  # pool name -> its jobs' launcher, once adopted
        self._owner: dict[int, Launcher] = {}  # job id -> the launcher of its live run
        self._by_pid: dict[int, Launcher] = {}  # a pool's run id (Slurm's job id) -> its pool

    def __getattr__(self, name: str) -> object:  # containment, zygotes: the local launcher's
        return getattr(self.local, name)

    def _for_job(self, job: JobRecord) -> Launcher:
        pool = self.pool_of(job)
        if pool in ("", "default"):
            return self.local
        launcher = self.backends.get(pool)
        if launcher is None:  # daemon.yaml lost the pool while its jobs were queued or ran
            raise TrialError(self.missing(pool))
        return launcher

    def missing(self, pool: str) -> str:
        return (
            f"resource pool '{pool}' is not in {self.source} any more; pools: "
            f"{', '.join(['default', *sorted(self.backends)])} (put it back under "
            "resource_pools: to run there again)"
        )

    def _of(self, handle: RunHandle | None, pid: int | None = None) -> Launcher:
        if handle is None:  # a run not watched: a pool's, by its id there, else this machine's
            return self._by_pid.get(pid or 0, self.local)
        return self._owner.get(handle.job_id, self.local)

    def _own(self, job_id: int, launcher: Launcher, handle: RunHandle) -> None:
        self._owner[job_id] = launcher
        if launcher is not self.local:
            self._by_pid[handle.pid] = launcher

    def _all(self) -> list[Launcher]:
        return [self.local, *self.backends.values(), *self._removed.values()]

    def start(self) -> None:
        for launcher in self._all():
            launcher.start()

    def stop(self) -> None:
        for launcher in self._all():
            launcher.stop()

    def spawn(self, job: JobRecord, plan: LaunchPlan) -> RunHandle:
        launcher = self._for_job(job)
        handle = launcher.spawn(job, plan)
        self._own(job.id, launcher, handle)
        return handle

    def wait_fd(self, handle: RunHandle) -> int | None:
        return self._of(handle).wait_fd(handle)

    def poll(self, handle: RunHandle) -> int | None:
        return self._of(handle).poll(handle)

    def signal(self, handle: RunHandle | None, pid: int | None, sig: int) -> None:
        self._of(handle, pid).signal(handle, pid, sig)

    def drain(self, handle: RunHandle) -> bool:
        return self._of(handle).drain(handle)

    def release(self, handle: RunHandle) -> None:
        self._of(handle).release(handle)
        if self._owner.pop(handle.job_id, self.local) is not self.local:
            self._by_pid.pop(handle.pid, None)

    def pids(self, handle: RunHandle) -> list[int]:
        return self._of(handle).pids(handle)

    def adopt(self, job: JobRecord) -> RunHandle | Lost:
        try:
            launcher = self._for_job(job)
        except TrialError as err:
            pool = self.pool_of(job)
            if not job.pid or self.removed is None:  # never submitted: queued again, refused
                return Lost(None, False, str(err))
            launcher = self._removed.get(pool) or self.removed(pool)
            if pool not in self._removed:
                self._removed[pool] = launcher
                launcher.start()
            self.note(
                f"job {job.id}: {self.missing(pool)}; its Slurm job {job.pid} is followed "
                "to its end by its id, and the trial cannot be queued there again",
                experiment_id=job.experiment_id,
                trial_id=job.trial_id,
                level="WARNING",
            )
        found = launcher.adopt(job)
        if not isinstance(found, Lost):
            self._own(job.id, launcher, found)
        return found

    def run_key(self, job: JobRecord) -> str:
        return self._owner.get(job.id, self.local).run_key(job)

    def cleanup(self, live: set[str]) -> None:
        for launcher in self._all():
            launcher.cleanup(live)

    def experiment_stopped(self, experiment_id: int) -> None:
        for launcher in self._all():
            launcher.experiment_stopped(experiment_id)

    def where(self, handle: RunHandle) -> str:
        return self._of(handle).where(handle)

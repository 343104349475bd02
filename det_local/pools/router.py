"""The pool seam: one :class:`~det_local.sched.run.launcher.Launcher` that hands each run to its
pool's launcher (this machine's, or a Slurm pool's), so the supervisor and the engine see one
launcher and no pool's details.

A run's pool is its experiment's `resources.resource_pool` (``pool_of``), read when it is
spawned or adopted; its handle remembers which launcher has it.
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
    ) -> None:
        self.local = local
        self.backends = backends
        self.pool_of = pool_of
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
            raise TrialError(
                f"resource pool '{pool}' is not in daemon.yaml any more; pools: "
                f"{', '.join(['default', *sorted(self.backends)])}"
            )
        return launcher

    def _of(self, handle: RunHandle | None, pid: int | None = None) -> Launcher:
        if handle is None:  # a run not watched: a pool's, by its id there, else this machine's
            return self._by_pid.get(pid or 0, self.local)
        return self._owner.get(handle.job_id, self.local)

    def _own(self, job_id: int, launcher: Launcher, handle: RunHandle) -> None:
        self._owner[job_id] = launcher
        if launcher is not self.local:
            self._by_pid[handle.pid] = launcher

    def _all(self) -> list[Launcher]:
        return [self.local, *self.backends.values()]

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
        except TrialError as err:  # nothing of it can be looked at: run it again, or refuse
            return Lost(None, True, str(err))
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

"""The pool seam: one :class:`~det_local.sched.launcher.Launcher` that hands each run to its
pool's launcher (this machine's, or a Slurm pool's), so the supervisor and the engine see one
launcher and no pool's details.

A run's pool is its experiment's `resources.resource_pool` (``pool_of``), read when it is
spawned or adopted; its handle remembers which launcher has it.
"""

from __future__ import annotations

from collections.abc import Callable

from det_local.sched.launcher import Launcher, Lost, RunHandle
from det_local.sched.plan import LaunchPlan
from det_local.store.jobs import JobRecord


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

    def __getattr__(self, name: str) -> object:  # containment, zygotes: the local launcher's
        return getattr(self.local, name)

    def _for_job(self, job: JobRecord) -> Launcher:
        pool = self.pool_of(job) if job.trial_id is not None else ""  # commands: here
        return self.backends.get(pool, self.local)

    def _of(self, handle: RunHandle | None) -> Launcher:
        if handle is None:
            return self.local
        return self._owner.get(handle.job_id, self.local)

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
        self._owner[job.id] = launcher
        return handle

    def wait_fd(self, handle: RunHandle) -> int | None:
        return self._of(handle).wait_fd(handle)

    def poll(self, handle: RunHandle) -> int | None:
        return self._of(handle).poll(handle)

    def signal(self, handle: RunHandle | None, pid: int | None, sig: int) -> None:
        self._of(handle).signal(handle, pid, sig)

    def drain(self, handle: RunHandle) -> bool:
        return self._of(handle).drain(handle)

    def release(self, handle: RunHandle) -> None:
        self._of(handle).release(handle)
        self._owner.pop(handle.job_id, None)

    def pids(self, handle: RunHandle) -> list[int]:
        return self._of(handle).pids(handle)

    def adopt(self, job: JobRecord) -> RunHandle | Lost:
        launcher = self._for_job(job)
        found = launcher.adopt(job)
        if not isinstance(found, Lost):
            self._owner[job.id] = launcher
        return found

    def run_key(self, job: JobRecord) -> str:
        return self._for_job(job).run_key(job)

    def cleanup(self, live: set[str]) -> None:
        for launcher in self._all():
            launcher.cleanup(live)

    def experiment_stopped(self, experiment_id: int) -> None:
        for launcher in self._all():
            launcher.experiment_stopped(experiment_id)

    def where(self, handle: RunHandle) -> str:
        return self._of(handle).where(handle)

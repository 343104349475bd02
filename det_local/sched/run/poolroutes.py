"""Which resource pool a job runs in, as the pool router (`pools/router.py`) asks when a
supervisor routes a run: a trial's is its experiment's `resources.resource_pool`, a command's
is `cmd run --pool`'s (`store/tables/pools.py`'s `job_pools`)."""

from __future__ import annotations

from det_local.pools import Pools
from det_local.store.db import Store
from det_local.store.tables.jobs import JobRecord


class PoolRoutes:
    """A job's pool and the slots a command asked of it; experiments' pools are cached (an
    experiment's config does not change)."""

    def __init__(self, store: Store, pools: Pools) -> None:
        self.store = store
        self.pools = pools
        self._pools_of: dict[int, str] = {}  # experiment id -> its pool

    def pool_of_job(self, job: JobRecord) -> str:
        """The resource pool of a job's experiment (the pool router asks)."""
        exp_id = job.experiment_id
        if exp_id is None:  # a command: `cmd run --pool`
            row = self.store.job_pools.get(job.id)
            return "" if row is None else row[0]
        if exp_id not in self._pools_of:
            config = self.store.get_experiment(exp_id).config
            self._pools_of[exp_id] = self.pools.pool_of_config(config)
        return self._pools_of[exp_id]

    def pool_slots(self, job: JobRecord) -> int | None:
        """The slots a command asked of its pool (None: a trial's come from its config)."""
        row = self.store.job_pools.get(job.id) if job.experiment_id is None else None
        return None if row is None else row[1]

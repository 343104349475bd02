"""The job queue in the order the scheduler goes by: what `job list` numbers and the
dashboard's queue page shows."""

from __future__ import annotations

from typing import Any


def in_queue_order(jobs: list[Any], paths: Any) -> list[Any]:
    """The order the scheduler goes by (what # means): running jobs, then the queue as the
    policy considers it (priority mode: priority, then submission order; fair share:
    interleaved by user), then, with --all, ended jobs."""
    from det_local.errors import DetLocalError
    from det_local.sched.queue.policy import JobView, PolicyConfig, RunningJob, queue_order
    from det_local.sched.settings import load_settings
    from det_local.store.states import JobState

    try:
        settings = load_settings(paths.settings)
        cfg = PolicyConfig(mode=settings.mode, user_weight=settings.user_weight)
    except DetLocalError:
        cfg = PolicyConfig()

    def view(j: Any) -> JobView:
        return JobView(j.id, j.user, j.priority, j.position, j.slots_needed)

    def key(j: Any) -> tuple[int, float, int]:
        return (j.priority, j.position, j.id)

    running = sorted((j for j in jobs if j.state == JobState.SCHEDULED), key=key)
    queued = {j.id: j for j in jobs if j.state == JobState.QUEUED}
    ended = sorted((j for j in jobs if not JobState(j.state).active), key=lambda j: j.id)
    running_views = [RunningJob(view(j), tuple(j.slots)) for j in running]
    order = queue_order([view(j) for j in queued.values()], cfg, running_views)
    return running + [queued[v.id] for v in order] + ended

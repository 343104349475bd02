"""The job queue and the scheduling pass: what waits, what starts, who is asked to preempt.

The policy itself (who goes first, who is preempted) is `sched/queue/policy.py`, a pure function
over views; this component builds those views from the job table and the slot inventory
(`sched/queue/inventory.py`), commits each start's allocation (slots, run id) before handing the job
to its starter, and asks the engine to preempt the victims. Passes are event-driven (a
submission, an exit, a queue change); re-entrant requests for a pass are folded into one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Protocol

from det_local.errors import DetLocalError, StateError
from det_local.sched.queue.inventory import LocalInventory
from det_local.sched.queue.policy import JobView, PolicyConfig, RunningJob, SortedQueue, schedule
from det_local.sched.settings import DaemonSettings
from det_local.store.states import JobKind
from det_local.store.tables.jobs import QUEUED, SCHEDULED, JobRecord, JobTable

# commands of these kinds are started by `shell start`, `notebook start`, `tensorboard start`
PRIORITY_MIN, PRIORITY_MAX = 1, 99
FOREIGN_RECHECK_S = 2.0  # how often GPUs held by foreign processes are looked at while jobs wait


def check_priority(priority: int) -> int:
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise DetLocalError(f"priority must be a whole number from 1 to 99, found {priority!r}")
    if not PRIORITY_MIN <= priority <= PRIORITY_MAX:
        raise DetLocalError(
            f"priority {priority} is outside 1-99 (1 is the most important, 42 the default)"
        )
    return priority


class Starter(Protocol):
    """Who carries out a start: the job's allocation is committed before it is called."""

    def start_trial(self, job: JobRecord, slots: list[int], run_id: int) -> None: ...

    def start_command(self, job: JobRecord) -> None: ...

    def preempt_trial(self, job: JobRecord) -> bool: ...  # False: it has no live run

    def start_gang_share(self, job: JobRecord) -> None: ...  # RESERVED: the placer goes on


def view(job: JobRecord) -> JobView:
    return JobView(
        id=job.id,
        user=job.user,
        priority=job.priority,
        position=job.position,
        slots=job.slots_needed,
        group=f"exp:{job.experiment_id}" if job.experiment_id is not None else None,
        preemptible=job.kind == JobKind.TRIAL or job.gang is not None,
    )


class JobQueue:
    def __init__(
        self,
        jobs: JobTable,
        next_trial_run: Callable[[int], int],
        inventory: LocalInventory,
        settings: DaemonSettings,
        starter: Starter,
        *,
        offline: bool,
        group_caps: Callable[[], dict[str, int]],
        after_pass: Callable[[], None],
    ) -> None:
        self.jobs = jobs
        self.next_trial_run = next_trial_run
        self.inventory = inventory
        self.settings = settings
        self.starter = starter
        self.offline = offline  # one request with no engine running: never start anything
        self.group_caps = group_caps  # "exp:<id>" -> resources.max_slots
        self.after_pass = after_pass
        self.waiting: dict[int, str] = {}  # queued job id -> why it waits
        self.preempting: set[int] = set()  # running job ids asked to preempt
        # queued jobs kept out of the passes for now, and why (a gang waiting for machines)
        self.hold_back: dict[int, str] = {}
        self.loop: asyncio.AbstractEventLoop | None = None
        self._scheduling = False
        self._again = False
        self._foreign_timer: asyncio.TimerHandle | None = None

    # ------------------------------------------------------------------ the pass
    def schedule(self) -> None:
        """Ask the policy what to start and whom to preempt; act on it. Re-entrant calls (a job
        that fails to start triggers another pass) are folded into one loop."""
        if self.offline:
            return
        if self._scheduling:
            self._again = True
            return
        self._scheduling = True
        try:
            while True:
                self._again = False
                self._schedule_once()
                if not self._again:
                    break
        finally:
            self._scheduling = False
        self.after_pass()

    @contextmanager
    def deferred(self, *, on_error: bool = True) -> Iterator[None]:
        """Passes asked for within the block run once, after it (when one was asked for;
        ``on_error=False``: not when the block raised). Nested blocks defer to the outer one."""
        outer = not self._scheduling
        if outer:
            self._scheduling = True
            self._again = False
        ok = False
        try:
            yield
            ok = True
        finally:
            if outer:
                self._scheduling = False
                if self._again and (ok or on_error):
                    self.schedule()

    def _policy_config(self) -> PolicyConfig:
        return PolicyConfig(
            mode=self.settings.mode,
            preemption=self.settings.preemption,
            group_max_slots=self.group_caps(),
            user_quota=self.settings.user_quota,
            user_weight=self.settings.user_weight,
        )

    def _schedule_once(self) -> None:
        # the writer's in-memory copy of the active jobs (no SQL), the queue in policy order:
        # the policy reads only as far into a long queue as can matter (policy rule 9)
        jobs = self.jobs.scheduling_view()
        if not jobs.queue:
            self.waiting = {}
            return
        inv = self.inventory
        held = {j.id: inv.ids(j.slots) for j in jobs.running.values()}
        running = [
            RunningJob(view(j), held[j.id], preempting=j.id in self.preempting)
            for j in jobs.running.values()
        ]
        held_back = self.hold_back
        queued = SortedQueue(
            jobs=(view(j) for j in jobs.queued_in_order() if j.id not in held_back),
            zero_slot=jobs.zero_slot,
        )
        free = inv.free(s for slots in held.values() for s in slots)
        decision = schedule(inv.total(), free.slots, running, queued, self._policy_config())
        # why the jobs read wait (those left unread wait too: decision.complete is False)
        self.waiting = dict(decision.waiting)
        self.waiting.update(held_back)
        if free.foreign_held and (self.waiting or not decision.complete):
            # nothing of ours tells when a foreign process lets go of its GPU: look again soon
            # while jobs wait (a bounded supervision tick, only then)
            self._recheck_foreign_later()
        # the records as they were when the policy decided (starting one changes the copy)
        preempt = [jobs.jobs[job_id] for job_id in decision.preempt]
        start = [(jobs.jobs[job_id], inv.indices(slots)) for job_id, slots in decision.start]
        for job in preempt:
            if (job.kind == JobKind.TRIAL or job.gang is not None) and self.starter.preempt_trial(
                job
            ):
                self.preempting.add(job.id)
        for job, slots in start:
            self._start(job, slots)

    def _recheck_foreign_later(self) -> None:
        if self._foreign_timer is not None or self.loop is None:
            return

        def again() -> None:
            self._foreign_timer = None
            self.schedule()

        self._foreign_timer = self.loop.call_later(FOREIGN_RECHECK_S, again)

    def _start(self, job: JobRecord, slots: list[int]) -> None:
        """Commit the allocation (durable before acting), then start."""
        if job.gang is not None:  # a share of a gang across machines: held until all are ready
            run_id = (
                self.next_trial_run(job.trial_id) if job.trial_id is not None else job.run_id + 1
            )
            self.jobs.reserve(job.id, slots, run_id)
            self.starter.start_gang_share(self.jobs.peek(job.id))
        elif job.kind == JobKind.TRIAL:
            assert job.experiment_id is not None and job.trial_id is not None
            run_id = self.next_trial_run(job.trial_id)
            self.jobs.allocate(job.id, slots, run_id)
            self.starter.start_trial(job, slots, run_id)
        else:
            self.jobs.allocate(job.id, slots, job.run_id + 1)
            self.starter.start_command(self.jobs.get(job.id))

    # ------------------------------------------------------------------ queue order changes
    def update_job(
        self,
        job_id: int,
        *,
        priority: int | None = None,
        ahead_of: int | None = None,
        behind_of: int | None = None,
        experiment_priority: Callable[[int, int], str],
    ) -> str:
        """`job update`: a new priority (an experiment's trials: the experiment's, through
        ``experiment_priority``), or a place ahead of / behind another job."""
        job = self.jobs.get(job_id)
        if job.state not in (QUEUED, SCHEDULED):
            raise StateError(f"job {job_id} has ended; only queued or running jobs can be updated")
        if sum(x is not None for x in (priority, ahead_of, behind_of)) != 1:
            raise DetLocalError(
                "job update: give exactly one of --priority, --ahead-of, --behind-of"
            )
        if priority is not None:
            check_priority(priority)
            if job.experiment_id is not None:
                return experiment_priority(job.experiment_id, priority)
            self.jobs.set_priority(job_id, priority)
            what = f"priority {priority}"
        else:
            other = int(ahead_of if ahead_of is not None else behind_of)  # type: ignore[arg-type]
            if other == job_id:
                raise DetLocalError(f"job {job_id} cannot move relative to itself")
            target = self.jobs.get(other)
            if target.state not in (QUEUED, SCHEDULED):
                raise StateError(f"job {other} has ended; move relative to a queued job")
            pos = self.jobs.neighbour_position(other, ahead=ahead_of is not None)
            self.jobs.set_position(job_id, pos)
            # `ahead of` also means at least as important
            if ahead_of is not None and target.priority < job.priority:
                self.jobs.set_priority(job_id, target.priority)
            if behind_of is not None and target.priority > job.priority:
                self.jobs.set_priority(job_id, target.priority)
            what = f"{'ahead of' if ahead_of is not None else 'behind'} job {other}"
        self.schedule()
        return f"job {job_id}: {what}"

    def set_group_priority(self, experiment_id: int, priority: int) -> None:
        """Every active job of the experiment takes this priority."""
        for job in self.jobs.active():
            if job.experiment_id == experiment_id:
                self.jobs.set_priority(job.id, priority)

    # ------------------------------------------------------------------ trials as jobs
    def enqueue_trial(self, trial_id: int, create: Callable[[], object]) -> None:
        """Queue the trial (again) for slots; it starts when the policy says so. ``create``
        makes its job, when it has none yet."""
        job = self.jobs.for_trial(trial_id)
        if job is None:
            create()
        elif job.state != QUEUED:
            self.jobs.requeue(job.id)

    def dequeue_trial(self, trial_id: int, message: str, *, cancel: bool = False) -> None:
        """Take the trial's job out of the queue: DONE (it is queued again on activation), or
        CANCELED (cancel=True: the experiment was killed)."""
        job = self.jobs.for_trial(trial_id)
        if job is not None and job.state == QUEUED:
            if cancel:
                self.jobs.cancel(job.id, message)
            else:
                self.jobs.finish(job.id, None, message)

    def finish_trial_job(self, trial_id: int, code: int | None, message: str) -> None:
        job = self.jobs.for_trial(trial_id)
        if job is not None:
            self.jobs.finish(job.id, code, message)

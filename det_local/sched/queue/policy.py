"""The scheduling policy: who starts, who waits and why, who is asked to preempt.

Pure functions over frozen views; no I/O, no store. The daemon calls :func:`schedule` after
every event (submission, exit, preemption acknowledged, ``job update``) with the slot
inventory, the running jobs and the queue, and carries out the :class:`Decision`. Asking a
trial to preempt (``should_preempt()``), waiting for its checkpoint and requeueing it is the
daemon's job; this module only decides *who*.

It follows Determined's priority scheduler (``master/internal/rm/agentrm/priority.go``, with
the tie-breaks of Determined #3340 / PR #3428) on one machine.

Rules
-----

1. **Order (priority mode).** Queued jobs are considered in ``(priority, position, id)``
   order: priority 1-99, lower number = more important (default 42; ``priority.py``
   defines the bounds and the default); among equal priorities
   the earliest submitted (smallest ``position``) goes first. :func:`queue_order` returns
   that order.
2. **Gang.** A job starts with all of its ``slots`` or not at all; it gets the first free
   slots in ``(node, index)`` order (:class:`~det_local.sched.queue.inventory.SlotId`; the policy
   hands out the slot ids it is given, wherever they are). A job needing more slots than the
   machine has waits (it can never run; :func:`check_request` rejects it at submission) and
   blocks nobody.
3. **Caps.** ``group_max_slots[group]`` (an experiment's ``resources.max_slots``) and
   ``user_quota[user]`` bound the slots a group / a user holds at once: running jobs
   (preempting ones included, they still hold their slots) plus jobs started in this pass. A
   job over a cap waits with the cap as its reason. Caps apply in both modes.
4. **Zero-slot jobs** start at once, whatever else is queued; they never block, reserve or
   preempt anything, and are never preempted for.
5. **No delaying more important work (backfill).** A job that cannot start for lack of slots
   is *blocked* and becomes a barrier. A job considered after a barrier may only start (or
   reserve, or preempt) if the jobs waiting for slots before it could take its slots back:
   preemption is on, it is preemptible, and it is strictly less important than each of them
   (priority number strictly greater: an equal-priority job cannot be preempted by it, rule
   6, so equal-priority later jobs stay behind: FIFO). "Waiting for slots" covers the
   blocked jobs and the jobs already waiting behind a barrier. With preemption off nothing
   passes a job blocked for lack of slots. A job waiting only for its group's max_slots or
   its user's quota is not a barrier: the free slots are no use to it.
6. **Preemption (priority mode, ``preemption=True``).** For a blocked job of priority P
   (blocked for lack of slots, never for a cap or a quota, never a zero-slot job), first
   count the free slots plus the slots being freed by already-preempting jobs (these are
   *reserved* for the blocked jobs in order, the most important first). If that is not
   enough, victims are chosen among running, preemptible, not-yet-preempting jobs whose
   priority number is strictly greater than P, the least important first and, among equal
   priorities, the most recently submitted (largest position) first; only as many as needed.
   If even all of them would not be enough, nothing is preempted for that job. Equal
   priority never preempts; non-preemptible jobs are never preempted. A job that reserved
   slots or got victims waits; it starts on a later pass when the slots are free.
7. **Fair share (``mode="fair_share"``).** Users with demand (a running or queued job that
   needs slots) split the machine by weight: ``share(u) = total * w(u) / sum(w)``
   (``user_weight``, default 1.0). Jobs are taken one at a time from the user furthest below
   its share (lowest ``usage / share``; usage = slots of its running jobs that are not being
   preempted, plus jobs started in this pass), each user's jobs in ``(priority, position,
   id)`` order; ties go to the more important, older head job. Rules 2-5 apply, except that
   passing a barrier needs only preemption on and a preemptible job, whatever its priority
   (a user crowding out a blocked user that stays within its share is, up to rounding, over
   its own share, so the preemption below can take the slots back); with preemption off
   nothing passes a blocked job. Preemption: a blocked job whose user stays within its share
   once it runs (``usage + reserved + slots <= ceil(share)``) may take slots from users
   holding more than ``ceil(share)``: the most over-share user first, its most recently
   submitted preemptible jobs first, never leaving a victim's user below ``ceil(share)``.
   Nobody crosses its share either way, so two users cannot preempt each other back and
   forth.
8. **Determinism.** The same inputs give the same decision; every tie is broken by a total
   order ending in the job id.
9. **Long queues.** Handed a :class:`SortedQueue` (the queue already in ``(priority,
   position, id)`` order, as the daemon keeps it), :func:`schedule` reads only as far as can
   matter: it stops once no queued job is left that needs no slot and no later job can start
   or make anyone preempt: every free slot is taken, or a job is blocked and preemption is
   off (nothing passes it); and no running job can be preempted for a later job (preemption
   off; priority mode: none left with a priority number greater than the last job read;
   fair share: none left at all). ``start`` and ``preempt`` are then exactly those of the
   whole queue; ``waiting`` lists the jobs read, and ``complete`` is False when some were
   left unread (they all wait).
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

from det_local.errors import DetLocalError
from det_local.sched.queue.inventory import SlotId

MODES = ("priority", "fair_share")


class SchedulingError(DetLocalError):
    """A request the scheduler can never satisfy (more slots than the machine has...)."""


@dataclass(frozen=True)
class JobView:
    """A queued or running job as the policy sees it."""

    id: int
    user: str
    priority: int  # 1..99, lower = more important
    position: float  # queue order key (submission order, moved by `job update`); smaller = earlier
    slots: int  # slots needed, all or nothing; 0 = needs no slot
    group: str | None = None  # e.g. "exp:5": jobs of one experiment share its max_slots
    preemptible: bool = True  # trials checkpoint and resume; commands/shells/notebooks don't
    weight: float = 1.0  # carried for display; fair share uses PolicyConfig.user_weight


@dataclass(frozen=True)
class RunningJob:
    job: JobView
    slots: tuple[SlotId, ...]  # the slots it holds
    preempting: bool = False  # already asked to preempt: its slots are being freed


@dataclass(frozen=True)
class PolicyConfig:
    mode: str = "priority"  # "priority" | "fair_share"
    preemption: bool = True
    group_max_slots: Mapping[str, int] = field(default_factory=dict)
    user_quota: Mapping[str, int] = field(default_factory=dict)
    user_weight: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise SchedulingError(
                f"scheduler mode {self.mode!r} is not known: use one of {', '.join(MODES)}"
            )
        for user, w in self.user_weight.items():
            if not w > 0:
                raise SchedulingError(
                    f"fair-share weight of user {user} is {w}: weights must be more than 0"
                )

    def weight(self, user: str) -> float:
        return float(self.user_weight.get(user, 1.0))


@dataclass(frozen=True)
class SortedQueue:
    """The queued jobs, handed over in ``(priority, position, id)`` order and read lazily
    (rule 9): ``jobs`` yields them all, zero-slot ones included; ``zero_slot`` counts those
    that need no slot."""

    jobs: Iterable[JobView]
    zero_slot: int


@dataclass(frozen=True)
class Decision:
    start: tuple[tuple[int, tuple[SlotId, ...]], ...]  # (job id, its slots) to start now
    preempt: tuple[int, ...]  # running job ids to ask to preempt now
    waiting: Mapping[int, str]  # queued job id -> why it waits
    # False: a SortedQueue was read only in part (rule 9); the jobs not in `waiting` wait too
    complete: bool = True


def check_request(
    slots: int,
    total_slots: int,
    kind_desc: str = "slots_per_trial",
    *,
    allow_zero: bool = False,
    more: str | None = None,
) -> None:
    """Reject at submission a slot request this machine can never satisfy. `more`: another
    remedy for a request over the machine's slots (``cpu_slots_remedy``), appended to the
    message."""
    if isinstance(slots, bool) or not isinstance(slots, int):
        raise SchedulingError(f"{kind_desc} {slots!r} is not a whole number: set it to 1 or more")
    if slots < 0:
        raise SchedulingError(
            f"{kind_desc} {slots} is negative: set it to at least {0 if allow_zero else 1}"
        )
    if slots == 0:
        if allow_zero:
            return
        raise SchedulingError(f"{kind_desc} is 0: this job needs a slot; set it to at least 1")
    if slots > total_slots:
        have = f"{total_slots} slot" + ("" if total_slots == 1 else "s")
        hint = (
            f"set it to {total_slots} or less"
            if total_slots > 0
            else "it cannot run here until the machine has slots"
        )
        if more:
            hint += f", or {more}"
        raise SchedulingError(f"{kind_desc} {slots} is more than this machine's {have}; {hint}")


def _key(j: JobView) -> tuple[int, float, int]:
    return (j.priority, j.position, j.id)


def _group_name(group: str) -> str:
    kind, _, rest = group.partition(":")
    return f"experiment {rest}" if kind == "exp" and rest else f"group {group}"


def _plural(n: int) -> str:
    return f"{n} slot" if n == 1 else f"{n} slots"


def queue_order(
    queued: Sequence[JobView],
    cfg: PolicyConfig,
    running: Sequence[RunningJob] = (),
) -> list[JobView]:
    """The order :func:`schedule` considers queued jobs in (what ``job list`` shows).

    Priority mode: ``(priority, position, id)``. Fair share: users interleaved by
    usage / weight, as if each job started when its turn came (``running`` gives the
    starting usage); the first jobs are exactly what schedule() considers first."""
    if cfg.mode == "priority":
        return sorted(queued, key=_key)
    usage = _fair_usage(running)
    out: list[JobView] = []
    for job in _fair_order(queued, cfg, usage):
        out.append(job)
        usage[job.user] = usage.get(job.user, 0) + job.slots
    return out


def _fair_usage(running: Sequence[RunningJob]) -> dict[str, int]:
    usage: dict[str, int] = {}
    for r in running:
        if not r.preempting:
            usage[r.job.user] = usage.get(r.job.user, 0) + len(r.slots)
    return usage


def _fair_order(
    queued: Sequence[JobView], cfg: PolicyConfig, usage: Mapping[str, int]
) -> Iterator[JobView]:
    """Yield jobs from the user with the lowest usage/weight (then the head job's priority,
    position, id). ``usage`` is read live: a caller that updates the yielded job's user
    between yields steers the order. Other users' entries keep the usage they were pushed
    with (a user whose job was just preempted comes up no earlier; it could not start
    anything in that pass anyway: its slots were reserved by the job that preempted it)."""
    per_user: dict[str, list[tuple[int, float, int, JobView]]] = {}
    for j in queued:
        per_user.setdefault(j.user, []).append((j.priority, j.position, j.id, j))
    heap: list[tuple[float, int, float, int, str, int]] = []
    weight: dict[str, float] = {}
    for user, jobs in per_user.items():
        jobs.sort(key=lambda t: t[:3])
        weight[user] = w = cfg.weight(user)
        p, pos, jid, _ = jobs[0]
        heap.append((usage.get(user, 0) / w, p, pos, jid, user, 0))
    heapq.heapify(heap)
    if not heap:
        return
    cur = heapq.heappop(heap)
    while True:
        user, i = cur[4], cur[5]
        jobs = per_user[user]
        yield jobs[i][3]
        i += 1
        if i < len(jobs):
            p, pos, jid, _ = jobs[i]
            nxt = (usage.get(user, 0) / weight[user], p, pos, jid, user, i)
            # one heap operation at most: keep going with this user while it stays first
            cur = heapq.heapreplace(heap, nxt) if heap and heap[0] < nxt else nxt
        elif heap:
            cur = heapq.heappop(heap)
        else:
            return


class _Pass:
    """The mutable state of one scheduling pass."""

    def __init__(
        self,
        total_slots: int,
        free: Sequence[SlotId],
        running: Sequence[RunningJob],
        cfg: PolicyConfig,
    ) -> None:
        self.cfg = cfg
        self.total = total_slots
        self.free = sorted(set(free))
        self.fp = 0  # free[fp:] are still available in this pass
        self.pending = 0  # slots being freed and not yet reserved by a blocked job
        self.group_used: dict[str, int] = {}
        self.user_used: dict[str, int] = {}  # caps: everything held, preempting included
        for r in running:
            n = len(r.slots)
            if r.job.group is not None:
                self.group_used[r.job.group] = self.group_used.get(r.job.group, 0) + n
            self.user_used[r.job.user] = self.user_used.get(r.job.user, 0) + n
            if r.preempting:
                self.pending += n
        self.start: list[tuple[int, tuple[SlotId, ...]]] = []
        self.preempt: list[int] = []
        self.waiting: dict[int, str] = {}
        self.barrier: JobView | None = None  # first job blocked for lack of slots
        self.barrier_top: JobView | None = None  # first blocked job at the highest number
        self.victim_finder: Callable[[JobView, int], list[RunningJob] | None] = self._no_victims
        self.may_pass: Callable[[JobView], bool] = self._may_pass_priority

    # -- the per-job rule ----------------------------------------------------------------

    def consider(self, j: JobView) -> bool:
        """Start ``j`` or record why it waits; True if it started."""
        n = j.slots
        if n <= 0:
            self.start.append((j.id, ()))
            return True
        if n > self.total:
            self.waiting[j.id] = f"needs {_plural(n)}, this machine has {self.total}"
            return False
        cfg = self.cfg
        if j.group is not None and j.group in cfg.group_max_slots:
            cap = cfg.group_max_slots[j.group]
            held = self.group_used.get(j.group, 0)
            if n > cap:
                self.waiting[j.id] = (
                    f"needs {_plural(n)}, more than {_group_name(j.group)}'s max_slots {cap}"
                )
                return False
            if held + n > cap:
                self.waiting[j.id] = (
                    f"{_group_name(j.group)} at max_slots {cap} (holds {held}, needs {n})"
                )
                return False
        if j.user in cfg.user_quota:
            quota = cfg.user_quota[j.user]
            held = self.user_used.get(j.user, 0)
            if n > quota:
                self.waiting[j.id] = f"needs {_plural(n)}, more than user {j.user}'s quota {quota}"
                return False
            if held + n > quota:
                self.waiting[j.id] = f"user {j.user} at quota {quota} (holds {held}, needs {n})"
                return False
        if self.barrier is not None and not self.may_pass(j):
            self.waiting[j.id] = self._behind(j)
            # it waits for slots too: what passes it later must be less important than it
            if self.barrier_top is None or j.priority > self.barrier_top.priority:
                self.barrier_top = j
            return False
        avail = len(self.free) - self.fp
        if avail >= n:
            slots = tuple(self.free[self.fp : self.fp + n])
            self.fp += n
            self.start.append((j.id, slots))
            if j.group is not None:
                self.group_used[j.group] = self.group_used.get(j.group, 0) + n
            self.user_used[j.user] = self.user_used.get(j.user, 0) + n
            return True
        self._blocked(j, avail)
        return False

    def _blocked(self, j: JobView, avail: int) -> None:
        n = j.slots
        reason = f"needs {_plural(n)}, {avail} free"
        if avail + self.pending >= n:
            from_pending = n - avail
            self.fp = len(self.free)
            self.pending -= from_pending
            self.on_reserved(j, n)
            if from_pending:
                reason += f"; waiting for {from_pending} being freed by preemption"
        elif self.cfg.preemption:
            victims = self.victim_finder(j, n - avail - self.pending)
            if victims:
                got = sum(len(v.slots) for v in victims)
                self.pending = avail + self.pending + got - n
                self.fp = len(self.free)
                self.preempt.extend(v.job.id for v in victims)
                self.on_reserved(j, n)
                reason += "; preempting job " + ", ".join(str(v.job.id) for v in victims)
        self.waiting[j.id] = reason
        if self.barrier is None:
            self.barrier = j
        if self.barrier_top is None or j.priority > self.barrier_top.priority:
            self.barrier_top = j

    def on_reserved(self, j: JobView, n: int) -> None:
        """Hook: ``j`` will get ``n`` slots once they are freed (fair share counts it)."""

    def _behind(self, j: JobView) -> str:
        b = self.barrier
        assert b is not None
        if self.cfg.mode == "fair_share":
            return f"behind job {b.id} (user {b.user})"
        top = self.barrier_top
        if self.cfg.preemption and j.preemptible and top is not None:
            b = top
        return f"behind job {b.id} (priority {b.priority})"

    def _may_pass_priority(self, j: JobView) -> bool:
        top = self.barrier_top
        return (
            self.cfg.preemption and j.preemptible and top is not None and j.priority > top.priority
        )

    @staticmethod
    def _no_victims(j: JobView, need: int) -> list[RunningJob] | None:
        return None

    def settled(self, last: JobView) -> bool:
        """Rule 9: no job after ``last`` (in this pass's order) that needs slots can start or
        get anyone preempted."""
        if self.fp < len(self.free) and (self.barrier is None or self.cfg.preemption):
            return False  # a slot is free and a later job may still reach it
        return not self.cfg.preemption or not self.victims_after(last)

    def victims_after(self, last: JobView) -> bool:
        """Whether a job after ``last`` may still find running jobs to preempt."""
        finder = self.victim_finder
        return isinstance(finder, _PriorityVictims) and finder.any_after(last.priority)

    def decision(self, complete: bool = True) -> Decision:
        return Decision(
            start=tuple(self.start),
            preempt=tuple(self.preempt),
            waiting=MappingProxyType(self.waiting),
            complete=complete,
        )


class _PriorityVictims:
    """Victims for priority mode: candidates sorted least important first, most recent first
    among equals. A blocked job of priority P may take any prefix of the candidates with a
    number > P, and blocked jobs come in priority order, so the victims taken in a pass are
    always a prefix: a pointer and prefix sums answer each request in O(log n)."""

    def __init__(self, running: Sequence[RunningJob]) -> None:
        cands = [r for r in running if not r.preempting and r.job.preemptible and r.slots]
        cands.sort(key=lambda r: (-r.job.priority, -r.job.position, -r.job.id))
        self.cands = cands
        self.neg_prio = [-r.job.priority for r in cands]
        self.cum = [0]
        for r in cands:
            self.cum.append(self.cum[-1] + len(r.slots))
        self.next = 0

    def __call__(self, j: JobView, need: int) -> list[RunningJob] | None:
        k = bisect_left(self.neg_prio, -j.priority)  # candidates with priority number > P
        if k <= self.next or self.cum[k] - self.cum[self.next] < need:
            return None
        start = self.next
        end = bisect_left(self.cum, self.cum[start] + need, lo=start + 1, hi=k + 1)
        self.next = end
        return self.cands[start:end]

    def any_after(self, priority: int) -> bool:
        """Whether a job of this priority, or a less important one, may still get victims."""
        return self.next < len(self.cands) and self.cands[self.next].job.priority > priority


class _FairPass(_Pass):
    def __init__(
        self,
        total_slots: int,
        free: Sequence[SlotId],
        running: Sequence[RunningJob],
        queued: Sequence[JobView],
        cfg: PolicyConfig,
    ) -> None:
        super().__init__(total_slots, free, running, cfg)
        self.usage = _fair_usage(running)
        demand = {r.job.user for r in running if r.slots} | {j.user for j in queued if j.slots > 0}
        wsum = sum(cfg.weight(u) for u in demand)
        self.ceil_share = {
            u: math.ceil(total_slots * cfg.weight(u) / wsum - 1e-9) for u in sorted(demand)
        }
        self.reserved: dict[str, int] = {}
        self.by_user: dict[str, list[RunningJob]] = {}
        for r in running:
            if not r.preempting and r.job.preemptible and r.slots:
                self.by_user.setdefault(r.job.user, []).append(r)
        for lst in self.by_user.values():
            lst.sort(key=lambda r: (-r.job.position, -r.job.id))  # most recent first
        self.version = 0  # bumped on every start or preemption: memo of failed searches
        self.failed: dict[str, tuple[int, int]] = {}  # user -> (version, smallest need failed)
        self.victim_finder = self._fair_victims
        self.may_pass = self._may_pass_fair

    def _may_pass_fair(self, j: JobView) -> bool:
        return self.cfg.preemption and j.preemptible

    def victims_after(self, last: JobView) -> bool:
        # jobs come in no priority order here: any preemptible running job left may do
        return any(self.by_user.values())

    def consider(self, j: JobView) -> bool:
        started = super().consider(j)
        if started and j.slots > 0:
            self.usage[j.user] = self.usage.get(j.user, 0) + j.slots
            self.version += 1
        return started

    def on_reserved(self, j: JobView, n: int) -> None:
        self.reserved[j.user] = self.reserved.get(j.user, 0) + n

    def _fair_victims(self, j: JobView, need: int) -> list[RunningJob] | None:
        u = j.user
        planned = self.usage.get(u, 0) + self.reserved.get(u, 0)
        if planned + j.slots > self.ceil_share.get(u, 0):
            return None  # running it would put its user over its share
        memo = self.failed.get(u)
        if memo is not None and memo[0] == self.version and need >= memo[1]:
            return None
        usage = dict(self.usage)
        taken: set[int] = set()
        victims: list[RunningJob] = []
        got = 0
        over = {
            v: jobs
            for v, jobs in self.by_user.items()
            if v != u and usage.get(v, 0) > self.ceil_share.get(v, 0)
        }
        while got < need and over:
            # the most over-share user (usage / weight) first; ties by name
            v = min(over, key=lambda x: (-usage.get(x, 0) / self.cfg.weight(x), x))
            floor = self.ceil_share.get(v, 0)
            pick = None
            for r in over[v]:
                if r.job.id not in taken and usage[v] - len(r.slots) >= floor:
                    pick = r
                    break
            if pick is None:
                del over[v]
                continue
            taken.add(pick.job.id)
            victims.append(pick)
            got += len(pick.slots)
            usage[v] -= len(pick.slots)
            if usage[v] <= floor:
                del over[v]
        if got < need:
            self.failed[u] = (self.version, min(need, memo[1]) if memo else need)
            return None
        self.usage.update(usage)  # in place: _fair_order reads it live
        for v in {r.job.user for r in victims}:
            self.by_user[v] = [r for r in self.by_user[v] if r.job.id not in taken]
        self.version += 1
        return victims


def schedule(
    total_slots: int,
    free: Sequence[SlotId],
    running: Sequence[RunningJob],
    queued: Sequence[JobView] | SortedQueue,
    cfg: PolicyConfig,
) -> Decision:
    """One scheduling pass: what to start, whom to ask to preempt, why the rest wait. A
    :class:`SortedQueue` is read only as far as can matter (rule 9)."""
    zero_left: int | None = None
    if isinstance(queued, SortedQueue):
        zero_left = queued.zero_slot
        order: Iterable[JobView] = queued.jobs
        if cfg.mode == "fair_share":
            queued = list(queued.jobs)
    elif cfg.mode != "fair_share":
        order = sorted(queued, key=_key)
    p: _Pass
    if cfg.mode == "fair_share":
        assert not isinstance(queued, SortedQueue)
        p = _FairPass(total_slots, free, running, queued, cfg)
        order = _fair_order(queued, cfg, p.usage)
    else:
        p = _Pass(total_slots, free, running, cfg)
        if cfg.preemption:
            p.victim_finder = _PriorityVictims(running)
    if zero_left is None:
        for job in order:
            p.consider(job)
        return p.decision()
    jobs = iter(order)
    for job in jobs:
        p.consider(job)
        if job.slots <= 0:
            zero_left -= 1
        if zero_left <= 0 and p.settled(job):
            return p.decision(complete=next(jobs, None) is None)
    return p.decision()

"""The scheduling policy (det_local/sched/queue/policy.py): one test per rule, plus a small daemon
simulation for the multi-pass behaviour, randomised invariants and the speed budget."""

from __future__ import annotations

import random
import re
import time
from collections.abc import Sequence
from dataclasses import replace

import pytest

from det_local.errors import DetLocalError
from det_local.priority import DEFAULT_PRIORITY
from det_local.sched.queue.policy import (
    Decision,
    JobView,
    PolicyConfig,
    RunningJob,
    SchedulingError,
    check_request,
    queue_order,
    schedule,
)

PRIO = PolicyConfig()
PRIO_NOPREEMPT = PolicyConfig(preemption=False)
FAIR = PolicyConfig(mode="fair_share")


def job(
    id: int,
    slots: int = 1,
    priority: int = DEFAULT_PRIORITY,
    user: str = "ann",
    position: float | None = None,
    group: str | None = None,
    preemptible: bool = True,
) -> JobView:
    return JobView(
        id=id,
        user=user,
        priority=priority,
        position=float(id) if position is None else position,
        slots=slots,
        group=group,
        preemptible=preemptible,
    )


def run(j: JobView, slots: Sequence[int], preempting: bool = False) -> RunningJob:
    return RunningJob(job=j, slots=tuple(slots), preempting=preempting)


def free_of(total: int, running: Sequence[RunningJob]) -> list[int]:
    held = {s for r in running for s in r.slots}
    return [s for s in range(total) if s not in held]


def sched(
    total: int, running: Sequence[RunningJob], queued: Sequence[JobView], cfg: PolicyConfig = PRIO
) -> Decision:
    return schedule(total, free_of(total, running), running, queued, cfg)


def started(d: Decision) -> list[int]:
    return [jid for jid, _ in d.start]


# ---------------------------------------------------------------------------------------
# check_request


def test_check_request_too_many_slots_names_the_machine_size() -> None:
    with pytest.raises(SchedulingError) as e:
        check_request(4, 2)
    assert str(e.value) == (
        "slots_per_trial 4 is more than this machine's 2 slots; set it to 2 or less"
    )
    assert isinstance(e.value, DetLocalError)


@pytest.mark.parametrize(
    ("slots", "total", "kwargs", "message"),
    [
        (2, 1, {}, "slots_per_trial 2 is more than this machine's 1 slot; set it to 1 or less"),
        (3, 2, {"kind_desc": "resources.slots"}, "resources.slots 3 is more than"),
        (1, 0, {}, "slots_per_trial 1 is more than this machine's 0 slots; it cannot run"),
        (0, 4, {}, "slots_per_trial is 0: this job needs a slot; set it to at least 1"),
        (-1, 4, {}, "slots_per_trial -1 is negative: set it to at least 1"),
        (-1, 4, {"allow_zero": True}, "slots_per_trial -1 is negative: set it to at least 0"),
        (1.5, 4, {}, "slots_per_trial 1.5 is not a whole number"),
        (True, 4, {}, "slots_per_trial True is not a whole number"),
    ],
)
def test_check_request_rejects(slots: int, total: int, kwargs: dict, message: str) -> None:
    with pytest.raises(SchedulingError, match="^" + re.escape(message)):
        check_request(slots, total, **kwargs)


@pytest.mark.parametrize(("slots", "total"), [(1, 1), (2, 2), (1, 8), (0, 0), (0, 4)])
def test_check_request_accepts(slots: int, total: int) -> None:
    check_request(slots, total, allow_zero=True)
    if slots:
        check_request(slots, total)


def test_policy_config_validates_mode_and_weights() -> None:
    with pytest.raises(SchedulingError, match="scheduler mode 'fifo' is not known"):
        PolicyConfig(mode="fifo")
    with pytest.raises(SchedulingError, match="weight of user bob is 0"):
        PolicyConfig(mode="fair_share", user_weight={"bob": 0})


# ---------------------------------------------------------------------------------------
# rule 1: order


def test_queue_order_is_priority_then_position() -> None:
    jobs = [
        job(1, priority=50),
        job(2, priority=10),
        job(3, priority=42),
        job(4, priority=10),
        job(5, priority=42, position=0.5),  # moved ahead with `job update --ahead-of 1`
    ]
    assert [j.id for j in queue_order(jobs, PRIO)] == [2, 4, 5, 3, 1]


def test_equal_priority_oldest_submission_first_3340() -> None:
    # Determined #3340: among equal priorities the oldest submission goes first.
    queued = [job(3, slots=2), job(1, slots=2), job(2, slots=2)]
    d = sched(2, [], queued)
    assert d.start == ((1, (0, 1)),)
    assert d.waiting[2] == "needs 2 slots, 0 free"


def test_more_important_job_starts_first() -> None:
    d = sched(2, [], [job(1, slots=2, priority=50), job(2, slots=2, priority=10)])
    assert d.start == ((2, (0, 1)),)


def test_starts_take_the_lowest_free_indices() -> None:
    running = [run(job(9), [1]), run(job(8), [4])]
    d = schedule(6, [5, 3, 0, 2], running, [job(1, 2), job(2, 1), job(3, 1)], PRIO)
    assert d.start == ((1, (0, 2)), (2, (3,)), (3, (5,)))
    assert d.preempt == ()
    assert dict(d.waiting) == {}


# ---------------------------------------------------------------------------------------
# rule 2: gang


def test_gang_never_starts_with_fewer_slots() -> None:
    d = sched(4, [run(job(9, slots=2), [0, 1])], [job(1, slots=3)], PRIO_NOPREEMPT)
    assert d.start == ()
    assert d.waiting == {1: "needs 3 slots, 2 free"}


def test_job_larger_than_machine_waits_and_blocks_nobody() -> None:
    d = sched(2, [], [job(1, slots=4, priority=1), job(2, slots=1)], PRIO_NOPREEMPT)
    assert started(d) == [2]
    assert d.waiting[1] == "needs 4 slots, this machine has 2"


# ---------------------------------------------------------------------------------------
# rule 3: backfill


B_RUNNING = [run(job(90, slots=2, priority=5), [0, 1])]  # 4 slots, 2 free
B_BLOCKED = job(1, slots=4, priority=10)  # needs all 4: blocked, can't preempt job 90


@pytest.mark.parametrize(
    ("cfg", "candidate", "starts", "reason"),
    [
        # preemption on, less important, preemptible: the blocked job can take it back
        (PRIO, job(2, slots=2, priority=50), True, None),
        (PRIO, job(2, slots=1, priority=11), True, None),
        # not preemptible: it would hold the slots the blocked job needs
        (PRIO, job(2, slots=1, priority=50, preemptible=False), False, "behind job 1"),
        # preemption off: nothing passes a job blocked for lack of slots
        (PRIO_NOPREEMPT, job(2, slots=1, priority=50), False, "behind job 1 (priority 10)"),
        # equal priority is FIFO: equal priority never preempts, so no backfill
        (PRIO, job(2, slots=1, priority=10), False, "behind job 1 (priority 10)"),
        # more important is considered before the blocked job and simply starts
        (PRIO_NOPREEMPT, job(2, slots=1, priority=9), True, None),
        # fits now or not at all
        (PRIO, job(2, slots=3, priority=50), False, "needs 3 slots, 2 free"),
    ],
)
def test_backfill_rules(
    cfg: PolicyConfig, candidate: JobView, starts: bool, reason: str | None
) -> None:
    d = sched(4, B_RUNNING, [B_BLOCKED, candidate], cfg)
    assert d.waiting[1].startswith("needs 4 slots, ")
    assert (candidate.id in started(d)) is starts
    if reason is not None:
        assert d.waiting[candidate.id].startswith(reason)
    assert d.preempt == ()


def test_behind_reason_names_the_equal_priority_blocked_job() -> None:
    queued = [B_BLOCKED, job(2, slots=4, priority=42), job(3, slots=1, priority=42)]
    d = sched(4, B_RUNNING, queued)
    # job 3 may pass job 1 (priority 10) but not job 2 (same priority 42)
    assert d.waiting[3] == "behind job 2 (priority 42)"


def test_jobs_waiting_behind_a_barrier_keep_their_place() -> None:
    # job 1 can't run while job 90 does; job 2 (42, not preemptible) waits behind it. Job 4
    # (also 42, later) must not pass job 2, which could never take the slots back; job 3
    # (50, preemptible) may: both job 1 and job 2 could preempt it.
    queued = [
        B_BLOCKED,
        job(2, slots=2, priority=42, preemptible=False),
        job(3, slots=1, priority=50),
        job(4, slots=1, priority=42),
    ]
    d = sched(4, B_RUNNING, queued)
    assert d.waiting[2] == "behind job 1 (priority 10)"
    assert d.waiting[4] == "behind job 2 (priority 42)"
    assert d.start == ((3, (2,)),)


@pytest.mark.parametrize(
    ("cfg", "blocked", "why"),
    [
        (
            PolicyConfig(preemption=False, group_max_slots={"exp:5": 2}),
            job(1, slots=2, priority=10, group="exp:5"),
            "experiment 5 at max_slots 2 (holds 2, needs 2)",
        ),
        (
            PolicyConfig(preemption=False, user_quota={"bob": 2}),
            job(1, slots=2, priority=10, user="bob"),
            "user bob at quota 2 (holds 2, needs 2)",
        ),
    ],
)
def test_job_waiting_on_cap_or_quota_is_not_a_barrier(
    cfg: PolicyConfig, blocked: JobView, why: str
) -> None:
    running = [run(job(90, slots=2, priority=42, user="bob", group="exp:5"), [0, 1])]
    d = sched(4, running, [blocked, job(2, slots=2, priority=50)], cfg)
    assert d.waiting == {1: why}
    assert d.start == ((2, (2, 3)),)


def test_backfilled_job_is_reclaimed_when_the_blocked_job_can_start() -> None:
    # 4 slots; a non-preemptible important shell holds 2; job 1 needs 4 and must wait for
    # it; job 2 backfills into the 2 free slots. When the shell exits job 1 preempts job 2.
    shell = job(90, slots=2, priority=5, preemptible=False)
    sim = Sim(4, PRIO)
    sim.running = [run(shell, [0, 1])]
    sim.queued = [B_BLOCKED, job(2, slots=2, priority=50)]
    sim.step()
    assert sim.running_ids() == [2, 90]
    sim.finish(90)
    d = sim.step()
    assert d.preempt == (2,)
    assert d.waiting[1] == "needs 4 slots, 2 free; preempting job 2"
    sim.settle()
    assert sim.running_ids() == [1]
    assert [j.id for j in sim.queued] == [2]


# ---------------------------------------------------------------------------------------
# rule 4: preemption


def test_preempts_least_important_first() -> None:
    running = [
        run(job(90, priority=60), [0]),
        run(job(91, priority=80), [1]),
        run(job(92, priority=70), [2]),
        run(job(93, priority=5), [3]),
    ]
    d = sched(4, running, [job(1, slots=2, priority=10)])
    assert d.preempt == (91, 92)
    assert d.start == ()
    assert d.waiting[1] == "needs 2 slots, 0 free; preempting job 91, 92"


def test_equal_priority_victims_most_recent_submission_first_3340() -> None:
    # Determined #3340: among equal priorities the most recently submitted is preempted.
    running = [
        run(job(90, priority=50, position=3.0), [0]),
        run(job(91, priority=50, position=7.0), [1]),
        run(job(92, priority=50, position=5.0), [2]),
    ]
    d = sched(3, running, [job(1, slots=1, priority=10)])
    assert d.preempt == (91,)
    d = sched(3, running, [job(1, slots=2, priority=10)])
    assert d.preempt == (91, 92)


def test_preempts_only_as_many_as_needed() -> None:
    running = [
        run(job(90, slots=2, priority=50), [0, 1]),
        run(job(91, slots=1, priority=60), [2]),
    ]
    # one slot free + job 91's one slot is enough for two
    d = sched(4, running, [job(1, slots=2, priority=10)])
    assert d.preempt == (91,)


def test_preempts_nothing_when_all_candidates_are_not_enough() -> None:
    running = [
        run(job(90, slots=2, priority=5), [0, 1]),  # more important: not a candidate
        run(job(91, slots=1, priority=60), [2]),
        run(job(92, slots=1, priority=60, preemptible=False), [3]),
    ]
    d = sched(4, running, [job(1, slots=3, priority=10)])
    assert d.preempt == ()
    assert d.waiting[1] == "needs 3 slots, 0 free"


@pytest.mark.parametrize(
    ("victim", "why"),
    [
        (job(90, slots=2, priority=10, position=99), "equal priority never preempts"),
        (job(90, slots=2, priority=5), "more important"),
        (job(90, slots=2, priority=60, preemptible=False), "not preemptible"),
    ],
)
def test_never_preempts(victim: JobView, why: str) -> None:
    d = sched(2, [run(victim, [0, 1])], [job(1, slots=2, priority=10)])
    assert d.preempt == (), why
    assert d.waiting[1] == "needs 2 slots, 0 free"


def test_preemption_off_preempts_nothing() -> None:
    d = sched(2, [run(job(90, priority=90), [0, 1])], [job(1, priority=1)], PRIO_NOPREEMPT)
    assert d.preempt == ()


def test_zero_slot_job_never_preempts() -> None:
    d = sched(1, [run(job(90, priority=90), [0])], [job(1, slots=0, priority=1)])
    assert d.start == ((1, ()),)
    assert d.preempt == ()


def test_zero_slot_running_job_is_never_a_victim() -> None:
    running = [run(job(90, slots=0, priority=90), []), run(job(91, priority=50), [0])]
    d = sched(1, running, [job(1, priority=10)])
    assert d.preempt == (91,)


def test_cap_blocked_job_does_not_preempt() -> None:
    cfg = PolicyConfig(group_max_slots={"exp:1": 1}, user_quota={"bob": 1})
    running = [
        run(job(90, priority=90, group="exp:1", user="bob"), [0]),
        run(job(91, priority=90), [1]),
    ]
    queued = [job(1, priority=1, group="exp:1"), job(2, priority=1, user="bob", position=2)]
    d = sched(2, running, queued, cfg)
    assert d.preempt == ()
    assert d.waiting[1].startswith("experiment 1 at max_slots 1")
    assert d.waiting[2].startswith("user bob at quota 1")


def test_already_preempting_slots_are_counted_not_asked_twice() -> None:
    running = [
        run(job(90, slots=2, priority=50), [0, 1], preempting=True),
        run(job(91, slots=2, priority=60), [2, 3]),
    ]
    d = sched(4, running, [job(1, slots=2, priority=10)])
    # job 90's two slots are on their way back: no new preemption, 90 not asked again
    assert d.preempt == ()
    assert d.waiting[1] == "needs 2 slots, 0 free; waiting for 2 being freed by preemption"


def test_slots_being_freed_go_to_the_most_important_blocked_job_first() -> None:
    running = [
        run(job(90, slots=2, priority=50), [0, 1], preempting=True),
        run(job(91, slots=2, priority=60), [2, 3]),
        run(job(92, slots=2, priority=70), [4, 5]),
    ]
    queued = [job(2, slots=2, priority=20), job(1, slots=2, priority=10)]
    d = sched(6, running, queued)
    # job 1 takes the two being freed; job 2 needs its own victim, the least important
    assert d.waiting[1] == "needs 2 slots, 0 free; waiting for 2 being freed by preemption"
    assert d.waiting[2] == "needs 2 slots, 0 free; preempting job 92"
    assert d.preempt == (92,)


def test_free_and_freed_slots_combine() -> None:
    running = [
        run(job(90, slots=1, priority=50), [0], preempting=True),
        run(job(91, slots=2, priority=60), [1, 2]),
    ]
    # 1 free (slot 3) + 1 being freed + 2 from job 91 = 4
    d = sched(4, running, [job(1, slots=4, priority=10)])
    assert d.preempt == (91,)
    assert d.start == ()


def test_victim_surplus_serves_the_next_blocked_job() -> None:
    running = [run(job(90, slots=4, priority=90), [0, 1, 2, 3])]
    queued = [job(1, slots=2, priority=10), job(2, slots=2, priority=20)]
    d = sched(4, running, queued)
    assert d.preempt == (90,)
    assert d.waiting[1] == "needs 2 slots, 0 free; preempting job 90"
    assert d.waiting[2] == "needs 2 slots, 0 free; waiting for 2 being freed by preemption"


def test_a_job_that_reserved_slots_keeps_them_from_backfill() -> None:
    running = [run(job(90, slots=2, priority=50), [0, 1], preempting=True)]
    queued = [job(1, slots=3, priority=10), job(2, slots=1, priority=90)]
    d = sched(3, running, queued)
    # slot 2 is free but job 1 will take it with the two being freed
    assert d.start == ()
    assert d.waiting[1] == "needs 3 slots, 1 free; waiting for 2 being freed by preemption"
    assert d.waiting[2] == "needs 1 slot, 0 free"


def test_less_important_blocked_job_may_preempt_when_it_may_pass() -> None:
    # job 1 can never fit while the important shell runs; job 2 (less important, preemptible)
    # may pass it, and may itself preempt still less important work
    running = [
        run(job(90, slots=2, priority=1, preemptible=False), [0, 1]),
        run(job(91, slots=2, priority=90), [2, 3]),
    ]
    queued = [job(1, slots=4, priority=10), job(2, slots=2, priority=50)]
    d = sched(4, running, queued)
    assert d.preempt == (91,)
    assert d.waiting[2] == "needs 2 slots, 0 free; preempting job 91"


def test_preempted_job_resumes_after_the_important_one() -> None:
    sim = Sim(2, PRIO)
    sim.submit(job(1, slots=2, priority=50))
    sim.settle()
    assert sim.running_ids() == [1]
    sim.submit(job(2, slots=2, priority=10))
    sim.settle()
    assert sim.running_ids() == [2]
    assert sim.preempted == [1]
    sim.finish(2)
    sim.settle()
    assert sim.running_ids() == [1]


# ---------------------------------------------------------------------------------------
# rule 6: caps


def test_group_max_slots_counts_running_and_started_in_this_pass() -> None:
    cfg = PolicyConfig(group_max_slots={"exp:5": 3})
    running = [run(job(90, group="exp:5"), [0])]
    queued = [job(i, group="exp:5") for i in range(1, 5)] + [job(9)]
    d = sched(8, running, queued, cfg)
    assert started(d) == [1, 2, 9]
    assert d.waiting[3] == "experiment 5 at max_slots 3 (holds 3, needs 1)"
    assert d.waiting[4] == "experiment 5 at max_slots 3 (holds 3, needs 1)"


def test_preempting_jobs_still_count_against_caps() -> None:
    cfg = PolicyConfig(group_max_slots={"exp:5": 2}, user_quota={"bob": 2})
    running = [run(job(90, slots=2, group="exp:5", user="bob"), [0, 1], preempting=True)]
    d = sched(4, running, [job(1, group="exp:5"), job(2, user="bob")], cfg)
    assert d.start == ()
    assert d.waiting[1].startswith("experiment 5 at max_slots 2")
    assert d.waiting[2].startswith("user bob at quota 2")


def test_user_quota() -> None:
    cfg = PolicyConfig(user_quota={"bob": 3})
    queued = [job(1, 2, user="bob"), job(2, 2, user="bob"), job(3, 1, user="bob"), job(4, 2)]
    d = sched(8, [], queued, cfg)
    assert started(d) == [1, 3, 4]
    assert d.waiting == {2: "user bob at quota 3 (holds 2, needs 2)"}


@pytest.mark.parametrize(
    ("cfg", "j", "why"),
    [
        (
            PolicyConfig(group_max_slots={"exp:5": 2}),
            job(1, slots=4, group="exp:5"),
            "needs 4 slots, more than experiment 5's max_slots 2",
        ),
        (
            PolicyConfig(group_max_slots={"cmd": 1}),
            job(1, slots=2, group="cmd"),
            "needs 2 slots, more than group cmd's max_slots 1",
        ),
        (
            PolicyConfig(user_quota={"bob": 1}),
            job(1, slots=2, user="bob"),
            "needs 2 slots, more than user bob's quota 1",
        ),
    ],
)
def test_job_larger_than_its_cap_says_so(cfg: PolicyConfig, j: JobView, why: str) -> None:
    d = sched(8, [], [j, job(2)], cfg)
    assert d.waiting == {1: why}
    assert started(d) == [2]


@pytest.mark.parametrize("cfg", [PRIO, FAIR])
def test_caps_apply_in_both_modes(cfg: PolicyConfig) -> None:
    cfg = replace(cfg, group_max_slots={"exp:1": 1}, user_quota={"bob": 2})
    queued = [job(1, group="exp:1"), job(2, group="exp:1")] + [
        job(i, user="bob") for i in (3, 4, 5)
    ]
    d = sched(8, [], queued, cfg)
    assert sorted(started(d)) == [1, 3, 4]
    assert set(d.waiting) == {2, 5}


# ---------------------------------------------------------------------------------------
# rule 7: zero-slot jobs


@pytest.mark.parametrize("cfg", [PRIO, PRIO_NOPREEMPT, FAIR])
def test_zero_slot_jobs_start_regardless(cfg: PolicyConfig) -> None:
    cfg = replace(cfg, user_quota={"bob": 0}, group_max_slots={"exp:1": 0})
    running = [run(job(90, slots=2, priority=1), [0, 1])]
    queued = [
        job(1, slots=2, priority=1),  # blocked: a barrier
        job(2, slots=0, priority=99, preemptible=False),  # behind it, still starts
        job(3, slots=0, user="bob", group="exp:1"),  # over quota and max_slots of 0
    ]
    d = sched(2, running, queued, cfg)
    assert sorted(d.start) == [(2, ()), (3, ())]
    assert d.preempt == ()
    assert set(d.waiting) == {1}


# ---------------------------------------------------------------------------------------
# rule 5: fair share


def test_fair_share_weights_1_to_3() -> None:
    cfg = replace(FAIR, user_weight={"bob": 3.0})
    queued = [job(i, user="ann") for i in range(1, 11)] + [
        job(i, user="bob") for i in range(11, 21)
    ]
    d = sched(8, [], queued, cfg)
    users = [queued[jid - 1].user for jid in started(d)]
    assert users.count("ann") == 2 and users.count("bob") == 6


def test_fair_share_equal_weights_interleave_users() -> None:
    queued = [job(i, user="ann") for i in range(1, 5)] + [job(i, user="bob") for i in range(5, 9)]
    assert [j.id for j in queue_order(queued, FAIR)] == [1, 5, 2, 6, 3, 7, 4, 8]
    d = sched(4, [], queued, FAIR)
    assert started(d) == [1, 5, 2, 6]


def test_fair_share_counts_running_usage() -> None:
    running = [run(job(90, user="ann"), [0]), run(job(91, user="ann"), [1])]
    queued = [job(1, user="ann"), job(2, user="bob"), job(3, user="bob")]
    d = sched(4, running, queued, FAIR)
    assert started(d) == [2, 3]
    assert queue_order(queued, FAIR, running)[0].id == 2


def test_fair_share_within_a_user_priority_then_position() -> None:
    queued = [job(1, user="ann", priority=50), job(2, user="ann", priority=10), job(3, user="bob")]
    # tie on usage: the more important head job first
    assert [j.id for j in queue_order(queued, FAIR)] == [2, 3, 1]


def test_fair_share_preempts_over_share_user_most_recent_first() -> None:
    # 4 slots, two users: 2 each. bob holds all 4; ann queues one job.
    running = [run(job(90 + i, user="bob", position=90 + i), [i]) for i in range(4)]
    d = sched(4, running, [job(1, user="ann", position=100)], FAIR)
    assert d.preempt == (93,)
    assert d.waiting[1] == "needs 1 slot, 0 free; preempting job 93"
    # ann asks for 3: she'd be over her share of 2, so nothing is preempted for it
    d = sched(4, running, [job(1, slots=3, user="ann", position=100)], FAIR)
    assert d.preempt == ()


def test_fair_share_never_pushes_the_victim_below_its_share() -> None:
    # bob holds 3 of 4 (share 2): only one slot can be taken from him; his most recent job
    # holds 2 and would leave him at 1, so the older one-slot job goes instead.
    running = [
        run(job(90, slots=1, user="bob", position=1), [0]),
        run(job(91, slots=2, user="bob", position=2), [1, 2]),
        run(job(92, slots=1, user="ann", position=3), [3]),
    ]
    d = sched(4, running, [job(1, user="ann", position=10)], FAIR)
    assert d.preempt == (90,)
    # ann needing 2 more would go over her share: nothing
    d = sched(4, running, [job(1, slots=2, user="ann", position=10)], FAIR)
    assert d.preempt == ()


def test_fair_share_preemption_respects_weights_and_non_preemptible() -> None:
    cfg = replace(FAIR, user_weight={"bob": 3.0})  # 8 slots: ann 2, bob 6
    running = [run(job(90 + i, user="bob", preemptible=(i != 7)), [i]) for i in range(8)]
    queued = [job(1, slots=2, user="ann", position=200)]
    d = sched(8, running, queued, cfg)
    assert d.preempt == (96, 95)  # 97 is not preemptible; most recent preemptible first


def test_fair_share_takes_from_the_most_over_share_user_first() -> None:
    # 6 slots, three users with demand: a share of 2 each
    running = [run(job(80 + i, user="bob", position=80 + i), [i]) for i in range(4)]
    running += [run(job(90 + i, user="cy", position=90 + i), [4 + i]) for i in range(2)]
    d = sched(6, running, [job(1, slots=2, user="ann", position=100)], FAIR)
    assert d.preempt == (83, 82)  # bob is 2 over, cy is at her share
    running = [run(job(80 + i, user="bob", position=80 + i), [i]) for i in range(3)]
    running += [run(job(90 + i, user="cy", position=90 + i), [3 + i]) for i in range(3)]
    d = sched(6, running, [job(1, slots=2, user="ann", position=100)], FAIR)
    assert d.preempt == (82, 92)  # one each: neither goes below 2


def test_fair_share_queue_order_follows_weights() -> None:
    cfg = replace(FAIR, user_weight={"bob": 3.0})
    queued = [job(i, user="ann") for i in range(1, 9)] + [job(i, user="bob") for i in range(9, 17)]
    first = [j.user for j in queue_order(queued, cfg)[:8]]
    assert first.count("ann") == 2 and first.count("bob") == 6


def test_fair_share_is_stable_no_ping_pong() -> None:
    cfg = replace(FAIR, user_weight={"bob": 3.0})
    sim = Sim(8, cfg)
    for i in range(1, 21):
        sim.submit(job(i, user="bob"))
    sim.settle()
    assert len(sim.running) == 8
    for i in range(21, 31):
        sim.submit(job(i, user="ann"))
    sim.settle()
    users = sorted(r.job.user for r in sim.running)
    assert users.count("ann") == 2 and users.count("bob") == 6
    preempted = list(sim.preempted)
    for _ in range(3):  # further passes change nothing
        d = sim.step()
        assert d.start == () and d.preempt == ()
    assert sim.preempted == preempted


def test_fair_share_barrier_needs_preemption_and_preemptible() -> None:
    running = [run(job(90, slots=2, user="bob"), [0, 1])]
    queued = [job(1, slots=4, user="ann"), job(2, slots=1, user="bob", position=50)]
    d = sched(4, running, queued, replace(FAIR, preemption=False))
    assert d.start == ()
    assert d.waiting[2] == "behind job 1 (user ann)"
    d = sched(4, running, queued, FAIR)
    assert started(d) == [2]  # preemptible: fair share can take it back
    queued[1] = replace(queued[1], preemptible=False)
    d = sched(4, running, queued, FAIR)
    assert d.waiting[2] == "behind job 1 (user ann)"


# ---------------------------------------------------------------------------------------
# rule 8: determinism, invariants, speed


def random_state(
    rng: random.Random, total: int, n_running: int, n_queued: int
) -> tuple[list[int], list[RunningJob], list[JobView]]:
    users = ["ann", "bob", "cy", "dee"]
    slots = list(range(total))
    rng.shuffle(slots)
    running: list[RunningJob] = []
    jid = 1000
    for _ in range(n_running):
        n = rng.choice([0, 1, 1, 1, 2, 4])
        if n > len(slots):
            break
        held, slots = slots[:n], slots[n:]
        j = JobView(
            id=jid,
            user=rng.choice(users),
            priority=rng.choice([10, 42, 42, 60, 90]),
            position=float(rng.randrange(10_000)),
            slots=n,
            group=rng.choice([None, "exp:1", "exp:2"]),
            preemptible=rng.random() < 0.8,
        )
        running.append(RunningJob(j, tuple(sorted(held)), preempting=rng.random() < 0.1))
        jid += 1
    queued = [
        JobView(
            id=i,
            user=rng.choice(users),
            priority=rng.choice([10, 42, 42, 60, 90]),
            position=float(rng.randrange(10_000)),
            slots=rng.choice([0, 1, 1, 1, 2, 4, 8]),
            group=rng.choice([None, "exp:1", "exp:2"]),
            preemptible=rng.random() < 0.8,
        )
        for i in range(1, n_queued + 1)
    ]
    return sorted(slots), running, queued


CONFIGS = [
    PRIO,
    PRIO_NOPREEMPT,
    FAIR,
    replace(FAIR, preemption=False),
    PolicyConfig(
        group_max_slots={"exp:1": 4, "exp:2": 2},
        user_quota={"bob": 3, "cy": 5},
    ),
    PolicyConfig(
        mode="fair_share",
        group_max_slots={"exp:1": 4},
        user_quota={"ann": 4},
        user_weight={"ann": 3.0, "dee": 0.5},
    ),
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"{c.mode}-{c.preemption}")
def test_same_inputs_same_decision_whatever_the_input_order(cfg: PolicyConfig) -> None:
    rng = random.Random(7)
    for _ in range(30):
        free, running, queued = random_state(rng, 8, 6, 30)
        d1 = schedule(8, free, running, queued, cfg)
        for _ in range(3):
            q2, r2, f2 = list(queued), list(running), list(free)
            rng.shuffle(q2)
            rng.shuffle(r2)
            rng.shuffle(f2)
            assert schedule(8, f2, r2, q2, cfg) == d1


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"{c.mode}-{c.preemption}")
def test_invariants_on_random_states(cfg: PolicyConfig) -> None:
    rng = random.Random(11)
    for _ in range(300):
        total = rng.choice([1, 2, 4, 8])
        free, running, queued = random_state(rng, total, rng.randrange(6), rng.randrange(25))
        d = schedule(total, free, running, queued, cfg)
        check_invariants(total, free, running, queued, cfg, d)


def check_invariants(
    total: int,
    free: list[int],
    running: list[RunningJob],
    queued: list[JobView],
    cfg: PolicyConfig,
    d: Decision,
) -> None:
    by_id = {j.id: j for j in queued}
    run_by_id = {r.job.id: r for r in running}
    # every queued job either starts or has a reason
    assert sorted([*started(d), *d.waiting]) == sorted(by_id)
    used: list[int] = []
    for jid, slots in d.start:
        assert len(slots) == by_id[jid].slots  # gang
        used.extend(slots)
    assert len(used) == len(set(used)) and set(used) <= set(free)
    for v in d.preempt:
        r = run_by_id[v]
        assert r.job.preemptible and not r.preempting and r.slots
    assert len(d.preempt) == len(set(d.preempt))
    if not cfg.preemption:
        assert d.preempt == ()
    # caps hold after the starts
    group: dict[str, int] = {}
    user: dict[str, int] = {}
    for j, n in [(r.job, len(r.slots)) for r in running] + [
        (by_id[jid], len(s)) for jid, s in d.start
    ]:
        if j.group:
            group[j.group] = group.get(j.group, 0) + n
        user[j.user] = user.get(j.user, 0) + n
    for g, cap in cfg.group_max_slots.items():
        assert group.get(g, 0) <= cap or all(by_id[jid].group != g for jid, s in d.start if s)
    for u, cap in cfg.user_quota.items():
        assert user.get(u, 0) <= cap or all(by_id[jid].user != u for jid, s in d.start if s)
    if cfg.mode == "priority":
        # no priority inversion: a started job after one blocked for lack of slots must be
        # preemptible and strictly less important, with preemption on
        order = queue_order(queued, cfg)
        pos = {j.id: i for i, j in enumerate(order)}
        blocked = [
            by_id[i]
            for i, why in d.waiting.items()
            if (why.startswith("needs ") and " free" in why) or why.startswith("behind ")
        ]
        for jid, slots in d.start:
            j = by_id[jid]
            if not slots:
                continue
            for b in blocked:
                if pos[b.id] < pos[jid]:
                    assert cfg.preemption and j.preemptible and j.priority > b.priority
        # victims are strictly less important than some blocked job
        if d.preempt:
            most_important = min(b.priority for b in blocked)
            assert all(run_by_id[v].job.priority > most_important for v in d.preempt)


def test_simulation_drains_any_queue() -> None:
    # every job that fits its caps eventually runs, in every mode
    for cfg in CONFIGS:
        rng = random.Random(3)
        sim = Sim(4, cfg)
        for i in range(1, 41):
            sim.submit(
                job(
                    i,
                    slots=rng.choice([0, 1, 2, 4]),
                    priority=rng.choice([10, 42, 90]),
                    user=rng.choice(["ann", "bob"]),
                    preemptible=rng.random() < 0.7,
                )
            )
        for _ in range(2000):
            sim.step()
            sim.apply_preemptions()
            if sim.running:
                sim.finish(min(sim.running, key=lambda r: r.job.position).job.id)
            if not sim.running and not sim.step().start:
                break
        assert not sim.running, cfg
        # what is left can never run: larger than its user's quota
        assert all(j.slots > cfg.user_quota[j.user] for j in sim.queued), cfg
        assert sorted(sim.done + [j.id for j in sim.queued]) == list(range(1, 41))


def big_state() -> tuple[list[int], list[RunningJob], list[JobView]]:
    rng = random.Random(5)
    users = [f"user{i}" for i in range(12)]
    running = []
    for i in range(50):
        j = JobView(
            id=100_000 + i,
            user=rng.choice(users),
            priority=rng.choice([10, 30, 42, 60, 80]),
            position=float(i),
            slots=1,
            group=f"exp:{i % 7}",
            preemptible=i % 5 != 0,
        )
        running.append(RunningJob(j, (i,), preempting=i % 11 == 0))
    queued = [
        JobView(
            id=i,
            user=rng.choice(users),
            priority=rng.choice([5, 10, 30, 42, 42, 60, 80]),
            position=float(100 + i),
            slots=rng.choice([1, 1, 2, 4, 8, 16]),
            group=f"exp:{i % 40}",
            preemptible=i % 9 != 0,
        )
        for i in range(10_000)
    ]
    return list(range(50, 64)), running, queued


@pytest.mark.parametrize(
    "cfg",
    [
        PRIO,
        PRIO_NOPREEMPT,
        FAIR,
        PolicyConfig(
            mode="fair_share",
            group_max_slots={f"exp:{i}": 4 for i in range(40)},
            user_quota={"user1": 8},
            user_weight={"user2": 3.0},
        ),
    ],
    ids=["priority", "priority-nopreempt", "fair_share", "fair_share-caps"],
)
def test_ten_thousand_queued_jobs_in_well_under_50ms(cfg: PolicyConfig) -> None:
    free, running, queued = big_state()
    schedule(64, free, running, queued, cfg)  # warm-up
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        d = schedule(64, free, running, queued, cfg)
        best = min(best, time.perf_counter() - t0)
    print(f"\nschedule(): 10,000 queued, 64 slots, 50 running, {cfg.mode}: {best * 1000:.1f} ms")
    assert len(d.start) + len(d.waiting) == 10_000
    assert best < 0.2


# ---------------------------------------------------------------------------------------
# a tiny daemon: applies decisions; preempted jobs exit at once and are requeued


class Sim:
    def __init__(self, total: int, cfg: PolicyConfig) -> None:
        self.total = total
        self.cfg = cfg
        self.running: list[RunningJob] = []
        self.queued: list[JobView] = []
        self.preempted: list[int] = []
        self.done: list[int] = []

    def submit(self, j: JobView) -> None:
        self.queued.append(j)

    def running_ids(self) -> list[int]:
        return sorted(r.job.id for r in self.running)

    def step(self) -> Decision:
        d = schedule(
            self.total, free_of(self.total, self.running), self.running, self.queued, self.cfg
        )
        by_id = {j.id: j for j in self.queued}
        for jid, slots in d.start:
            self.running.append(RunningJob(by_id[jid], slots))
        ids = set(started(d))
        self.queued = [j for j in self.queued if j.id not in ids]
        self.running = [
            replace(r, preempting=True) if r.job.id in d.preempt else r for r in self.running
        ]
        self.preempted.extend(d.preempt)
        # zero-slot jobs are done at once
        for r in [r for r in self.running if not r.slots]:
            self.finish(r.job.id)
        return d

    def apply_preemptions(self) -> None:
        """Preempting trials checkpoint, exit and go back to the queue."""
        for r in [r for r in self.running if r.preempting]:
            self.running.remove(r)
            self.queued.append(r.job)

    def finish(self, jid: int) -> None:
        self.running = [r for r in self.running if r.job.id != jid]
        self.done.append(jid)

    def settle(self) -> None:
        for _ in range(20):
            self.apply_preemptions()
            d = self.step()
            if not d.start and not d.preempt:
                return
        raise AssertionError("the schedule does not settle")

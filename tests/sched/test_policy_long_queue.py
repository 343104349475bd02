"""Policy rule 9: a queue handed over as a SortedQueue is read only as far as can matter, and
the decision (what starts, on which slots, whom to preempt) is exactly the one the whole queue
gives."""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from dataclasses import replace

import pytest

from det_local.sched.queue.policy import (
    Decision,
    JobView,
    PolicyConfig,
    RunningJob,
    SortedQueue,
    queue_order,
    schedule,
)

PRIO = PolicyConfig()
FAIR = PolicyConfig(mode="fair_share")
CONFIGS = [
    PRIO,
    PolicyConfig(preemption=False),
    FAIR,
    replace(FAIR, preemption=False),
    PolicyConfig(group_max_slots={"exp:1": 2, "exp:2": 1}, user_quota={"bob": 3}),
    PolicyConfig(
        mode="fair_share",
        group_max_slots={"exp:1": 4},
        user_quota={"ann": 4},
        user_weight={"ann": 3.0, "dee": 0.5},
    ),
]


class Counted:
    """The queue in policy order, counting how many jobs were read."""

    def __init__(self, jobs: Sequence[JobView]) -> None:
        self.jobs = list(jobs)
        self.read = 0

    def __iter__(self) -> Iterator[JobView]:
        for j in self.jobs:
            self.read += 1
            yield j


def lazily(
    total: int,
    free: Sequence[int],
    running: Sequence[RunningJob],
    queued: Sequence[JobView],
    cfg: PolicyConfig,
) -> tuple[Decision, Counted]:
    # the daemon's index order: (priority, position, id), whatever the mode
    ordered = Counted(sorted(queued, key=lambda j: (j.priority, j.position, j.id)))
    zero = sum(1 for j in queued if j.slots <= 0)
    return schedule(total, free, running, SortedQueue(ordered, zero), cfg), ordered


def same_decision(full: Decision, lazy: Decision, queued: Sequence[JobView]) -> None:
    assert lazy.start == full.start
    assert lazy.preempt == full.preempt
    # the jobs read wait for the same reasons; the rest wait too
    for jid, why in lazy.waiting.items():
        assert full.waiting[jid] == why
    if lazy.complete:
        assert dict(lazy.waiting) == dict(full.waiting)
    else:
        assert set(lazy.waiting) < set(full.waiting)


def random_state(
    rng: random.Random, total: int, n_running: int, n_queued: int
) -> tuple[list[int], list[RunningJob], list[JobView]]:
    users = ["ann", "bob", "cy", "dee"]
    slots = list(range(total))
    rng.shuffle(slots)
    running: list[RunningJob] = []
    preemptible_share = rng.choice([0.0, 0.5, 1.0])
    for jid in range(1000, 1000 + n_running):
        n = rng.choice([0, 1, 1, 1, 2, 4])
        if n > len(slots):
            break
        held, slots = slots[:n], slots[n:]
        j = JobView(
            id=jid,
            user=rng.choice(users),
            priority=rng.choice([10, 42, 42, 43, 60, 90]),
            position=float(rng.randrange(10_000)),
            slots=n,
            group=rng.choice([None, "exp:1", "exp:2"]),
            preemptible=rng.random() < preemptible_share,
        )
        running.append(RunningJob(j, tuple(sorted(held)), preempting=rng.random() < 0.1))
    queued = [
        JobView(
            id=i,
            user=rng.choice(users),
            priority=rng.choice([10, 42, 42, 43, 60, 90]),
            # ties in position are broken by id
            position=float(rng.randrange(50)),
            slots=rng.choice([0, 1, 1, 1, 1, 2, 4, 8]) if rng.random() < 0.9 else 0,
            group=rng.choice([None, "exp:1", "exp:2"]),
            preemptible=rng.random() < 0.7,
        )
        for i in range(1, n_queued + 1)
    ]
    return sorted(slots), running, queued


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"{c.mode}-{c.preemption}")
def test_sorted_queue_gives_the_same_decision_as_the_whole_queue(cfg: PolicyConfig) -> None:
    rng = random.Random(23)
    stopped_early = 0
    for _ in range(600):
        total = rng.choice([1, 2, 4, 8])
        free, running, queued = random_state(
            rng, total, rng.randrange(8), rng.choice([0, 1, 3, 10, 40, 120])
        )
        full = schedule(total, free, running, queued, cfg)
        lazy, read = lazily(total, free, running, queued, cfg)
        same_decision(full, lazy, queued)
        if not lazy.complete:
            stopped_early += 1
            assert len(lazy.start) + len(lazy.waiting) < len(queued)
            if cfg.mode == "priority":  # (fair share takes the whole queue to interleave it)
                assert read.read <= len(lazy.start) + len(lazy.waiting) + 1
    assert stopped_early > 20  # the early stop is exercised, not only the full read


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"{c.mode}-{c.preemption}")
def test_sorted_queue_over_a_simulated_daemon(cfg: PolicyConfig) -> None:
    # pass after pass, as the daemon runs them: start, end one job, requeue a preempted one
    rng = random.Random(5)
    for _ in range(20):
        total = rng.choice([2, 4])
        _, _, queued = random_state(rng, total, 0, 60)
        running: list[RunningJob] = []
        for _ in range(200):
            free = sorted(set(range(total)) - {s for r in running for s in r.slots})
            full = schedule(total, free, running, queued, cfg)
            lazy, _ = lazily(total, free, running, queued, cfg)
            same_decision(full, lazy, queued)
            by_id = {j.id: j for j in queued}
            for jid in full.preempt:
                running = [replace(r, preempting=True) if r.job.id == jid else r for r in running]
            for jid, slots in full.start:
                running.append(RunningJob(by_id.pop(jid), slots))
            queued = list(by_id.values())
            if not running:
                break
            ended = rng.choice(running)
            running.remove(ended)
            if ended.preempting:  # it checkpointed: back in the queue
                queued.append(ended.job)


def test_a_long_queue_behind_busy_slots_is_not_read() -> None:
    # the benchmark's case: commands (not preemptible) hold both slots, 10,000 wait
    running = [
        RunningJob(JobView(i, "ann", 42, float(i), 1, preemptible=False), (i,)) for i in (0, 1)
    ]
    queued = [JobView(i, "ann", 42, float(i), 1, preemptible=False) for i in range(2, 10_002)]
    for cfg in (PRIO, PolicyConfig(preemption=False)):
        d, read = lazily(2, [], running, queued, cfg)
        assert d.start == () and d.preempt == () and not d.complete
        assert read.read <= 2
    # one slot frees: the first job takes it, nothing more is read than the next one
    d, read = lazily(2, [1], running[:1], queued, PRIO)
    assert d.start == ((2, (1,)),) and not d.complete and read.read <= 3


def test_long_queue_reads_on_while_a_later_job_may_preempt() -> None:
    # trials of priority 90 hold the slots: a queued job of priority 42 may preempt them even
    # after one of priority 10 that needs more than the machine could free
    low = [RunningJob(JobView(100 + i, "ann", 90, float(100 + i), 1), (i,)) for i in (0, 1)]
    queued = [
        JobView(1, "bob", 10, 1.0, 4),  # 4 > 2 slots: waits, blocks nobody
        *[JobView(i, "bob", 80, float(i), 2, group="exp:9") for i in range(2, 500)],
        JobView(500, "cy", 42, 500.0, 1),
    ]
    cfg = PolicyConfig(group_max_slots={"exp:9": 0})
    full = schedule(2, [], low, queued, cfg)
    lazy, _ = lazily(2, [], low, queued, cfg)
    assert full.preempt == (101,)
    same_decision(full, lazy, queued)


def test_a_blocked_job_that_found_no_victims_does_not_end_the_read() -> None:
    # A (priority 42) needs all 3 slots: the two trials of priority 60 are not enough (the
    # command holds the third). B (priority 50, after A) needs 1: it passes A and preempts one
    # of them, though A, read before it, found no victims
    queued = [JobView(1, "ann", 42, 1.0, 3), JobView(2, "bob", 50, 2.0, 1)]
    queued += [JobView(i, "cy", 55, float(i), 1) for i in range(3, 100)]
    running = [
        RunningJob(JobView(100, "dee", 42, 0.0, 1, preemptible=False), (0,)),
        RunningJob(JobView(101, "dee", 60, 0.5, 1), (1,)),
        RunningJob(JobView(102, "dee", 60, 0.6, 1), (2,)),
    ]
    full = schedule(3, [], running, queued, PRIO)
    lazy, read = lazily(3, [], running, queued, PRIO)
    assert full.waiting[2].endswith("preempting job 102")
    # job 3 (priority 55) passes B and takes job 101; after it nothing is left to take
    assert full.preempt == (102, 101) and full.waiting[3].endswith("preempting job 101")
    same_decision(full, lazy, queued)
    assert not lazy.complete and read.read <= 4  # (the 4th: read to see that one is left)


def test_zero_slot_jobs_deep_in_the_queue_still_start() -> None:
    running = [RunningJob(JobView(50, "ann", 42, 0.0, 2, preemptible=False), (0, 1))]
    queued = [JobView(i, "ann", 42, float(i), 1) for i in range(1, 300)]
    queued.append(JobView(300, "ann", 99, 300.0, 0))
    for cfg in CONFIGS:
        full = schedule(2, [], running, queued, cfg)
        lazy, _ = lazily(2, [], running, queued, cfg)
        assert (300, ()) in lazy.start
        same_decision(full, lazy, queued)


def test_fair_share_sorted_queue_keeps_the_interleaving() -> None:
    queued = [JobView(i, ["ann", "bob"][i % 2], 42, float(i), 1) for i in range(1, 41)]
    full = schedule(4, [0, 1, 2, 3], [], queued, FAIR)
    lazy, _ = lazily(4, [0, 1, 2, 3], [], queued, FAIR)
    same_decision(full, lazy, queued)
    assert [j for j, _ in lazy.start] == [j.id for j in queue_order(queued, FAIR)[:4]]

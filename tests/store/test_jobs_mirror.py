"""The writer's in-memory copy of the active jobs (store/tables/jobs.py ActiveJobs) stays what SQL
says: after every kind of change, after a rolled-back request, after another connection's
commit. Real SQLite files, the engine's own request path for the rollback."""

from __future__ import annotations

import random
import sqlite3
from pathlib import Path

import pytest

from det_local.errors import StateError
from det_local.store.db import Store
from det_local.store.states import JOB_TRANSITIONS, JobState
from det_local.store.tables.jobs import QUEUED, SCHEDULED, JobRecord, JobTable


def sql_view(store: Store) -> list[JobRecord]:
    """The active jobs as SQL gives them on the writer's own connection (its uncommitted
    changes included), bypassing the copy."""
    return JobTable(store.conn, readonly=True).active()


def check(store: Store) -> None:
    truth = sql_view(store)
    assert store.jobs.active() == truth
    view = store.jobs.scheduling_view()
    queued = [j for j in truth if j.state == QUEUED]
    queued.sort(key=lambda j: (j.priority, j.position, j.id))
    assert list(view.queued_in_order()) == queued
    assert view.running == {j.id: j for j in truth if j.state == SCHEDULED}
    assert view.zero_slot == sum(1 for j in queued if j.slots_needed == 0)
    # what a reader sees once committed: the same rows
    if not store.conn.in_transaction:
        reader = Store(store.path, readonly=True)
        try:
            assert reader.jobs.active() == truth
        finally:
            reader.close()


def random_change(store: Store, rng: random.Random, ids: list[int], trial: list[int]) -> None:
    jobs = store.jobs
    op = rng.choice(
        ["create", "create", "allocate", "process", "finish", "requeue", "priority", "move"]
        + ["acked", "cancel"]
    )
    if op == "create" or not ids:
        kind = rng.choice(["COMMAND", "TRIAL"])
        trial_id = None
        if kind == "TRIAL":
            trial[0] += 1
            trial_id = trial[0]
        ids.append(
            jobs.create(
                kind=kind,
                name=f"job {len(ids)}",
                user=rng.choice(["ann", "bob"]),
                uid=1000,
                priority=rng.choice([10, 42, 42, 90]),
                slots_needed=rng.choice([0, 1, 1, 2]),
                experiment_id=1 if trial_id else None,
                trial_id=trial_id,
                argv=["true"],
                cwd="/",
            )
        )
        return
    job_id = rng.choice(ids)
    moves = {
        "allocate": (
            JobState.SCHEDULED,
            jobs.allocate,
            (rng.sample(range(4), rng.choice([0, 1, 2])), 1),
        ),
        "finish": (JobState.DONE, jobs.finish, (rng.choice([None, 0, 1]), "ended")),
        "cancel": (JobState.CANCELED, jobs.cancel, ("canceled",)),
    }
    if op in moves or op == "requeue":
        # a state change: made as the transition table allows, refused (nothing changed) if not
        new, change, args = moves.get(op) or (JobState.QUEUED, None, ())
        before = jobs.get(job_id)
        legal = before.state == new.value or new in JOB_TRANSITIONS[JobState(before.state)]
        try:
            if change is None:
                jobs.requeue(job_id, priority=rng.choice([None, 5, 50]))
            else:
                change(job_id, *args)  # type: ignore[operator]
        except StateError as err:
            assert not legal, err
            assert jobs.get(job_id) == before
            assert (
                f"job {job_id} is {JobState(before.state).value}; it cannot become {new.value}"
                in str(err)
            )
        else:
            assert legal, (before.state, new)
            assert jobs.get(job_id).state == new.value
    elif op == "process":
        jobs.set_process(job_id, rng.randrange(2, 1 << 20), float(rng.randrange(1000)))
    elif op == "priority":
        jobs.set_priority(job_id, rng.choice([1, 42, 99]))
    elif op == "move":
        other = rng.choice(ids)
        if other != job_id and jobs.get(other).state in (QUEUED, SCHEDULED):
            jobs.set_position(job_id, jobs.neighbour_position(other, ahead=rng.random() < 0.5))
    else:
        jobs.set_preempt_acked(job_id)


def test_copy_equals_sql_after_random_changes_and_rollbacks(tmp_path: Path) -> None:
    store = Store(tmp_path / "db.sqlite")
    rng = random.Random(3)
    ids: list[int] = []
    trial = [0]
    rolled_back = 0
    for _ in range(400):
        if rng.random() < 0.15:
            # a request's savepoint: changes, then kept or undone (as requests.py does)
            store.conn.execute("SAVEPOINT request")
            kept = list(ids)
            for _ in range(rng.randrange(1, 6)):
                random_change(store, rng, ids, trial)
                check(store)  # the copy follows uncommitted changes too
            if rng.random() < 0.5:
                store.jobs.reload()
                store.conn.execute("ROLLBACK TO request")
                ids[:] = kept
                rolled_back += 1
            store.conn.execute("RELEASE request")
        else:
            random_change(store, rng, ids, trial)
        check(store)
    assert rolled_back > 5
    assert len(store.jobs.active()) > 5
    store.close()


def test_copy_is_kept_not_read_again_while_nothing_else_writes(tmp_path: Path) -> None:
    store = Store(tmp_path / "db.sqlite")
    a = store.jobs.create(kind="COMMAND", name="a", user="ann", uid=1, priority=42, slots_needed=1)
    view = store.jobs.scheduling_view()
    store.jobs.allocate(a, [0], 1)
    store.jobs.create(kind="COMMAND", name="b", user="ann", uid=1, priority=42, slots_needed=1)
    assert store.jobs.scheduling_view() is view  # changed in place, not read again
    assert list(view.running) == [a] and len(view.queue) == 1
    check(store)
    store.close()


def test_another_connections_commit_is_seen(tmp_path: Path) -> None:
    # one writer is the rule; a repair by hand (or a test) must still not leave the copy stale
    store = Store(tmp_path / "db.sqlite")
    a = store.jobs.create(kind="COMMAND", name="a", user="ann", uid=1, priority=42, slots_needed=1)
    b = store.jobs.create(kind="COMMAND", name="b", user="ann", uid=1, priority=42, slots_needed=1)
    check(store)
    other = sqlite3.connect(store.path)
    with other:
        other.execute("UPDATE jobs SET state='DONE' WHERE id=?", (a,))
        other.execute("UPDATE jobs SET priority=7 WHERE id=?", (b,))
    other.close()
    assert [(j.id, j.priority) for j in store.jobs.active()] == [(b, 7)]
    check(store)
    store.close()


def test_a_reader_reads_sql(tmp_path: Path) -> None:
    store = Store(tmp_path / "db.sqlite")
    reader = Store(store.path, readonly=True)
    assert reader.jobs.active() == []
    a = store.jobs.create(kind="COMMAND", name="a", user="ann", uid=1, priority=42, slots_needed=1)
    assert [j.id for j in reader.jobs.active()] == [a]
    assert [j.id for j in reader.jobs.scheduling_view().queued_in_order()] == [a]
    store.jobs.finish(a, 0)
    assert reader.jobs.active() == []
    reader.close()
    store.close()


def test_a_request_rolled_back_leaves_no_trace_in_the_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """requests.py: a request whose answer cannot be recorded (a full disk) is undone; the
    job it created must not stay in the copy (a pass would start a job that does not exist)."""
    from det_local.sched.engine import Engine
    from det_local.sched.intake import spool
    from det_local.store.paths import Paths

    monkeypatch.setenv("DET_LOCAL_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("DET_LOCAL_CPU_SLOTS", "2")
    paths = Paths.from_env()
    engine = Engine(paths, offline=True, out=lambda line: None)
    try:
        kept = engine.submit_command(
            argv=["true"], cwd="/", env={"PATH": "/bin:/usr/bin"}, slots=1, priority=42,
            user="ann", uid=1000,
        )  # fmt: skip
        assert [j.id for j in engine.store.jobs.scheduling_view().queued_in_order()] == [kept]
        payload = {"argv": ["true"], "cwd": "/", "env": {"PATH": "/bin:/usr/bin"}, "slots": 1}
        req_id = spool.submit(paths, "cmd_run", payload)
        req = spool.read(next(p for p in spool.pending(paths) if p.name.startswith(req_id)))

        def disk_full(request_id: str, result: object) -> None:
            raise sqlite3.OperationalError("database or disk is full")

        monkeypatch.setattr(engine.store.jobs, "record_request", disk_full)
        with pytest.raises(sqlite3.OperationalError):
            engine.spool.apply_and_record(req)
        assert not engine.store.conn.in_transaction
        check(engine.store)
        assert [j.id for j in engine.store.jobs.active()] == [kept]
        monkeypatch.undo()
        # tried again later: applied once
        answer = engine.spool.apply_and_record(req)
        check(engine.store)
        assert [j.id for j in engine.store.jobs.active()] == [kept, answer["value"]]
    finally:
        engine.store.close()

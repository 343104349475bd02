"""The state tables (store/states.py) and the store's enforcement of them (DESIGN rule 3): every
legal move is accepted, every illegal one raises StateError naming both states and changes
nothing. Stored and printed values are the strings they always were. Real SQLite files."""

from __future__ import annotations

import itertools
import json
import uuid as uuidlib
from collections.abc import Callable, Mapping
from enum import Enum
from pathlib import Path
from typing import Any

import pytest

from det_local.errors import DetLocalError, NotFoundError, StateError
from det_local.priority import DEFAULT_PRIORITY, MAX_PRIORITY, MIN_PRIORITY, check_priority
from det_local.store.db import Store
from det_local.store.records import CheckpointRecord
from det_local.store.states import (
    CHECKPOINT_TRANSITIONS,
    JOB_TRANSITIONS,
    STOPPING_TRANSITIONS,
    TRANSITIONS,
    CheckpointState,
    JobState,
    State,
    Stopping,
    check_checkpoint_transition,
    check_job_transition,
    check_stopping,
    check_transition,
)


def _pairs(table: Mapping[Any, frozenset[Any]]) -> tuple[list[Any], list[Any]]:
    """(legal, illegal) (old, new) pairs of a table; staying put is legal."""
    legal, illegal = [], []
    for old, new in itertools.product(table, repeat=2):
        (legal if old == new or new in table[old] else illegal).append((old, new))
    return legal, illegal


TABLES: list[tuple[str, Mapping[Any, frozenset[Any]], Callable[[Any, Any], None]]] = [
    ("experiment", TRANSITIONS, lambda o, n: check_transition("experiment", 7, o, n)),
    ("job", JOB_TRANSITIONS, lambda o, n: check_job_transition(7, o, n)),
    ("checkpoint", CHECKPOINT_TRANSITIONS, lambda o, n: check_checkpoint_transition("u-7", o, n)),
    ("stopping", STOPPING_TRANSITIONS, lambda o, n: check_stopping(7, o, n)),
]


def _name(s: Any) -> str:
    return "none" if s is None else str(s.value)


@pytest.mark.parametrize("kind,table,check", TABLES, ids=[t[0] for t in TABLES])
def test_every_legal_move_is_accepted_and_every_illegal_one_raises(
    kind: str, table: Mapping[Any, frozenset[Any]], check: Callable[[Any, Any], None]
) -> None:
    legal, illegal = _pairs(table)
    assert illegal, f"the {kind} table allows everything"
    for old, new in legal:
        check(old, new)
    for old, new in illegal:
        with pytest.raises(StateError) as err:
            check(old, new)
        message = str(err.value)
        assert _name(old) in message and _name(new) in message and "7" in message, message
        assert "\n" not in message


def test_tables_cover_every_state_and_the_moves_named_in_the_design() -> None:
    for enum_cls, table in (
        (State, TRANSITIONS),
        (JobState, JOB_TRANSITIONS),
        (CheckpointState, CHECKPOINT_TRANSITIONS),
    ):
        assert set(table) == set(enum_cls)
        assert all(set(targets) <= set(enum_cls) for targets in table.values())
    assert set(STOPPING_TRANSITIONS) == {None, *Stopping}
    J = JobState
    assert J.SCHEDULED in JOB_TRANSITIONS[J.QUEUED] and J.CANCELED in JOB_TRANSITIONS[J.QUEUED]
    assert J.QUEUED in JOB_TRANSITIONS[J.DONE]  # a trial's job queued again on activate
    assert not JOB_TRANSITIONS[J.CANCELED]
    assert J.SCHEDULED not in JOB_TRANSITIONS[J.DONE]
    assert not CHECKPOINT_TRANSITIONS[CheckpointState.DELETED]
    assert Stopping.ERROR not in STOPPING_TRANSITIONS[Stopping.KILL]  # nothing outranks a kill


def test_values_are_todays_strings() -> None:
    assert [s.value for s in JobState] == ["QUEUED", "RESERVED", "SCHEDULED", "DONE", "CANCELED"]
    assert [s.value for s in CheckpointState] == ["COMPLETED", "PARTIALLY_DELETED", "DELETED"]
    assert [s.value for s in Stopping] == ["pause", "kill", "error"]
    for member in (*JobState, *CheckpointState, *Stopping, *State):
        assert member == member.value and str(member) == member.value
        assert f"{member}" == member.value and json.dumps(member) == f'"{member.value}"'


# -- the store enforces the job table -----------------------------------------------------------
def _job_in(store: Store, state: JobState) -> int:
    """A fresh job brought to ``state`` through legal moves only."""
    jobs = store.jobs
    job_id = jobs.create(kind="COMMAND", name="j", user="ann", uid=1, priority=42, slots_needed=1)
    if state == JobState.SCHEDULED:
        jobs.allocate(job_id, [0], 1)
    elif state == JobState.RESERVED:
        jobs.reserve(job_id, [0], 1)
    elif state == JobState.DONE:
        jobs.finish(job_id, 0, "ended")
    elif state == JobState.CANCELED:  # no writer method yet: the state as SQL would hold it
        store.conn.execute("UPDATE jobs SET state='CANCELED' WHERE id=?", (job_id,))
        jobs.reload()
    assert jobs.get(job_id).state == state
    return job_id


MOVES: dict[JobState, Callable[[Store, int], None]] = {
    JobState.QUEUED: lambda s, j: s.jobs.requeue(j, priority=5),
    JobState.SCHEDULED: lambda s, j: s.jobs.allocate(j, [1], 2),
    JobState.RESERVED: lambda s, j: s.jobs.reserve(j, [1], 2),
    JobState.DONE: lambda s, j: s.jobs.finish(j, 3, "done"),
}


@pytest.mark.parametrize(
    "old,new",
    list(itertools.product(JobState, MOVES)),
    ids=[f"{o.value}->{n.value}" for o, n in itertools.product(JobState, MOVES)],
)
def test_job_moves_follow_the_table(tmp_path: Path, old: JobState, new: JobState) -> None:
    store = Store(tmp_path / "db.sqlite")
    job_id = _job_in(store, old)
    before = store.jobs.get(job_id)
    view_before = store.jobs.active()
    if old == new or new in JOB_TRANSITIONS[old]:
        MOVES[new](store, job_id)
        after = store.jobs.get(job_id)
        assert after.state == new
        assert type(after.state) is JobState
        assert store.conn.execute("SELECT state FROM jobs WHERE id=?", (job_id,)).fetchone() == (
            new.value,
        )
        assert (job_id in {j.id for j in store.jobs.active()}) == new.active
    else:
        with pytest.raises(StateError, match=f"^job {job_id} is {old.value}; it cannot become "):
            MOVES[new](store, job_id)
        assert store.jobs.get(job_id) == before  # the row as it was
        assert store.jobs.active() == view_before  # and the writer's copy
    store.close()


def test_a_move_of_a_job_that_does_not_exist_is_not_found(tmp_path: Path) -> None:
    store = Store(tmp_path / "db.sqlite")
    with pytest.raises(NotFoundError, match="job 99 not found"):
        store.jobs.finish(99, 0)
    store.close()


def test_job_json_state_is_a_plain_string(tmp_path: Path) -> None:
    store = Store(tmp_path / "db.sqlite")
    job = store.jobs.get(_job_in(store, JobState.SCHEDULED))
    d = job.to_json()
    assert type(d["state"]) is str and d["state"] == "SCHEDULED"
    reader = Store(store.path, readonly=True)
    assert [j.state for j in reader.jobs.list(include_done=True)] == [JobState.SCHEDULED]
    reader.close()
    store.close()


def test_an_unknown_stored_job_state_is_one_line(tmp_path: Path) -> None:
    store = Store(tmp_path / "db.sqlite")
    job_id = _job_in(store, JobState.DONE)
    store.conn.execute("UPDATE jobs SET state='LIMBO' WHERE id=?", (job_id,))
    with pytest.raises(StateError, match="unknown state 'LIMBO'; the states are QUEUED, "):
        store.jobs.get(job_id)
    store.close()


# -- the store enforces the checkpoint table ----------------------------------------------------
def _world(tmp_path: Path) -> tuple[Store, int, int]:
    store = Store(tmp_path / "db.sqlite")
    exp = store.create_experiment(name="e", config={})
    trial = store.create_trial(exp, hparams={}, seed=1)
    return store, exp, trial


def _ckpt(exp: int, trial: int, state: str = "COMPLETED") -> CheckpointRecord:
    u = str(uuidlib.uuid4())
    return CheckpointRecord(u, exp, trial, 3, state, f"/nowhere/{u}", {}, {}, 1.0)


def test_a_checkpoint_is_recorded_completed_and_then_deleted(tmp_path: Path) -> None:
    store, exp, trial = _world(tmp_path)
    rec = _ckpt(exp, trial)
    store.add_checkpoint(rec)
    got = store.get_checkpoint(rec.uuid)
    assert got.state == CheckpointState.COMPLETED and type(got.state) is CheckpointState
    assert got.to_json()["state"] == "COMPLETED" and type(got.to_json()["state"]) is str
    store.mark_checkpoint_deleted(rec.uuid)
    store.mark_checkpoint_deleted(rec.uuid)  # again: it stays DELETED
    assert store.get_checkpoint(rec.uuid).state == CheckpointState.DELETED
    store.close()


@pytest.mark.parametrize("state", ["DELETED", "PARTIALLY_DELETED", "SOMETHING"])
def test_a_checkpoint_recorded_in_another_state_is_refused(tmp_path: Path, state: str) -> None:
    store, exp, trial = _world(tmp_path)
    rec = _ckpt(exp, trial, state)
    with pytest.raises(StateError, match=f"checkpoint {rec.uuid} "):
        store.add_checkpoint(rec)
    assert store.list_checkpoints() == []
    assert store.get_trial(trial).latest_checkpoint is None
    store.close()


def test_marking_many_deleted_is_all_or_none(tmp_path: Path) -> None:
    store, exp, trial = _world(tmp_path)
    a, b = _ckpt(exp, trial), _ckpt(exp, trial)
    store.add_checkpoint(a)
    store.add_checkpoint(b)
    missing = str(uuidlib.uuid4())
    with pytest.raises(NotFoundError, match=f"checkpoint {missing} not found"):
        store.mark_checkpoints_deleted([a.uuid, missing, b.uuid])
    assert {c.state for c in store.list_checkpoints()} == {CheckpointState.COMPLETED}
    store.mark_checkpoints_deleted([a.uuid, b.uuid])
    assert {c.state for c in store.list_checkpoints()} == {CheckpointState.DELETED}
    store.close()


def test_a_partially_deleted_checkpoint_can_be_deleted(tmp_path: Path) -> None:
    store, exp, trial = _world(tmp_path)
    rec = _ckpt(exp, trial)
    store.add_checkpoint(rec)
    store.conn.execute("UPDATE checkpoints SET state='PARTIALLY_DELETED' WHERE uuid=?", (rec.uuid,))
    assert store.get_checkpoint(rec.uuid).state == CheckpointState.PARTIALLY_DELETED
    store.mark_checkpoints_deleted([rec.uuid])
    assert store.get_checkpoint(rec.uuid).state == CheckpointState.DELETED
    store.close()


# -- experiments and trials (the table that was already enforced) -------------------------------
def test_an_illegal_trial_move_raises_and_changes_nothing(tmp_path: Path) -> None:
    store, exp, trial = _world(tmp_path)
    store.set_trial_state(trial, State.COMPLETED)
    before = store.get_trial(trial)
    # (ACTIVE it may become again: `experiment continue`)
    with pytest.raises(StateError, match=f"^trial {trial} is COMPLETED; it cannot become PAUSED$"):
        store.set_trial_state(trial, State.PAUSED)
    assert store.get_trial(trial) == before
    store.close()


# -- priorities: defined once -------------------------------------------------------------------
def test_priority_bounds_and_default_are_one_definition() -> None:
    from det_local.config import DEFAULT_PRIORITY as config_default
    from det_local.config.resources import SPEC, ResourcesConfig

    assert (MIN_PRIORITY, MAX_PRIORITY, DEFAULT_PRIORITY) == (1, 99, 42)
    assert config_default is DEFAULT_PRIORITY
    assert ResourcesConfig().effective_priority == DEFAULT_PRIORITY
    assert (SPEC["priority"].lo, SPEC["priority"].hi) == (MIN_PRIORITY, MAX_PRIORITY)
    for p in (MIN_PRIORITY, DEFAULT_PRIORITY, MAX_PRIORITY):
        assert check_priority(p) == p
    for bad, why in ((0, "outside 1-99"), (100, "outside 1-99"), (True, "whole number")):
        with pytest.raises(DetLocalError, match=why):
            check_priority(bad)


def test_enums_are_str_enums() -> None:
    for cls in (State, JobState, CheckpointState, Stopping):
        assert issubclass(cls, str) and issubclass(cls, Enum)

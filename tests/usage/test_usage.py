"""Usage reports (issue 30): allocation records kept for every job move, and `det-local usage`
over a scripted day's allocations, checked to the second."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from det_local.store.db import Store
from det_local.usage.report import KEYS, report
from tests.support import paths
from tests.support.world import Env

H = 3600.0


@contextlib.contextmanager
def _store(db: Path, readonly: bool = False) -> Iterator[Store]:
    store = Store(db, readonly=readonly)
    try:
        yield store
    finally:
        store.close()


# A scripted day two days ago, as (job, kind, user, slots, start, end in seconds after its
# midnight, the rest of the record): two users, a search (three trials, one preempted and resumed
# on another slot), a command that preempted it, a 2-slot trial.
DAY: list[tuple[int, str, str, list[int], float, float, dict[str, Any]]] = [
    # alice's search, experiment 1: trial 1 preempted at 02:00 by bob's command, resumed at 03:00
    (1, "TRIAL", "alice", [0], 0, 2 * H, {"experiment_id": 1, "trial_id": 1, "ended": "requeued"}),
    (1, "TRIAL", "alice", [1], 3 * H, 4.5 * H, {"experiment_id": 1, "trial_id": 1, "run_id": 2}),
    (2, "TRIAL", "alice", [1], 0, H,
     {"experiment_id": 1, "trial_id": 2, "util_sum": 500, "util_n": 10}),  # 50% busy
    (3, "TRIAL", "alice", [1], H, 2.5 * H, {"experiment_id": 1, "trial_id": 3}),
    # bob: a command (02:00:00 to 02:45:30, 80% busy), then a 2-slot trial
    (4, "COMMAND", "bob", [0], 2 * H, 2 * H + 2730, {"util_sum": 800, "util_n": 10}),
    (5, "TRIAL", "bob", [0, 1], 5 * H, 6 * H, {"experiment_id": 2, "trial_id": 4}),
]  # fmt: skip


def _day(db: Path) -> float:
    """DAY's allocations in the store at `db`; returns its midnight (day0)."""
    day0 = float(int(time.time() - 2 * 86400))
    with _store(db) as store:
        for job_id, kind, user, slots, start, end, rest in DAY:
            store.usage.add_allocation(
                job_id=job_id,
                kind=kind,
                user=user,
                slots=slots,
                started_at=day0 + start,
                ended_at=day0 + end,
                **rest,
            )
    return day0


def test_a_scripted_day_sums_to_the_second(dl: Env) -> None:
    day0 = _day(dl.paths.db)
    rep = dl.json("usage", "--since", "30d")
    rows = {r["key"]: r for r in rep["rows"]}
    assert rows["alice"]["slot_seconds"] == 7200 + 5400 + 3600 + 5400
    assert rows["alice"]["slot_hours"] == 6.0
    assert rows["alice"]["allocations"] == 4
    assert rows["alice"]["sampled_slot_seconds"] == 3600
    assert rows["alice"]["used_slot_seconds"] == 1800 and rows["alice"]["mean_util_pct"] == 50.0
    assert rows["bob"]["slot_seconds"] == 2730 + 7200
    assert rows["bob"]["kinds"] == {"COMMAND": 2730, "TRIAL": 7200}
    assert rows["bob"]["used_slot_seconds"] == 2184 and rows["bob"]["mean_util_pct"] == 80.0
    assert [r["key"] for r in rep["rows"]] == ["alice", "bob"]  # most slot-hours first
    assert rep["total"]["slot_seconds"] == 21600 + 9930
    by_slot = {r["key"]: r["slot_seconds"] for r in dl.json("usage", "--by", "slot")["rows"]}
    assert by_slot == {0: 7200 + 2730 + 3600, 1: 5400 + 3600 + 5400 + 3600}
    by_exp = {r["key"]: r["slot_seconds"] for r in dl.json("usage", "--by", "experiment")["rows"]}
    assert by_exp == {1: 21600, 2: 7200, None: 2730}
    # a window cuts allocations at its edge: from 02:00 on
    with _store(dl.paths.db, readonly=True) as store:
        cut = report(store.usage, since=day0 + 2 * H, by="user")
    assert {r["key"]: r["slot_seconds"] for r in cut["rows"]} == {
        "alice": 5400 + 1800,
        "bob": 9930,
    }
    # the table and the CSV say the same
    table = dl.det("usage").out
    assert "alice" in table and "6.00" in table
    csv = dl.det("usage", "--csv").out.splitlines()
    assert csv[0] == "user,allocations,slot_hours,used_slot_hours,mean_util_pct"
    assert csv[1] == "alice,4,6.0,0.5,50.0"


def test_usage_json_keys_are_documented(dl: Env) -> None:
    _day(dl.paths.db)
    rep = dl.json("usage")
    assert set(rep) == {"since", "until", "by", "rows", "total"}
    assert all(list(r) == list(KEYS) for r in [*rep["rows"], rep["total"]])
    readme = (paths.REPO / "README.md").read_text()
    section = readme[readme.index("### Who has the GPUs") :]
    for key in [*KEYS, "since", "until", "by", "rows", "total"]:
        assert f"`{key}`" in section, key


def test_every_job_move_keeps_an_allocation_record(dl: Env) -> None:
    with _store(dl.paths.db) as store:
        jobs = store.jobs
        with store.transaction():
            job = jobs.create(kind="TRIAL", name="t", user="alice", uid=1000, priority=42,
                              slots_needed=1, experiment_id=1, trial_id=1)  # fmt: skip
        with store.transaction():
            jobs.allocate(job, [0], 1)
        with store.transaction():
            jobs.requeue(job)  # preempted
        with store.transaction():
            jobs.reserve(job, [1], 2)  # a gang's share: held, not yet spawned
        with store.transaction():
            jobs.commit(job)  # the same allocation goes on
        with store.transaction():
            jobs.finish(job, 0)
        cmd = jobs.create(kind="COMMAND", name="c", user="bob", uid=1001, priority=42,
                          slots_needed=1)  # fmt: skip
        jobs.cancel(cmd, "removed")  # never held slots: no record
        allocs = store.usage.list_allocations(job)
        assert [(a.slots, a.run_id, a.ended) for a in allocs] == [
            ([0], 1, "requeued"),
            ([1], 2, "ended"),
        ]
        assert all(a.ended_at is not None and a.ended_at >= a.started_at for a in allocs)
        assert store.usage.list_allocations(cmd) == []
        # a rolled-back move leaves no record
        other = jobs.create(kind="SHELL", name="s", user="bob", uid=1001, priority=42,
                            slots_needed=1)  # fmt: skip
        try:
            with store.transaction():
                jobs.allocate(other, [0], 1)
                raise RuntimeError("boom")
        except RuntimeError:
            jobs.reload()
        assert store.usage.list_allocations(other) == []


def test_usage_bad_input(dl: Env) -> None:
    r = dl.det("usage", "--since", "lately")
    assert r.rc == 1
    assert r.err.strip() == (
        "error: --since 'lately': expected how long ago (30d, 12h, 90m) or a date (2026-11-01)"
    )
    r = dl.det("usage", "--by", "team")
    assert r.err.strip() == "error: --by 'team': expected one of user, experiment, slot, kind"


def test_daemon_yaml_settings_and_their_errors(tmp_path: Path) -> None:
    import pytest

    from det_local.errors import ConfigError
    from det_local.usage.settings import load_usage_settings, parse_task_config

    path = tmp_path / "daemon.yaml"
    assert load_usage_settings(path).interval == 5.0  # no file: defaults
    path.write_text(
        "system_metrics: {interval: 2s, keep_full: 1h}\nidle_threshold: 10\nidle_policy: stop\n"
    )
    s = load_usage_settings(path)
    assert (s.interval, s.keep_full, s.idle_threshold) == (2.0, 3600.0, 10.0)
    assert s.policy("COMMAND") == "stop" and s.policy("NOTEBOOK") == "stop"
    path.write_text("system_metrics: false\n")
    assert load_usage_settings(path).enabled is False
    bad = {
        "system_metrics: {intervall: 5}": f"unknown field 'system_metrics.intervall' in {path}; "
        "did you mean 'interval'?",
        "idle_policy: {notebook: kill}": f"idle_policy.notebook in {path}: expected notify or "
        "stop, found 'kill'",
        "idle_policy: {trial: stop}": f"idle_policy.trial in {path}: not a kind that idles; the "
        "kinds are command, notebook, shell, tensorboard (trials are only ever flagged)",
        "idle_threshold: 120": f"idle_threshold in {path}: expected a GPU utilisation in percent "
        "(0 to 100), found 120",
    }
    for text, message in bad.items():
        path.write_text(text + "\n")
        with pytest.raises(ConfigError) as err:
            load_usage_settings(path)
        assert str(err.value) == message
    with pytest.raises(ConfigError) as err:
        parse_task_config(["idle_timout=30m"])
    assert str(err.value) == "--config: unknown key 'idle_timout'; did you mean 'idle_timeout'?"
    assert parse_task_config(["idle_timeout=1.5h"]) == {"idle_timeout": 5400.0}


def test_a_bad_daemon_yaml_stops_the_daemon_with_one_line(dl: Env) -> None:
    dl.settings({"idle_policy": {"shell": "sometimes"}})
    r = dl.det("daemon")
    assert r.rc == 1
    assert r.err.strip() == (
        f"error: idle_policy.shell in {dl.paths.settings}: expected notify or stop, "
        "found 'sometimes'"
    )

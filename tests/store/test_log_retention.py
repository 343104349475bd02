"""retention_policy.log_retention_days: logs of experiments that ended longer ago go."""

from __future__ import annotations

import sqlite3

from tests.support.world import Env, one_line_error

CPU1 = {"DET_LOCAL_FAKE_GPUS": "0", "DET_LOCAL_CPU_SLOTS": "1"}


def test_logs_of_experiments_ended_longer_ago_than_their_retention_are_removed(dl: Env) -> None:
    dl.setenv(**CPU1)
    runs = {}
    for name, days in (("now", 0), ("day", 1), ("kept", -1)):
        cfg, ctx = dl.context(
            f"print('hello {name}')\n",
            {"retention_policy": {"log_retention_days": days}},
            name=name,
        )
        runs[name] = (cfg, ctx)
    for name in ("now", "day", "kept"):
        assert dl.det("run", *runs[name]).rc == 0
    # each engine sweeps when it starts: the third run's removed the first one's log (0 days)
    assert not dl.paths.trial_log(1, 1).exists()
    assert "hello day" in dl.log(2, 2) and "hello kept" in dl.log(3, 3)
    assert (
        "removed the logs of 1 trial (retention_policy.log_retention_days)" in dl.events(1)[-1]
    ), dl.events(1)
    # two days later (the store's end times moved back), the one-day experiment's log goes
    with sqlite3.connect(dl.paths.db) as db:
        db.execute("UPDATE experiments SET ended_at = ended_at - 2 * 86400")
    dl.daemon_start()
    assert dl.det("daemon", "stop").rc == 0
    assert not dl.paths.trial_log(2, 2).exists()
    assert "hello kept" in dl.log(3, 3)  # -1: kept forever
    r = dl.det("trial", "logs", "2")
    one_line_error(
        r,
        "trial 2's logs were removed: experiment 2 ended more than 1 day ago "
        "(retention_policy.log_retention_days); its metrics and checkpoints remain",
    )

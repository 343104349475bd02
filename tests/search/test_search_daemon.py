"""A whole adaptive_asha search through the daemon: submitted by `det-local run` (which follows
it, with live progress lines), paused while its first trials run (they checkpoint and free their
slots), activated (they resume from those checkpoints), then played to the end: trials stopped
early, the expected best trial, `experiment best` agreeing, every slot free at the end.

The trial script reports loss = |lr - 0.3| + 1/batches every 2 batches (with the time metric
`batches`) and checkpoints there. ASHA never stops the trial with the best metric at a rung, so
the trial whose lr is closest to 0.3 reaches the top rung and is the best. Waits are bounded
polls; the trials hold (polling, bounded) at batch 1 of their first run until the test says go.
"""

from __future__ import annotations

import json
import re

from det_local.store.states import State
from tests.support.searchkit import GATED_SCRIPT
from tests.support.world import Env, wait_for

MAX_TRIALS = 6


def _config(dl: Env) -> dict:
    return {
        "hyperparameters": {
            "lr": {"type": "double", "minval": 0.0, "maxval": 1.0},
            "gate": str(dl.tmp / "go"),
            "record": str(dl.record_path),
        },
        "searcher": {
            "name": "adaptive_asha",
            "metric": "loss",
            "time_metric": "batches",
            "max_time": 8,
            "max_trials": MAX_TRIALS,
            "max_concurrent_trials": 2,
            "mode": "aggressive",
            "divisor": 2,
            "max_rungs": 3,
        },  # one bracket, rungs at 2, 4 and 8 batches
        "reproducibility": {"experiment_seed": 11},
        "max_restarts": 0,
    }


def test_adaptive_asha_through_the_daemon_with_pause_and_activate(dl: Env) -> None:
    dl.daemon_start(DET_LOCAL_FAKE_GPUS="0", DET_LOCAL_CPU_SLOTS="2")
    cfg, ctx = dl.context(GATED_SCRIPT, _config(dl))
    plan = dl.json("config", "check", cfg, ctx)["plan"]
    assert plan["trials"] == MAX_TRIALS
    assert plan["search"]["brackets"][0]["rungs"] == [2, 4, 8]

    follow = dl.start("run", cfg, ctx)  # submits to the daemon and follows the experiment
    wait_for(lambda: len(dl.records()) == 2, what="the first two trials to start")
    wait_for(lambda: all(t.latest_checkpoint for t in dl.trials(1)), what="their first checkpoints")
    # both hold at batch 1 with a checkpoint: pause them
    r = dl.det("experiment", "pause", 1)
    assert (r.rc, r.out.strip()) == (0, "experiment 1 paused"), r
    wait_for(
        lambda: [t.state for t in dl.trials(1)] == [State.PAUSED, State.PAUSED],
        what="both trials to pause",
    )
    wait_for(lambda: dl.experiment(1).state == State.PAUSED, what="the experiment to pause")
    _slots_free(dl)
    # the follower stops at the pause (exit 3), its last progress line saying so
    r = follow.wait()
    assert r.rc == 3, r
    shown = [line for line in r.out.splitlines() if line.startswith("[search]")]
    assert shown and shown[-1] == (
        f"[search] 0 running, 2 paused, 0 completed, 0 stopped of {MAX_TRIALS}"
    ), shown
    assert "resume with: det-local experiment activate 1" in r.out

    (dl.tmp / "go").touch()
    r = dl.det("experiment", "activate", 1)
    assert (r.rc, r.out.strip()) == (0, "experiment 1 activated"), r
    wait_for(
        lambda: dl.experiment(1).state == State.COMPLETED, timeout=45, what="the search to end"
    )

    # the paused trials resumed from their checkpoints, in a second run
    runs = dl.records()
    for trial in (1, 2):
        resumed = [x for x in runs if x["trial"] == trial and x["run"] == 2]
        assert len(resumed) == 1, runs
        assert resumed[0]["start"] == 1 and resumed[0]["latest"], runs
    assert all(x["start"] == 0 for x in runs if x["trial"] > 2), runs

    trials = dl.json("trial", "list", "1")
    assert len(trials) == MAX_TRIALS
    assert all(t["state"] == "COMPLETED" for t in trials), trials
    steps = {t["id"]: t["steps_completed"] for t in trials}
    assert min(steps.values()) < 8, steps  # ASHA stopped some early
    expected = min(trials, key=lambda t: abs(t["hparams"]["lr"] - 0.3))
    assert steps[expected["id"]] == 8, (expected, steps)
    ranked = sorted(trials, key=lambda t: t["best_validation"])
    assert ranked[0]["id"] == expected["id"]

    best = dl.json("experiment", "best", "1")
    assert best["trial"]["id"] == expected["id"]
    assert abs(best["best_validation"] - (abs(expected["hparams"]["lr"] - 0.3) + 1 / 8)) < 1e-9
    assert best["checkpoint"]["steps_completed"] == 8
    described = dl.json("experiment", "describe", "1")
    assert described["trials"][0]["id"] == expected["id"]
    assert described["trials"][0]["rung"] == 2

    _slots_free(dl)
    assert all(j.state == "DONE" for j in dl.jobs()), dl.jobs()
    assert dl.json("job", "list") == []


def _slots_free(dl: Env) -> None:
    """No slot is allocated to anything (bounded wait: a job's slots are freed when it is
    reaped)."""

    def free() -> bool:
        slots = dl.json("slots")
        return len(slots) == 2 and all(s["allocation"] is None for s in slots)

    wait_for(free, what="every slot to be free")
    assert re.search(r"\|\s*$", dl.det("slots").out.splitlines()[2])  # "Used by" is empty
    assert json.loads(dl.det("slots", "--json").out)[0]["used_by"] == ""

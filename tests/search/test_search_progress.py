"""Live search progress while `det-local run` follows an experiment: one compact line per real
change (trials running, queued, completed, stopped by the searcher; the best validation), never
on a poll that changed nothing, never in the middle of a trial's output line, and none for a
single-trial experiment."""

from __future__ import annotations

import io
import re
from typing import Any

from det_local.client.follow import Follower
from det_local.store.db import Store
from det_local.store.states import State
from tests.support.searchkit import ASHA
from tests.support.world import Env

LINE = re.compile(
    r"^\[search\] (?P<counts>\d+ running(?:, \d+ [a-z]+)*) of (?P<total>\d+)"
    r"(?:; best (?P<metric>\S+) (?P<best>\S+) \(trial (?P<trial>\d+)\))?$"
)


def parse(line: str) -> dict[str, Any]:
    m = LINE.match(line)
    assert m, line
    counts = {kind: int(n) for n, kind in (c.split(" ") for c in m["counts"].split(", "))}
    return {
        "counts": counts,
        "total": int(m["total"]),
        "metric": m["metric"],
        "best": None if m["best"] is None else float(m["best"]),
        "trial": None if m["trial"] is None else int(m["trial"]),
    }


# ------------------------------------------------------------------ the line, from a store
def _world(det_home: Any, searcher: dict[str, Any]) -> Store:
    from det_local.store.paths import Paths

    store = Store(Paths(det_home).ensure().db)
    store.create_experiment(
        name="p",
        config={
            "name": "p",
            "entrypoint": "python3 train.py",
            "hyperparameters": {"lr": {"type": "double", "minval": 0.0, "maxval": 1.0}},
            "searcher": {"metric": "loss", **searcher},
        },
    )
    return store


def _trial(store: Store, *, scheduled: bool = False) -> tuple[int, int]:
    tid = store.create_trial(1, hparams={"lr": 0.5}, seed=1)
    job = store.jobs.create(
        kind="TRIAL", name="t", user="u", uid=0, priority=42, slots_needed=1,
        experiment_id=1, trial_id=tid,
    )  # fmt: skip
    if scheduled:
        store.jobs.allocate(job, [0], store.next_trial_run(tid))
    return tid, job


def _end(store: Store, tid: int, job: int, outcome: str, state: State = State.COMPLETED) -> None:
    store.jobs.finish(job, 0, outcome)
    store.set_trial_state(tid, state)


def test_progress_line_counts_and_best(det_home: Any) -> None:
    store = _world(det_home, ASHA["searcher"])
    out = io.StringIO()
    follower = Follower(store, store_paths(det_home), 1, out)

    running, rjob = _trial(store, scheduled=True)
    queued, _ = _trial(store)
    follower.pump()
    assert progress(out) == ["[search] 1 running, 1 queued, 0 completed, 0 stopped of 8"]

    follower.pump()  # nothing changed: nothing printed
    store.set_trial_steps(running, 10)  # nor for steps alone
    follower.pump()
    assert len(progress(out)) == 1

    done, djob = _trial(store, scheduled=True)
    stopped, sjob = _trial(store, scheduled=True)
    failed, fjob = _trial(store, scheduled=True)
    paused, pjob = _trial(store, scheduled=True)
    store.set_best_validation(done, 0.5)
    store.set_best_validation(stopped, 0.25)
    store.set_best_validation(running, 0.75)
    # 0.38 ASHA stops the trials at its top rung too: only a stop short of max_time is early
    store.add_metrics(done, 1, [("validation", 16, {"loss": 0.5, "batches": 16}, 0.0, None)])
    store.add_metrics(stopped, 1, [("validation", 8, {"loss": 0.25, "batches": 8}, 0.0, None)])
    _end(store, done, djob, "stopped")
    _end(store, stopped, sjob, "stopped")
    _end(store, failed, fjob, "error", State.ERROR)
    store.jobs.requeue(pjob)
    store.set_trial_state(paused, State.PAUSED)
    follower.pump()
    line = progress(out)[-1]
    assert line == (
        "[search] 1 running, 1 queued, 1 paused, 1 completed, 1 stopped, 1 errored of 8; "
        f"best loss 0.25 (trial {stopped})"
    )
    assert parse(line)["counts"]["stopped"] == 1

    # a queued trial given its slots: its new run id is written just before its job's state;
    # the poll after a change looks again, so a reader between the two catches up
    store.next_trial_run(queued)
    follower.pump()
    assert progress(out)[-1].startswith("[search] 1 running, 1 queued,")
    store.jobs.allocate(store.jobs.for_trial(queued).id, [1], 1)  # type: ignore[union-attr]
    follower.pump()
    assert progress(out)[-1].startswith("[search] 2 running, 1 paused,")
    assert len(progress(out)) == 3  # the line in between was the same: not repeated


def test_larger_is_better_and_no_line_for_a_single_trial(det_home: Any) -> None:
    store = _world(det_home, {"name": "random", "max_trials": 3, "smaller_is_better": False})
    out = io.StringIO()
    follower = Follower(store, store_paths(det_home), 1, out)
    a, _ = _trial(store, scheduled=True)
    b, _ = _trial(store, scheduled=True)
    store.set_best_validation(a, 0.5)
    store.set_best_validation(b, 0.9)
    follower.pump()
    assert progress(out) == [
        f"[search] 2 running, 0 completed, 0 stopped of 3; best loss 0.9 (trial {b})"
    ]
    store.close()


def test_single_searcher_prints_no_progress(det_home: Any) -> None:
    store = _world(det_home, {"name": "single", "max_length": 5})
    out = io.StringIO()
    follower = Follower(store, store_paths(det_home), 1, out)
    _trial(store, scheduled=True)
    follower.pump()
    follower.pump()
    assert progress(out) == []
    quiet = Follower(store, store_paths(det_home), 1, None)  # --quiet: nothing at all
    _trial(store, scheduled=True)
    quiet.pump()


def store_paths(det_home: Any) -> Any:
    from det_local.store.paths import Paths

    return Paths(det_home)


def progress(out: io.StringIO) -> list[str]:
    return [line for line in out.getvalue().splitlines() if line.startswith("[search]")]


# ------------------------------------------------------------------ through `det-local run`
SCRIPT = """\
import determined as det
from determined import core

info = det.get_cluster_info()
lr = info.trial.hparams["lr"]
with core.init() as ctx:
    for steps in range(1, 17):
        print(f"batch {steps} of trial {info.trial.trial_id}", flush=True)
        if steps % 4 == 0:
            loss = abs(lr - 0.3) + 1.0 / steps
            ctx.train.report_validation_metrics(
                steps_completed=steps, metrics={"loss": loss, "batches": steps}
            )
            with ctx.checkpoint.store_path({"steps_completed": steps}) as (p, _):
                (p / "s").write_text(str(steps))
        if ctx.preempt.should_preempt():
            break
"""


def test_run_prints_progress_on_changes_only(dl: Env) -> None:
    dl.env["DET_LOCAL_CPU_SLOTS"] = "2"
    dl.env["DET_LOCAL_FAKE_GPUS"] = "0"
    cfg, ctx = dl.context(SCRIPT, ASHA)
    r = dl.det("run", cfg, ctx, timeout=240)
    assert r.rc == 0, r.out + r.err
    lines = r.out.splitlines()
    shown = [line for line in lines if line.startswith("[search]")]
    # whole lines only: a progress line never shares a line with trial output
    assert all("[search]" not in line for line in lines if not line.startswith("[search]"))
    assert all(re.match(r"^\[trial \d+\] batch \d+ of trial \d+$", line) for line in lines
               if " of trial " in line)  # fmt: skip
    # printed on changes only: never the same line twice in a row, and a bounded number
    assert all(a != b for a, b in zip(shown, shown[1:], strict=False)), shown
    assert 3 <= len(shown) <= 8 * 7, shown
    parsed = [parse(line) for line in shown]
    assert all(p["total"] == 8 for p in parsed)
    assert all(sum(p["counts"].values()) <= 8 for p in parsed)
    assert max(p["counts"]["running"] for p in parsed) == 2  # two slots

    trials = dl.json("trial", "list", "1")
    final = parsed[-1]
    stopped = [t for t in trials if t["steps_completed"] < 16]
    assert stopped, "ASHA stopped no trial early"
    assert final["counts"]["running"] == 0 and final["counts"].get("queued", 0) == 0
    assert final["counts"]["stopped"] == len(stopped)
    assert final["counts"]["completed"] == len(trials) - len(stopped)
    best = dl.json("experiment", "best", "1")
    assert final["trial"] == best["trial"]["id"] and final["metric"] == "loss"
    assert abs(final["best"] - best["best_validation"]) < 1e-5
    # the best value only ever improves
    bests = [p["best"] for p in parsed if p["best"] is not None]
    assert bests == sorted(bests, reverse=True)
    # the summary comes after the last progress line
    assert lines.index(shown[-1]) < lines.index(
        next(x for x in lines if x.startswith("Experiment"))
    )

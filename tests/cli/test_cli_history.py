"""What a run did, through the real CLI: `trial metrics` (table, CSV, JSON, --group),
`experiment describe`'s best trial, `experiment events`; and the truth from the daemon:
`slots` and `config check` show the running daemon's inventory, `cmd list` the commands' start
and end times, the daemon's log one line per job start and end. Each bad input's one line."""

from __future__ import annotations

import csv
import io
import re

from det_local.views import experiments as expviews
from tests.support.world import Env, one_line_error, wait_for

TIME = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d"
CPU1 = {"DET_LOCAL_FAKE_GPUS": "0", "DET_LOCAL_CPU_SLOTS": "1"}


def _crash_once(dl: Env) -> int:
    """trainer.py for 6 batches, crashing once after its first checkpoint (batch 2): two runs,
    a restart event, checkpoint GC. Returns the trial id."""
    cfg, ctx = dl.trainer(
        {"batches": 6, "ckpt_every": 2, "crash_runs": 1},
        {"max_restarts": 1, "searcher": {"name": "single", "metric": "loss", "max_length": 6}},
    )
    r = dl.det("run", "-q", cfg, ctx)
    assert r.rc == 0, r
    return int(dl.trial(1).id)


def test_trial_metrics_table_csv_json_and_the_best_trial(dl: Env) -> None:
    tid = _crash_once(dl)
    stored = dl.metrics(tid)
    assert [(m.group, m.run_id, m.steps_completed) for m in stored] == [
        ("training", 1, 1),
        ("training", 1, 2),
        *(("training", 2, s) for s in range(3, 7)),
        ("validation", 2, 6),
    ]

    # the table: one column per metric name, a Run column (a restart made two runs)
    r = dl.det("trial", "metrics", tid)
    assert r.rc == 0, r
    lines = r.out.splitlines()
    assert re.split(r"\s*\|\s*", lines[0].strip()) == ["Group", "Run", "Steps", "Time", "loss", "x"]
    rows = [re.split(r"\s*\|\s*", ln.strip()) for ln in lines[2:]]
    assert len(rows) == 7
    assert rows[0][:3] == ["training", "1", "1"] and re.fullmatch(TIME, rows[0][3])
    assert rows[0][4:] == ["1", "0"]
    assert rows[-1][:3] == ["validation", "2", "6"] and rows[-1][4:] == ["0.166667", "15"]

    # --group: only that group, no Group column
    r = dl.det("trial", "metrics", tid, "--group", "validation")
    assert r.rc == 0, r
    assert re.split(r"\s*\|\s*", r.out.splitlines()[0].strip()) == ["Steps", "Time", "loss", "x"]
    assert len(r.out.splitlines()) == 3

    # --csv: a header, one row per report, values as reported
    r = dl.det("trial", "metrics", tid, "--csv")
    assert r.rc == 0, r
    table = list(csv.DictReader(io.StringIO(r.out)))
    assert list(table[0]) == ["trial_id", "run_id", "group", "steps_completed", "time", "loss", "x"]
    assert [(row["group"], int(row["steps_completed"])) for row in table] == [
        (m.group, m.steps_completed) for m in stored
    ]
    for row, m in zip(table, stored, strict=True):
        assert float(row["loss"]) == m.metrics["loss"] and int(row["x"]) == m.metrics["x"]
        assert abs(float(row["time"]) - m.time) < 0.001

    # --json: every report as recorded
    assert dl.json("trial", "metrics", tid, "-g", "training") == [
        {
            "trial_id": tid,
            "run_id": m.run_id,
            "group": "training",
            "steps_completed": m.steps_completed,
            "time": m.time,
            "metrics": m.metrics,
        }
        for m in stored
        if m.group == "training"
    ]

    # describe ends with the best trial and its checkpoint
    best = expviews.best_trial(1)
    assert best["checkpoint"] is not None
    r = dl.det("experiment", "describe", 1)
    assert r.rc == 0, r
    assert r.out.splitlines()[-1] == (
        f"Best trial: {tid}, loss 0.166667, checkpoint {best['checkpoint']['uuid']} "
        "(steps_completed=6)"
    )


def test_trial_metrics_bad_input(dl: Env) -> None:
    tid = _crash_once(dl)
    r = dl.det("trial", "metrics", 99)
    one_line_error(r, "trial 99 not found", "`det-local trial list EXPERIMENT_ID`")
    r = dl.det("trial", "metrics", tid, "--group", "valdation")
    one_line_error(
        r,
        f"trial {tid} has no 'valdation' metrics; did you mean 'validation'? it has reported "
        "training, validation metrics (--group NAME)",
    )
    r = dl.det("trial", "metrics", tid, "--group", "inference")
    one_line_error(r, "has no 'inference' metrics; it has reported training, validation")
    r = dl.det("trial", "metrics", tid, "--json", "--csv")
    one_line_error(r, "--json and --csv: choose one")

    # a trial that has reported nothing: an empty history, and a --group error that says so
    cfg, ctx = dl.context("print('no metrics')\n", name="quiet")
    assert dl.det("run", "-q", cfg, ctx).rc == 0
    quiet = dl.trial(2).id
    r = dl.det("trial", "metrics", quiet)
    assert (r.rc, r.out) == (0, f"trial {quiet} has reported no metrics yet\n"), r
    assert dl.json("trial", "metrics", quiet) == []
    assert dl.det("trial", "metrics", quiet, "--csv").out == (
        "trial_id,run_id,group,steps_completed,time\n"
    )
    r = dl.det("trial", "metrics", quiet, "-g", "validation")
    one_line_error(r, f"trial {quiet} has reported no metrics yet")
    # describe without any validation of the searcher's metric
    r = dl.det("experiment", "describe", 2)
    assert r.out.splitlines()[-1] == (
        "Best trial: none yet (no trial has validated the searcher's metric)"
    ), r


def test_experiment_events(dl: Env) -> None:
    tid = _crash_once(dl)
    events = dl.json("experiment", "events", 1)
    assert [(e["level"], e["trial_id"]) for e in events] == [("WARNING", tid), ("INFO", None)]
    restart, gc = (e["message"] for e in events)
    assert restart == (
        f"trial {tid} exited with code 1; restarting from its latest checkpoint (restart 1 of 1)"
    )
    assert gc.startswith("experiment 1: checkpoint GC deleted 2 checkpoints, kept 1")
    store = dl.store()
    assert [e["time"] for e in events] == [t for t, *_ in store.list_events(1)]
    store.close()

    dl.setenv(COLUMNS="200")  # whole messages (at 100 columns a long one is cut with …)
    r = dl.det("experiment", "events", 1)
    assert r.rc == 0, r
    lines = r.out.splitlines()
    assert re.split(r"\s*\|\s*", lines[0].strip()) == ["Time", "Level", "Trial", "Message"]
    cells = [re.split(r"\s*\|\s*", ln.strip(), maxsplit=3) for ln in lines[2:]]
    assert [c[1:] for c in cells] == [["WARNING", str(tid), restart], ["INFO", "", gc]]
    assert all(re.fullmatch(TIME, c[0]) for c in cells)

    for command in ("events", "describe"):
        one_line_error(dl.det("experiment", command, 7), "experiment 7 not found")


def test_slots_cmd_list_and_daemon_log_from_the_daemon(dl: Env) -> None:
    """The daemon has 2 CPU slots (its environment); the CLI's has no DET_LOCAL_CPU_SLOTS."""
    dl.daemon_start(DET_LOCAL_FAKE_GPUS="0", DET_LOCAL_CPU_SLOTS="2")
    dl.setenv(DET_LOCAL_CPU_SLOTS=None)
    job = dl.cmd(*dl.held("a"), name="held-a")
    wait_for(lambda: dl.order() == ["a"], what="the command to start")

    rows = dl.json("slots")
    assert [(r["index"], r["kind"]) for r in rows] == [(0, "cpu"), (1, "cpu")]
    assert [r["used_by"] for r in rows] == [f"command {job} (root)", ""]
    r = dl.det("slots")
    assert r.rc == 0, r
    assert f"command {job} (root)" in r.out.splitlines()[2]
    assert r.out.splitlines()[4:] == [
        "as the running det-local engine found them: no GPU (DET_LOCAL_FAKE_GPUS=0 hides the "
        "GPUs); 2 CPU slots (DET_LOCAL_CPU_SLOTS)"
    ]

    # config check plans a 2-slot trial on the daemon's two slots
    cfg, ctx = dl.context("print('hi')\n", {"resources": {"slots_per_trial": 2}})
    plan = dl.json("config", "check", cfg, ctx)["plan"]
    assert plan["slots"] == [0, 1]

    # cmd list: a start time while it runs, then an end time
    r = dl.det("cmd", "list")
    header, _, row = r.out.splitlines()
    assert re.split(r"\s*\|\s*", header.strip()) == [
        "ID", "State", "Exit", "Slots", "User", "Started", "Ended", "Command"
    ]  # fmt: skip
    cells = re.split(r"\s*\|\s*", row.strip())
    assert cells[1] == "SCHEDULED" and re.fullmatch(TIME, cells[5])
    assert cells[6:] == ["", "held-a"]
    dl.release("a")
    dl.wait_job(job)
    r = dl.det("cmd", "list", "--all")
    cells = re.split(r"\s*\|\s*", r.out.splitlines()[2].strip())
    assert cells[1:3] == ["DONE", "0"] and re.fullmatch(TIME, cells[5])
    assert re.fullmatch(TIME, cells[6]) and cells[7] == "held-a"

    # the daemon's log: one line when the job started, one when it ended
    log = (dl.paths.run_dir / "daemon.log").read_text()
    started = [ln for ln in log.splitlines() if f"job {job} started" in ln]
    ended = [ln for ln in log.splitlines() if f"job {job} ended" in ln]
    pid = dl.job(job).pid
    assert len(started) == 1 and started[0].endswith(
        f"det-local: job {job} started: command 'held-a', user root, slots [0], pid {pid}"
    ), log
    assert len(ended) == 1 and ended[0].endswith(
        f"det-local: job {job} ended: command 'held-a', user root, slots [0]; it exited with code 0"
    ), log

    # no daemon: discovered here, in this environment (one CPU slot)
    assert dl.det("daemon", "stop").rc == 0
    wait_for(lambda: dl.daemon_pid() is None or not _alive(dl), what="the daemon to stop")
    assert [r["index"] for r in dl.json("slots")] == [0]
    assert dl.json("config", "check", cfg, ctx)["plan"]["slots"] == [0]


def _alive(dl: Env) -> bool:
    from det_local.sched.enginelock import lock_free

    return not lock_free(dl.paths)

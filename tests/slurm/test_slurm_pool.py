"""Slurm pools against a real single-host Slurm (tests/support/slurmkit.py): trials as batch jobs,
control (pause, kill, time limits, jobs lost to the cluster), adoption after a daemon crash."""

from __future__ import annotations

import json
from typing import Any

import pytest

from det_local.store.states import State
from tests.support import slurmkit
from tests.support.world import Env, wait_for

pytestmark = pytest.mark.slow


def pools(**slurm_settings: Any) -> dict[str, Any]:
    return {"resource_pools": {"hpc": {"slurm": {"partition": "debug", **slurm_settings}}}}


HPC = {"resources": {"resource_pool": "hpc"}}


def start_daemon(dl: Env, slurm: slurmkit.Slurm, **slurm_settings: Any) -> int:
    return dl.daemon_start(pools(**slurm_settings), SLURM_CONF=str(slurm.conf))


def slurm_ids(dl: Env) -> list[int]:
    """The Slurm job of each trial's latest run (recorded in its job's pid column)."""
    return [j.pid for j in dl.jobs() if j.pid]


def submissions(dl: Env, exp_id: int = 1) -> int:
    """How many Slurm jobs the experiment's trial runs were (one batch script per run)."""
    return len(list((dl.home / "experiments" / str(exp_id)).glob("trials/*/runs/*/slurm-batch.sh")))


def records(dl: Env) -> list[dict[str, Any]]:
    return dl.records()


def check_exact(dl: Env, trial_id: int, batches: int) -> None:
    final = dl.metrics(trial_id, "validation")[-1]
    assert final.metrics["x"] == sum(range(batches))  # no batch skipped or repeated
    trial = dl.store().get_trial(trial_id)
    assert trial.state == State.COMPLETED and trial.steps_completed == batches


ENV_PROBE = """
import json, os, determined as det
info = det.get_cluster_info()
with det.core.init() as core:
    with core.checkpoint.store_path({"steps_completed": 1}) as (path, _):
        (path / "w").write_text("1")
    core.train.report_training_metrics(steps_completed=1, metrics={"loss": 0.5})
    print("PROBE " + json.dumps({
        "slurm_job": os.environ.get("SLURM_JOB_ID"),
        "trial_id": info.trial.trial_id,
        "latest": info.latest_checkpoint,
        "slot_ids": info.slot_ids,
        "det_vars": sorted(k for k in os.environ if k.startswith("DET_")),
    }), flush=True)
"""


def test_core_api_trial_runs_as_a_slurm_job(dl: Env, slurm: slurmkit.Slurm) -> None:
    start_daemon(dl, slurm)
    cfg, ctx = dl.context(ENV_PROBE, HPC)
    r = dl.det("run", cfg, ctx)
    assert r.rc == 0, (r, slurm.logs())
    assert "Experiment 1 (ctx) COMPLETED" in r.out
    probe = json.loads(r.out.split("PROBE ", 1)[1].splitlines()[0])
    (job,) = dl.jobs()
    assert probe["slurm_job"] == str(job.pid)  # the run was that Slurm job
    # and `run` said so, as `trial describe` does (issue 36)
    assert f"trial 1 -> Slurm job {job.pid} (pool hpc)\n" in r.out, r.out
    described = dl.det("trial", "describe", 1).out
    assert f"  Slurm job:         {job.pid} (pool hpc)\n" in described, described
    assert dl.json("trial", "describe", 1)["slurm_job"] == {"pool": "hpc", "id": job.pid}
    assert probe["trial_id"] == 1 and probe["slot_ids"] == [0]
    assert {"DET_EXPERIMENT_ID", "DET_TRIAL_ID", "DET_HPARAMS"} <= set(probe["det_vars"])
    assert [m.metrics["loss"] for m in dl.metrics(1, "training")] == [0.5]
    assert len(dl.checkpoints(1)) == 1
    assert job.slots == [] and job.state == "DONE" and job.exit_code == 0
    info = dl.paths.trial_info_dir(1, 1, job.run_id)
    script = (info / "slurm-batch.sh").read_text()
    assert "#SBATCH --partition=debug" in script and "#SBATCH --no-requeue" in script
    assert slurm.queue() == []
    # `det-local slots` shows the pool
    out = dl.det("slots").out
    assert "hpc" in out and "slurm" in out and "partition debug" in out


def test_pause_activate_resumes_exactly_and_kill_empties_squeue(
    dl: Env, slurm: slurmkit.Slurm
) -> None:
    start_daemon(dl, slurm)
    hp = {"batches": 16, "ckpt_every": 4, "hold_at": 6, "record": str(dl.record_path)}
    cfg, ctx = dl.trainer(hp)  # the YAML names no pool: `--pool hpc` sends it to Slurm
    assert dl.det("run", "--detach", "--pool", "hpc", cfg, ctx).rc == 0
    wait_for(lambda: dl.store().get_trial(1).steps_completed >= 6, timeout=60, what="batch 6")
    first = slurm_ids(dl)[0]
    assert str(first) in slurm.queue()
    r = dl.det("experiment", "pause", 1)
    assert r.out.strip() == "experiment 1 paused", r
    wait_for(lambda: dl.experiment(1).state == State.PAUSED, timeout=60, what="the pause")
    wait_for(lambda: slurm.queue() == [], timeout=30, what="the job to leave squeue")
    assert dl.store().get_trial(1).steps_completed == 6
    assert dl.det("experiment", "activate", 1).rc == 0
    wait_for(lambda: dl.experiment(1).state == State.COMPLETED, timeout=90, what="completion")
    check_exact(dl, 1, 16)
    runs = records(dl)
    assert [r["start"] for r in runs] == [0, 6]
    assert submissions(dl) == 2  # a new Slurm job resumed it
    # its log says where the second job started, as a local run's does (issue 36)
    (ckpt,) = [c for c in dl.checkpoints(1) if c.steps_completed == 6]
    logs = dl.det("trial", "logs", 1).out
    assert logs.count("resuming from checkpoint") == 1, logs
    assert f"trial 1 run 2: resuming from checkpoint {ckpt.uuid} at batch 6\n" in logs, logs

    # kill: scancel, nothing left in squeue
    hp = {"batches": 10, "hold_at": 2}
    cfg, ctx = dl.trainer(hp, HPC, name="k")
    assert dl.det("run", "--detach", cfg, ctx).rc == 0
    wait_for(lambda: dl.store().get_trial(2).steps_completed >= 2, timeout=60, what="batch 2")
    assert slurm.queue() != []
    assert dl.det("experiment", "kill", 2).out.strip() == "experiment 2 killed"
    wait_for(lambda: dl.experiment(2).state == State.CANCELED, timeout=60, what="the kill")
    wait_for(lambda: slurm.queue() == [], timeout=30, what="squeue to be empty")


def test_lost_job_is_requeued_and_a_failing_trial_errors(dl: Env, slurm: slurmkit.Slurm) -> None:
    start_daemon(dl, slurm)
    hp = {"batches": 12, "ckpt_every": 4, "hold_at": 4, "record": str(dl.record_path)}
    cfg, ctx = dl.trainer(hp, {**HPC, "max_restarts": 0})
    assert dl.det("run", "--detach", cfg, ctx).rc == 0
    wait_for(lambda: dl.store().get_trial(1).steps_completed >= 4, timeout=60, what="batch 4")
    wait_for(lambda: len(dl.checkpoints(1)) == 1, what="the first checkpoint")
    slurm.run("scancel", str(slurm_ids(dl)[0]))  # someone else cancels it
    wait_for(lambda: dl.experiment(1).state == State.COMPLETED, timeout=90, what="completion")
    check_exact(dl, 1, 12)
    assert dl.store().get_trial(1).restarts == 0  # max_restarts was not spent
    assert [r["start"] for r in records(dl)] == [0, 4]
    assert any("was cancelled outside det-local" in e for e in dl.events(1))

    # the trial's own failure spends max_restarts, then ERROR
    cfg, ctx = dl.context("raise SystemExit(3)\n", {**HPC, "max_restarts": 1}, name="bad")
    r = dl.det("run", cfg, ctx)
    assert r.rc == 1, r
    assert "Experiment 2 (bad) ERROR" in r.out
    trial = dl.store().get_trial(2)
    assert trial.state == State.ERROR and trial.restarts == 1
    assert "exited with code 3 after 1 restart" in (trial.message or "")
    assert slurm.queue() == []


def test_time_limit_continues_in_a_second_job(dl: Env, slurm: slurmkit.Slurm) -> None:
    """The job's time-limit signal (USR1 to the batch shell, `--signal=B:USR1@N`) mid-training:
    the trial checkpoints, and a second job continues it. Slurm's own timer sends it up to a
    minute early (it ticks once a minute), so the test delivers the same signal to the batch
    shell at a chosen batch with `scancel --signal=USR1 --batch`, as Slurm does at the lead."""
    start_daemon(dl, slurm, sbatch_args=["--time=10"], signal_lead=300)
    hp = {"batches": 30, "ckpt_every": 5, "delay": 0.1, "record": str(dl.record_path)}
    cfg, ctx = dl.trainer(hp, {**HPC, "max_restarts": 0})
    assert dl.det("run", "--detach", cfg, ctx).rc == 0
    wait_for(lambda: dl.store().get_trial(1).steps_completed >= 7, timeout=60, what="batch 7")
    script = next(dl.home.glob("experiments/1/trials/1/runs/*/slurm-batch.sh")).read_text()
    assert "#SBATCH --signal=B:USR1@300" in script and "#SBATCH --time=10" in script
    slurm.run("scancel", "--signal=USR1", "--batch", str(slurm_ids(dl)[0]))
    wait_for(lambda: dl.experiment(1).state == State.COMPLETED, timeout=120, what="completion")
    check_exact(dl, 1, 30)
    runs = records(dl)
    assert len(runs) == 2 and runs[1]["start"] >= 7, runs
    assert submissions(dl) == 2
    assert any("reaches its time limit soon" in e for e in dl.events(1))
    assert dl.store().get_trial(1).restarts == 0


def test_daemon_killed_while_a_job_runs_adopts_it(dl: Env, slurm: slurmkit.Slurm) -> None:
    start_daemon(dl, slurm)
    hp = {"batches": 40, "ckpt_every": 10, "delay": 0.1, "record": str(dl.record_path)}
    cfg, ctx = dl.trainer(hp, HPC)
    assert dl.det("run", "--detach", cfg, ctx).rc == 0
    wait_for(lambda: dl.store().get_trial(1).steps_completed >= 3, timeout=60, what="batch 3")
    dl.kill_daemon()
    start_daemon(dl, slurm)
    wait_for(lambda: dl.experiment(1).state == State.COMPLETED, timeout=120, what="completion")
    check_exact(dl, 1, 40)
    assert len(records(dl)) == 1  # the same job went on: adopted, not restarted
    assert submissions(dl) == 1


def test_asha_search_across_the_pool(dl: Env, slurm: slurmkit.Slurm) -> None:
    from tests.support.searchkit import GATED_SCRIPT

    start_daemon(dl, slurm)
    (dl.tmp / "go").touch()
    config = {
        **HPC,
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
            "max_trials": 4,
            "max_concurrent_trials": 2,
            "mode": "aggressive",
            "divisor": 2,
            "max_rungs": 3,
        },
        "reproducibility": {"experiment_seed": 11},
        "max_restarts": 0,
    }
    cfg, ctx = dl.context(GATED_SCRIPT, config)
    r = dl.det("run", cfg, ctx, timeout=240)
    assert r.rc == 0, r
    assert "Experiment 1 (ctx) COMPLETED" in r.out
    trials = dl.trials(1)
    assert len(trials) == 4 and all(t.state == State.COMPLETED for t in trials)
    assert submissions(dl) >= 4  # every trial run was its own Slurm job
    assert slurm.queue() == []


def test_slurm_job_id_survives_in_embedded_run(dl: Env, slurm: slurmkit.Slurm) -> None:
    """`det-local run` with no daemon: the embedded engine submits and follows the job."""
    dl.settings(pools())
    dl.setenv(SLURM_CONF=str(slurm.conf))
    cfg, ctx = dl.trainer({"batches": 6, "ckpt_every": 3}, HPC)
    r = dl.det("run", cfg, ctx)
    assert r.rc == 0, r
    assert "Experiment 1 (ctx) COMPLETED" in r.out
    (job,) = dl.jobs()
    shown = slurm.run("scontrol", "show", "job", str(job.pid)).stdout
    assert f"JobId={job.pid}" in shown and "JobState=COMPLETED" in shown


def test_pytorch_trial_runs_on_the_pool(dl: Env, slurm: slurmkit.Slurm) -> None:
    from tests.support.trials.pytorch import TRAIN, config

    start_daemon(dl, slurm)
    cfg, ctx = dl.context(TRAIN, {**config("pt", {"batches": 8}), **HPC})
    r = dl.det("run", cfg, ctx, timeout=180)
    assert r.rc == 0, r
    assert "Experiment 1 (pt) COMPLETED" in r.out
    trial = dl.store().get_trial(1)
    assert trial.state == State.COMPLETED and trial.steps_completed == 8
    assert [m.steps_completed for m in dl.metrics(1, "validation")] == [4, 8]
    assert len(dl.checkpoints(1)) >= 1
    assert submissions(dl) == 1 and slurm.queue() == []


def test_job_lost_while_the_daemon_was_down_is_requeued(dl: Env, slurm: slurmkit.Slurm) -> None:
    start_daemon(dl, slurm)
    hp = {"batches": 12, "ckpt_every": 4, "hold_at": 4, "record": str(dl.record_path)}
    cfg, ctx = dl.trainer(hp, {**HPC, "max_restarts": 0})
    assert dl.det("run", "--detach", cfg, ctx).rc == 0
    wait_for(lambda: len(dl.checkpoints(1)) == 1, timeout=60, what="the first checkpoint")
    dl.kill_daemon()
    slurm.run("scancel", str(slurm_ids(dl)[0]))  # an admin, while no engine watches
    wait_for(lambda: slurm.queue() == [], timeout=30, what="the job to go")
    start_daemon(dl, slurm)
    wait_for(lambda: dl.experiment(1).state == State.COMPLETED, timeout=90, what="completion")
    check_exact(dl, 1, 12)
    assert dl.store().get_trial(1).restarts == 0
    assert [r["start"] for r in records(dl)] == [0, 4]
    assert any("was cancelled outside det-local" in e for e in dl.events(1))


def test_the_kept_batch_script_leaves_the_token_out(dl: Env, slurm: slurmkit.Slurm) -> None:
    start_daemon(dl, slurm)
    cfg, ctx = dl.trainer({"batches": 2, "ckpt_every": 2}, HPC)
    assert dl.det("run", cfg, ctx).rc == 0
    (kept,) = dl.home.glob("experiments/1/trials/1/runs/*/slurm-batch.sh")
    text = kept.read_text()
    assert "export DET_LOCAL_TOKEN=<per-run token>" in text
    token = json.loads((kept.parent / "cluster.json").read_text())["session_token"]
    assert token not in text


def test_cmd_run_in_a_slurm_pool(dl: Env, slurm: slurmkit.Slurm) -> None:
    start_daemon(dl, slurm)
    r = dl.det("cmd", "run", "--pool", "hpc", "--", "sh", "-c", "echo job $SLURM_JOB_ID; exit 3")
    assert r.rc == 0, r
    (job,) = dl.jobs()
    done = dl.wait_job(job.id, timeout=60)
    assert done.exit_code == 3 and done.slots_needed == 0  # none of this machine's slots
    assert f"job {done.pid}" in dl.det("cmd", "logs", job.id).out
    listed = dl.json("job", "list", "--all")
    assert listed[0]["pool"] == "hpc"
    dl.setenv(COLUMNS="200")
    assert f"hpc (Slurm job {done.pid})" in dl.det("job", "list", "--all").out
    assert slurm.queue() == []
    r = dl.det("cmd", "run", "--pool", "gpus", "--", "true")
    assert r.rc != 0 and r.err.strip() == (
        "error: --pool: pool 'gpus' does not exist; pools: default, hpc "
        f"(add it under resource_pools: in {dl.paths.settings})"
    ), r


def test_a_job_waiting_in_slurm_is_pending_with_slurms_reason(
    dl: Env, slurm: slurmkit.Slurm
) -> None:
    """`job list` showed such a job SCHEDULED with Slots 0/0 (issue 36): it is PENDING with
    the reason squeue gives, until Slurm starts it."""
    from tests.support.slurmctl import job_fields

    start_daemon(dl, slurm)
    # the only node is taken whole: the trial's job waits in Slurm's queue
    blocker = slurm.run(
        "sbatch", "--parsable", "--exclusive", "-p", "debug", "-o", "/dev/null", "--wrap",
        "sleep 600",
    ).stdout.strip()  # fmt: skip
    try:
        wait_for(lambda: blocker in slurm.queue(), what="the blocking job")
        cfg, ctx = dl.trainer({"batches": 2, "record": str(dl.record_path)})
        assert dl.det("run", "--detach", "--pool", "hpc", cfg, ctx).rc == 0

        def pool_state() -> str | None:
            (job,) = dl.json("job", "list")
            return job["pool_state"]

        wait_for(lambda: (pool_state() or "").startswith("PENDING ("), timeout=60, what="PENDING")
        (job,) = dl.json("job", "list")
        reason = job_fields(slurm, job["pid"])["Reason"]
        assert reason in ("Resources", "Priority"), reason
        wait_for(lambda: pool_state() == f"PENDING ({reason})", timeout=30, what="the reason")
        dl.setenv(COLUMNS="300")  # whole cells in a pipe
        row = dl.det("job", "list").out.splitlines()[2]
        assert f"| PENDING ({reason}) |" in row and f"hpc (Slurm job {job['pid']})" in row, row
    finally:
        slurm.run("scancel", blocker, check=False)
    wait_for(lambda: dl.experiment(1).state == State.COMPLETED, timeout=90, what="completion")
    assert dl.json("job", "list") == []
    assert dl.store().jobs.waiting() == {}  # nothing left behind once it ran

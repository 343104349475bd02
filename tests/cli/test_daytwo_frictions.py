"""Frictions a new user met on the second day (issue 27), each reproduced: what they saw
and what they see now."""

from __future__ import annotations

import json

from tests.support import paths
from tests.support.world import Env, gone

CPU1 = {"DET_LOCAL_FAKE_GPUS": "0", "DET_LOCAL_CPU_SLOTS": "1"}
HIDDEN = "(1 ended command not shown; `det-local cmd list --all` lists them)"


def test_cmd_list_says_ended_commands_are_hidden(dl: Env) -> None:
    dl.setenv(**CPU1)
    r = dl.det("cmd", "run", "-f", "--", "echo", "hi")
    assert r.rc == 0, r
    r = dl.det("cmd", "list")
    assert r.rc == 0 and r.err == HIDDEN + "\n", r
    r = dl.det("cmd", "list", "--json")
    assert json.loads(r.out) == [] and r.err == HIDDEN + "\n", r
    r = dl.det("cmd", "list", "--all")
    assert r.rc == 0 and r.err == "" and "DONE" in r.out, r


SLOW_EXIT = """\
import atexit, sys, time
if sys.argv[1:] == ["daemon"]:  # the daemon itself, not `daemon start|stop`
    atexit.register(time.sleep, 1.5)  # an interpreter slow to end after the lock is released
"""


def test_daemon_stop_says_stopped_once_the_process_has_exited(dl: Env) -> None:
    hook = dl.tmp / "slowexit"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(SLOW_EXIT)
    pid = dl.daemon_start(PYTHONPATH=f"{hook}:{dl.env.get('PYTHONPATH', '')}", **CPU1)
    r = dl.det("daemon", "stop")
    assert r.rc == 0 and r.out == f"det-local daemon {pid} stopped\n", r
    assert gone(pid)  # at once: no waiting here


CKPT3 = """\
import determined as det
from determined import core

with core.init() as ctx:
    for step in (1, 2, 3):
        ctx.train.report_training_metrics(steps_completed=step, metrics={"loss": 1.0 / step})
        with ctx.checkpoint.store_path({"steps_completed": step}) as (path, _):
            (path / "w").write_text(str(step))
"""


def test_run_summary_says_checkpoint_gc_removed_the_older_ones(dl: Env) -> None:
    dl.setenv(**CPU1)
    cfg, ctx = dl.context(CKPT3)
    r = dl.det("run", cfg, ctx)
    assert r.rc == 0, r
    lines = r.out.splitlines()
    i = next(i for i, ln in enumerate(lines) if ln.startswith("    checkpoints: 1, latest "))
    assert lines[i + 1] == (
        "    2 older checkpoints removed by checkpoint GC (checkpoint_storage: "
        "save_trial_latest 1, save_trial_best 1, save_experiment_best 0)"
    ), r.out  # the values GC applied: Determined's defaults, none configured (issue 34)


ASHA = """\
import determined as det
from determined import core

lr = det.get_cluster_info().trial.hparams["lr"]
with core.init() as ctx:
    for steps in range(1, 9):
        if steps % 2 == 0:
            loss = abs(lr - 0.3) + 1.0 / steps
            ctx.train.report_validation_metrics(
                steps_completed=steps, metrics={"loss": loss, "batches": steps}
            )
            with ctx.checkpoint.store_path({"steps_completed": steps}) as (p, _):
                (p / "s").write_text(str(steps))
        if ctx.preempt.should_preempt():
            break
"""


def test_search_summary_shows_trials_asha_stopped_early(dl: Env) -> None:
    dl.setenv(**CPU1)
    cfg, ctx = dl.context(
        ASHA,
        {
            "hyperparameters": {"lr": {"type": "double", "minval": 0.0, "maxval": 1.0}},
            "searcher": {
                "name": "adaptive_asha",
                "metric": "loss",
                "time_metric": "batches",
                "max_time": 8,
                "max_trials": 4,
                "max_concurrent_trials": 1,
                "mode": "aggressive",
                "divisor": 2,
                "max_rungs": 3,
            },
            "reproducibility": {"experiment_seed": 11},
        },
    )
    r = dl.det("run", cfg, ctx, timeout=300)
    assert r.rc == 0, r
    short = [t.id for t in dl.trials(1) if t.steps_completed < 8]
    assert short, r.out  # ASHA stopped some
    head = next(ln for ln in r.out.splitlines() if " trials" in ln and "best loss" in ln)
    assert (
        head == f"  4 trials ({len(short)} stopped early by the searcher), best loss first "
        "(smaller is better):"
    ), r.out
    for tid in short:
        row = next(ln for ln in r.out.splitlines() if ln.split(" | ")[0].strip() == str(tid))
        assert "COMPLETED (stopped early)" in row, r.out


README_CORE_V2 = """\
from determined.experimental import core_v2

core_v2.init(config=core_v2.Config(name="notebook", hparams={"lr": 0.01}))
core_v2.train.report_training_metrics(steps_completed=1, metrics={"loss": 0.5})
core_v2.close()
"""


def test_core_v2_readme_snippet_ends_without_a_refused_bye(dl: Env) -> None:
    import subprocess
    import sys

    repo = paths.REPO
    script = dl.tmp / "nb.py"
    script.write_text(README_CORE_V2)
    env = dict(dl.env, PYTHONPATH=f"{repo / 'det_local' / 'compat'}:{repo}")
    dl.daemon_start(**CPU1)
    for _ in range(2):
        r = subprocess.run(
            [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120
        )
        assert r.returncode == 0 and r.stderr == "", r
    assert dl.det("daemon", "stop").rc == 0
    log = (dl.paths.run_dir / "daemon.log").read_text()
    assert "unmanaged trial 2 ended COMPLETED" in log, log
    assert "refused" not in log, log


def test_pytest_det_configs_collects_with_ids_and_keeps_a_failed_runs_home(dl: Env) -> None:
    import os
    import re
    import shutil
    import subprocess
    import sys

    from tests.support.trials.testmode import SCRIPT, script_config

    good, _ = dl.context(SCRIPT, script_config(), name="good")
    bad, _ = dl.context(SCRIPT, script_config("validate"), name="bad")
    suite = dl.tmp / "suite"
    suite.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("DET_LOCAL")}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "--rootdir", str(suite)]
        + ["--det-configs", str(good), str(bad)],
        cwd=suite,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = proc.stdout
    assert proc.returncode == 1, out + proc.stderr
    assert "collected 2 items" in out, out
    assert re.search(r"good/config\.yaml::det-config\[config\.yaml\] PASSED", out), out
    assert re.search(r"bad/config\.yaml::det-config\[config\.yaml\] FAILED", out), out
    hint = re.search(r"its home is kept: DET_LOCAL_HOME=(\S+) det-local trial logs (\d+)", out)
    assert hint, out
    logs = subprocess.run(
        [sys.executable, "-m", "det_local.cli.main", "trial", "logs", hint.group(2)],
        env=dict(env, DET_LOCAL_HOME=hint.group(1)),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert logs.returncode == 0 and "ValueError: validation broke" in logs.stdout, logs
    shutil.rmtree(hint.group(1))  # kept for us; ours to remove


def test_describe_and_trial_list_fit_100_columns_in_bytes_too(dl: Env) -> None:
    dl.setenv(**CPU1)
    cfg, ctx = dl.context(
        CKPT3.replace('{"loss": 1.0 / step}', '{"validation_loss": 1.0 / step}'),
        {
            "hyperparameters": {"batch_size": 64, "hidden_size": 128, "learning_rate": 0.05},
            "searcher": {"name": "single", "metric": "loss", "max_length": 3},
        },
    )
    assert dl.det("run", cfg, ctx).rc == 0
    dl.setenv(COLUMNS="100")
    for args in (("experiment", "describe", "1"), ("trial", "list", "1")):
        r = dl.det(*args)
        assert r.rc == 0, r
        widest = max(len(line.encode()) for line in r.out.splitlines())
        assert widest <= 100, r.out  # awk and cut count bytes: "…" was three of them
        assert "..." in r.out, r.out  # something was cut (the test is about that)

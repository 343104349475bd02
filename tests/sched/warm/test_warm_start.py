"""Warm trial starts (`sched/warm/zygotes.py`, `trial/zygote.py`): the trials of a search after the
first are forked from a zygote that has imported torch, and see exactly what a cold trial sees."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from det_local.sched.run.launchplan import LaunchPlan
from det_local.sched.warm.zygotes import MAX_OWN_FILES, Cold, WarmSpec, daemon_enabled, warm_spec
from tests.support.trials.warm import PER_TRIAL, SCRIPT, serial_grid, trial_facts
from tests.support.world import Env, wait_for


def _search(dl: Env, out: Path, env: dict[str, str], n: int = 3, **cfg: Any) -> tuple[Path, Path]:
    return dl.context(SCRIPT, {**serial_grid(out, env, n), **cfg})


def test_warm_trial_sees_what_a_cold_one_sees(dl: Env) -> None:
    out = dl.tmp / "out"
    out.mkdir()
    cfg, ctx = _search(dl, out, {"WAIT_ZYGOTE": "1:1.1", "DET_LOCAL_METRIC_LINES": "1"})
    r = dl.det("run", "-q", cfg, ctx, timeout=180)
    assert r.rc == 0, r
    facts = trial_facts(out)
    assert sorted(facts) == [1, 2, 3]
    assert facts[1]["warm"] is False
    assert facts[2]["warm"] is True and facts[3]["warm"] is True
    cold = facts[1]
    for trial_id in (2, 3):
        warm = facts[trial_id]
        assert warm["leaked"] is None  # trial 2 set it in its own fork only
        for key in ("cwd", "ids", "argv", "path0", "main"):
            assert warm[key] == cold[key], key
        for key in ("umask", "threads", "cuda_init", "stdin_tty"):
            assert warm[key] == cold[key], key
        same = {k: v for k, v in cold["env"].items() if k not in PER_TRIAL}
        assert {k: v for k, v in warm["env"].items() if k not in PER_TRIAL} == same
        assert warm["env"]["DET_TRIAL_ID"] == str(trial_id)
        assert warm["env"]["DET_LOCAL_TOKEN"] != cold["env"]["DET_LOCAL_TOKEN"]
        assert set(warm["env"]) == set(cold["env"])
    assert cold["leaked"] is None
    # each in its own session, whose process group the daemon signals (the job's recorded pid)
    pids = {j.trial_id: j.pid for j in dl.jobs()}
    for trial_id, seen in facts.items():
        assert seen["pgid"] == seen["sid"] == pids[trial_id]
    trials = dl.trials(1)
    assert [t.state.value for t in trials] == ["COMPLETED"] * 3
    # how long each took to start: an event, a line in its log, a summary in describe
    store = dl.store()
    starts = store.list_trial_starts(1)
    store.close()
    assert [(t, r, warm) for t, r, warm, _ in starts] == [(1, 1, False), (2, 1, True), (3, 1, True)]
    assert "det-local: trial 1 started cold in " in dl.log(1, 1)
    for trial_id in (2, 3):
        assert f"det-local: trial {trial_id} started warm in " in dl.log(1, trial_id)
    r = dl.det("experiment", "describe", "1")
    assert r.rc == 0, r
    line = next(ln for ln in r.out.splitlines() if ln.strip().startswith("Trial start: "))
    assert "2 warm (p50 " in line and "1 cold (p50 " in line, line


def test_torch_imported_by_the_contexts_own_module_is_preloaded(dl: Env) -> None:
    # examples/digits_pytorch's shape: train.py imports model_def, which imports torch
    out = dl.tmp / "out"
    out.mkdir()
    script = SCRIPT.replace("import torch\n", "from model import torch\n", 1)
    # warm: torch and what its first optimizer would import lazily (zygote.LAZY) are there
    script = script.replace('"torch" in sys.modules', '"torch._dynamo" in sys.modules', 1)
    assert "\nimport torch\n" not in script and "torch._dynamo" in script
    cfg, ctx = _search(dl, out, {"WAIT_ZYGOTE": "1:1.1"}, n=2)
    (ctx / "train.py").write_text(script)
    (ctx / "model.py").write_text("import torch\n")
    r = dl.det("run", "-q", cfg, ctx, timeout=180)
    assert r.rc == 0, r
    assert [f["warm"] for f in trial_facts(out).values()] == [False, True]


@pytest.mark.parametrize("mode", ["v2", "v1"])
def test_warm_trial_runs_in_its_jobs_cgroup(dl: Env, mode: str) -> None:
    out = dl.tmp / "out"
    out.mkdir()
    dl.setenv(DET_LOCAL_CGROUPS=mode)
    cfg, ctx = _search(dl, out, {"WAIT_ZYGOTE": "1:1.1"}, n=2)
    r = dl.det("run", "-q", cfg, ctx, timeout=180)
    assert r.rc == 0, r
    facts = trial_facts(out)
    jobs = {j.trial_id: j for j in dl.jobs()}
    if f"job-{jobs[1].id}-" not in facts[1]["cgroup"]:
        pytest.skip(f"no cgroup {mode} containment here")
    assert facts[2]["warm"] is True
    for trial_id, seen in facts.items():
        job = jobs[trial_id]
        mine = [ln for ln in seen["cgroup"].splitlines() if f"/job-{job.id}-{job.run_id}" in ln]
        cold = [ln for ln in facts[1]["cgroup"].splitlines() if f"/job-{jobs[1].id}-" in ln]
        assert len(mine) == len(cold) > 0, (seen["cgroup"], facts[1]["cgroup"])


def test_warm_trial_exit_code_reaches_the_daemon(dl: Env) -> None:
    out = dl.tmp / "out"
    out.mkdir()
    cfg, ctx = _search(dl, out, {"WAIT_ZYGOTE": "1:1.1", "EXIT_CODE": "3"}, n=2)
    r = dl.det("run", "-q", cfg, ctx, timeout=180)
    facts = trial_facts(out)
    assert facts[2]["warm"] is True
    jobs = {j.trial_id: j for j in dl.jobs()}
    assert jobs[1].exit_code == jobs[2].exit_code == 3, (r, jobs)


def test_failed_preload_starts_cold_with_one_warning(dl: Env) -> None:
    out = dl.tmp / "out"
    out.mkdir()
    cfg, ctx = _search(dl, out, {"DET_LOCAL_PRELOAD": "no_such_module_xyz"})
    r = dl.det("run", "-q", cfg, ctx, timeout=180)
    assert r.rc == 0, r
    facts = trial_facts(out)
    assert [f["warm"] for f in facts.values()] == [False, False, False]
    events = [e for e in dl.events(1) if "warm starts off" in e]
    assert len(events) == 1, dl.events(1)
    assert "cannot preload no_such_module_xyz" in events[0]


def test_zygote_killed_next_trial_cold_then_new_zygote(dl: Env) -> None:
    out = dl.tmp / "out"
    out.mkdir()
    # trial 1 waits for zygote 1 and kills it -9: trial 2 starts cold, and waits for the new
    # zygote; trial 3 is forked from it
    env = {"WAIT_ZYGOTE": "1:1.1,2:1.2", "KILL_ZYGOTE": "1"}
    cfg, ctx = _search(dl, out, env, n=3)
    r = dl.det("run", "-q", cfg, ctx, timeout=240)
    assert r.rc == 0, r
    facts = trial_facts(out)
    assert [facts[i]["warm"] for i in (1, 2, 3)] == [False, False, True]
    assert any("its zygote ended" in e for e in dl.events(1)), dl.events(1)


def test_single_trial_and_switch_off_stay_cold(dl: Env) -> None:
    out = dl.tmp / "out"
    out.mkdir()
    cfg, ctx = _search(dl, out, {"DET_LOCAL_WARM_START": "off"}, n=2)
    r = dl.det("run", "-q", cfg, ctx, timeout=180)
    assert r.rc == 0, r
    assert [f["warm"] for f in trial_facts(out).values()] == [False, False]
    assert not list((dl.home / "run" / "z").glob("*"))


def test_daemon_restart_adopts_no_zygote(dl: Env) -> None:
    out = dl.tmp / "out"
    out.mkdir()
    dl.daemon_start()
    cfg, ctx = _search(dl, out, {"WAIT_ZYGOTE": "1:1.1", "GATE": "2"}, n=2)
    r = dl.det("experiment", "create", cfg, ctx)
    assert r.rc == 0, r
    wait_for(lambda: len(trial_facts(out)) == 2, timeout=120, what="trial 2 to run")
    assert trial_facts(out)[2]["warm"] is True
    sock = dl.home / "run" / "z" / "1.1" / "s"
    zygote_pid = _zygote_pid(sock)
    dl.kill_daemon()
    # its daemon gone, the zygote serves no more, but stays to record its running trial's exit
    wait_for(lambda: not sock.exists(), timeout=30, what="the zygote to stop serving")
    assert not _gone(zygote_pid)
    # a new daemon adopts trial 2's run, its exit status recorded by the zygote; no zygote
    dl.daemon_start()
    (out / "gate").touch()
    wait_for(lambda: _done(dl), timeout=60, what="the experiment to complete")
    wait_for(lambda: _gone(zygote_pid), timeout=60, what="the old zygote to exit")
    assert [t.state.value for t in dl.trials(1)] == ["COMPLETED", "COMPLETED"]
    assert {j.trial_id: j.exit_code for j in dl.jobs()} == {1: 0, 2: 0}
    # no new zygote: only the old one's directory and its wrapper's exit file (root's)
    assert sorted(p.name for p in (dl.home / "run" / "z").iterdir()) == ["1.1", "1.1.exit"]


def test_zygote_stops_when_its_experiment_ends(dl: Env) -> None:
    out = dl.tmp / "out"
    out.mkdir()
    dl.daemon_start()
    cfg, ctx = _search(dl, out, {"WAIT_ZYGOTE": "1:1.1"}, n=2)
    assert dl.det("experiment", "create", cfg, ctx).rc == 0
    wait_for(lambda: _done(dl), timeout=120, what="the experiment to complete")
    assert trial_facts(out)[2]["warm"] is True
    zygote_pid = _zygote_pid(dl.home / "run" / "z" / "1.1" / "s")
    wait_for(lambda: _gone(zygote_pid), timeout=30, what="the zygote to exit")


def _done(dl: Env) -> bool:
    return dl.experiment(1).state.value == "COMPLETED"


def _zygote_pid(sock: Path) -> int:
    log = (sock.parent / "log").read_text()
    return int(log.split("ready (pid ")[1].split(",")[0])


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_shell_entrypoint_starts_cold_said_once(dl: Env) -> None:
    out = dl.tmp / "out"
    out.mkdir()
    cfg, ctx = _search(dl, out, {}, n=2, entrypoint="python3 train.py && true")
    r = dl.det("run", "-q", cfg, ctx, timeout=180)
    assert r.rc == 0, r
    assert [f["warm"] for f in trial_facts(out).values()] == [False, False]
    said = [e for e in dl.events(1) if "start cold" in e]
    assert said == ["experiment 1: its trials start cold: the entrypoint uses shell syntax"]


def test_launcher_entrypoint_starts_cold_said_once(dl: Env) -> None:
    """A search whose trials run under torch_distributed: cold (its workers are torchrun's
    subprocesses), said once for the experiment, not once per trial."""
    cfg, ctx = dl.context(
        "print('worker')\n",
        {
            "entrypoint": "python3 -m det_local.launch.torch_distributed python3 train.py",
            "searcher": {"name": "grid", "metric": "loss", "max_length": 1},
            "hyperparameters": {"x": {"type": "categorical", "vals": [0, 1]}},
            "resources": {"max_slots": 1},
        },
    )
    dl.det("run", "-q", cfg, ctx, timeout=180)
    assert len(dl.trials(1)) == 2 and all(j.pid for j in dl.jobs())
    said = [e for e in dl.events(1) if "start cold" in e]
    assert said == [
        "experiment 1: its trials start cold: its entrypoint is a launcher "
        "(det_local.launch.torch_distributed), whose workers are started by the launcher itself "
        "as new processes (see sched/warm/zygotes.py)"
    ]
    assert not (dl.home / "run" / "z").exists()


# ---------------------------------------------------------------------------- the plan alone
def _plan(tmp: Path, entrypoint: Any, searcher: str = "grid", **env: str) -> LaunchPlan:
    (tmp / "train.py").write_text(
        "import os\nimport torch.nn as nn\nfrom numpy import ones\nimport helper\n"
        "from . import x\nif True:\n    import json\n"
    )
    (tmp / "helper.py").write_text("")
    config = {"entrypoint": entrypoint, "searcher": {"name": searcher}}
    return LaunchPlan(
        argv=["sh", "-c", "x"],
        env={"DET_EXPERIMENT_ID": "7", "DET_EXPERIMENT_CONFIG": json.dumps(config), **env},
        cwd=str(tmp),
        user="u",
        slots=[0],
        log_path=str(tmp / "log"),
        info_dir=str(tmp),
    )


def test_warm_spec_preloads_the_scripts_top_level_imports(tmp_path: Path) -> None:
    spec = warm_spec(_plan(tmp_path, "python3 train.py --lr 1", DET_LOCAL_PRELOAD="scipy, x"))
    assert isinstance(spec, WarmSpec)
    assert spec.argv == ["python3", "train.py", "--lr", "1"]
    # absolute top-level imports as written, not the context's own modules (helper.py imports
    # nothing), then determined and the extras
    assert spec.preload == ("os", "torch.nn", "numpy", "determined", "scipy", "x")


def test_warm_spec_follows_the_contexts_own_modules(tmp_path: Path) -> None:
    plan = _plan(tmp_path, "python3 train.py")
    # helper (imported by train.py) imports torch, a package of the context and one of its
    # submodules; the package and the submodule import more; a cycle back to helper ends
    (tmp_path / "helper.py").write_text(
        "import torch\nfrom pkg import sub\nimport pkg.deep.leaf\n"
        "def f():\n    import never_preloaded\n"
    )
    (tmp_path / "pkg" / "deep").mkdir(parents=True)
    (tmp_path / "pkg" / "__init__.py").write_text("from sklearn.datasets import load_digits\n")
    (tmp_path / "pkg" / "sub.py").write_text("import helper\nimport yaml\n")
    (tmp_path / "pkg" / "deep" / "__init__.py").write_text("import csv\n")
    (tmp_path / "pkg" / "deep" / "leaf.py").write_text("from . import x\nimport json as j\n")
    spec = warm_spec(plan)
    assert isinstance(spec, WarmSpec)
    assert spec.preload == (
        "os",
        "torch.nn",
        "numpy",
        "torch",
        "sklearn.datasets",
        "yaml",
        "csv",
        "json",
        "determined",
    )


def test_warm_spec_reads_a_bounded_number_of_own_modules(tmp_path: Path) -> None:
    plan = _plan(tmp_path, "python3 train.py")
    # helper -> m0 -> m1 -> ... each importing a module of its own name: the walk stops
    (tmp_path / "helper.py").write_text("import m0\n")
    for i in range(MAX_OWN_FILES + 8):
        (tmp_path / f"m{i}.py").write_text(f"import m{i + 1}\nimport ext{i}\n")
    spec = warm_spec(plan)
    assert isinstance(spec, WarmSpec)
    ext = [m for m in spec.preload if m.startswith("ext")]
    assert ext == [f"ext{i}" for i in range(MAX_OWN_FILES - 1)]  # helper.py is the first file


@pytest.mark.parametrize(
    ("entrypoint", "searcher", "env", "why", "quiet"),
    [
        ("python3 train.py", "single", {}, "a single-trial experiment (not a search)", True),
        ("python3 train.py", "grid", {"DET_LOCAL_WARM_START": "off"}, "is off", True),
        ("python3 train.py | tee x", "grid", {}, "the entrypoint uses shell syntax", False),
        ("torchrun train.py", "grid", {}, "its entrypoint is a launcher (torchrun)", False),
        (
            "python3 -m determined.launch.torch_distributed python3 train.py",
            "grid",
            {},
            "its entrypoint is a launcher (determined.launch.torch_distributed), whose workers",
            False,
        ),
        ("python3 -m det_local.launch.deepspeed python3 train.py", "grid", {}, "launcher", False),
        ("bash train.py", "grid", {}, "the entrypoint is not `python script.py`", False),
        (["python3", "train.py"], "grid", {}, "not a plain `python script.py` string", False),
        ("python3 missing.py", "grid", {}, "its script missing.py is not a file", False),
    ],
)
def test_warm_spec_says_why_cold(
    tmp_path: Path, entrypoint: Any, searcher: str, env: dict[str, str], why: str, quiet: bool
) -> None:
    cold = warm_spec(_plan(tmp_path, entrypoint, searcher, **env))
    assert isinstance(cold, Cold)
    assert why in cold.why and cold.quiet is quiet


def test_single_trial_forced_warm_by_the_experiment(tmp_path: Path) -> None:
    spec = warm_spec(_plan(tmp_path, "python3 train.py", "single", DET_LOCAL_WARM_START="1"))
    assert isinstance(spec, WarmSpec)


def test_daemon_switch() -> None:
    assert daemon_enabled({}) and daemon_enabled({"DET_LOCAL_WARM_STARTS": "1"})
    assert not daemon_enabled({"DET_LOCAL_WARM_STARTS": "off"})

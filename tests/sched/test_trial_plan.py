"""One plan per trial run (issue 12, item 2): the plan the engine launches with, and the one
`config check` shows, come from `sched/run/trialplan.build_trial_plan`; golden files pin them.

Values that vary between machines and runs are placeholders in the golden files: <home>,
<context>, <python> (the interpreter's directory), <package> (det_local's parent directory),
<host>. DET_LOCAL_UPDATE_GOLDEN=1 rewrites the files (review the diff)."""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path
from typing import Any

import pytest

import det_local
from det_local.sched.queue import hardware as slots
from det_local.sched.run.launchplan import STOP_TRAPS, LaunchPlan
from det_local.sched.run.trialplan import TrialFacts, build_trial_plan
from det_local.store.paths import Paths
from tests.support import paths

GOLDEN = paths.GOLDEN
CONFIG = {
    "name": "golden",
    "entrypoint": "python3 train.py --epochs 2",
    "resources": {"slots_per_trial": 2},
    "environment": {"environment_variables": ["FOO=bar", "OMP_NUM_THREADS=3"]},
    "searcher": {"name": "single", "metric": "loss", "max_length": {"batches": 10}},
    "data": {"url": "x"},
}


def _placeholders(value: Any, subs: list[tuple[str, str]]) -> Any:
    if isinstance(value, str):
        for real, mark in subs:
            value = value.replace(real, mark)
        return value
    if isinstance(value, dict):
        return {k: _placeholders(v, subs) for k, v in value.items()}
    if isinstance(value, list):
        return [_placeholders(v, subs) for v in value]
    return value


def _normal(plan: LaunchPlan, home: Path, context: Path) -> dict[str, Any]:
    subs = [
        (str(context), "<context>"),
        (str(home), "<home>"),
        (str(Path(det_local.__file__).resolve().parent.parent), "<package>"),
        (os.path.dirname(sys.executable), "<python>"),
        (socket.gethostname(), "<host>"),
    ]
    subs.sort(key=lambda s: -len(s[0]))  # the longest first: a venv may lie inside the package
    data = plan.to_json()
    data["env"] = dict(sorted(data["env"].items()))
    return dict(_placeholders(data, subs))


def _compare(name: str, got: dict[str, Any]) -> None:
    path = GOLDEN / name
    if os.environ.get("DET_LOCAL_UPDATE_GOLDEN") == "1":
        path.write_text(json.dumps(got, indent=2, sort_keys=True) + "\n")
    want = json.loads(path.read_text())
    assert got == want, f"the plan differs from {path} (DET_LOCAL_UPDATE_GOLDEN=1 rewrites it)"


def _facts(tmp_path: Path, **over: Any) -> TrialFacts:
    context = tmp_path / "ctx"
    context.mkdir(exist_ok=True)
    base = dict(
        experiment_id=7,
        trial_id=12,
        run_id=3,
        seed=1234,
        hparams={"lr": 0.1, "layers": 2},
        config=CONFIG,
        context=context,
        steps_completed=40,
        latest_checkpoint="0f8c1d9e-5b7a-4c1e-9d2f-3a6b8c0e1f24",
        slots=[1, 2],
        token="t0ken",
        user="alice",
        uid=None,
        umask=0o027,
        checkpoint_dir=tmp_path / "home" / "checkpoints",
        slots_per_trial=2,
        captured_env={"PATH": "/opt/bin:/usr/bin", "LANG": "C.UTF-8", "SECRET": "x"},
        ports={
            "C10D_PORT": 29400,
            "INTER_TRAIN_PROCESS_COMM_PORT_1": 29401,
            "INTER_TRAIN_PROCESS_COMM_PORT_2": 29402,
            "DTRAIN_SSH_PORT": 29403,
        },
    )
    base.update(over)
    return TrialFacts(**base)  # type: ignore[arg-type]


@pytest.fixture
def passwd_free(monkeypatch: pytest.MonkeyPatch) -> None:
    """HOME/USER/LOGNAME come from the passwd entry of the user a trial runs as: pinned."""
    import pwd

    entry = pwd.struct_passwd(("alice", "x", 4242, 4242, "", "/home/alice", "/bin/sh"))
    monkeypatch.setattr(pwd, "getpwuid", lambda uid: entry)


def test_gpu_trial_plan_matches_golden(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, passwd_free: None
) -> None:
    monkeypatch.setenv("DET_LOCAL_FAKE_GPUS", "4")
    paths = Paths(tmp_path / "home")
    plan = build_trial_plan(_facts(tmp_path), paths, slots.discover())
    got = _normal(plan, paths.home, tmp_path / "ctx")
    # what each part of the plan must be, not only what it was
    env = got["env"]
    assert env["CUDA_VISIBLE_DEVICES"] == f"{slots.fake_uuid(1)},{slots.fake_uuid(2)}"
    assert env["C10D_PORT"] == "29400" and got["ports"]["DTRAIN_SSH_PORT"] == 29403
    assert "SECRET" not in env and env["FOO"] == "bar" and env["OMP_NUM_THREADS"] == "3"
    assert got["slots"] == [1, 2] and got["umask"] == 0o027 and got["cwd"] == "<context>"
    _compare("trial_plan_gpu.json", got)


def test_cpu_trial_plan_matches_golden(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, passwd_free: None
) -> None:
    monkeypatch.setenv("DET_LOCAL_FAKE_GPUS", "0")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    config = {**CONFIG, "environment": {}, "resources": {"slots_per_trial": 1}}
    facts = _facts(tmp_path, config=config, slots=[0], slots_per_trial=1, latest_checkpoint=None)
    paths = Paths(tmp_path / "home")
    plan = build_trial_plan(facts, paths, slots.discover(cpu_slots=2))
    got = _normal(plan, paths.home, tmp_path / "ctx")
    assert got["env"]["OMP_NUM_THREADS"] == "4"  # half of 8 cores: one of two CPU slots
    assert got["env"]["CUDA_VISIBLE_DEVICES"] == ""
    assert "DET_LATEST_CHECKPOINT" not in got["env"]
    _compare("trial_plan_cpu.json", got)


def test_config_check_shows_the_plan_the_engine_builds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`config check` builds its plan with build_trial_plan: the same env, argv and slots as
    the engine's plan for the same facts, but the port and token placeholders."""
    from det_local.client import preview

    home = tmp_path / "home"
    monkeypatch.setenv("DET_LOCAL_HOME", str(home))
    monkeypatch.setenv("DET_LOCAL_FAKE_GPUS", "4")
    ctx = tmp_path / "ctx"
    ctx.mkdir()
    (ctx / "train.py").write_text("print(1)\n")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(json.dumps(CONFIG))
    shown = preview.preview(cfg, ctx)["plan"]
    assert shown["slots"] == [0, 1]
    assert shown["env"]["CUDA_VISIBLE_DEVICES"] == f"{slots.fake_uuid(0)},{slots.fake_uuid(1)}"
    assert shown["env"]["C10D_PORT"] == "<a free port>"
    assert shown["env"]["DET_LOCAL_TOKEN"] == "<per-run token>"
    assert shown["argv"] == ["sh", "-c", f"{STOP_TRAPS}\npython3 train.py --epochs 2"]

"""Day-two verbs (issue 27): `experiment download-model-def`, `slot disable|enable`,
`cluster node disable|enable`."""

from __future__ import annotations

import os
import shutil
import tarfile
from pathlib import Path

import pytest

from tests.support.users import ADMIN, ADMIN_GROUP, A, Shared
from tests.support.world import Env, one_line_error

CPU2 = {"DET_LOCAL_FAKE_GPUS": "0", "DET_LOCAL_CPU_SLOTS": "2"}


def test_download_model_def_writes_the_context_snapshot(dl: Env) -> None:
    dl.setenv(**CPU2)
    cfg, ctx = dl.context("print('hi')\n", files={"pkg/model.py": "W = 1\n"})
    assert dl.det("run", cfg, ctx).rc == 0
    r = dl.det("experiment", "download-model-def", "1", "-o", dl.tmp)
    assert r.rc == 0 and r.out == f"Wrote {dl.tmp}/experiment_1_model_def.tgz\n", r
    with tarfile.open(dl.tmp / "experiment_1_model_def.tgz") as tar:
        names = sorted(n for n in tar.getnames() if n != ".")
        model = tar.extractfile("./pkg/model.py")
        assert model is not None and model.read() == b"W = 1\n"
    assert names == ["./config.yaml", "./pkg", "./pkg/model.py", "./train.py"]
    r = dl.det("experiment", "download-model-def", "7")
    assert r.rc == 1 and r.err == (
        "error: experiment 7 not found; `det-local experiment list` shows the ids\n"
    ), r


def test_a_disabled_slot_finishes_its_work_and_takes_nothing_new(dl: Env) -> None:
    dl.daemon_start(**CPU2)
    first = dl.cmd(*dl.held("a"), slots=1)
    dl.wait_job(first, "SCHEDULED")
    held_slot = dl.job(first).slots[0]
    r = dl.det("slot", "disable", held_slot)
    assert r.rc == 0 and r.out == (
        f"slot {held_slot} disabled: what runs there finishes; nothing new is placed there\n"
    ), r
    # the running command goes on; the other slot takes the next one; a third waits
    second = dl.cmd(*dl.held("b"), slots=1)
    dl.wait_job(second, "SCHEDULED")
    assert dl.job(second).slots == [1 - held_slot]
    third = dl.cmd("true", slots=1)
    dl.release("a")
    dl.wait_job(first, "DONE")
    assert dl.job(third).state == "QUEUED"  # the freed slot is disabled
    rows = dl.json("slots", "--json")
    assert [r["disabled"] for r in rows] == [i == held_slot for i in range(2)]
    assert "(disabled)" in dl.det("slots").out
    # kept across a daemon restart
    assert dl.det("daemon", "stop").rc == 0
    dl.daemon_start()
    assert dl.job(third).state == "QUEUED"
    r = dl.det("slot", "enable", held_slot)
    assert r.rc == 0 and r.out == f"slot {held_slot} enabled\n", r
    dl.wait_job(third, "DONE")
    dl.release("b")


def test_slot_and_node_disable_refuse_bad_input_in_one_line(dl: Env) -> None:
    dl.daemon_start(**CPU2)
    r = dl.det("slot", "disable", "5")
    one_line_error(r, "slot 5 does not exist: this machine has slots 0-1")
    r = dl.det("cluster", "node", "disable", "gpu-box-2")
    one_line_error(r, "node 'gpu-box-2' is not this machine (local)", "on gpu-box-2 itself")
    r = dl.det("cluster", "node", "disable", "local")
    assert r.rc == 0 and r.out.startswith("node local disabled: it takes no new gang shares"), r
    assert dl.det("cluster", "node", "disable", "local").out == "node local was already disabled\n"
    assert dl.det("cluster", "node", "enable", "local").out == "node local enabled\n"


RESUMING = """\
import determined as det
from determined import core

info = det.get_cluster_info()
with core.init() as ctx:
    steps = 0
    if info.latest_checkpoint:
        with ctx.checkpoint.restore_path(info.latest_checkpoint) as path:
            steps = int((path / "steps").read_text())
    print(f"run starts at {steps}", flush=True)
    for op in ctx.searcher.operations():
        while steps < op.length:
            steps += 1
            ctx.train.report_training_metrics(steps_completed=steps, metrics={"loss": 1.0 / steps})
        ctx.train.report_validation_metrics(steps_completed=steps, metrics={"loss": 1.0 / steps})
        with ctx.checkpoint.store_path({"steps_completed": steps}) as (path, _):
            (path / "steps").write_text(str(steps))
        op.report_completed(1.0 / steps)
"""


def _resuming(dl: Env) -> tuple[object, object]:
    return dl.context(
        RESUMING, {"searcher": {"name": "single", "metric": "loss", "max_length": {"batches": 4}}}
    )


def test_continue_trains_the_same_trial_further_from_its_latest_checkpoint(dl: Env) -> None:
    dl.setenv(**CPU2)
    cfg, ctx = _resuming(dl)
    assert dl.det("run", cfg, ctx).rc == 0
    assert dl.trial(1).steps_completed == 4
    # no daemon: it runs here, in the foreground
    r = dl.det("experiment", "continue", "1", "--config", "searcher.max_length.batches=7")
    assert r.rc == 0, r
    assert r.out.startswith(
        "experiment 1 continues: trial 1 resumes at steps_completed=4 from checkpoint "
    ), r
    t = dl.trial(1)
    assert (t.state.value, t.steps_completed, t.run_id) == ("COMPLETED", 7, 2)
    assert dl.experiment(1).state.value == "COMPLETED"
    assert [m.steps_completed for m in dl.metrics(1, "training")] == [1, 2, 3, 4, 5, 6, 7]
    assert "run starts at 0" in dl.log(1, 1) and "run starts at 4" in dl.log(1, 1)
    assert dl.experiment(1).config["searcher"]["max_length"] == {"batches": 7}
    # collected again when it ended again: the latest checkpoint is the one kept
    kept = [c.steps_completed for c in dl.checkpoints(1) if c.state == "COMPLETED"]
    assert kept == [7], dl.checkpoints(1)
    # through a daemon: answered at once, trained there
    dl.daemon_start()
    r = dl.det("experiment", "continue", "1", "--config", "searcher.max_length.batches=9")
    assert r.rc == 0 and r.out.startswith("experiment 1 continues: trial 1 resumes at "), r
    assert dl.det("experiment", "wait", "1").rc == 0
    assert dl.trial(1).steps_completed == 9


def test_continue_refuses_in_one_line(dl: Env) -> None:
    dl.setenv(**CPU2)
    cfg, ctx = _resuming(dl)
    assert dl.det("run", cfg, ctx).rc == 0
    r = dl.det("experiment", "continue", "1", "--config", "searcher.max_length")
    one_line_error(r, "--config 'searcher.max_length': expected KEY=VALUE with a dotted key")
    r = dl.det("experiment", "continue", "1", "--config", "searcher.max_lenght=5")
    one_line_error(r, "searcher.max_lenght", "continued config")
    r = dl.det("experiment", "continue", "9")
    one_line_error(r, "experiment 9 not found")
    grid, gctx = dl.context(
        "print(1)\n",
        {
            "searcher": {"name": "grid", "metric": "loss", "max_length": 1},
            "hyperparameters": {"x": {"type": "categorical", "vals": [1, 2]}},
        },
        name="grid",
    )
    assert dl.det("run", grid, gctx).rc == 0
    r = dl.det("experiment", "continue", "2")
    one_line_error(
        r,
        "experiment 2 is a search (grid, 2 trials); only a single-trial experiment "
        "(searcher: single) can be continued",
    )


def test_what_peers_see_of_a_disabled_slot_and_a_disabled_node(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The federation's view of this node (`EngineView.slots`, what it advertises and checks
    a reserve against): disabled slots are not free; a disabled node has nothing free and
    refuses reserves (federate/gangs/ checks `node_disabled`)."""
    from det_local.sched.engine import Engine
    from det_local.sched.extensions import EngineView
    from det_local.store.paths import Paths

    monkeypatch.setenv("DET_LOCAL_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("DET_LOCAL_CPU_SLOTS", "3")
    monkeypatch.setenv("DET_LOCAL_FAKE_GPUS", "0")
    engine = Engine(Paths.from_env(), offline=True, out=lambda line: None)
    view = EngineView(engine, log=lambda line: None)
    view.install_placer(None, node_id="gpu-box-1")
    assert view.slots() == (3, 3, "cpu")
    assert engine.set_drain("slot:1", True, "root").startswith("slot 1 disabled")
    assert view.slots() == (2, 3, "cpu")
    assert [s.index for s in engine.slots.free([]).slots] == [0, 2]
    msg = engine.set_drain("node:gpu-box-1", True, "root")
    assert msg.startswith("node gpu-box-1 disabled: it takes no new gang shares"), msg
    assert view.node_disabled() and view.slots() == (0, 3, "cpu")
    # kept in the store: a new engine (a daemon restart) finds both
    engine.store.close()
    again = Engine(Paths.from_env(), offline=True, out=lambda line: None)
    assert again.slots.disabled == {1} and again.store.drains.node()
    assert again.set_drain("node:local", False, "root") == "node local enabled"
    assert again.set_drain("slot:1", False, "root") == "slot 1 enabled"
    assert EngineView(again, log=lambda line: None).slots() == (3, 3, "cpu")


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("useradd") is None,
    reason="multi-user tests create real users: they need root and useradd",
)
def test_only_an_admin_disables_a_slot_or_the_node(shared: Shared) -> None:
    from det_local import api
    from det_local.errors import DetLocalError

    for target in ("slot:0", "node:local"):
        with pytest.raises(DetLocalError) as exc:
            shared.as_user(A, api.control_job, "drain", {"target": target, "disabled": True})
        assert str(exc.value) == (
            f"permission denied: only root or a member of the {ADMIN_GROUP} group may disable "
            "or enable slots and nodes"
        )
    msg = shared.as_user(ADMIN, api.control_job, "drain", {"target": "slot:0", "disabled": True})
    assert msg.startswith("slot 0 disabled")
    job = shared.held(A, "a")
    assert shared.wait_job(job, "SCHEDULED").slots == [1]  # not the disabled slot
    shared.release("a")

"""Data-parallel training through the real daemon: a PyTorchTrial (tests/fixtures/ddp_trial.py)
with slots_per_trial 2 on 2 CPU slots (DDP over gloo, `determined.launch.torch_distributed`)
learns exactly what the same experiment learns on 1 slot with the same global batch size:
the same validation metrics at every validation, the same final weights in the checkpoint.
The 2-slot trial holds both slots while it runs (the 1-slot one waits: gang scheduling), and
when both have ended the slots are free, the queue is empty and no trial process is left.

Waits are bounded polls; the `dl` fixture stops the daemon and every process of the home.
"""

from __future__ import annotations

import re
from typing import Any

import psutil
import pytest
import torch

from det_local.store.states import State
from tests.support import paths
from tests.support.trials.ddp import STEPS, final_weights
from tests.support.world import Env, wait_for

FIXTURE = paths.FIXTURES / "ddp_trial.py"
CPU2 = {"DET_LOCAL_FAKE_GPUS": "0", "DET_LOCAL_CPU_SLOTS": "2"}


def config(slots: int) -> dict[str, Any]:
    """The same experiment but for its slot count: one entrypoint, one seed, one global batch."""
    return {
        "name": f"ddp-{slots}-slot",
        "hyperparameters": {"global_batch_size": 32},
        "resources": {"slots_per_trial": slots},
        "reproducibility": {"experiment_seed": 7},
        "searcher": {
            "name": "single",
            "metric": "validation_loss",
            "smaller_is_better": True,
            "max_length": STEPS[-1],
        },
        "entrypoint": "python3 -m determined.launch.torch_distributed python3 train.py",
        "max_restarts": 0,
    }


def submit(dl: Env, slots: int) -> int:
    cfg, ctx = dl.context(FIXTURE.read_text(), config(slots), name=f"ddp{slots}")
    r = dl.det("run", "--detach", cfg, ctx)
    found = re.search(r"Created experiment (\d+)", r.out)
    assert r.rc == 0 and found, r
    return int(found.group(1))


def home_processes(dl: Env, daemon: int) -> list[str]:
    """Live processes of this home other than the daemon (a job's environment names it)."""
    me = psutil.Process()
    spared = {daemon, me.pid, *(p.pid for p in me.parents())}
    found = []
    for proc in psutil.process_iter(["pid"]):
        if proc.pid in spared:
            continue
        try:
            if proc.environ().get("DET_LOCAL_HOME") == str(dl.home) and (
                proc.status() != psutil.STATUS_ZOMBIE
            ):
                found.append(f"{proc.pid} {' '.join(proc.cmdline())}")
        except (psutil.NoSuchProcess, psutil.AccessDenied, OSError):
            continue
    return found


def trial_tree(job_pid: int) -> list[psutil.Process] | None:
    """The job's process tree once both ranks' `python3 train.py` workers are up, else None."""
    try:
        root = psutil.Process(job_pid)
        tree = [root, *root.children(recursive=True)]
        workers = [p for p in tree if p.cmdline()[1:] == ["train.py"]]
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None
    return tree if len(workers) == 2 else None


def alive(proc: psutil.Process) -> bool:
    """Still running (is_running() also tells a reused pid apart); a zombie counts as gone."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_two_slots_learn_what_one_slot_learns(dl: Env) -> None:
    daemon = dl.daemon_start(**CPU2)
    two = submit(dl, 2)
    one = submit(dl, 1)

    # The 2-slot trial holds both CPU slots; the 1-slot trial waits for one (gang scheduling).
    jobs = wait_for(
        lambda: (
            (js := dl.json("job", "list"))
            and any(j["experiment_id"] == two and j["state"] == "SCHEDULED" for j in js)
            and any(j["experiment_id"] == one for j in js)
            and js
        ),
        timeout=30,
        interval=0.1,
        what="the 2-slot trial to start and the 1-slot trial to be queued",
    )
    by_exp = {j["experiment_id"]: j for j in jobs}
    assert sorted(by_exp[two]["slots"]) == [0, 1], jobs
    assert by_exp[one]["state"] == "QUEUED" and by_exp[one]["slots"] == [], jobs
    tree = wait_for(
        lambda: trial_tree(by_exp[two]["pid"]),
        timeout=30,
        interval=0.1,
        what="the 2-slot trial's two rank processes",
    )
    slots = dl.json("slots")
    assert [s["index"] for s in slots] == [0, 1], slots
    for s in slots:
        assert s["kind"] == "cpu" and f"experiment {two} trial" in (s["allocation"] or ""), slots

    for exp_id in (two, one):
        wait_for(
            lambda e=exp_id: dl.experiment(e).state in (State.COMPLETED, State.ERROR),
            timeout=60,
            interval=0.1,
            what=f"experiment {exp_id} to end",
        )
        trial = dl.trial(exp_id)
        assert dl.experiment(exp_id).state == State.COMPLETED, dl.log(exp_id, trial.id)
        assert trial.steps_completed == STEPS[-1]

    # Same global batch, same seed: DDP on 2 ranks learns what 1 process learns.
    trial2, trial1 = dl.trial(two), dl.trial(one)
    val2, val1 = dl.metrics(trial2.id, "validation"), dl.metrics(trial1.id, "validation")
    assert [m.steps_completed for m in val2] == [m.steps_completed for m in val1] == STEPS
    for a, b in zip(val2, val1, strict=True):
        assert a.metrics["validation_loss"] == pytest.approx(b.metrics["validation_loss"], rel=1e-5)
        assert a.metrics["accuracy"] == pytest.approx(b.metrics["accuracy"], abs=1e-6)
    train2, train1 = dl.metrics(trial2.id, "training"), dl.metrics(trial1.id, "training")
    assert [m.steps_completed for m in train2] == [m.steps_completed for m in train1]
    for a, b in zip(train2, train1, strict=True):
        assert a.metrics["loss"] == pytest.approx(b.metrics["loss"], rel=1e-5)
    weights2, weights1 = final_weights(dl, trial2.id), final_weights(dl, trial1.id)
    assert weights2.keys() == weights1.keys()
    for name, w in weights2.items():
        torch.testing.assert_close(w, weights1[name], rtol=1e-5, atol=1e-6, msg=name)
    assert not torch.equal(weights2["0.weight"], torch.zeros_like(weights2["0.weight"]))

    # Both slots are free, nothing is queued or running, no trial process is left behind.
    assert dl.json("job", "list") == []
    slots = dl.json("slots")
    assert len(slots) == 2 and not any(s["allocation"] or s["used_by"] for s in slots), slots
    wait_for(
        lambda: not any(alive(p) for p in tree),
        timeout=10,
        interval=0.05,
        what="the 2-slot trial's processes to be gone",
    )
    assert home_processes(dl, daemon) == []
    assert not psutil.Process(daemon).children(recursive=True)

"""Engine state that must survive a new process: best validation and last validation."""

from __future__ import annotations

from tests.support.world import Env

SCRIPT = """\
import json, os
import determined as det
from determined import core

info = det.get_cluster_info()
with core.init() as ctx:
    run = int(os.environ["DET_TRIAL_RUN_ID"])
    if run == 1:
        ctx.train.report_validation_metrics(steps_completed=1, metrics={"acc": 0.5})
        ctx.train.report_validation_metrics(steps_completed=2, metrics={"acc": 0.9})
        ctx.train.report_validation_metrics(steps_completed=3, metrics={"acc": 0.7})
        with ctx.checkpoint.store_path({"steps_completed": 3}) as (path, _):
            (path / "x").write_text("x")
        ctx.preempt.acknowledge_preemption_signal()
        # wait to be paused (the test pauses the experiment)
        import time
        deadline = time.time() + 60
        while not ctx.preempt.should_preempt() and time.time() < deadline:
            time.sleep(0.01)
    else:
        seen = {
            "best": ctx.train.get_experiment_best_validation(),
            "last": ctx.train._get_last_validation(),
        }
        with open(os.environ["OUT"], "w") as f:
            json.dump(seen, f)
"""


def test_best_and_last_validation_after_reload(dl: Env) -> None:
    import json

    out = dl.tmp / "seen.json"
    cfg, ctx = dl.context(
        SCRIPT,
        {
            "searcher": {"name": "single", "metric": "acc", "smaller_is_better": False},
            "environment": {"environment_variables": [f"OUT={out}"]},
        },
    )
    proc = dl.start("run", cfg, ctx)
    from tests.support.world import wait_for

    wait_for(lambda: dl.checkpoints(1), timeout=60, what="a checkpoint")
    r = dl.det("experiment", "pause", "1")
    assert r.rc == 0, r.err
    assert proc.wait().rc == 3
    # a new process (a new engine) loads the experiment from the store
    r = dl.det("experiment", "activate", "1")
    assert r.rc == 0, r.out + r.err
    seen = json.loads(out.read_text())
    assert seen == {"best": 0.9, "last": 3}

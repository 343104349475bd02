"""`determined.common.util` inside det-local trials: the metric group names Determined's e2e
fixture `core_api/11_generic_metrics.py` reports to, and the small helpers scripts call."""

from __future__ import annotations

from det_local.store.states import State
from tests.support.world import Env

# Written the way Determined's generic-metrics fixture is: groups from det_util's names plus
# custom ones, every batch reporting to one of them through report_metrics.
SCRIPT = """\
import logging
import random

import determined as det
from determined.common import util as det_util

GROUPS = [det_util._LEGACY_TRAINING, det_util._LEGACY_VALIDATION, "group_b", "infer ence"]


@det_util.preserve_random_state
def noise():
    return random.random()


def main(core_context, increment_by):
    x = 0.0
    for batch in range(8):
        x += increment_by
        group = GROUPS[batch % len(GROUPS)]
        core_context.train.report_metrics(
            group=group, steps_completed=batch + 1, metrics={"x": x, "noise": noise()}
        )
    conf = det_util.yaml_safe_load(det_util.yaml_safe_dump({"groups": GROUPS, "n": 8}))
    print("roundtrip", conf == {"groups": GROUPS, "n": 8})
    print("sizes", det_util.sizeof_fmt(1536), det_util.sizeof_fmt(3 * 1024 ** 3))
    print("chunks", ["".join(c) for c in det_util.chunks("ABCDEFG", 3)])
    print("bools", det_util.strtobool("off"), det_util.strtobool("yes"), det_util.debug_mode())
    print("inference", det_util._INFERENCE)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format=det.LOG_FORMAT)
    random.seed(0)
    first = random.random()
    random.seed(0)
    noise()
    print("random state preserved", random.random() == first)
    with det.core.init() as core_context:
        main(core_context=core_context, increment_by=1)
"""


def test_common_util_names_in_a_trial(dl: Env) -> None:
    cfg, ctx = dl.context(SCRIPT, {"searcher": {"name": "single", "metric": "x"}})
    r = dl.det("run", cfg, ctx)
    assert r.rc == 0, r.out + r.err
    trial = dl.trial(1)
    assert trial.state == State.COMPLETED
    by_group: dict[str, list[int]] = {}
    for m in dl.metrics(trial.id):
        by_group.setdefault(m.group, []).append(m.steps_completed)
    # det_util's names are the built-in groups: trial metrics show them as training/validation
    assert by_group == {
        "training": [1, 5],
        "validation": [2, 6],
        "group_b": [3, 7],
        "infer ence": [4, 8],
    }
    assert dl.metrics(trial.id, "validation")[-1].metrics["x"] == 6.0
    assert trial.best_validation == 2.0  # the searcher metric came in through the group name
    log = dl.log(1, trial.id)
    assert "random state preserved True" in log
    assert "roundtrip True" in log
    assert "sizes 1.5KB 3.0GB" in log
    assert "chunks ['ABC', 'DEF', 'G']" in log
    assert "bools False True False" in log
    assert "inference inference" in log

"""Warm starts where the common data-science stack is installed (issue 28): scikit-learn imports
pandas, which imports pyarrow, whose bundled jemalloc starts a background thread at import. The
zygote switches it off through jemalloc's own configuration (`trial/zygote.py`'s
``quiet_allocators``; why, in `sched/warm/zygotes.py`), so a search's trials after the first are
forked, and a forked trial still sees what a cold one sees."""

from __future__ import annotations

import shutil

import pytest

from tests.support.paths import REPO
from tests.support.trials.warm import PER_TRIAL, SCRIPT, serial_grid, trial_facts
from tests.support.world import Env

pytest.importorskip("pandas")
pytest.importorskip("pyarrow")
pytest.importorskip("sklearn")

# trial 1 waits (bounded) for the experiment's zygote, so that the later trials can be forked
GATE = """
import os as _os, time as _time
_zsock = _os.path.join(_os.environ["DET_LOCAL_HOME"], "run", "z", "1.1", "s")
_deadline = _time.monotonic() + 180
while _os.environ.get("DET_TRIAL_ID") == "1" and not _os.path.exists(_zsock):
    assert _time.monotonic() < _deadline, "no zygote"
    _time.sleep(0.05)
"""


def _starts(dl: Env) -> list[tuple[int, int, bool]]:
    store = dl.store()
    try:
        return [(t, r, warm) for t, r, warm, _ in store.list_trial_starts(1)]
    finally:
        store.close()


@pytest.mark.slow
def test_digits_search_starts_every_trial_after_the_first_warm(dl: Env) -> None:
    ctx = dl.tmp / "digits_pytorch"
    shutil.copytree(
        REPO / "examples" / "digits_pytorch", ctx, ignore=shutil.ignore_patterns("__pycache__")
    )
    train = ctx / "train.py"
    source = train.read_text()
    head, _, rest = source.partition('"""\n\n')  # after the module docstring
    train.write_text(f'{head}"""\n{GATE}\n{rest}')
    config = ctx / "search.yaml"
    config.write_text(
        "name: digits_common_stack\n"
        "hyperparameters:\n"
        "  global_batch_size: 64\n"
        "  lr: {type: categorical, vals: [0.02, 0.05, 0.1]}\n"
        "  momentum: 0.9\n  hidden_size: 32\n  dropout: 0.0\n  lr_decay: 1.0\n"
        "searcher: {name: grid, metric: validation_loss, max_concurrent_trials: 1}\n"
        "max_restarts: 0\n"
        "entrypoint: python3 train.py --batches 10\n"
    )
    r = dl.det("run", "-q", config, ctx, timeout=420)
    assert r.rc == 0, r
    assert [t.state.value for t in dl.trials(1)] == ["COMPLETED"] * 3
    assert _starts(dl) == [(1, 1, False), (2, 1, True), (3, 1, True)], dl.events(1)
    assert not [e for e in dl.events(1) if "cold" in e], dl.events(1)


def test_a_warm_trial_with_the_common_stack_sees_what_a_cold_one_sees(dl: Env) -> None:
    out = dl.tmp / "out"
    out.mkdir()
    script = SCRIPT.replace("import torch\n", "import torch\nimport sklearn, pandas, pyarrow\n", 1)
    script = script.replace(
        '"stdin_tty": os.isatty(0),',
        '"stdin_tty": os.isatty(0), "stack": "pyarrow" in sys.modules and "pandas" in sys.modules,',
        1,
    )
    assert script.count("pyarrow") == 2
    cfg, ctx = dl.context(script, serial_grid(out, {"WAIT_ZYGOTE": "1:1.1"}, n=2))
    r = dl.det("run", "-q", cfg, ctx, timeout=240)
    assert r.rc == 0, r
    facts = trial_facts(out)
    cold, warm = facts[1], facts[2]
    assert (cold["warm"], warm["warm"]) == (False, True)
    assert cold["stack"] is warm["stack"] is True
    for key in ("cwd", "ids", "argv", "path0", "main", "umask", "threads", "cuda_init"):
        assert warm[key] == cold[key], key
    # exactly the cold trial's environment: the zygote's jemalloc switch is not in it
    same = {k: v for k, v in cold["env"].items() if k not in PER_TRIAL}
    assert {k: v for k, v in warm["env"].items() if k not in PER_TRIAL} == same
    assert "JE_ARROW_MALLOC_CONF" not in warm["env"]
    assert _starts(dl) == [(1, 1, False), (2, 1, True)]

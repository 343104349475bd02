"""Determined 0.38's log_policies: labels on the trial, cancel_retries stops restarts."""

from __future__ import annotations

from det_local.store.states import State
from tests.support.world import Env

CANCEL = "cancel_retries"
CPU1 = {"DET_LOCAL_FAKE_GPUS": "0", "DET_LOCAL_CPU_SLOTS": "1"}

OOM = """\
import sys
print("RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB", flush=True)
print("dataset shard 7 unreadable", flush=True)
sys.exit(1)
"""


def test_cancel_retries_ends_the_trial_without_restarts_and_labels_it(dl: Env) -> None:
    dl.setenv(**CPU1)
    cfg, ctx = dl.context(
        OOM,
        {
            "max_restarts": 3,
            "log_policies": [
                {
                    "name": "bad shard",
                    "pattern": "shard \\d+ unreadable",
                    "action": "cancel_retries",
                }
            ],
        },
    )
    r = dl.det("run", cfg, ctx)
    assert r.rc == 1, r
    t = dl.trial(1)
    assert t.state == State.ERROR and t.restarts == 0, t
    assert t.message == (
        "trial 1 exited with code 1; not restarted: its output matched log policy 'bad shard' "
        "(cancel_retries); see `det-local trial logs 1`"
    )
    out = dl.det("trial", "describe", "1").out
    assert "  Log policies:      CUDA OOM, bad shard (cancel_retries)" in out.splitlines(), out
    assert dl.json("trial", "describe", "1", "--json")["log_policies"] == [
        {"name": "CUDA OOM", "action": None},
        {"name": "bad shard", "action": "cancel_retries"},
    ]


def test_without_a_matching_action_it_restarts_and_a_name_alone_turns_a_default_off(
    dl: Env,
) -> None:
    dl.setenv(**CPU1)
    cfg, ctx = dl.context(OOM, {"max_restarts": 1, "log_policies": [{"name": "CUDA OOM"}]})
    r = dl.det("run", cfg, ctx)
    assert r.rc == 1, r
    t = dl.trial(1)
    assert t.state == State.ERROR and t.restarts == 1, t
    assert dl.json("trial", "describe", "1", "--json")["log_policies"] == []


def test_a_bad_pattern_is_refused_at_submission(dl: Env) -> None:
    cfg, ctx = dl.context("print(1)\n", {"log_policies": [{"name": "x", "pattern": "(["}]})
    r = dl.det("run", cfg, ctx)
    assert r.rc != 0 and r.err.startswith(
        f"error: log_policies[0].pattern in {cfg}: is not a valid regular expression ("
    ), r
    assert len(r.err.strip().splitlines()) == 1, r

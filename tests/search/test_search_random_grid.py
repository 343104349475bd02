"""single, random and grid (random_test.go, grid_test.go), InvalidHP rules, Shutdown flags,
warm starts and make_searcher's choice of method."""

from __future__ import annotations

import pytest

from det_local.search import PROMOTION, STOP_ONCE, STOPPING, make_searcher
from det_local.search.actions import Close, Create, Shutdown, ValidateAfter
from det_local.search.adaptive import Tournament
from det_local.search.asha import AshaStopping
from det_local.search.asha_legacy import AshaPromotion, AshaStopOnce
from det_local.search.grid import GridSearch
from det_local.search.random_search import RandomSearch, SingleSearch
from tests.support.searchkit import Runner, config, creates, reloaded, searcher


def test_random_search_method() -> None:  # TestRandomSearchMethod
    s = searcher(
        {"name": "random", "max_trials": 4, "max_concurrent_trials": 2},
        {"x": {"type": "int", "minval": 0, "maxval": 10, "count": 4}},
    )
    r = Runner(s)
    r.run(100, 10, increasing=False)
    assert len(r.trials) == 4
    for t in r.trials:
        assert 0 <= t.hparams["x"] <= 10 and not t.stopped
    assert r.shutdowns == 1


def test_single_search_method() -> None:  # TestSingleSearchMethod
    s = searcher({"name": "single"}, {})
    r = Runner(s)
    r.run(100, 10, increasing=False)
    assert len(r.trials) == 1 and not r.trials[0].stopped and r.shutdowns == 1


def test_grid_search_method() -> None:  # TestGridSearchMethod
    s = searcher(
        {"name": "grid", "max_concurrent_trials": 2},
        {"a": {"type": "int", "minval": 0, "maxval": 3, "count": 4}},
    )
    r = Runner(s)
    r.run(100, 10, increasing=False)
    assert sorted(t.hparams["a"] for t in r.trials) == [0, 1, 2, 3]
    assert not any(t.stopped for t in r.trials) and r.shutdowns == 1


def test_fan_out_and_replacement() -> None:
    s = searcher({"name": "random", "max_trials": 5, "max_concurrent_trials": 2})
    first = creates(s.initial_actions())
    assert len(first) == 2
    assert len(creates(s.on_trial_exited(first[0].request_id))) == 1


def test_max_concurrent_trials_zero_starts_everything() -> None:
    s = searcher({"name": "random", "max_trials": 5, "max_concurrent_trials": 0})
    assert len(creates(s.initial_actions())) == 5
    g = searcher(
        {"name": "grid", "max_concurrent_trials": 0},
        {"a": {"type": "int", "minval": 0, "maxval": 5, "count": 6}},
    )
    assert len(creates(g.initial_actions())) == 6


def test_max_length_gives_one_operation_then_close() -> None:
    s = searcher(
        {
            "name": "random",
            "max_trials": 2,
            "max_concurrent_trials": 1,
            "max_length": {"batches": 300},
        }
    )
    a = s.initial_actions()
    rid = a[0].request_id
    assert a[1:] == [ValidateAfter(rid, 300), Close(rid)]
    s2 = searcher({"name": "single"})
    out = s2.initial_actions()
    assert out[1:] == [Close(out[0].request_id)]


def test_random_replaces_invalid_hp_trials() -> None:
    s = searcher({"name": "random", "max_trials": 2, "max_concurrent_trials": 2})
    a, b = (c.request_id for c in creates(s.initial_actions()))
    assert len(creates(s.on_trial_exited_early(a, "INVALID_HP"))) == 1  # not counted
    assert creates(s.on_trial_exited_early(b, "ERRORED")) == []  # counted: budget spent
    assert s.state.trials_requested == 3


def test_grid_and_single_do_not_replace_invalid_hp_trials() -> None:
    g = searcher(
        {"name": "grid", "max_concurrent_trials": 2},
        {"a": {"type": "int", "minval": 0, "maxval": 1, "count": 2}},
    )
    a, b = (c.request_id for c in creates(g.initial_actions()))
    assert creates(g.on_trial_exited_early(a, "INVALID_HP")) == []
    out = g.on_trial_exited(b)
    assert out == [Shutdown(failure=False, cancel=False)]
    s = searcher({"name": "single"})
    (c,) = creates(s.initial_actions())
    assert s.on_trial_exited_early(c.request_id, "INVALID_HP") == [Shutdown()]


@pytest.mark.parametrize(
    "reasons,failure,cancel",
    [
        (["ERRORED", "ERRORED"], True, False),
        (["USER_CANCELED", "USER_CANCELED"], False, True),
        (["ERRORED", "USER_CANCELED"], False, False),
        (["ERRORED", None], False, False),  # one completed: the search succeeded
        (["INVALID_HP", "ERRORED"], False, False),
    ],
)
def test_shutdown_flags(reasons: list, failure: bool, cancel: bool) -> None:
    s = searcher(
        {"name": "grid", "max_concurrent_trials": 2},
        {"a": {"type": "int", "minval": 0, "maxval": 1, "count": 2}},
    )
    rids = [c.request_id for c in creates(s.initial_actions())]
    out: list = []
    for rid, reason in zip(rids, reasons, strict=True):
        out = s.on_trial_exited(rid) if reason is None else s.on_trial_exited_early(rid, reason)
    assert out[-1] == Shutdown(failure=failure, cancel=cancel)


def test_repeated_exit_reports_are_ignored() -> None:
    s = searcher({"name": "random", "max_trials": 3, "max_concurrent_trials": 1})
    (c,) = creates(s.initial_actions())
    assert len(creates(s.on_trial_exited(c.request_id))) == 1
    assert s.on_trial_exited(c.request_id) == []
    assert s.on_trial_exited_early(c.request_id, "ERRORED") == []
    assert s.state.trials_requested == 2


def test_unknown_exit_reason_is_a_bug() -> None:
    s = searcher({"name": "single"})
    (c,) = creates(s.initial_actions())
    with pytest.raises(ValueError):
        s.on_trial_exited_early(c.request_id, "BORED")


def test_warm_start_checkpoint_goes_into_every_create() -> None:
    s = searcher(
        {
            "name": "random",
            "max_trials": 3,
            "max_concurrent_trials": 2,
            "source_checkpoint_uuid": "ckpt-1",
        }
    )
    assert all(c.warm_start_checkpoint == "ckpt-1" for c in creates(s.initial_actions()))
    a = searcher(
        {
            "name": "adaptive_asha",
            "max_trials": 4,
            "time_metric": "batches",
            "max_time": 10,
            "source_checkpoint_uuid": "ckpt-2",
        }
    )
    assert {c.warm_start_checkpoint for c in creates(a.initial_actions())} == {"ckpt-2"}


def test_progress_random_and_grid() -> None:
    s = searcher({"name": "random", "max_trials": 4, "max_concurrent_trials": 2})
    a, b = (c.request_id for c in creates(s.initial_actions()))
    assert s.progress() == 0.0
    s.set_trial_progress(a, 0.5)
    assert s.progress() == pytest.approx(0.125)
    s.on_trial_exited(a)
    assert s.progress() == pytest.approx(0.25)
    g = searcher(
        {"name": "grid", "max_concurrent_trials": 1},
        {"a": {"type": "int", "minval": 0, "maxval": 1, "count": 2}},
    )
    (c,) = creates(g.initial_actions())
    g.on_trial_exited_early(c.request_id, "INVALID_HP")
    assert g.progress() == pytest.approx(0.5)


def test_snapshot_round_trip_random_and_grid() -> None:
    for sc, hps in (
        ({"name": "random", "max_trials": 4, "max_concurrent_trials": 2}, None),
        (
            {"name": "grid", "max_concurrent_trials": 2},
            {"a": {"type": "int", "minval": 0, "maxval": 3, "count": 4}},
        ),
    ):
        cfg = config(sc, hps)
        s = make_searcher(cfg)
        first = creates(s.initial_actions())
        twin = reloaded(cfg, s)
        assert twin.snapshot() == s.snapshot()
        assert s.on_trial_exited(first[0].request_id) == twin.on_trial_exited(first[0].request_id)


def test_restore_of_an_earlier_single_snapshot() -> None:
    cfg = config({"name": "single"})
    s = make_searcher(cfg)
    (c,) = creates(s.initial_actions())
    snap = s.snapshot()
    snap["method"] = {"max_length": None}  # what the first single searcher saved
    snap["state"] = {
        k: v for k, v in snap["state"].items() if k not in ("canceled", "trial_progress")
    }
    fresh = make_searcher(cfg)
    fresh.restore(snap)
    assert fresh.on_trial_exited(c.request_id) == [Shutdown()]


def test_make_searcher_choices() -> None:
    def method(sc: dict):
        s = searcher(sc)
        return s.kind, s.method

    assert isinstance(method({"name": "single"})[1], SingleSearch)
    assert isinstance(method({"name": "random", "max_trials": 2})[1], RandomSearch)
    assert isinstance(method({"name": "grid"})[1], GridSearch)
    kind, m = method(
        {
            "name": "async_halving",
            "num_rungs": 2,
            "max_trials": 4,
            "time_metric": "batches",
            "max_time": 8,
        }
    )
    assert kind == STOPPING and isinstance(m, AshaStopping)
    kind, m = method(
        {"name": "async_halving", "num_rungs": 2, "max_trials": 4, "max_length": {"batches": 8}}
    )
    assert kind == PROMOTION and isinstance(m, AshaPromotion)
    kind, m = method(
        {
            "name": "async_halving",
            "num_rungs": 2,
            "max_trials": 4,
            "max_length": {"batches": 8},
            "stop_once": True,
        }
    )
    assert kind == STOP_ONCE and isinstance(m, AshaStopOnce)
    # time_metric/max_time win over max_length (0.38 semantics)
    kind, m = method(
        {
            "name": "adaptive_asha",
            "max_trials": 4,
            "time_metric": "batches",
            "max_time": 8,
            "max_length": {"batches": 8},
            "stop_once": True,
        }
    )
    assert kind == STOPPING and isinstance(m, Tournament)
    assert all(isinstance(sub, AshaStopping) for sub in m.subs)


def test_create_order_is_hparams_then_id_then_seed() -> None:
    s1 = searcher({"name": "random", "max_trials": 1}, seed=5)
    s2 = searcher({"name": "random", "max_trials": 1}, seed=5)
    (a,) = creates(s1.initial_actions())
    (b,) = creates(s2.initial_actions())
    assert isinstance(a, Create) and a == b


def test_plan_counts_trials() -> None:
    from det_local.search import plan

    grid_cfg = config(
        {"name": "grid", "max_concurrent_trials": 2},
        {"a": {"type": "int", "minval": 0, "maxval": 3, "count": 4}, "b": [1, 2]},
    )
    assert plan(grid_cfg)["trials"] == 4
    assert plan(config({"name": "random", "max_trials": 9}))["trials"] == 9
    assert plan(config({"name": "single"}))["trials"] == 1


def test_only_promotion_asha_pauses_trials() -> None:
    base = {"name": "async_halving", "num_rungs": 2, "max_trials": 4}
    assert searcher({**base, "max_length": {"batches": 8}}).pauses_trials
    assert not searcher({**base, "max_length": {"batches": 8}, "stop_once": True}).pauses_trials
    assert not searcher({**base, "time_metric": "batches", "max_time": 8}).pauses_trials
    assert not searcher({"name": "random", "max_trials": 2}).pauses_trials

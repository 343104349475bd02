"""0.38 stopping-based ASHA and adaptive ASHA (asha_stopping_test.go, tournament_test.go),
re-derived, plus InvalidHP/early-exit handling, progress and snapshots."""

from __future__ import annotations

import json

import pytest

from det_local.errors import DetLocalError, MetricError
from det_local.search.actions import Shutdown, Stop
from det_local.search.adaptive import Tournament
from det_local.search.asha import EXITED_METRIC, AshaStopping
from tests.support.searchkit import Runner, config, creates, reloaded, searcher


def bare(num_rungs: int = 3, units: tuple[int, ...] = (1, 3, 9), divisor: float = 3.0):
    s = AshaStopping(
        num_rungs=num_rungs,
        max_trials=10,
        divisor=divisor,
        max_time=units[-1],
        time_metric="batches",
        metric="loss",
    )
    assert s.units == list(units)
    return s


def rungs(s: AshaStopping) -> list[list[tuple[str, float]]]:
    return [s.rung_metrics(r) for r in range(s.num_rungs)]


def test_insert_metric() -> None:  # TestInsertCompletedMetric
    cases = [
        (1.2, [0.0, 1.5, 2.1], 1, [0.0, 1.2, 1.5, 2.1]),
        (3.0, [0.0, 1.5, 2.0], 3, [0.0, 1.5, 2.0, 3.0]),
        (-3.4, [-3.0, -2.0, -1.0], 0, [-3.4, -3.0, -2.0, -1.0]),
        (1.2, [], 0, [1.2]),
        (1.5, [1.0, 1.5, 2.0], 1, [1.0, 1.5, 1.5, 2.0]),  # before equal values
    ]
    for new, existing, index, after in cases:
        s = bare()
        s.values[0] = list(existing)
        s.ids[0] = [""] * len(existing)
        assert s._insert(0, "t", new) == index
        assert s.values[0] == after


def test_get_metric() -> None:  # TestGetMetric
    s = bare()
    assert s.read_report("r", {"loss": 0.25, "batches": 2.0}) == (2, 0.25)
    s.time_metric = "custom_time_step"
    assert s.read_report("r", {"loss": 1.2, "custom_time_step": 5.0}) == (5, 1.2)
    s.time_metric = "batches"
    s.smaller_is_better = False
    assert s.read_report("r", {"loss": 0.2, "batches": 3}) == (3, -0.2)
    with pytest.raises(MetricError, match="searcher metric 'loss'") as err:
        s.read_report("req-7", {"batches": 2.0})
    assert "req-7" in str(err.value) and "'batches': 2.0" in str(err.value)
    assert isinstance(err.value, DetLocalError)


@pytest.mark.parametrize(
    "report,what",
    [
        ({"loss": 0.5}, "time metric 'batches' (no such key)"),
        ({"loss": 0.5, "batches": "ten"}, "time metric 'batches' ('ten')"),
        ({"loss": 0.5, "batches": -1}, "time metric 'batches' (-1)"),
        ({"loss": "low", "batches": 1}, "searcher metric 'loss' ('low')"),
        ({"loss": True, "batches": 1}, "searcher metric 'loss' (True)"),
        ({"accuracy": 0.9, "batches": 1}, "searcher metric 'loss' (no such key)"),
    ],
)
def test_bad_reports_raise_naming_the_trial_and_metric(report: dict, what: str) -> None:
    s = searcher(
        {
            "name": "async_halving",
            "num_rungs": 2,
            "max_trials": 4,
            "time_metric": "batches",
            "max_time": 10,
        }
    )
    rid = creates(s.initial_actions())[0].request_id
    with pytest.raises(MetricError) as err:
        s.on_validation(rid, report)
    assert what in str(err.value) and rid in str(err.value)


def test_stop_trials_step_by_step() -> None:  # TestStopTrials
    # first validation: rung 0 takes it; one result keeps max(int(1/3), 1) = 1: it continues
    # to rung 1, where its time (1) is short of 3
    s = bare()
    s.trial_rungs = {"r1": 0}
    assert s.early_stopping("r1", 1, 0.5) == []
    assert rungs(s) == [[("r1", 0.5)], [], []]
    assert s.trial_rungs == {"r1": 1}

    # second validation, better than the first: index 0 < max(int(2/3), 1) = 1: continues
    s = bare()
    s.values[0], s.ids[0] = [0.5], ["r1"]
    s.trial_rungs = {"r1": 1, "r2": 0}
    assert s.early_stopping("r2", 1, 0.4) == []
    assert rungs(s) == [[("r2", 0.4), ("r1", 0.5)], [], []]
    assert s.trial_rungs == {"r1": 1, "r2": 1}

    # second validation, worse than the first: index 1 >= 1: stopped, stays in rung 0
    s = bare()
    s.values[0], s.ids[0] = [0.5], ["r1"]
    s.trial_rungs = {"r1": 1, "r2": 0}
    assert s.early_stopping("r2", 1, 0.6) == [Stop("r2")]
    assert rungs(s) == [[("r1", 0.5), ("r2", 0.6)], [], []]
    assert s.trial_rungs == {"r1": 1, "r2": 0}


def test_one_report_can_pass_several_rungs_and_the_top_rung_stops() -> None:
    s = bare()
    s.trial_rungs = {"r1": 0}
    assert s.early_stopping("r1", 9, 0.3) == [Stop("r1")]
    assert rungs(s) == [[("r1", 0.3)], [("r1", 0.3)], [("r1", 0.3)]]
    assert s.trial_rungs == {"r1": 2}


def test_asha_stopping_search_method() -> None:  # TestASHAStoppingSearchMethod
    s = searcher(
        {
            "name": "async_halving",
            "num_rungs": 3,
            "divisor": 3,
            "max_trials": 10,
            "max_concurrent_trials": 3,
            "time_metric": "batches",
            "max_time": 900,
        }
    )
    assert s.method.units == [100, 300, 900]
    r = Runner(s)
    r.run(900, 100, increasing=True)
    assert len(r.trials) == 10
    stopped = [t.stopped_at for t in r.trials]
    assert stopped.count(900) == 1 and stopped.count(100) == 9
    assert r.shutdowns == 1


def test_adaptive_asha_search_method() -> None:  # TestAdaptiveASHASearchMethod
    s = searcher(
        {
            "name": "adaptive_asha",
            "max_time": 90,
            "time_metric": "batches",
            "divisor": 3,
            "max_rungs": 5,
            "max_concurrent_trials": 3,
            "max_trials": 9,
            "mode": "standard",
        }
    )
    t = s.method
    assert isinstance(t, Tournament)
    assert [sub.units for sub in t.subs] == [[10, 30, 90], [30, 90]]
    r = Runner(s)
    r.run(90, 10, increasing=True)
    assert len(t.trial_table) == 9 and len(r.trials) == 9
    b1 = [tr.stopped_at for tr in r.trials if t.trial_table[tr.request_id] == 0]
    b2 = [tr.stopped_at for tr in r.trials if t.trial_table[tr.request_id] == 1]
    assert len(b1) == 6 and b1.count(10) == 5 and b1.count(90) == 1
    assert len(b2) == 3 and b2.count(30) == 2 and b2.count(90) == 1
    assert r.shutdowns == 1
    assert s.progress() == pytest.approx(1.0)


def test_smaller_is_better_false_negates() -> None:
    s = searcher(
        {
            "name": "async_halving",
            "num_rungs": 2,
            "divisor": 2,
            "max_trials": 4,
            "max_concurrent_trials": 2,
            "time_metric": "batches",
            "max_time": 4,
            "smaller_is_better": False,
        }
    )
    a, b = (c.request_id for c in creates(s.initial_actions()))
    assert s.on_validation(a, {"loss": 0.9, "batches": 2}) == []
    # 0.1 is worse when larger is better: stopped, replaced
    out = s.on_validation(b, {"loss": 0.1, "batches": 2})
    assert out[0] == Stop(b) and len(creates(out)) == 1
    assert s.method.rung_metrics(0) == [(a, -0.9), (b, -0.1)]


def _two_trial_search():
    cfg = config(
        {
            "name": "async_halving",
            "num_rungs": 3,
            "divisor": 3,
            "max_trials": 4,
            "max_concurrent_trials": 2,
            "time_metric": "batches",
            "max_time": 9,
        }
    )
    from det_local.search import make_searcher

    s = make_searcher(cfg)
    a, b = (c.request_id for c in creates(s.initial_actions()))
    return cfg, s, a, b


def test_invalid_hp_removes_metrics_stops_and_always_replaces() -> None:
    _, s, a, b = _two_trial_search()
    s.on_validation(a, {"loss": 0.5, "batches": 1})
    assert s.rung_of(a) == 1
    out = s.on_trial_exited_early(a, "INVALID_HP")
    assert out[0] == Stop(a) and len(creates(out)) == 1
    assert s.method.rung_metrics(0) == []
    assert s.method.invalid == 1
    assert s.state.invalid == [a]


def test_errored_trial_ranks_worst_and_is_replaced_within_budget() -> None:
    _, s, a, b = _two_trial_search()
    s.on_validation(a, {"loss": 0.5, "batches": 1})
    out = s.on_trial_exited_early(b, "ERRORED")
    assert len(creates(out)) == 1
    assert s.method.rung_metrics(0) == [(a, 0.5), (b, EXITED_METRIC)]
    assert s.state.failed == [b]


def test_normal_exit_is_not_replaced() -> None:
    _, s, a, b = _two_trial_search()
    assert s.on_trial_exited(a) == []
    assert s.method.trials_completed == 1


def test_reports_after_a_stop_are_not_ranked_again() -> None:
    _, s, a, b = _two_trial_search()
    s.on_validation(a, {"loss": 0.1, "batches": 1})
    out = s.on_validation(b, {"loss": 0.9, "batches": 1})
    assert out[0] == Stop(b)
    assert s.on_validation(b, {"loss": 0.9, "batches": 2}) == []
    assert len(s.method.rung_metrics(0)) == 2


def test_budget_counts_trials_and_shutdown_comes_once() -> None:
    cfg, s, a, b = _two_trial_search()
    live = [a, b]
    seen: list[str] = [a, b]
    shutdowns = 0
    metric = 0.0
    while live:
        rid = live.pop(0)
        metric += 1  # every trial worse than the one before: each is stopped at rung 0
        out = s.on_validation(rid, {"loss": metric, "batches": 1})
        out += s.on_trial_exited(rid)
        for c in creates(out):
            live.append(c.request_id)
            seen.append(c.request_id)
        shutdowns += sum(isinstance(x, Shutdown) for x in out)
    assert len(seen) == 4  # max_trials
    assert shutdowns == 1


def test_progress() -> None:
    cfg, s, a, b = _two_trial_search()
    assert s.progress() == 0.0
    s.on_validation(a, {"loss": 0.5, "batches": 1})
    assert s.progress() == pytest.approx(1 / (1.2 * 4))


def test_snapshot_round_trip_continues_identically() -> None:
    cfg, s, a, b = _two_trial_search()
    s.on_validation(a, {"loss": 0.5, "batches": 1})
    s.on_validation(b, {"loss": 0.7, "batches": 1})
    snap = json.loads(json.dumps(s.snapshot()))
    twin = reloaded(cfg, s)
    assert twin.snapshot() == snap
    for x in (s, twin):
        out = x.on_trial_exited(b)
        out2 = x.on_validation(a, {"loss": 0.4, "batches": 3})
        x.trace = out + out2  # type: ignore[attr-defined]
    assert s.trace == twin.trace  # type: ignore[attr-defined]
    assert s.snapshot() == twin.snapshot()


@pytest.mark.parametrize(
    "smaller_is_better,diverged",
    [(True, float("-inf")), (False, float("inf")), (True, float("inf")), (False, float("-inf"))],
)
def test_infinite_metrics_rank_worst_in_either_direction(
    smaller_is_better: bool, diverged: float
) -> None:
    """A diverged trial's infinite metric (even -inf when smaller is better) ranks as the worst
    value, like NaN: it is stopped and never outranks a finite result."""
    for name in ("async_halving", "adaptive_asha"):
        extra = (
            {"num_rungs": 2} if name == "async_halving" else {"max_rungs": 2, "mode": "aggressive"}
        )
        s = searcher(
            {
                "name": name,
                "divisor": 2,
                "max_trials": 4,
                "max_concurrent_trials": 2,
                "time_metric": "batches",
                "max_time": 4,
                "smaller_is_better": smaller_is_better,
                **extra,
            }
        )
        a, b = [c.request_id for c in creates(s.initial_actions())][:2]
        assert s.on_validation(a, {"loss": 0.5, "batches": 2}) == []
        out = s.on_validation(b, {"loss": diverged, "batches": 2})
        assert out[0] == Stop(b), (name, out)
        sign = 1.0 if smaller_is_better else -1.0
        rung = s.method.subs[0] if isinstance(s.method, Tournament) else s.method
        assert rung.rung_metrics(0) == [(a, sign * 0.5), (b, EXITED_METRIC)]

"""Adaptive ASHA: brackets of async_halving searches with different early-stopping rates, run
side by side by a tournament (Determined's adaptive_asha.go and tournament.go).

With T = max_trials, d = divisor, L = the time budget (max_time, or max_length's value):

* rungs per bracket, when bracket_rungs is empty: R = min(max_rungs, int(ln L / ln d) + 1,
  int(ln T / ln d) + 1) with Go's float64 logs; aggressive -> [R], standard ->
  [(R-1)//2+1 .. R], conservative -> [1 .. R]; sorted descending (most early stopping first);
* trials per bracket: weight_b = d**(r_b-1) / r_b, trials_b = max(int(weight_b / sum * T), 1),
  the remainder max(T - sum, 0) to bracket 0;
* concurrency per bracket: with max_concurrent_trials 0 every bracket gets
  max(trials of the last bracket, int(d)); else m = max(mct, brackets) is split evenly, the
  first m % n brackets one more.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from det_local.search.actions import Action, Create, SearchState
from det_local.search.base import NewTrial, SearchMethod
from det_local.search.gomath import go_int, go_log, go_pow

MODES = ("aggressive", "standard", "conservative")


@dataclass(frozen=True)
class Bracket:
    num_rungs: int
    max_trials: int
    max_concurrent_trials: int


def max_rungs_for(max_rungs: int, length: int, max_trials: int, divisor: float) -> int:
    """The rung count of the deepest bracket: at most max_rungs, and such that the top rung
    can be reached both in length and in trials."""
    return min(
        max_rungs,
        go_int(go_log(float(length)) / go_log(divisor)) + 1,
        go_int(go_log(float(max_trials)) / go_log(divisor)) + 1,
    )


def mode_rungs(mode: str, max_rungs: int) -> list[int]:
    if mode == "aggressive":
        return [max_rungs]
    if mode == "standard":
        return list(range((max_rungs - 1) // 2 + 1, max_rungs + 1))
    if mode == "conservative":
        return list(range(1, max_rungs + 1))
    raise ValueError(f"unknown adaptive mode {mode!r} (one of {', '.join(MODES)})")


def bracket_max_trials(max_trials: int, divisor: float, brackets: Sequence[int]) -> list[int]:
    """Trials per bracket, for roughly equal training budget per bracket."""
    weights = [go_pow(divisor, float(r - 1)) / float(r) for r in brackets]
    total = 0.0
    for w in weights:
        total += w
    out = [max(go_int(w / total * float(max_trials)), 1) for w in weights]
    out[0] += max(max_trials - sum(out), 0)
    return out


def bracket_max_concurrent_trials(
    max_concurrent_trials: int, divisor: float, max_trials: Sequence[int]
) -> list[int]:
    n = len(max_trials)
    if max_concurrent_trials == 0:
        return [max(max_trials[-1], go_int(divisor))] * n
    m = max(max_concurrent_trials, n)
    out = [m // n] * n
    for i in range(m % n):
        out[i] += 1
    return out


def make_brackets(
    *,
    max_trials: int,
    divisor: float,
    length: int,
    mode: str = "standard",
    max_rungs: int = 5,
    bracket_rungs: Sequence[int] = (),
    max_concurrent_trials: int = 16,
) -> list[Bracket]:
    rungs = list(bracket_rungs)
    if not rungs:
        rungs = mode_rungs(mode, max_rungs_for(max_rungs, length, max_trials, divisor))
    rungs.sort(reverse=True)
    trials = bracket_max_trials(max_trials, divisor, rungs)
    concurrent = bracket_max_concurrent_trials(max_concurrent_trials, divisor, trials)
    return [Bracket(r, t, c) for r, t, c in zip(rungs, trials, concurrent, strict=True)]


class Tournament:
    """Runs sub-searches side by side: every event for a trial goes to the sub-search that
    created it; progress is their average."""

    def __init__(self, subs: Sequence[SearchMethod]) -> None:
        self.subs = list(subs)
        self.trial_table: dict[str, int] = {}

    def _maker(self, index: int, new_trial: NewTrial) -> NewTrial:
        def make(hparams: dict[str, Any] | None = None) -> Create:
            create = new_trial(hparams)
            self.trial_table[create.request_id] = index
            return create

        return make

    def initial_actions(self, new_trial: NewTrial) -> list[Action]:
        actions: list[Action] = []
        for i, sub in enumerate(self.subs):
            actions.extend(sub.initial_actions(self._maker(i, new_trial)))
        return actions

    def on_validation(
        self, request_id: str, metrics: dict[str, Any], new_trial: NewTrial
    ) -> list[Action]:
        i = self.trial_table.get(request_id)
        if i is None:
            return []
        return self.subs[i].on_validation(request_id, metrics, self._maker(i, new_trial))

    def on_op_completed(
        self, request_id: str, length: int, metric: float, new_trial: NewTrial
    ) -> list[Action]:
        i = self.trial_table.get(request_id)
        if i is None:
            return []
        return self.subs[i].on_op_completed(request_id, length, metric, self._maker(i, new_trial))

    def on_trial_exited(self, request_id: str, new_trial: NewTrial) -> list[Action]:
        i = self.trial_table.get(request_id)
        if i is None:
            return []
        return self.subs[i].on_trial_exited(request_id, self._maker(i, new_trial))

    def on_trial_exited_early(
        self, request_id: str, reason: str, new_trial: NewTrial
    ) -> list[Action]:
        i = self.trial_table.get(request_id)
        if i is None:
            return []
        return self.subs[i].on_trial_exited_early(request_id, reason, self._maker(i, new_trial))

    def progress(self, state: SearchState) -> float:
        if not self.subs:
            return 0.0
        return sum(sub.progress(state) for sub in self.subs) / len(self.subs)

    def rung_of(self, request_id: str) -> int | None:
        i = self.trial_table.get(request_id)
        return None if i is None else self.subs[i].rung_of(request_id)

    def snapshot(self) -> dict[str, Any]:
        return {
            "kind": "tournament",
            "trial_table": dict(self.trial_table),
            "sub_search_states": [sub.snapshot() for sub in self.subs],
        }

    def restore(self, data: dict[str, Any]) -> None:
        self.trial_table = {str(k): int(v) for k, v in data["trial_table"].items()}
        for sub, state in zip(self.subs, data["sub_search_states"], strict=True):
            sub.restore(state)

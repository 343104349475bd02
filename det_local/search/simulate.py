"""A search played on a simulated clock, with no processes: what the engine does with a
searcher's actions, in miniature (Determined's simulate.go plays the same role).

Trials wait in a FIFO queue for one of ``workers`` slots. A trial that got ``ValidateAfter``
operations trains to each length, reports ``op.report_completed(metric)`` and, out of
operations, exits (when closed) or waits paused until it is promoted (relaunched from its
units so far) or closed. A trial with no operations (0.38) trains to ``max_units``, reporting a
validation with the searcher metric and the time metric every ``report_every`` units, and ends
``stop_delay`` after a Stop. ``objective(trial, units)`` gives the metric; ``fault(trial)`` may
make a trial end early (INVALID_HP, ERRORED, USER_CANCELED) at a given number of units.

Used by the tests (invariants, snapshot round trips) and by bench/asha_sim.py.
"""

from __future__ import annotations

import heapq
import json
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from det_local.search.actions import Action, Close, Create, Shutdown, Stop, ValidateAfter
from det_local.search.base import Searcher

QUEUED, RUNNING, PAUSED, ENDED = "queued", "running", "paused", "ended"


@dataclass
class SimTrial:
    request_id: str
    hparams: dict[str, Any]
    seed: int
    index: int  # creation order, from 0
    state: str = QUEUED
    units: int = 0  # units trained (and checkpointed) so far
    ops: deque[int] = field(default_factory=deque)
    had_ops: bool = False
    closed: bool = False
    stopping: bool = False
    reports: list[tuple[int, float]] = field(default_factory=list)
    ended_by: str = ""  # "exit", or an early-exit reason
    epoch: int = 0  # bumps when the trial leaves its slot: stale events are ignored


@dataclass
class SimResult:
    trials: list[SimTrial]
    actions: list[Action]  # every action, in order
    shutdowns: list[Shutdown]
    clock: float  # when the last trial ended
    units_trained: int  # the training budget used, over all trials
    max_active: int  # most trials at once with work to do: not ended, stopped, paused or done
    max_running: int  # most trials holding a slot at once
    ops_out_of_order: list[str]  # trials given an operation shorter than what they had done
    ops_after_end: list[str]  # trials given an operation after they ended


Objective = Callable[[SimTrial, int], float]
Fault = Callable[[SimTrial], "tuple[str, int] | None"]


class Simulation:
    def __init__(
        self,
        searcher: Searcher,
        objective: Objective,
        *,
        workers: int,
        max_units: int,
        metric: str = "loss",
        time_metric: str = "batches",
        report_every: int = 1,
        unit_time: float = 1.0,
        stop_delay: float = 0.0,
        fault: Fault | None = None,
        reload: Callable[[dict[str, Any]], Searcher] | None = None,
        budget: int | None = None,
        engine_pauses: bool = True,
    ) -> None:
        """`reload`, when given, rebuilds the searcher from a JSON round trip of its snapshot
        after every event (the engine's persist-and-restart, at every step). `budget` stops
        the simulation once that many units were trained (for equal-budget comparisons).
        `engine_pauses=False` plays an engine that cannot keep trials waiting for promotion:
        a trial out of operations exits and is reported as ended."""
        self.searcher = searcher
        self.objective = objective
        self.workers = workers
        self.max_units = max_units
        self.metric = metric
        self.time_metric = time_metric
        self.report_every = max(report_every, 1)
        self.unit_time = unit_time
        self.stop_delay = stop_delay
        self.fault = fault or (lambda t: None)
        self.reload = reload
        self.budget = budget
        self.engine_pauses = engine_pauses
        self.trials: dict[str, SimTrial] = {}
        self.order: list[SimTrial] = []
        self.queue: deque[SimTrial] = deque()
        self.running = 0
        self.clock = 0.0
        self.events: list[tuple[float, int, str, str, int]] = []
        self.seq = 0
        self.actions: list[Action] = []
        self.shutdowns: list[Shutdown] = []
        self.units_trained = 0
        self.max_active = 0
        self.max_running = 0
        self.out_of_order: list[str] = []
        self.after_end: list[str] = []
        self._faults: dict[str, tuple[str, int] | None] = {}

    # ------------------------------------------------------------------ plumbing
    def _at(self, when: float, kind: str, trial: SimTrial) -> None:
        self.seq += 1
        heapq.heappush(self.events, (when, self.seq, kind, trial.request_id, trial.epoch))

    def _apply(self, actions: list[Action]) -> None:
        work = deque(actions)
        while work:
            action = work.popleft()
            self.actions.append(action)
            if isinstance(action, Create):
                t = SimTrial(action.request_id, action.hparams, action.seed, len(self.order))
                self.trials[t.request_id] = t
                self.order.append(t)
                self._faults[t.request_id] = self.fault(t)
                self.queue.append(t)
            elif isinstance(action, ValidateAfter):
                t = self.trials[action.request_id]
                if action.length < t.units:
                    self.out_of_order.append(t.request_id)
                if t.state == ENDED:
                    self.after_end.append(t.request_id)
                t.ops.append(action.length)
                t.had_ops = True
                if t.state == PAUSED:
                    t.state = QUEUED
                    self.queue.append(t)
            elif isinstance(action, Close):
                t = self.trials[action.request_id]
                t.closed = True
                if t.state == PAUSED:
                    work.extend(self._end(t, "exit"))
            elif isinstance(action, Stop):
                t = self.trials[action.request_id]
                if t.state == RUNNING and not t.stopping:
                    t.stopping = True
                    t.epoch += 1
                    self._at(self.clock + self.stop_delay, "exit", t)
                elif t.state == QUEUED:
                    self.queue.remove(t)
                    work.extend(self._end(t, "exit"))
            elif isinstance(action, Shutdown):
                self.shutdowns.append(action)
        self._count()
        self._schedule()

    def _count(self) -> None:
        active = sum(
            1
            for t in self.order
            if t.state in (QUEUED, RUNNING) and not t.stopping and (t.ops or not t.had_ops)
        )
        self.max_active = max(self.max_active, active)

    def _schedule(self) -> None:
        while self.queue and self.running < self.workers:
            t = self.queue.popleft()
            t.state = RUNNING
            t.epoch += 1
            self.running += 1
            self.max_running = max(self.max_running, self.running)
            self._next_step(t)

    def _next_step(self, t: SimTrial) -> None:
        """Schedule the trial's next report (or its end)."""
        fault = self._faults.get(t.request_id)
        if t.had_ops or t.ops:
            if not t.ops:
                pauses = self.engine_pauses and self.searcher.pauses_trials
                kind = "exit" if t.closed or not pauses else "pause"
                self._at(self.clock, kind, t)
                return
            target = max(t.ops[0], t.units)
        else:
            if t.units >= self.max_units:
                self._at(self.clock, "exit", t)
                return
            target = min(t.units + self.report_every, self.max_units)
        if fault is not None and fault[1] <= target:
            self._at(self.clock + max(fault[1] - t.units, 0) * self.unit_time, "fault", t)
            return
        self._at(self.clock + (target - t.units) * self.unit_time, "report", t)

    def _release(self, t: SimTrial) -> None:
        if t.state == RUNNING:
            self.running -= 1
        t.epoch += 1

    def _end(self, t: SimTrial, how: str) -> list[Action]:
        self._release(t)
        t.state = ENDED
        t.ended_by = how
        if how == "exit":
            return self.searcher.on_trial_exited(t.request_id)
        return self.searcher.on_trial_exited_early(t.request_id, how)

    def _train_to(self, t: SimTrial, units: int) -> None:
        self.units_trained += max(units - t.units, 0)
        t.units = max(units, t.units)

    def _report(self, t: SimTrial) -> None:
        if t.had_ops or t.ops:
            length = t.ops[0]
            self._train_to(t, length)
            value = self.objective(t, t.units)
            t.reports.append((t.units, value))
            t.ops.popleft()
            actions = self.searcher.on_validation(
                t.request_id, {self.metric: value, self.time_metric: t.units}
            )
            actions += self.searcher.on_op_completed(t.request_id, length, value)
            self._apply(actions)
        else:
            self._train_to(t, min(t.units + self.report_every, self.max_units))
            value = self.objective(t, t.units)
            t.reports.append((t.units, value))
            self._apply(
                self.searcher.on_validation(
                    t.request_id, {self.metric: value, self.time_metric: t.units}
                )
            )
        if t.state == RUNNING and not t.stopping:
            self._next_step(t)

    # ------------------------------------------------------------------ the loop
    def run(self, max_events: int = 10_000_000) -> SimResult:
        self._apply(self.searcher.initial_actions())
        n = 0
        while self.events:
            n += 1
            if n > max_events:
                raise RuntimeError(f"simulation did not finish in {max_events} events")
            when, _seq, kind, rid, epoch = heapq.heappop(self.events)
            t = self.trials[rid]
            if epoch != t.epoch or t.state != RUNNING:
                continue
            if self.budget is not None and self.units_trained >= self.budget:
                break
            self.clock = when
            if kind == "report":
                self._report(t)
            elif kind == "exit":
                self._apply(self._end(t, "exit"))
            elif kind == "pause":
                # promoted or closed while on its way out: relaunch it, or it is done
                self._release(t)
                t.state = PAUSED
                if t.ops:
                    t.state = QUEUED
                    self.queue.append(t)
                elif t.closed:
                    self._apply(self._end(t, "exit"))
                self._count()
                self._schedule()
            elif kind == "fault":
                fault = self._faults[rid]
                assert fault is not None
                self._train_to(t, fault[1])
                self._apply(self._end(t, fault[0]))
            if self.reload is not None:
                data = json.loads(json.dumps(self.searcher.snapshot()))
                self.searcher = self.reload(data)
        return SimResult(
            trials=self.order,
            actions=self.actions,
            shutdowns=self.shutdowns,
            clock=self.clock,
            units_trained=self.units_trained,
            max_active=self.max_active,
            max_running=self.max_running,
            ops_out_of_order=self.out_of_order,
            ops_after_end=self.after_end,
        )

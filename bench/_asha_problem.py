"""The problem bench/asha_sim.py gives every scheduler: a multi-fidelity Hartmann-6 with a known
optimum, a seeded config list, a worker simulation on a simulated clock, and the one rule that
turns a run into a regret. Pure Python with no det-local import: the Ray and Optuna drivers run
it in their own virtual environment.
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Callable

R_MIN, R_MAX, ETA = 1, 64, 4
RUNGS = (1, 4, 16, 64)  # r * eta**k up to R
N_CONFIGS = 256
WORKERS = 4
# One synchronous successive-halving bracket over the 256 configs, restarting each promoted
# trial from scratch: 256*1 + 64*4 + 16*16 + 4*64 units. Every system gets this budget.
BUDGET = sum((N_CONFIGS // ETA**k) * r for k, r in enumerate(RUNGS))

_ALPHA = (1.0, 1.2, 3.0, 3.2)
_A = (
    (10, 3, 17, 3.5, 1.7, 8),
    (0.05, 10, 17, 0.1, 8, 14),
    (3, 3.5, 1.7, 10, 17, 8),
    (17, 8, 0.05, 10, 0.1, 14),
)
_P = (
    (1312, 1696, 5569, 124, 8283, 5886),
    (2329, 4135, 8307, 3736, 1004, 9991),
    (2348, 1451, 3522, 2883, 3047, 6650),
    (4047, 8828, 8732, 5743, 1091, 381),
)
H6_MIN = -3.322368011391339  # at (0.20169, 0.150011, 0.476874, 0.275332, 0.311652, 0.6573)
H6_ARGMIN = (0.20169, 0.150011, 0.476874, 0.275332, 0.311652, 0.6573)


def hartmann6(x: tuple[float, ...], alpha1: float = _ALPHA[0]) -> float:
    total = 0.0
    for i in range(4):
        inner = sum(_A[i][j] * (x[j] - _P[i][j] * 1e-4) ** 2 for j in range(6))
        total += (alpha1 if i == 0 else _ALPHA[i]) * math.exp(-inner)
    return -total


def objective(x: tuple[float, ...], r: int) -> float:
    """The metric after r units (1..64): Hartmann-6 plus a bias that vanishes at full fidelity.
    With s = log(r)/log(64), the deepest basin is shallower (alpha_1 lowered by 0.5*(1-s)), and a
    smooth config-dependent term of amplitude 0.4*(1-s) reorders configs at low fidelity."""
    s = math.log(r) / math.log(R_MAX)
    wobble = math.sin(7 * x[0] + 3 * x[3]) * math.cos(5 * x[1] - 2 * x[5])
    return hartmann6(x, _ALPHA[0] - 0.5 * (1 - s)) + 0.4 * (1 - s) * wobble


def configs(seed: int) -> list[tuple[float, ...]]:
    rng = random.Random(seed)
    return [tuple(rng.random() for _ in range(6)) for _ in range(N_CONFIGS)]


def regret(xs: list[tuple[float, ...]], reports: dict[int, list[tuple[int, float]]]) -> float:
    """The incumbent is the config with the best metric at the highest rung any config
    completed; regret is its true (full-fidelity) value minus the optimum."""
    best: tuple[int, float, int] | None = None  # (-rung, metric, index)
    for index, seq in reports.items():
        at = dict(seq)
        for r in reversed(RUNGS):
            if r in at:
                key = (-r, at[r], index)
                if best is None or key < best:
                    best = key
                break
    if best is None:
        return float("nan")
    return hartmann6(xs[best[2]]) - H6_MIN


def simulate(
    xs: list[tuple[float, ...]],
    start: Callable[[int], None],
    report: Callable[[int, int, float], bool],
    end: Callable[[int, int, float, bool], None],
    *,
    workers: int = WORKERS,
    budget: int = BUDGET,
) -> dict[int, list[tuple[int, float]]]:
    """Trials in config order on `workers` workers, one time unit per training unit. A running
    trial reports after every unit; `report(i, r, value)` says whether it goes on. A trial ends
    when told to stop or at R_MAX (`end(i, r, value, reached_max)`); its worker takes the next
    config. Stops once `budget` units were trained. Returns each trial's reports."""
    events: list[tuple[float, int, int]] = []
    reports: dict[int, list[tuple[int, float]]] = {}
    units = 0
    nxt = 0
    seq = 0
    running = 0

    def launch(now: float) -> None:
        nonlocal nxt, seq, running
        while running < workers and nxt < len(xs):
            i = nxt
            nxt += 1
            running += 1
            reports[i] = []
            start(i)
            seq += 1
            heapq.heappush(events, (now + 1, seq, i))

    launch(0.0)
    while events and units < budget:
        now, _, i = heapq.heappop(events)
        r = len(reports[i]) + 1
        units += 1
        value = objective(xs[i], r)
        reports[i].append((r, value))
        go_on = report(i, r, value)
        if go_on and r < R_MAX:
            seq += 1
            heapq.heappush(events, (now + 1, seq, i))
        else:
            running -= 1
            end(i, r, value, r >= R_MAX)
            launch(now)
    return reports

"""The end of a search in a few lines: its trials best first (by the searcher metric), at most
SHOWN of them, with the hyperparameters that vary between trials, and the best trial with its
checkpoint.

    Experiment 4 (mnist-asha) COMPLETED after 84.2s
      16 trials, best val_loss first (smaller is better):
      Trial | State     | Steps | val_loss | Hyperparameters
      ------+-----------+-------+----------+--------------------------------
      7     | COMPLETED | 400   | 0.0831   | lr=0.0123 hidden=128 dropout=0.2
      ...
      ... 6 more: `det-local experiment describe 4` lists them all
      best: trial 7 val_loss=0.0831 checkpoint 3f2a... (steps_completed=400)
"""

from __future__ import annotations

import math
from typing import Any

from det_local.store.db import Store
from det_local.store.states import CheckpointState

SHOWN = 10  # trials in the summary's table
ERRORS_SHOWN = 3  # failed trials whose message is printed


def rank(trials: list[Any], smaller_is_better: bool) -> list[Any]:
    """Best searcher metric first (trials without one last; NaN and the infinities, which the
    daemon never records as a best, after every number); ties in trial id order."""

    def key(t: Any) -> tuple[int, float, int]:
        if t.best_validation is None:
            return (2, 0.0, t.id)
        if not math.isfinite(t.best_validation):
            return (1, 0.0, t.id)
        value = t.best_validation if smaller_is_better else -t.best_validation
        return (0, value, t.id)

    return sorted(trials, key=key)


def searcher_of(config: dict[str, Any]) -> tuple[str | None, bool]:
    """(metric, smaller_is_better) from an experiment's config."""
    searcher = config.get("searcher") or {}
    return searcher.get("metric"), bool(searcher.get("smaller_is_better", True))


def best_checkpoint(store: Store, trial: Any, metric: str | None) -> Any:
    """The trial's checkpoint at its best validation (recorded at the same steps), else its
    latest completed one; None without any."""
    steps = None
    for m in store.list_metrics(trial.id, "validation"):
        if metric is not None and m.metrics.get(metric) == trial.best_validation:
            steps = m.steps_completed
    ckpts = [
        c for c in store.list_checkpoints(trial_id=trial.id) if c.state == CheckpointState.COMPLETED
    ]
    at_best = [c for c in ckpts if c.steps_completed == steps]
    return at_best[-1] if at_best else (ckpts[-1] if ckpts else None)


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:.6g}"
    return str(value)


def _hparams(hparams: dict[str, Any], prefix: str = "") -> list[str]:
    out = []
    for k, v in hparams.items():
        if isinstance(v, dict) and v:
            out += _hparams(v, f"{prefix}{k}.")
        else:
            out.append(f"{prefix}{k}={_fmt(v)}")
    return out


def _varying(per_trial: list[list[str]]) -> set[str]:
    """The hyperparameter names whose values differ between trials (all of them when none
    does): what the search explored, without the constants."""
    seen: dict[str, set[str]] = {}
    for items in per_trial:
        for item in items:
            name, _, value = item.partition("=")
            seen.setdefault(name, set()).add(value)
    varying = {name for name, values in seen.items() if len(values) > 1}
    return varying or set(seen)


def search_lines(
    store: Store, experiment_id: int, trials: list[Any], stopped: set[int] | None = None
) -> list[str]:
    """The summary's lines after its first (indented by two spaces). stopped: the trials the
    searcher stopped early (ASHA), which Determined records as COMPLETED."""
    from det_local.tables import table, terminal_width

    exp = store.get_experiment(experiment_id)
    metric, smaller = searcher_of(exp.config)
    shown_metric = metric or "metric"
    ranked = rank(trials, smaller)
    order = "smaller" if smaller else "larger"
    lines = [f"  {len(trials)} trials, best {shown_metric} first ({order} is better):"]
    stopped = stopped or set()
    if stopped:
        n = len(stopped)
        lines[0] = (
            f"  {len(trials)} trials ({n} stopped early by the searcher), best {shown_metric} "
            f"first ({order} is better):"
        )
    varying = _varying([_hparams(t.hparams) for t in trials])
    rows = [
        [
            t.id,
            f"{t.state.value} (stopped early)" if t.id in stopped else t.state.value,
            t.steps_completed,
            "" if t.best_validation is None else _fmt(t.best_validation),
            " ".join(h for h in _hparams(t.hparams) if h.partition("=")[0] in varying),
        ]
        for t in ranked[:SHOWN]
    ]
    headers = ["Trial", "State", "Steps", shown_metric, "Hyperparameters"]
    text = table(headers, rows, flex=("Hyperparameters",), width=terminal_width() - 2)
    lines += [f"  {ln}" for ln in text.splitlines()]
    if len(ranked) > SHOWN:
        lines.append(
            f"  … {len(ranked) - SHOWN} more: `det-local experiment describe {experiment_id}` "
            "lists them all"
        )
    failed = [t for t in trials if t.message]
    for t in failed[:ERRORS_SHOWN]:
        lines.append(f"  trial {t.id}: {t.message}")
    if len(failed) > ERRORS_SHOWN:
        lines.append(f"  … and {len(failed) - ERRORS_SHOWN} more trials with a message")
    best = ranked[0] if ranked and ranked[0].best_validation is not None else None
    if best is None:
        lines.append(f"  best: none yet (no trial reported a validation {shown_metric})")
        return lines
    ckpt = best_checkpoint(store, best, metric)
    where = (
        f"checkpoint {ckpt.uuid} (steps_completed={ckpt.steps_completed})"
        if ckpt is not None
        else "no checkpoint"
    )
    lines.append(f"  best: trial {best.id} {shown_metric}={_fmt(best.best_validation)} {where}")
    return lines

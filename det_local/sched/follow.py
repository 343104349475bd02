"""Following an experiment: its trials' output as it is written, then a summary."""

from __future__ import annotations

import asyncio
import math
import os
from typing import IO, Any

from det_local.store.db import Store
from det_local.store.paths import Paths
from det_local.store.states import State


class Follower:
    """Tails every trial log of one experiment; prefixes lines with the trial id when there are
    several trials."""

    def __init__(self, store: Store, paths: Paths, experiment_id: int, out: IO[str] | None) -> None:
        self.store = store
        self.paths = paths
        self.experiment_id = experiment_id
        self.out = out
        self.offsets: dict[int, int] = {}
        self.partial: dict[int, bytes] = {}
        self._stop = False

    def stop(self) -> None:
        self._stop = True

    def pump(self) -> None:
        trials = self.store.list_trials(self.experiment_id)
        many = len(trials) > 1
        for t in trials:
            path = self.paths.trial_log(self.experiment_id, t.id)
            try:
                size = os.path.getsize(path)
            except OSError:
                continue
            start = self.offsets.get(t.id, 0)
            if size <= start:
                continue
            with open(path, "rb") as f:
                f.seek(start)
                data = self.partial.pop(t.id, b"") + f.read(size - start)
            self.offsets[t.id] = size
            cut = data.rfind(b"\n") + 1
            if cut < len(data):
                self.partial[t.id] = data[cut:]
            data = data[:cut]
            if not data or self.out is None:
                continue
            text = data.decode("utf-8", "replace")
            if many:
                text = "".join(f"[trial {t.id}] {line}\n" for line in text.splitlines())
            self.out.write(text)
            self.out.flush()

    def _finished(self) -> bool:
        rec = self.store.get_experiment(self.experiment_id)
        if rec.state.terminal:
            return True
        if rec.state == State.PAUSED:
            return all(t.state != State.ACTIVE for t in self.store.list_trials(self.experiment_id))
        return False

    async def run(self, poll: float = 0.05, until_stopped: bool = False) -> None:
        while True:
            self.pump()
            if self._stop or (until_stopped and self._finished()):
                break
            await asyncio.sleep(poll)
        self.pump()
        if self.out is not None:
            for rest in self.partial.values():
                if rest:
                    self.out.write(rest.decode("utf-8", "replace") + "\n")
            self.out.flush()


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:.6g}"
    return str(value)


def summary(store: Store, experiment_id: int, elapsed: float) -> str:
    rec = store.get_experiment(experiment_id)
    lines = [f"Experiment {experiment_id} ({rec.name}) {rec.state.value} after {elapsed:.1f}s"]
    trials = store.list_trials(experiment_id)
    if (
        rec.message
        and rec.state != State.COMPLETED
        and all(t.message != rec.message for t in trials)
    ):
        lines.append(f"  {rec.message}")
    for t in trials:
        lines.append(
            f"  trial {t.id}: {t.state.value}, steps_completed={t.steps_completed}"
            + (f", restarts={t.restarts}" if t.restarts else "")
        )
        val = store.latest_metrics(t.id, "validation")
        if val is not None:
            shown = ", ".join(f"{k}={_fmt(v)}" for k, v in val.metrics.items())
            lines.append(f"    last validation (steps_completed={val.steps_completed}): {shown}")
        ckpts = [c for c in store.list_checkpoints(trial_id=t.id) if c.state == "COMPLETED"]
        if ckpts:
            last = ckpts[-1]
            lines.append(
                f"    checkpoints: {len(ckpts)}, latest {last.uuid} "
                f"(steps_completed={last.steps_completed})"
            )
        if t.message:  # why it failed, or why it ended early (InvalidHP)
            lines.append(f"    {t.message}")
    if rec.state == State.PAUSED:
        lines.append(f"  resume with: det-local experiment activate {experiment_id}")
    return "\n".join(lines)

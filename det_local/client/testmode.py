"""The report of `det-local run --test`: which of the four test-mode steps passed.

The steps are judged from what the store recorded, so they hold for Trial classes, Trainer
scripts and Core API scripts alike:

1. train one batch        training metrics reported by the first run
2. validate               validation metrics reported by the first run
3. checkpoint             a checkpoint recorded by the first run (its first one)
4. restore and train      a second process, started from exactly that checkpoint, exits 0
                          after reporting training at a later step

"One more batch" is what a script that follows its searcher operations (or the Trainer in
test mode) trains: the restored run gets an operation one batch past the checkpoint. A Core API
script that trains to a fixed length of its own (Determined's `core_api/2_checkpoints` tutorial,
its e2e `noop` fixture) ignores operations: the first run trains to its end, checkpointing on
the way, and the restored run resumes from the *first* of those checkpoints (not the latest,
after which there is nothing left to train) and trains to its end again. The step passes when
the restored run reports training past the checkpoint and exits 0: the resume path really ran.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from det_local.store.db import Store
from det_local.store.paths import Paths
from det_local.store.records import json_safe
from det_local.store.states import CheckpointState, State

STEP_NAMES = (
    "train one batch",
    "validate",
    "checkpoint",
    "restore the checkpoint in a new process and train one more batch",
)


@dataclass
class StepResult:
    name: str
    passed: bool
    detail: str


@dataclass
class TestReport:
    experiment_id: int
    trial_id: int | None
    passed: bool
    steps: list[StepResult]
    training: list[dict[str, Any]] = field(default_factory=list)
    validation: list[dict[str, Any]] = field(default_factory=list)
    checkpoint_uuid: str | None = None
    checkpoint_path: str | None = None
    traceback: str | None = None
    log: str = ""

    @property
    def failed_step(self) -> str | None:
        return next((s.name for s in self.steps if not s.passed), None)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("log")
        return json_safe(d)

    def format(self) -> str:
        lines = [f"Test mode, experiment {self.experiment_id}:"]
        for s in self.steps:
            lines.append(f"  {'PASS' if s.passed else 'FAIL'}  {s.name}: {s.detail}")
        if self.traceback and not self.passed:
            lines.append(f"  traceback from the trial ({self.failed_step}):")
            lines.extend("    " + line for line in self.traceback.rstrip().splitlines())
        lines.append("Test mode: PASSED" if self.passed else "Test mode: FAILED")
        return "\n".join(lines)


def last_traceback(log: str, max_lines: int = 80) -> str | None:
    """The last Python traceback in a trial's output, with the line that names the error."""
    start = log.rfind("Traceback (most recent call last):")
    if start < 0:
        return None
    lines = log[start:].splitlines()
    end = len(lines)
    for i in range(1, len(lines)):  # the traceback ends at its first unindented line
        if lines[i] and not lines[i].startswith((" ", "\t")):
            end = i + 1
            break
    block = lines[:end]
    if len(block) > max_lines:
        block = block[:5] + ["    ..."] + block[-(max_lines - 6) :]
    return "\n".join(block)


def _shown(metrics: dict[str, Any], limit: int = 4) -> str:
    items = list(metrics.items())[:limit]
    return ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in items)


def build_report(store: Store, paths: Paths, experiment_id: int) -> TestReport:
    trials = store.list_trials(experiment_id)
    trial = trials[0] if trials else None
    log = ""
    if trial is not None:
        try:
            log = paths.trial_log(experiment_id, trial.id).read_text(errors="replace")
        except OSError:
            log = ""
    if trial is None:
        none = [StepResult(n, False, "no trial was started") for n in STEP_NAMES]
        return TestReport(experiment_id, None, False, none, log=log)

    metrics = store.list_metrics(trial.id)
    train1 = [m for m in metrics if m.run_id == 1 and m.group == "training"]
    val1 = [m for m in metrics if m.run_id == 1 and m.group == "validation"]
    train2 = [m for m in metrics if m.run_id == 2 and m.group == "training"]
    ckpts = [
        c for c in store.list_checkpoints(trial_id=trial.id) if c.state == CheckpointState.COMPLETED
    ]
    from det_local.sched.run.trialstart import restore_checkpoint

    first_ckpt = restore_checkpoint(store, trial.id)

    steps: list[StepResult] = []
    steps.append(
        StepResult(
            STEP_NAMES[0],
            bool(train1),
            f"training metrics at steps_completed={train1[0].steps_completed} "
            f"({_shown(train1[0].metrics)})"
            if train1
            else "the first run reported no training metrics",
        )
    )
    steps.append(
        StepResult(
            STEP_NAMES[1],
            bool(val1),
            f"{_shown(val1[-1].metrics)}"
            if val1
            else "the first run reported no validation metrics",
        )
    )
    steps.append(
        StepResult(
            STEP_NAMES[2],
            first_ckpt is not None,
            f"{first_ckpt.uuid} at steps_completed={first_ckpt.steps_completed}"
            if first_ckpt is not None
            else "the first run recorded no checkpoint",
        )
    )
    restored_ok = (
        trial.run_id >= 2
        and trial.state == State.COMPLETED
        and first_ckpt is not None
        and any(m.steps_completed > first_ckpt.steps_completed for m in train2)
    )
    at = "" if first_ckpt is None else f" at steps_completed={first_ckpt.steps_completed}"
    if restored_ok:
        detail = (
            f"trained to steps_completed={max(m.steps_completed for m in train2)} "
            f"from the checkpoint{at}"
        )
    elif trial.run_id < 2:
        detail = "not run: there was no checkpoint to restore"
    elif trial.state != State.COMPLETED:
        detail = f"the restored run ended {trial.state.value}: {trial.message or ''}".rstrip(": ")
    else:
        detail = (
            f"the restored run reported no training past the checkpoint{at}: a script that "
            "trains to a fixed length needs training left after its first checkpoint"
        )
    steps.append(StepResult(STEP_NAMES[3], restored_ok, detail))
    passed = all(s.passed for s in steps)
    return TestReport(
        experiment_id=experiment_id,
        trial_id=trial.id,
        passed=passed,
        steps=steps,
        training=[m.to_json() for m in metrics if m.group == "training"],
        validation=[m.to_json() for m in metrics if m.group == "validation"],
        checkpoint_uuid=ckpts[-1].uuid if ckpts else None,
        checkpoint_path=ckpts[-1].path if ckpts else None,
        traceback=None if passed else last_traceback(log),
        log=log,
    )

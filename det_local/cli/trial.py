"""`det-local trial`: list and describe trials, print and follow their logs."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import IO, TYPE_CHECKING, Annotated, Any, Optional

import typer

from det_local.cli.checkpoint import JsonFlag, checkpoints_table, fmt_time, fmt_value

if TYPE_CHECKING:
    from det_local.store.db import Store
    from det_local.store.records import MetricRecord, TrialRecord

app = typer.Typer(
    no_args_is_help=True,
    rich_markup_mode=None,
    help="Trials: list, describe, logs.",
)

TRAINING = "training"
VALIDATION = "validation"

_BLOCK = 1 << 16
_POLL_MIN_S = 0.02
_POLL_MAX_S = 0.1


# ---------------------------------------------------------------------------- shared formatting
def fmt_metrics(metrics: dict[str, Any] | None) -> str:
    if not metrics:
        return ""
    return " ".join(f"{k}={fmt_value(v)}" for k, v in metrics.items())


def flatten(d: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    """Nested hyperparameters as dotted names (Determined nests them that way)."""
    out: list[tuple[str, Any]] = []
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out += flatten(v, f"{prefix}{k}.")
        else:
            out.append((f"{prefix}{k}", v))
    return out


def trials_table(
    store: Store, trials: Iterable[TrialRecord], rungs: dict[int, int] | None = None
) -> str:
    """Trials with hparams and their latest validation metrics (one small query per trial);
    a Rung column for ASHA searches."""
    from det_local.cli.common import table

    rows = []
    for t in trials:
        latest = store.latest_metrics(t.id, VALIDATION)
        row = [
            t.id,
            t.state.value,
            t.steps_completed,
            t.restarts,
            "" if t.best_validation is None else fmt_value(t.best_validation),
            fmt_metrics(latest.metrics if latest else None),
            fmt_metrics(t.hparams),
            t.latest_checkpoint or "",
        ]
        if rungs:
            row.insert(3, "" if rungs.get(t.id) is None else rungs[t.id])
        rows.append(row)
    headers = ["ID", "State", "Steps", "Restarts", "Best Validation", "Latest Validation"]
    headers += ["Hyperparameters", "Checkpoint"]
    if rungs:
        headers.insert(3, "Rung")
    return table(headers, rows)


# ---------------------------------------------------------------------------- list / describe
@app.command("list")
def list_trials(
    experiment_id: Annotated[
        int, typer.Argument(metavar="EXPERIMENT_ID", help="The experiment's id.")
    ],
    as_json: JsonFlag = False,
) -> None:
    """List an experiment's trials."""
    from det_local.api import open_store
    from det_local.cli.common import print_json, table

    store = open_store()
    store.get_experiment(experiment_id)  # a clear error for an unknown id
    trials = store.list_trials(experiment_id)
    if as_json:
        print_json([t.to_json() for t in trials])
        return
    rows = [
        [
            t.id,
            t.state.value,
            t.steps_completed,
            t.restarts,
            "" if t.best_validation is None else fmt_value(t.best_validation),
            t.latest_checkpoint or "",
            fmt_metrics(dict(flatten(t.hparams))),
            fmt_time(t.created_at),
            fmt_time(t.ended_at),
        ]
        for t in trials
    ]
    headers = ["ID", "State", "Steps", "Restarts", "Best Validation", "Checkpoint"]
    print(table([*headers, "Hyperparameters", "Started", "Ended"], rows))


@app.command("describe")
def describe(
    trial_id: Annotated[int, typer.Argument(metavar="TRIAL_ID", help="The trial's id.")],
    as_json: JsonFlag = False,
) -> None:
    """Show a trial: state, hyperparameters, latest metrics and checkpoints."""
    from det_local.api import open_store
    from det_local.cli.common import print_json

    store = open_store()
    t = store.get_trial(trial_id)
    training = store.latest_metrics(trial_id, TRAINING)
    validation = store.latest_metrics(trial_id, VALIDATION)
    ckpts = store.list_checkpoints(trial_id=trial_id)
    if as_json:
        print_json(
            {
                "trial": t.to_json(),
                "checkpoints": [c.to_json() for c in ckpts],
                "metrics": {
                    TRAINING: training.to_json() if training else None,
                    VALIDATION: validation.to_json() if validation else None,
                },
            }
        )
        return
    lines = [
        f"Trial {t.id} of experiment {t.experiment_id}",
        f"  State:             {t.state.value}",
        f"  Steps completed:   {t.steps_completed}",
        f"  Restarts:          {t.restarts}",
        f"  Runs:              {t.run_id}",
        f"  Seed:              {t.seed}",
        "  Best validation:   "
        + ("" if t.best_validation is None else fmt_value(t.best_validation)),
        f"  Latest checkpoint: {t.latest_checkpoint or ''}",
    ]
    if t.warm_start_checkpoint:
        lines.append(f"  Warm start:        {t.warm_start_checkpoint}")
    lines += [f"  Started:           {fmt_time(t.created_at)}"]
    lines += [f"  Ended:             {fmt_time(t.ended_at)}"]
    if t.message:
        lines.append(f"  Message:           {t.message}")
    lines += ["", "Hyperparameters:"]
    lines += [f"  {k}: {fmt_value(v)}" for k, v in flatten(t.hparams)] or ["  (none)"]
    for title, rec in (("training", training), ("validation", validation)):
        lines += ["", *_metrics_block(title, rec)]
    lines += ["", "Checkpoints:", checkpoints_table(ckpts)]
    print("\n".join(ln.rstrip() for ln in lines))


def _metrics_block(title: str, rec: MetricRecord | None) -> list[str]:
    if rec is None:
        return [f"Latest {title} metrics: (none yet)"]
    head = f"Latest {title} metrics (steps {rec.steps_completed}, {fmt_time(rec.time)}):"
    return [head, *(f"  {k}: {fmt_value(v)}" for k, v in rec.metrics.items())]


# ---------------------------------------------------------------------------- logs
@app.command("logs")
def logs(
    trial_id: Annotated[int, typer.Argument(metavar="TRIAL_ID", help="The trial's id.")],
    follow: Annotated[
        bool,
        typer.Option(
            "--follow", "-f", help="Keep printing new lines until the trial stops or pauses."
        ),
    ] = False,
    rank: Annotated[
        Optional[int], typer.Option("--rank", help="Only the lines of this worker rank.", min=0)
    ] = None,
    tail: Annotated[
        Optional[int], typer.Option("--tail", help="Start with only the last N lines.", min=0)
    ] = None,
) -> None:
    """Print a trial's output: every run and rank (rank N's lines start with [rank=N])."""
    from det_local.api import open_store, paths

    store = open_store()
    trial = store.get_trial(trial_id)
    path = paths().trial_log(trial.experiment_id, trial_id)
    prefix = None if rank is None else f"[rank={rank}] ".encode()
    out = sys.stdout.buffer
    try:
        if follow:
            _follow(store, trial_id, path, _LineFilter(prefix), tail, out)
        else:
            _print_once(path, _LineFilter(prefix), tail, out)
        out.flush()
    except KeyboardInterrupt:
        pass  # Ctrl-C ends a follow quietly
    except BrokenPipeError:
        # The reader went away (`| head`): stop quietly, and keep Python's exit-time flush
        # from raising again on the closed pipe.
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        except (OSError, ValueError):
            pass


class _LineFilter:
    """Passes whole lines through (those starting with `prefix` when one is set) and holds
    back a trailing partial line until its end arrives (or flush())."""

    def __init__(self, prefix: bytes | None) -> None:
        self.prefix = prefix
        self.pending = b""

    def feed(self, data: bytes) -> bytes:
        data = self.pending + data
        cut = data.rfind(b"\n") + 1
        self.pending = data[cut:]
        return self._keep(data[:cut])

    def flush(self) -> bytes:
        rest, self.pending = self.pending, b""
        return self._keep(rest)

    def _keep(self, chunk: bytes) -> bytes:
        if self.prefix is None or not chunk:
            return chunk
        return b"".join(ln for ln in chunk.splitlines(keepends=True) if ln.startswith(self.prefix))


def _tail_start(f: IO[bytes], end: int, n: int, prefix: bytes | None) -> int:
    """The offset of the first of the last `n` lines of f[:end] (lines starting with
    `prefix` when one is set), reading backwards block by block; 0 when there are fewer."""
    if n <= 0:
        return end
    need = len(prefix) if prefix else 0
    count = 0
    pos = end
    head = b""  # the first bytes of what has been scanned so far (from `pos` on)
    while pos > 0:
        step = min(_BLOCK, pos)
        pos -= step
        f.seek(pos)
        data = f.read(step) + head
        i = step
        while (j := data.rfind(b"\n", 0, i)) >= 0:
            i = j
            start = pos + j + 1
            if start >= end:  # the file's final newline starts no line
                continue
            if prefix is None or data[j + 1 : j + 1 + need] == prefix:
                count += 1
                if count == n:
                    return start
        head = data[: max(need, 1)]
    return 0


def _copy(f: IO[bytes], filt: _LineFilter, out: IO[bytes]) -> bool:
    """Copies what f holds now; returns whether anything was read."""
    got = False
    while data := f.read(_BLOCK):
        got = True
        if kept := filt.feed(data):
            out.write(kept)
    return got


def _open_at(path: Path, tail: int | None, prefix: bytes | None) -> IO[bytes] | None:
    try:
        f = open(path, "rb")  # noqa: SIM115 - kept open across polls; closed by the caller
    except FileNotFoundError:
        return None
    if tail is not None:
        f.seek(_tail_start(f, os.fstat(f.fileno()).st_size, tail, prefix))
    return f


def _print_once(path: Path, filt: _LineFilter, tail: int | None, out: IO[bytes]) -> None:
    f = _open_at(path, tail, filt.prefix)
    if f is None:
        return  # the trial has not written anything yet
    with f:
        _copy(f, filt, out)
    out.write(filt.flush())


def _follow(
    store: Store,
    trial_id: int,
    path: Path,
    filt: _LineFilter,
    tail: int | None,
    out: IO[bytes],
) -> None:
    """Print new lines as they arrive until the trial is PAUSED or finished (its state is
    re-read from the store on every idle poll), then print what is left and return."""
    from det_local.store.states import State

    f = _open_at(path, tail, filt.prefix)  # --tail applies to what exists now
    delay = _POLL_MIN_S
    try:
        while True:
            if f is None:
                f = _open_at(path, None, None)
            if f is not None:
                if os.fstat(f.fileno()).st_size < f.tell():  # truncated: start again
                    f.seek(0)
                if _copy(f, filt, out):
                    out.flush()
                    delay = _POLL_MIN_S
                    continue
            state = store.get_trial(trial_id).state
            if state.terminal or state is State.PAUSED:
                # Lines written before the state changed are in the file by now: drain them.
                if f is None:
                    f = _open_at(path, None, None)
                if f is not None:
                    _copy(f, filt, out)
                out.write(filt.flush())
                return
            time.sleep(delay)
            delay = min(delay * 2, _POLL_MAX_S)
    finally:
        if f is not None:
            f.close()

"""TensorBoard curves for every trial: `tensorboard start` shows a trial's own event files where
it wrote some (PyTorchTrial, a script using get_tensorboard_path()), and otherwise event files
written here from the metrics the trial reported (the store's history), so Core API and
custom-script trials get learning curves too.

The files are written by the caller (the client running `tensorboard start`, reading the store
read-only) into its own cache (`Paths.metric_events_dir`), anew at each start. Tags follow
Determined's TensorBoard metric writer: ``Determined/<name>`` for training,
``Determined/val_<name>`` for validation (a name already starting with ``val`` is kept), and
``Determined/<group>_<name>`` for another group.
"""

from __future__ import annotations

from pathlib import Path

from det_local.store.db import Store
from det_local.store.paths import Paths
from det_local.store.tfevents import EventFileWriter

EVENT_GLOB = "*tfevents*"


def has_event_files(directory: Path) -> bool:
    """Whether TensorBoard finds event files anywhere under `directory`."""
    try:
        return next(iter(directory.rglob(EVENT_GLOB)), None) is not None
    except OSError:  # a directory this user may not read: none that TensorBoard could read
        return False


def tag(group: str, name: str) -> str:
    if group == "training":
        return "Determined/" + name
    if group == "validation":
        return "Determined/" + (name if name.startswith("val") else "val_" + name)
    return f"Determined/{group}_{name}"


def _is_scalar(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def write_metric_events(store: Store, trial_id: int, directory: Path) -> int:
    """Replace the event files in `directory` with one holding every scalar the trial reported
    (at its steps_completed and the time it was reported); returns how many it holds, and
    writes nothing when the trial reported none."""
    if directory.is_dir():
        for old in directory.glob(EVENT_GLOB):
            old.unlink()
    reports = store.list_metrics(trial_id)
    scalars = [
        (tag(r.group, name), float(value), r.steps_completed, r.time)
        for r in reports
        for name, value in r.metrics.items()
        if _is_scalar(value)
    ]
    if not scalars:
        return 0
    with EventFileWriter(directory) as writer:
        for name, value, step, when in scalars:
            writer.add_scalar(name, value, step, when)
    return len(scalars)


def trial_logdirs(store: Store, paths: Paths, experiment_ids: list[int]) -> list[tuple[str, Path]]:
    """(run name, directory) for each trial of the experiments, for TensorBoard's
    --logdir_spec: the trial's own directory when it holds event files, else the directory of
    the event files written from its metrics. Raises NotFoundError for an unknown experiment."""
    found = []
    for exp_id in experiment_ids:
        store.get_experiment(exp_id)  # NotFoundError: "experiment 9 not found; ..."
        for t in store.list_trials(exp_id):
            own = paths.trial_dir(exp_id, t.id)
            name = f"trial_{t.id}"
            if own.is_dir() and has_event_files(own):
                found.append((name, own))
                continue
            written = paths.metric_events_dir(exp_id, t.id)
            found.append((name, written if write_metric_events(store, t.id, written) else own))
    return found

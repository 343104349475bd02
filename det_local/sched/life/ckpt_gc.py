"""Checkpoint garbage collection when an experiment ends (Determined's rule).

When an experiment reaches COMPLETED, CANCELED or ERROR, det-local keeps the union of

* the experiment's best ``save_experiment_best`` checkpoints,
* each trial's best ``save_trial_best`` checkpoints,
* each trial's latest ``save_trial_latest`` checkpoints (by ``steps_completed``),

and deletes the files of every other checkpoint of the experiment, whose record stays, in state
DELETED (its metrics stay too). The three numbers come from the experiment's
``checkpoint_storage`` (defaults 0, 1, 1).

"Best" is by the searcher metric (``smaller_is_better``) of the trial's validation reported at
the checkpoint's ``steps_completed``, as Determined pairs a checkpoint with the validation at the
same total batches. A checkpoint with no such validation (or one without the searcher metric)
cannot be best: it is kept only as one of its trial's latest. The rest follows Determined's SQL
(``ExperimentCheckpointsToGCRaw``):

* ranks are SQL ``rank()``: equal keys share a rank; metric ties are broken by the order in which
  the validations were recorded (earlier ranks first); two checkpoints paired with the same
  validation tie; checkpoints at the same steps_completed tie as latest;
* NaN ranks after every number (as PostgreSQL sorts it), and so do +inf and -inf whichever
  direction is better (an infinite metric is a diverged run, never the best checkpoint);
* every recorded checkpoint takes part in the ranking, DELETED ones included (so a rerun selects
  the same set);
* a checkpoint any trial was warm-started from (of any experiment) is never deleted, nor one
  registered as a model version (the model registry, `store/tables/registry.py`).

One deliberate difference: Determined partitions the latest-ranking by the *validation's* trial,
so checkpoints without a validation compete across trials for ``save_trial_latest``; det-local
ranks each checkpoint among its own trial's checkpoints, as the setting is documented.

The same pass removes the directories of the experiment's incomplete checkpoints: begun by a
trial that died before recording them (``ckpt_begin`` without a ``checkpoint``); they were never
checkpoints (no record lists them), and their entries are dropped once the directories are gone.

Not collected: experiments run in test mode (`det-local run --test`, whose report points at its
checkpoint; Determined would delete it, its ``save_*`` being 0), PAUSED or ACTIVE experiments,
and experiments that ended before det-local had checkpoint GC.

Crash safety: the experiment's end is committed first; then the doomed checkpoints are marked
DELETED in one commit; then their directories are removed; then the experiment is marked as
collected. An experiment that ended but is not marked collected is collected again when the
engine starts, and that pass removes the directory of every DELETED checkpoint of the
experiment that is still on disk, so an interrupted GC finishes.

In the engine the marks are made on its event loop and the files are removed on a worker thread
(deleting large checkpoints takes a while; the engine goes on answering meanwhile), with the
owner's rights when a root daemon acts for a user (``rm`` run as that user: the engine's own ids
never change); the end of GC is recorded back on the loop, and until then the experiment counts
as work in progress (an embedded ``det-local run`` waits for it).
"""

from __future__ import annotations

import asyncio
import math
import os
import shutil
import uuid as uuidlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from det_local.store.db import GC_DONE, GC_SKIPPED, Store
from det_local.store.records import CHECKPOINT_DELETED


# ---------------------------------------------------------------------------- the rule (pure)
@dataclass(frozen=True)
class GcPolicy:
    save_experiment_best: int = 0
    save_trial_best: int = 1
    save_trial_latest: int = 1
    smaller_is_better: bool = True

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> GcPolicy:
        """From a stored experiment config (Determined's defaults for what is unset)."""
        storage = config.get("checkpoint_storage") or {}
        searcher = config.get("searcher") or {}

        def count(name: str, default: int) -> int:
            value = storage.get(name)
            return default if value is None else int(value)

        sib = searcher.get("smaller_is_better")
        return cls(
            save_experiment_best=count("save_experiment_best", 0),
            save_trial_best=count("save_trial_best", 1),
            save_trial_latest=count("save_trial_latest", 1),
            smaller_is_better=True if sib is None else bool(sib),
        )


@dataclass(frozen=True)
class Candidate:
    """A checkpoint as the rule sees it."""

    uuid: str
    trial_id: int
    steps_completed: int
    metric: float | None = None  # the searcher metric of its validation; None: no validation
    validation_id: int = 0  # that validation's order of recording (ties among equal metrics)


def _metric_key(c: Candidate, sign: float) -> tuple[int, float, int]:
    """Sort key of `ORDER BY sign * metric ASC NULLS LAST, v.id ASC` (NaN and the infinities
    after numbers)."""
    if c.metric is None:
        return (2, 0.0, 0)
    if not math.isfinite(c.metric):
        return (1, 0.0, c.validation_id)
    return (0, sign * c.metric, c.validation_id)


def _ranks(keys: Sequence[Any]) -> list[int]:
    """SQL rank(): 1 + how many keys sort strictly before (equal keys share a rank)."""
    ordered = sorted(keys)
    first: dict[Any, int] = {}
    for i, k in enumerate(ordered):
        first.setdefault(k, i + 1)
    return [first[k] for k in keys]


def select_for_deletion(
    candidates: Iterable[Candidate], policy: GcPolicy, protected: Iterable[str] = ()
) -> list[str]:
    """The uuids Determined's rule deletes, in the order given. `protected` uuids (warm-start
    sources, checkpoints a trial may still resume from) are never selected."""
    cands = list(candidates)
    sign = 1.0 if policy.smaller_is_better else -1.0
    keys = [_metric_key(c, sign) for c in cands]
    exp_rank = _ranks(keys)
    trial_rank = [0] * len(cands)
    latest_rank = [0] * len(cands)
    by_trial: dict[int, list[int]] = {}
    for i, c in enumerate(cands):
        by_trial.setdefault(c.trial_id, []).append(i)
    for members in by_trial.values():
        for i, r in zip(members, _ranks([keys[i] for i in members]), strict=True):
            trial_rank[i] = r
        for i, r in zip(members, _ranks([-cands[i].steps_completed for i in members]), strict=True):
            latest_rank[i] = r
    keep = set(protected)
    doomed = []
    for i, c in enumerate(cands):
        not_best = (
            exp_rank[i] > policy.save_experiment_best and trial_rank[i] > policy.save_trial_best
        )
        if (
            (not_best or c.metric is None)
            and latest_rank[i] > policy.save_trial_latest
            and c.uuid not in keep
        ):
            doomed.append(c.uuid)
    return doomed


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def candidates_of(store: Store, experiment_id: int, metric: str | None) -> list[Candidate]:
    """Every checkpoint of the experiment (DELETED ones too), each with the searcher metric of
    its trial's validation at the same steps_completed (the last one recorded there, should a
    restart have validated a step twice)."""
    validation: dict[tuple[int, int], tuple[int, float | None]] = {}
    for row_id, trial_id, steps, metrics in store.list_validations(experiment_id):
        value = _number(metrics.get(metric)) if metric is not None else None
        validation[(trial_id, steps)] = (row_id, value)
    out = []
    for c in store.list_checkpoints(experiment_id=experiment_id):
        row_id, value = validation.get((c.trial_id, c.steps_completed), (0, None))
        out.append(Candidate(c.uuid, c.trial_id, c.steps_completed, value, row_id))
    return out


# ---------------------------------------------------------------------------- applying it
@dataclass
class GcResult:
    deleted: list[str]  # marked DELETED by this pass
    removed: list[str]  # directories removed from disk (this pass's and interrupted ones')
    failed: list[str]  # "uuid: why" for directories that could not be removed
    kept: int  # checkpoints left COMPLETED


@dataclass
class GcPlan:
    """What one pass does once its marks are committed: the files to remove."""

    experiment_id: int
    deleted: list[str]  # marked DELETED by this pass
    targets: list[tuple[str, str]]  # (uuid, recorded path) of every DELETED checkpoint
    # (uuid, path) of checkpoints begun and never completed (their trials died writing them)
    incomplete: list[tuple[str, str]] = field(default_factory=list)


def _checkpoint_dir(uuid: str, recorded: str) -> Path | None:
    """The directory to remove: the recorded path, only when it is absolute and named by the
    checkpoint's own (well-formed) uuid, so that a malformed record cannot aim GC elsewhere."""
    try:
        if str(uuidlib.UUID(uuid)) != uuid:
            return None
    except ValueError:
        return None
    path = Path(recorded)
    if not path.is_absolute() or path.name != uuid or ".." in path.parts:
        return None
    return path


def _remove(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path)


def mark(store: Store, experiment_id: int, *, protected: Iterable[str] = ()) -> GcPlan:
    """Apply the rule to an ended experiment and commit the DELETED marks (the store only; no
    file is touched). The plan's targets are every DELETED checkpoint of the experiment, so
    that a pass after a crash removes what an interrupted one left."""
    rec = store.get_experiment(experiment_id)
    assert rec.state.terminal, f"experiment {experiment_id} is {rec.state.value}"
    policy = GcPolicy.from_config(rec.config)
    metric = (rec.config.get("searcher") or {}).get("metric")
    cands = candidates_of(store, experiment_id, metric)
    # warm-start sources, and checkpoints a model version points at (`store/tables/registry.py`)
    keep = set(protected) | store.warm_start_checkpoints() | store.models.registered()
    for t in store.list_trials(experiment_id):  # none, once the experiment ended; to be sure
        if not t.state.terminal and t.latest_checkpoint:
            keep.add(t.latest_checkpoint)
    doomed = select_for_deletion(cands, policy, keep)
    listed = store.list_checkpoints(experiment_id=experiment_id)
    deleted = {c.uuid for c in listed if c.state == CHECKPOINT_DELETED}
    newly = [u for u in doomed if u not in deleted]
    if newly:
        store.mark_checkpoints_deleted(newly)  # committed before any file goes
    deleted.update(newly)
    targets = [(c.uuid, c.path) for c in listed if c.uuid in deleted]
    incomplete = store.list_incomplete_checkpoints(experiment_id=experiment_id)
    return GcPlan(experiment_id, newly, targets + incomplete, incomplete)


def settled(targets: Sequence[tuple[str, str]], failed: Sequence[str]) -> list[str]:
    """The uuids of `targets` whose directories are gone now (removed, or never there): all
    but those remove_targets() reported as failures."""
    failed_ids = {f.split(":", 1)[0] for f in failed}
    return [u for u, _ in targets if u not in failed_ids]


def remove_targets(
    targets: Sequence[tuple[str, str]], remove: Callable[[Path], None] | None = None
) -> tuple[list[str], list[str]]:
    """Remove the checkpoints' directories: (removed uuids, "uuid: why" failures). `remove`
    deletes one path (default: with this process's rights). Filesystem only: safe to run off
    the engine's event loop."""
    removed: list[str] = []
    failed: list[str] = []
    for uuid, recorded in targets:
        path = _checkpoint_dir(uuid, recorded)
        if path is None:
            if os.path.lexists(recorded):
                failed.append(f"{uuid}: its recorded path {recorded!r} is not <storage>/<uuid>")
            continue
        if not os.path.lexists(path):
            continue
        try:
            (remove or _remove)(path)
            removed.append(uuid)
        except OSError as err:
            failed.append(f"{uuid}: {path}: {err.strerror or err}")
    return removed, failed


def _remover_as(identity: dict[str, Any]) -> Callable[[Path], None]:
    """A `remove` for remove_targets() that deletes with another user's rights: `rm -rf` run as
    that user (a link is removed, never followed). This process's ids never change, so the
    engine's other threads go on as root meanwhile."""
    import subprocess

    uid = identity["uid"]

    def remove(path: Path) -> None:
        proc = subprocess.run(
            ["rm", "-rf", "--", str(path)],
            capture_output=True,
            text=True,
            cwd="/",
            env={"PATH": "/usr/bin:/bin", "LC_ALL": "C"},
            user=uid,
            group=identity.get("gid", uid),
            extra_groups=identity.get("groups") or [],
        )
        if proc.returncode != 0:
            lines = proc.stderr.strip().splitlines() or [f"rm exited with {proc.returncode}"]
            # "rm: cannot remove 'PATH/x': Permission denied" -> "Permission denied"
            raise OSError(lines[-1].rsplit(": ", 1)[-1] + f" (removing as uid {uid})")

    return remove


def remove_files(
    targets: Sequence[tuple[str, str]], identity: dict[str, Any] | None = None
) -> tuple[list[str], list[str]]:
    """remove_targets() with the rights of `identity` (uid/gid/groups: the experiment's owner,
    when a root daemon acts for a user), else this process's."""
    uid = (identity or {}).get("uid")
    if uid is None or uid == 0 or os.geteuid() != 0:
        return remove_targets(targets)
    assert identity is not None
    return remove_targets(targets, _remover_as(identity))


def finish(store: Store, plan: GcPlan, failed: Sequence[str] = ()) -> int:
    """Forget the incomplete checkpoints whose directories are gone and mark the experiment
    collected; the number of checkpoints it keeps."""
    experiment_id = plan.experiment_id
    store.drop_incomplete_checkpoints(settled(plan.incomplete, failed))
    store.set_checkpoint_gc(experiment_id, GC_DONE)
    return sum(
        1
        for c in store.list_checkpoints(experiment_id=experiment_id)
        if c.state != CHECKPOINT_DELETED
    )


def collect(
    store: Store,
    experiment_id: int,
    *,
    identity: dict[str, Any] | None = None,
    protected: Iterable[str] = (),
) -> GcResult:
    """Apply the rule to an ended experiment: mark, then remove files (see the module doc).
    Idempotent: running it again after a crash finishes what was started. Marks the experiment
    collected at the end. `identity` (uid/gid/groups): remove files with that user's rights."""
    plan = mark(store, experiment_id, protected=protected)
    removed, failed = remove_files(plan.targets, identity)
    return GcResult(plan.deleted, removed, failed, finish(store, plan, failed))


# ---------------------------------------------------------------------------- in the engine
class CheckpointGC:
    """Checkpoint GC as the engine runs it: once per ended experiment, marks on the event loop,
    files removed on a worker thread (see the module doc). ``identity_of(experiment_id)``: whose
    rights its files are removed with; ``skip(experiment_id)``: experiments never collected
    (test mode, unmanaged runs); ``on_done``: called when a pass ends (the engine's idle check).
    """

    def __init__(
        self,
        store: Store,
        *,
        identity_of: Callable[[int], dict[str, Any]],
        skip: Callable[[int], bool],
        note: Callable[..., None],
        out: Callable[[str], None],
        on_done: Callable[[], None],
    ) -> None:
        self.store = store
        self.identity_of = identity_of
        self.skip = skip
        self.note = note
        self.out = out
        self.on_done = on_done
        self.running: set[int] = set()  # experiments whose checkpoint files are being removed
        self.loop: asyncio.AbstractEventLoop | None = None

    def collect_if_ended(self, experiment_id: int) -> None:
        """Called whenever an experiment may have ended: collects it once.

        Inside an open transaction (a spool request being applied) the marks could still roll
        back, so GC waits for the commit (the next loop iteration); should the engine stop
        first, the start of the next engine does it."""
        store = self.store
        if experiment_id in self.running or not store.checkpoint_gc_due(experiment_id):
            return
        if store.conn.in_transaction:
            if self.loop is not None:
                self.loop.call_soon(self._after_commit, experiment_id)
            return
        self._collect_logged(experiment_id)

    def _after_commit(self, experiment_id: int) -> None:
        try:
            self.collect_if_ended(experiment_id)
        except Exception:  # e.g. the engine stopped meanwhile: the next start collects it
            pass

    def collect_pending(self) -> None:
        """At engine start: every ended experiment whose GC has not run or was interrupted."""
        for experiment_id in self.store.checkpoint_gc_pending():
            self._collect_logged(experiment_id)

    def _collect_logged(self, experiment_id: int) -> None:
        """Mark on the event loop (the store), remove the files on a worker thread (large
        checkpoints take a while to delete; the engine goes on answering meanwhile), then
        record the end of GC back on the loop. The experiment counts as work in progress until
        then, so an embedded run waits for it."""
        store = self.store
        try:
            if self.skip(experiment_id):
                store.set_checkpoint_gc(experiment_id, GC_SKIPPED)
                return
            identity = self.identity_of(experiment_id)
            plan = mark(store, experiment_id)
        except Exception as err:  # GC must never take the engine down; the next start retries
            self._failed(experiment_id, err)
            return
        loop = self.loop
        if loop is None or not loop.is_running() or not plan.targets:
            try:
                removed, failed = remove_files(plan.targets, identity)
            except Exception as err:
                self._failed(experiment_id, err)
                return
            self._finished(plan, removed, failed)
            return
        self.running.add(experiment_id)
        future = loop.run_in_executor(None, remove_files, plan.targets, identity)

        def done(fut: Any) -> None:
            self.running.discard(experiment_id)
            try:
                removed, failed = fut.result()
                self._finished(plan, removed, failed)
            except Exception as err:  # the store closed meanwhile: the next start finishes it
                self._failed(experiment_id, err)
            try:
                self.on_done()
            except Exception:  # the engine stopped meanwhile
                pass

        future.add_done_callback(done)

    def _failed(self, experiment_id: int, err: BaseException) -> None:
        message = (
            f"experiment {experiment_id}: checkpoint GC failed ({err!r}); "
            "it is tried again when det-local next starts"
        )
        try:
            self.note(message, experiment_id=experiment_id, level="WARNING")
        except Exception:  # the store itself failed
            self.out(f"det-local: {message}")

    def _finished(self, plan: GcPlan, removed: list[str], failed: list[str]) -> None:
        experiment_id = plan.experiment_id
        try:
            kept = finish(self.store, plan, failed)
        except Exception as err:
            self._failed(experiment_id, err)
            return
        partial = {u for u, _ in plan.incomplete}
        for uuid in removed:
            if uuid in partial:
                self.note(
                    f"experiment {experiment_id}: checkpoint GC removed incomplete checkpoint "
                    f"{uuid} (its trial stopped while writing it)",
                    experiment_id=experiment_id,
                )
        gone = len((set(plan.deleted) | set(removed)) - partial)
        if gone:
            self.note(
                f"experiment {experiment_id}: checkpoint GC deleted {gone} "
                f"checkpoint{'s' if gone != 1 else ''}, kept {kept} "
                "(checkpoint_storage save_experiment_best/save_trial_best/save_trial_latest)",
                experiment_id=experiment_id,
                echo=False,  # routine: `experiment events` and the daemon's log show it
            )
        for failure in failed:
            self.note(
                f"experiment {experiment_id}: checkpoint GC could not remove checkpoint "
                f"{failure}; remove it by hand",
                experiment_id=experiment_id,
                level="WARNING",
            )

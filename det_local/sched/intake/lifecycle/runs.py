"""Killing one trial; archiving and deleting experiments; deleting checkpoints and editing
their metadata. One handler per request op (:data:`HANDLERS`), as in `sched/intake/handlers.py`.

Deleting is durable before acting: the records change with the request (checkpoints marked
DELETED, an experiment's rows removed), committed with its answer; the files go after the
commit (`_after_commit`), with the owner's rights (a root daemon acts for users). Should the
engine stop in between, those files stay on disk, unreferenced (a failure to remove one is
logged, naming it).
"""

from __future__ import annotations

import asyncio
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, cast

from det_local.errors import DetLocalError, NotFoundError, StateError
from det_local.sched.intake.handlers import Controls, Handler, authorize, own_experiment
from det_local.sched.intake.spool import Request
from det_local.sched.life import trialexit
from det_local.sched.life.ckpt_gc import CheckpointGC, remove_files
from det_local.sched.life.experiments import ExperimentRun, TrialRun
from det_local.sched.queue.jobqueue import JobQueue
from det_local.sched.run.runas import identity, uid_of
from det_local.store.paths import Paths
from det_local.store.records import CheckpointRecord
from det_local.store.states import CHECKPOINT_DOWNLOADABLE, CheckpointState, State


class RunsHost(trialexit.TrialExitHost, Protocol):
    """What these requests need of the engine beyond `handlers.Controls`."""

    paths: Paths
    queue: JobQueue
    runs: dict[int, TrialRun]
    experiments: dict[int, ExperimentRun]

    def experiment(self, experiment_id: int) -> ExperimentRun: ...

    loop: asyncio.AbstractEventLoop | None
    gc: CheckpointGC


def _engine(c: Controls) -> RunsHost:
    return cast(RunsHost, c)


def _owner_identity(c: Controls, experiment_id: int) -> dict[str, Any]:
    return identity(uid_of(c.store.get_experiment(experiment_id).user))


def _after_commit(c: Controls, work: Callable[[], None]) -> None:
    """Run `work` once the request's changes are committed: at once when there is no open
    transaction (an engine acting for one request, autocommitting), else on the engine's
    loop's next turn (the spool server commits the request and its answer first)."""
    loop = _engine(c).loop
    if c.store.conn.in_transaction and loop is not None and loop.is_running():
        loop.call_soon(_logged, c, work)
    else:
        work()


def _logged(c: Controls, work: Callable[[], None]) -> None:
    try:
        work()
    except Exception as err:  # the engine goes on; the files stay for a person to remove
        c.log_safely(f"removing deleted files failed: {err}")


def _remover(
    c: Controls, targets: list[tuple[str, str]], ident: dict[str, Any]
) -> Callable[[], None]:
    def remove() -> None:
        _, failed = remove_files(targets, ident)
        for failure in failed:
            c.log_safely(f"could not remove deleted checkpoint {failure}; remove it by hand")

    return remove


def _mark_deleted(c: Controls, ckpts: list[CheckpointRecord]) -> None:
    for k in ckpts:
        if k.state != CheckpointState.DELETED:
            c.store.mark_checkpoint_deleted(k.uuid)  # no BEGIN: the request's own transaction


# ---------------------------------------------------------------------- trials
def trial_kill(c: Controls, req: Request) -> str:
    """Stop one trial of a search. The searcher hears it as Determined's does: the trial
    exited early, USER_CANCELED (ASHA counts it out of its rung; a grid goes on)."""
    engine = _engine(c)
    trial_id = int(req.payload["trial_id"])
    trial = c.store.get_trial(trial_id)
    exp_rec = c.store.get_experiment(trial.experiment_id)
    authorize(c.settings, req, exp_rec.user, f"trial {trial_id} (experiment {exp_rec.id})")
    if trial.state.terminal:
        return f"trial {trial_id} is already {trial.state.value}"
    if exp_rec.state not in (State.ACTIVE, State.PAUSED):
        raise StateError(
            f"trial {trial_id}: its experiment {exp_rec.id} is {exp_rec.state.value}; "
            "only trials of ACTIVE or PAUSED experiments can be killed"
        )
    exp = engine.experiment(exp_rec.id)
    run = engine.runs.get(trial_id)
    engine.note(f"trial {trial_id} killed by {req.user}", experiment_id=exp.id, trial_id=trial_id)
    if run is not None:  # its exit is CANCELED (trialexit): the searcher hears it then
        run.kill_requested = True
        engine.trial_jobs.terminate(run)
        return f"trial {trial_id} killed"
    engine.queue.dequeue_trial(trial_id, "trial killed", cancel=True)
    c.store.set_trial_state(trial_id, State.CANCELED, f"killed by {req.user}")
    request_id = exp.request_of.get(trial_id)
    if request_id is not None:
        exp.waiting.discard(request_id)  # a <=0.37 ASHA trial waiting to be promoted
        engine.apply(exp, exp.searcher.on_trial_exited_early(request_id, "USER_CANCELED"))
    engine.queue.schedule()
    trialexit.finish_if_done(engine, exp)
    engine.check_idle()
    return f"trial {trial_id} killed"


# ---------------------------------------------------------------------- experiments
def experiment_archive(c: Controls, req: Request) -> str:
    exp_id = own_experiment(c, req)
    state = c.store.get_experiment(exp_id).state
    if not state.terminal:
        raise StateError(
            f"experiment {exp_id} is {state.value}; only ended experiments can be archived "
            f"(`det-local experiment kill {exp_id}` first)"
        )
    c.store.lifecycle.set_archived(exp_id, True)
    return f"experiment {exp_id} archived"


def experiment_unarchive(c: Controls, req: Request) -> str:
    exp_id = own_experiment(c, req)
    c.store.lifecycle.set_archived(exp_id, False)
    return f"experiment {exp_id} unarchived"


def experiment_delete(c: Controls, req: Request) -> str:
    """Remove the experiment's checkpoints (but those registered in a model), its logs, its
    context snapshot and its records. Refused while it runs."""
    engine = _engine(c)
    exp_id = own_experiment(c, req)
    rec = c.store.get_experiment(exp_id)
    if not rec.state.terminal or any(r.experiment_id == exp_id for r in engine.runs.values()):
        raise StateError(
            f"experiment {exp_id} is {rec.state.value}; it cannot be deleted while it runs or "
            f"is paused (`det-local experiment kill {exp_id}` first)"
        )
    if exp_id in engine.gc.running:
        raise StateError(
            f"experiment {exp_id}: checkpoint GC is still removing its files; ask again in a moment"
        )
    registered = c.store.models.registered()
    ckpts = c.store.list_checkpoints(experiment_id=exp_id)
    doomed = [k for k in ckpts if k.uuid not in registered]
    kept = len(ckpts) - len(doomed)
    for k in ckpts:
        if k.uuid in registered:  # it outlives the experiment: still its creator's
            c.store.models.record_creator(k.uuid, rec.user)
    ident = _owner_identity(c, exp_id)
    targets = [(k.uuid, k.path) for k in doomed]
    targets += c.store.list_incomplete_checkpoints(experiment_id=exp_id)
    _mark_deleted(c, doomed)
    c.store.lifecycle.delete_experiment(exp_id, registered)
    engine.experiments.pop(exp_id, None)
    exp_dir = engine.paths.experiment_dir(exp_id)  # logs, the context snapshot
    env_file = engine.paths.experiment_env(exp_id)
    remove_checkpoints = _remover(c, targets, ident)

    def remove() -> None:
        remove_checkpoints()
        _remove_tree(exp_dir)
        env_file.unlink(missing_ok=True)

    _after_commit(c, remove)
    return f"experiment {exp_id} deleted" + (
        f" ({kept} checkpoint{'s' if kept != 1 else ''} registered in a model kept)" if kept else ""
    )


def _remove_tree(path: Path) -> None:
    """The experiment's directory in the home (the engine's own: removed with its rights;
    rmtree never follows a link out of it)."""
    if path.is_symlink():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path)


# ---------------------------------------------------------------------- checkpoints
def _own_checkpoint(c: Controls, req: Request, uuid: str) -> tuple[CheckpointRecord, str]:
    """The checkpoint and its owner: its experiment's, or (that experiment deleted, the
    checkpoint kept by a model) its creator's as recorded then."""
    ckpt = c.store.get_checkpoint(uuid)
    owner = c.store.models.checkpoint_owner(uuid, ckpt.experiment_id) or "nobody"
    authorize(c.settings, req, owner, f"checkpoint {uuid}")
    return ckpt, owner


def checkpoint_delete(c: Controls, req: Request) -> str:
    """Delete checkpoints' files (their records stay, DELETED). Each is checked before any is
    deleted: a registered one, one of a running experiment or another user's refuses all."""
    uuids = [str(u) for u in req.payload["uuids"]]
    registered = c.store.models.registered()
    in_registry = [u for u in uuids if u in registered]
    if in_registry:
        raise StateError(
            "this subset of checkpoints provided are in the model registry and cannot be "
            f"deleted: {in_registry} (`det-local model list` shows the models)"
        )
    owned = [_own_checkpoint(c, req, u) for u in uuids]
    for k, _ in owned:
        try:
            state = c.store.get_experiment(k.experiment_id).state
        except NotFoundError:  # deleted: the checkpoint outlived it in a model, now left
            continue
        if not state.terminal:
            raise StateError(
                f"checkpoint {k.uuid}: its experiment {k.experiment_id} is {state.value}; "
                "checkpoints of running or paused experiments cannot be deleted (a trial may "
                "resume from them)"
            )
    by_owner: dict[str, list[CheckpointRecord]] = {}
    for k, owner in owned:
        by_owner.setdefault(owner, []).append(k)
    for owner, group in by_owner.items():
        _mark_deleted(c, group)
        targets = [(k.uuid, k.path) for k in group]
        # with the owner's rights (a root daemon acts for users)
        _after_commit(c, _remover(c, targets, _identity_for(owner, group)))
    n = len(uuids)
    return f"deleted {n} checkpoint{'s' if n != 1 else ''}"


def _identity_for(owner: str, ckpts: list[CheckpointRecord]) -> dict[str, Any]:
    """The rights files are removed with: the owner's; for a checkpoint whose creator is not
    known (an admin deletes it), its directory's owner's, never the daemon's."""
    if owner != "nobody":
        return identity(uid_of(owner))
    for k in ckpts:
        try:
            return identity(os.lstat(k.path).st_uid)
        except OSError:
            continue
    return identity(uid_of("nobody"))


def checkpoint_metadata(c: Controls, req: Request) -> dict[str, Any]:
    """Replace a checkpoint's user metadata (what add_metadata/remove_metadata computed)."""
    uuid = str(req.payload["uuid"])
    ckpt, _ = _own_checkpoint(c, req, uuid)
    metadata = req.payload["metadata"]
    if not isinstance(metadata, dict) or not all(isinstance(k, str) for k in metadata):
        raise DetLocalError(f"checkpoint {uuid}: metadata must be a JSON object")
    if ckpt.state not in CHECKPOINT_DOWNLOADABLE:
        raise StateError(f"checkpoint {uuid} is {ckpt.state}; its metadata cannot change")
    c.store.lifecycle.set_checkpoint_metadata(uuid, metadata)
    return metadata


HANDLERS: dict[str, Handler] = {
    "trial_kill": trial_kill,
    "experiment_archive": experiment_archive,
    "experiment_unarchive": experiment_unarchive,
    "experiment_delete": experiment_delete,
    "checkpoint_delete": checkpoint_delete,
    "checkpoint_metadata": checkpoint_metadata,
}

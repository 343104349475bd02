"""What each message of a trial session does: one handler per message type (``wire/rpc.py``).

A handler gets the engine's narrow :class:`TrialHost`, the session's run, the message and the
connecting uid; it returns the reply's value or raises:
:class:`~det_local.sched.sessions.trialserver.
Refused` for anything that is not the run's own (logged), another ``DetLocalError`` for an
error the trial made (answered, not logged). ``MESSAGES`` maps each type to its handler.
"""

from __future__ import annotations

import os
import stat
import time
import uuid as uuidlib
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from det_local.errors import DetLocalError, NotFoundError
from det_local.sched.run.runas import user_name
from det_local.sched.sessions.trialserver import Refused
from det_local.store.records import CheckpointRecord

if TYPE_CHECKING:
    from det_local.sched.life.experiments import ExperimentRun, TrialRun
    from det_local.sched.sessions.reports import Reports
    from det_local.store.db import Store


class TrialHost(Protocol):
    """What a session's messages may do to the engine."""

    store: Store
    reports: Reports  # metrics, progress, operations: what the searcher hears of

    def experiment_of(self, run: TrialRun) -> ExperimentRun: ...

    def end_unmanaged(self, run: TrialRun, msg: dict[str, Any]) -> bool: ...

    def run_ending(self, run: TrialRun) -> None: ...


Handler = Callable[["TrialHost", "TrialRun", dict[str, Any], int], Any]


def handle(host: TrialHost, run: TrialRun, msg: dict[str, Any], uid: int) -> Any:
    """The reply value of one message of the run's session (see the module doc)."""
    check_names_own_run(run, msg)
    kind = msg.get("t")
    handler = MESSAGES.get(kind) if isinstance(kind, str) else None
    if handler is None:
        raise DetLocalError(f"unknown request {str(kind)[:40]!r}")
    return handler(host, run, msg, uid)


# ---------------------------------------------------------------------- reports
def metrics(host: TrialHost, run: TrialRun, msg: dict[str, Any], uid: int) -> None:
    host.reports.on_metrics(run, host.experiment_of(run), msg["reports"])


def progress(host: TrialHost, run: TrialRun, msg: dict[str, Any], uid: int) -> None:
    host.reports.on_progress(run, host.experiment_of(run), float(msg["progress"]))


def nothing(host: TrialHost, run: TrialRun, msg: dict[str, Any], uid: int) -> None:
    """status, out_of_ops, bye: nothing to record."""


def early_exit(host: TrialHost, run: TrialRun, msg: dict[str, Any], uid: int) -> None:
    run.invalid_hp = msg.get("reason") == "INVALID_HP"


def best_val(host: TrialHost, run: TrialRun, msg: dict[str, Any], uid: int) -> float | None:
    exp = host.experiment_of(run)
    if exp.best is None:
        return None
    return exp.best if exp.config.searcher.smaller_is_better else -exp.best


def last_val(host: TrialHost, run: TrialRun, msg: dict[str, Any], uid: int) -> int | None:
    last = host.store.latest_metrics(run.trial_id, "validation")
    return None if last is None else last.steps_completed


def op_next(host: TrialHost, run: TrialRun, msg: dict[str, Any], uid: int) -> int | None:
    q = host.experiment_of(run).ops.get(run.request_id)
    return q[0] if q else None


def op_done(host: TrialHost, run: TrialRun, msg: dict[str, Any], uid: int) -> None:
    host.reports.on_op_done(run, host.experiment_of(run), int(msg["length"]), msg.get("metric"))


def preempt_ack(host: TrialHost, run: TrialRun, msg: dict[str, Any], uid: int) -> None:
    if not run.acked:
        host.store.jobs.set_preempt_acked(run.job_id)  # outlives a daemon crash
    run.acked = True


def time_limit(host: TrialHost, run: TrialRun, msg: dict[str, Any], uid: int) -> None:
    host.run_ending(run)


def unmanaged_end(host: TrialHost, run: TrialRun, msg: dict[str, Any], uid: int) -> None:
    if not host.end_unmanaged(run, msg):
        raise DetLocalError(f"unknown request {str(msg.get('t'))[:40]!r}")


# ---------------------------------------------------------------------- checkpoints
def ckpt_begin(host: TrialHost, run: TrialRun, msg: dict[str, Any], uid: int) -> None:
    """The trial is about to make a checkpoint's directory: recorded first, so that if it
    dies before the checkpoint is complete the directory is found and removed. The path is
    the daemon's own (the experiment's storage and the uuid), never one the trial names."""
    uuid_ = str(msg.get("uuid", ""))
    try:
        well_formed = str(uuidlib.UUID(uuid_)) == uuid_
    except ValueError:
        well_formed = False
    if not well_formed:
        raise DetLocalError(f"ckpt_begin: {uuid_[:64]!r} is not a checkpoint uuid")
    host.store.add_incomplete_checkpoint(
        uuid_,
        experiment_id=run.experiment_id,
        trial_id=run.trial_id,
        path=str(host.experiment_of(run).checkpoint_dir / uuid_),
    )


def own_checkpoint(host: TrialHost, run: TrialRun, uuid_: str, what: str) -> CheckpointRecord:
    """The record of one of this run's trial's checkpoints (Refused for anyone else's)."""
    ckpt = host.store.get_checkpoint(uuid_)
    if ckpt.trial_id != run.trial_id:
        raise Refused(
            f"checkpoint {uuid_} belongs to trial {ckpt.trial_id} of experiment "
            f"{ckpt.experiment_id}, not to trial {run.trial_id}; a trial may {what} only "
            "its own checkpoints"
        )
    return ckpt


def checkpoint(host: TrialHost, run: TrialRun, msg: dict[str, Any], uid: int) -> None:
    exp = host.experiment_of(run)
    uuid_ = checked_uuid(msg.get("uuid"))
    try:
        own_checkpoint(host, run, uuid_, "record")
        return  # a resend after a reconnect: already recorded
    except NotFoundError:
        pass
    path = checked_path(msg.get("path"), uuid_, exp.checkpoint_dir, uid)
    host.store.add_checkpoint(
        CheckpointRecord(
            uuid=uuid_,
            experiment_id=run.experiment_id,
            trial_id=run.trial_id,
            steps_completed=int(msg.get("steps_completed", 0)),
            state="COMPLETED",
            path=path,
            metadata=dict(msg.get("metadata") or {}),
            resources=dict(msg.get("resources") or {}),
            created_at=time.time(),
        )
    )


def ckpt_delete(host: TrialHost, run: TrialRun, msg: dict[str, Any], uid: int) -> None:
    uuid_ = checked_uuid(msg.get("uuid"))
    try:
        own_checkpoint(host, run, uuid_, "delete")
    except NotFoundError:
        return  # never recorded (or a resend): nothing to mark
    host.store.mark_checkpoint_deleted(uuid_)


def ckpt_get(
    host: TrialHost, run: TrialRun, msg: dict[str, Any], uid: int
) -> dict[str, Any] | None:
    """The record of one of the trial's own checkpoints, or of the checkpoint it was
    warm-started from; None when det-local has no such checkpoint."""
    uuid_ = checked_uuid(msg.get("uuid"))
    try:
        ckpt = host.store.get_checkpoint(uuid_)
    except NotFoundError:
        return None
    if (
        ckpt.trial_id != run.trial_id
        and host.store.get_trial(run.trial_id).warm_start_checkpoint != uuid_
    ):
        own_checkpoint(host, run, uuid_, "read")  # refuses, naming the owner
    return ckpt.to_json()


MESSAGES: dict[str, Handler] = {
    "metrics": metrics,
    "progress": progress,
    "status": nothing,
    "ckpt_begin": ckpt_begin,
    "checkpoint": checkpoint,
    "ckpt_delete": ckpt_delete,
    "ckpt_get": ckpt_get,
    "early_exit": early_exit,
    "best_val": best_val,
    "last_val": last_val,
    "op_next": op_next,
    "op_done": op_done,
    "out_of_ops": nothing,
    "preempt_ack": preempt_ack,
    "bye": nothing,
    "unmanaged_end": unmanaged_end,
    "time_limit": time_limit,
}


# ---------------------------------------------------------------------- authority checks
def check_names_own_run(run: TrialRun, msg: dict[str, Any]) -> None:
    """No field of a session's message may name another trial, run or experiment."""
    for key, own in (
        ("trial_id", run.trial_id),
        ("run_id", run.run_id),
        ("experiment_id", run.experiment_id),
    ):
        if key in msg and msg[key] != own:
            raise Refused(
                f"{key} {str(msg[key])[:20]} is not this session's ({own}); a session speaks "
                f"only for its own run (trial {run.trial_id} run {run.run_id})"
            )


def checked_uuid(value: Any) -> str:
    try:
        if isinstance(value, str) and str(uuidlib.UUID(value)) == value:
            return value
    except ValueError:
        pass
    raise Refused(
        f"checkpoint uuid {str(value)[:60]!r} is not a UUID (like "
        "'0f8c1d9e-5b7a-4c1e-9d2f-3a6b8c0e1f24')"
    )


def checked_path(value: Any, uuid_: str, storage: Any, uid: int) -> str:
    """The recorded path of a new checkpoint: its experiment's storage directory / its uuid,
    a real directory (no link) owned by the trial's user (checked under a root daemon)."""
    expected = Path(storage) / uuid_
    where = f"checkpoint {uuid_}: path {str(value)[:200]!r}"
    if not isinstance(value, str) or not value:
        raise Refused(f"{where} is not a path; it must be {expected}")
    path = Path(value)
    if not path.is_absolute():
        raise Refused(f"{where} must be the absolute path {expected}")
    if os.path.normpath(path) != os.path.normpath(expected):
        if ".." in path.parts:
            raise Refused(f"{where} leaves its directory with '..'; it must be {expected}")
        raise Refused(
            f"{where} is not its experiment's checkpoint directory {expected}; a trial records "
            "checkpoints only in its own experiment's checkpoint storage"
        )
    try:
        st = os.lstat(path)
    except OSError as err:
        raise Refused(f"{where}: {err.strerror}; it must be the directory {expected}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise Refused(f"{where} is not a directory (a link?); it must be {expected}")
    if os.path.realpath(path) != os.path.join(os.path.realpath(storage), uuid_):
        raise Refused(
            f"{where} is not its experiment's checkpoint directory {expected}; a trial records "
            "checkpoints only in its own experiment's checkpoint storage"
        )
    if os.geteuid() == 0 and st.st_uid != uid:
        raise Refused(
            f"{where} belongs to {user_name(st.st_uid)}, not to the trial's user "
            f"{user_name(uid)}; a trial records only directories it made"
        )
    return str(expected)

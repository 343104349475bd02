# mypy: disable-error-code="misc"
# (the mixin methods annotate `self: Engine`; mypy checks them against the whole engine)
"""The trial side of the engine's unix socket: hello, metric reports, checkpoints, searcher
operations, preemption acknowledgements.

The socket is an authority, not a pipe. A root daemon opens it to every user (mode 0666), so:

* **a session is bound to its allocation**: hello names a live trial, and both its token and the
  connecting process's uid (SO_PEERCRED) must be that run's (the job's user for a root daemon,
  the daemon's own uid otherwise); a token alone, leaked or stolen, is useless from another uid;
* **a session acts on its own run only**: it records checkpoints of its own trial, whose
  directory is ``<its experiment's storage>/<uuid>`` (a real directory owned by the trial's user,
  with a well-formed uuid no other trial recorded); it reads (``ckpt_get``) the records of its
  own trial's checkpoints and of the checkpoint its trial was warm-started from; it deletes only
  its own trial's checkpoints; no field of a message may name another trial or run; a run that
  ended has no session any more. Anything else is refused: a one-line error in the reply and one
  line in the daemon's log (rate-limited per uid), and nobody else's records change;
* **memory stays bounded whatever a client sends**: before hello a frame is at most
  ``rpc.HELLO_MAX_FRAME`` bytes and hello must arrive within ``rpc.HELLO_TIMEOUT`` seconds; a
  uid has at most ``PENDING_PER_UID`` connections waiting for hello and ``SESSIONS_PER_UID``
  sessions; a session frame is at most ``rpc.SESSION_MAX_FRAME`` bytes, and a uid reads at most
  ``LARGE_READS_PER_UID`` frames over ``LARGE_FRAME`` bytes at a time (the others wait, unread, in
  their sockets); frames are decoded one at a time on the event loop; replies wait for the client
  to read (drain) and a client whose unread replies pile up past ``WRITE_MAX`` is dropped.
"""

from __future__ import annotations

import asyncio
import math
import os
import secrets
import stat
import time
import uuid as uuidlib
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from det_local.errors import DetLocalError, MetricError, NotFoundError
from det_local.sched import unmanaged
from det_local.store.records import CheckpointRecord

if TYPE_CHECKING:
    from det_local.sched.engine import Engine, ExperimentRun, TrialRun

PENDING_PER_UID = 16  # connections of one uid that have not said hello yet
SESSIONS_PER_UID = 512  # authenticated connections of one uid (16-rank trials, many of them)
LARGE_FRAME = 256 * 1024  # frames over this many bytes ...
LARGE_READS_PER_UID = 2  # ... are read this many at a time per uid
WRITE_HIGH_WATER = 256 * 1024  # unread reply bytes after which a session waits for its client
WRITE_MAX = 8 * 1024 * 1024  # unread reply bytes after which a client is dropped
NOTES_PER_MINUTE = 20  # refusals logged per uid, kind and minute (the rest are counted)


# what a session may send (rpc.py); anything else is named "request" in the log
KINDS = frozenset(
    [
        "metrics",
        "progress",
        "status",
        "checkpoint",
        "ckpt_delete",
        "ckpt_get",
        "early_exit",
        "best_val",
        "last_val",
        "op_next",
        "op_done",
        "out_of_ops",
        "preempt_ack",
        "bye",
    ]
)


def _kind(msg: dict[str, Any]) -> str:
    kind = msg.get("t")
    return kind if isinstance(kind, str) and kind in KINDS else "request"


class Refused(DetLocalError):
    """A session asked for something that is not its own: refused and logged."""


@dataclass
class SocketState:
    """The socket's bookkeeping: connections per uid, large reads, the refusal log's budget."""

    pending: Counter[int] = field(default_factory=Counter)
    sessions: Counter[int] = field(default_factory=Counter)
    large_reads: dict[int, asyncio.Semaphore] = field(default_factory=dict)
    # (uid, what) -> (minute's start, lines logged, lines left out)
    notes: dict[tuple[int, str], tuple[float, int, int]] = field(default_factory=dict)
    warned: set[tuple[int, str]] = field(default_factory=set)  # (trial, metric) non-finite

    def large(self, uid: int) -> asyncio.Semaphore:
        sem = self.large_reads.get(uid)
        if sem is None:
            sem = self.large_reads[uid] = asyncio.Semaphore(LARGE_READS_PER_UID)
        return sem


class FrameTooLarge(Exception):
    def __init__(self, size: int, limit: int) -> None:
        super().__init__(size, limit)
        self.size = size
        self.limit = limit


async def _read_frame(
    reader: asyncio.StreamReader, limit: int, large: asyncio.Semaphore | None
) -> dict[str, Any]:
    from det_local import rpc

    (size,) = rpc.HEADER.unpack(await reader.readexactly(rpc.HEADER.size))
    if size > limit:
        raise FrameTooLarge(size, limit)
    if large is not None and size > LARGE_FRAME:
        async with large:
            body = await reader.readexactly(size)
    else:
        body = await reader.readexactly(size)
    return rpc.unpack(body)


class TrialSocketMixin:
    async def _on_connection(
        self: Engine, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        from det_local import rpc

        st = self.socket_state
        uid = _peer_uid(writer.get_extra_info("socket"))
        run: TrialRun | None = None
        if uid is None:
            writer.close()
            return
        if st.pending[uid] >= PENDING_PER_UID:
            self._refuse(
                uid,
                None,
                "connection",
                f"{PENDING_PER_UID} connections of this user are already waiting to say hello",
            )
            _write(writer, {"t": "hello", "error": "the daemon is busy; retry", "retry": True})
            writer.close()
            return
        st.pending[uid] += 1
        session = False
        try:
            try:
                msg = await asyncio.wait_for(
                    _read_frame(reader, rpc.HELLO_MAX_FRAME, None), rpc.HELLO_TIMEOUT
                )
            except asyncio.TimeoutError:
                self._refuse(
                    uid, None, "connection", f"no hello within {rpc.HELLO_TIMEOUT:g}s; closed"
                )
                return
            except FrameTooLarge as err:
                why = f"a frame of {err.size} bytes before hello (the limit is {err.limit}); closed"
                self._refuse(uid, None, "connection", why)
                _write(writer, {"t": "hello", "error": why})
                return
            finally:
                st.pending[uid] -= 1
                if st.pending[uid] <= 0:
                    del st.pending[uid]
            if msg.get("t") != "hello":
                why = f"the first frame must be hello, not {str(msg.get('t'))[:40]!r}; closed"
                self._refuse(uid, None, "connection", why)
                _write(writer, {"t": "hello", "error": why})
                return
            run = self._hello(msg, writer, uid)
            if run is None:
                return
            session = True
            st.sessions[uid] += 1
            large = st.large(uid)
            while True:
                msg = await _read_frame(reader, rpc.SESSION_MAX_FRAME, large)
                if (
                    self.runs.get(run.trial_id) is not run
                    and self.unmanaged.get(run.trial_id) is not run
                ):
                    why = f"run {run.run_id} of trial {run.trial_id} has ended; closed"
                    self._refuse(uid, run, _kind(msg), why)
                    if "id" in msg:
                        _write(writer, {"t": "reply", "id": msg["id"], "error": why})
                    return
                self._handle(run, msg, writer, uid)
                if writer.transport.get_write_buffer_size() > WRITE_HIGH_WATER:
                    await writer.drain()  # not read further until the client reads its replies
        except FrameTooLarge as err:
            if run is not None:
                self._refuse(
                    uid,
                    run,
                    "frame",
                    f"a frame of {err.size} bytes (the limit is {err.limit}); closed",
                )
        except rpc.FrameError as err:
            self._refuse(uid, run, "frame", f"{err}; closed")
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            if session:
                st.sessions[uid] -= 1
                if st.sessions[uid] <= 0:
                    del st.sessions[uid]
            if run is not None and writer in run.writers:
                run.writers.remove(writer)
                if run.trial_id in self.unmanaged:
                    unmanaged.disconnected(self, run)
            writer.close()

    def _hello(
        self: Engine, msg: dict[str, Any], writer: asyncio.StreamWriter, uid: int
    ) -> TrialRun | None:
        """The run this connection speaks for, or None (refused: answered and logged)."""
        if msg.get("unmanaged"):  # a core_v2 process det-local did not start
            return unmanaged.hello(self, msg, writer)
        trial_id = msg.get("trial_id")
        run = self.runs.get(trial_id) if type(trial_id) is int else None
        token = msg.get("token")
        if (
            run is None
            or not isinstance(token, str)
            or not secrets.compare_digest(token.encode(), run.token.encode())
        ):
            unknown = "unknown trial or wrong token"
            self._refuse(uid, None, "hello", f"{unknown} (trial {str(trial_id)[:20]})")
            _write(writer, {"t": "hello", "error": unknown})
            return None
        why: str | None = None
        owner = self._run_uid(run)
        run_id = msg.get("run_id", run.run_id)
        if uid != owner:
            why = (
                f"trial {run.trial_id} runs as {_user_name(owner)}; this connection is from "
                f"{_user_name(uid)} (uid {uid}): a trial's token is valid only in its own "
                "processes"
            )
        elif run_id != run.run_id:
            why = (
                f"run {str(run_id)[:20]} of trial {run.trial_id} is not running (run "
                f"{run.run_id} is)"
            )
        elif self.socket_state.sessions[uid] >= SESSIONS_PER_UID:
            why = f"this user already has {SESSIONS_PER_UID} trial sessions open"
        if why is not None:
            self._refuse(uid, run, "hello", why)
            _write(writer, {"t": "hello", "error": why})
            return None
        run.writers.append(writer)
        _write(writer, {"t": "hello", "preempt": run.preempt_sent})
        return run

    def _run_uid(self: Engine, run: TrialRun) -> int:
        """The uid a run's processes have: its job's user under a root daemon, else ours."""
        if os.geteuid() != 0:
            return os.geteuid()
        if self.unmanaged.get(run.trial_id) is run:  # a core_v2 process: no job
            return int(self.user_ids[run.experiment_id])
        return int(self.store.jobs.peek(run.job_id).uid)

    def _refuse(self: Engine, uid: int, run: TrialRun | None, what: str, why: str) -> None:
        """One line in the daemon's log for a refused request (at most NOTES_PER_MINUTE per
        uid, kind of request and minute; the next line logged says how many were left out)."""
        st = self.socket_state
        now = time.monotonic()
        key = (uid, what)
        start, logged, dropped = st.notes.get(key, (now, 0, 0))
        if now - start >= 60.0:
            start, logged = now, 0
        if logged >= NOTES_PER_MINUTE:
            st.notes[key] = (start, logged, dropped + 1)
            return
        st.notes[key] = (start, logged + 1, 0)
        who = f"{_user_name(uid)} (uid {uid})"
        if run is not None:
            who += f", trial {run.trial_id} run {run.run_id}"
        more = f" [{dropped} more such refusals of this user were not logged]" if dropped else ""
        self.note(
            f"trial socket: refused {what} from {who}: {why}{more}",
            experiment_id=None if run is None else run.experiment_id,
            trial_id=None if run is None else run.trial_id,
            level="WARNING",
        )

    def _handle(
        self: Engine,
        run: TrialRun,
        msg: dict[str, Any],
        writer: asyncio.StreamWriter,
        uid: int,
    ) -> None:
        kind = msg.get("t")
        exp = self.experiments[run.experiment_id]
        value: Any = None
        error: str | None = None
        try:
            _check_names_own_run(run, msg)
            if kind == "metrics":
                self._on_metrics(run, exp, msg["reports"])
            elif kind == "progress":
                self._on_progress(run, exp, float(msg["progress"]))
            elif kind == "status":
                pass
            elif kind == "ckpt_begin":
                self._on_checkpoint_begin(run, exp, msg)
            elif kind == "checkpoint":
                self._on_checkpoint(run, exp, msg, uid)
            elif kind == "ckpt_delete":
                self._on_ckpt_delete(run, msg)
            elif kind == "ckpt_get":
                value = self._on_ckpt_get(run, msg)
            elif kind == "early_exit":
                run.invalid_hp = msg.get("reason") == "INVALID_HP"
            elif kind == "best_val":
                value = (
                    None
                    if exp.best is None
                    else (exp.best if exp.config.searcher.smaller_is_better else -exp.best)
                )
            elif kind == "last_val":
                last = self.store.latest_metrics(run.trial_id, "validation")
                value = None if last is None else last.steps_completed
            elif kind == "op_next":
                q = exp.ops.get(run.request_id)
                value = q[0] if q else None
            elif kind == "op_done":
                self._on_op_done(run, exp, int(msg["length"]), msg.get("metric"))
            elif kind == "out_of_ops":
                pass
            elif kind == "preempt_ack":
                if not run.acked:
                    self.store.jobs.set_preempt_acked(run.job_id)  # outlives a daemon crash
                run.acked = True
            elif kind == "bye":
                pass
            elif kind == unmanaged.END and self.unmanaged.get(run.trial_id) is run:
                unmanaged.on_end(self, run, msg)
            else:
                error = f"unknown request {str(kind)[:40]!r}"
        except Refused as err:
            error = str(err)
            self._refuse(uid, run, _kind(msg), error)
        except DetLocalError as err:
            error = str(err)
        except (KeyError, TypeError, ValueError, IndexError, AttributeError) as err:
            error = f"malformed {str(kind)[:40]!r} message ({type(err).__name__}: {err})"[:300]
            self._refuse(uid, run, _kind(msg), error)
        if "id" in msg:
            reply: dict[str, Any] = {"t": "reply", "id": msg["id"]}
            if error is not None:
                reply["error"] = error
            else:
                reply["value"] = value
            _write(writer, reply)

    # ================================================================== reports
    def _better(self: Engine, exp: ExperimentRun, value: float, best: float | None) -> float | None:
        """Best is kept as a smaller-is-better number (negated when larger is better); NaN and
        the infinities are never the best (they rank worst, in either direction)."""
        if not math.isfinite(value):
            return best
        return value if best is None or value < best else best

    def _on_metrics(
        self: Engine, run: TrialRun, exp: ExperimentRun, reports: list[list[Any]]
    ) -> None:
        if not isinstance(reports, list):
            raise TypeError("reports must be a list")
        self.store.add_metrics(run.trial_id, run.run_id, reports)
        metric = exp.config.searcher.metric
        sign = 1.0 if exp.config.searcher.smaller_is_better else -1.0
        if reports:
            self.store.set_trial_steps(run.trial_id, max(int(r[1]) for r in reports))
        for group, steps, metrics, _t, _b in reports:
            if group != "validation":
                continue
            value = metrics.get(metric)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                if math.isfinite(value):
                    v = sign * float(value)
                    trial = self.store.get_trial(run.trial_id)
                    tb = None if trial.best_validation is None else sign * trial.best_validation
                    if tb is None or v < tb:
                        self.store.set_best_validation(run.trial_id, float(value))
                    exp.best = self._better(exp, v, exp.best)
                elif (run.trial_id, metric) not in self.socket_state.warned:
                    self.socket_state.warned.add((run.trial_id, metric))
                    self.note(
                        f"trial {run.trial_id}: validation metric '{metric}' is {value} at "
                        f"steps_completed={steps}; recorded as reported, it ranks worst (never "
                        "the best) for the searcher and checkpoint GC; check the learning rate "
                        "or the data",
                        experiment_id=exp.id,
                        trial_id=run.trial_id,
                        level="WARNING",
                    )
            try:
                actions = exp.searcher.on_validation(run.request_id, metrics)
            except MetricError as err:  # e.g. ASHA's metric or time_metric missing
                self._searcher_failed(exp, run.trial_id, str(err))
                return
            self._apply(exp, actions)

    def _searcher_failed(self: Engine, exp: ExperimentRun, trial_id: int, why: str) -> None:
        """The searcher cannot go on (a report it needs is missing): the experiment ends in
        ERROR; running trials checkpoint and stop; what they reported stays recorded."""
        from det_local.store.states import State

        message = f"trial {trial_id}: {why}"
        self.note(message, experiment_id=exp.id, trial_id=trial_id, level="ERROR")
        if self.store.get_experiment(exp.id).state == State.ACTIVE:
            self.store.set_experiment_state(exp.id, State.STOPPING_ERROR, message)
        exp.stopping = "error"
        for t in self.store.list_trials(exp.id):
            if t.id not in self.runs:
                self._dequeue_trial(t.id, "experiment failed")
        for r in [r for r in self.runs.values() if r.experiment_id == exp.id]:
            self._preempt(r, exp)
        self._maybe_finish(exp)

    def _on_progress(self: Engine, run: TrialRun, exp: ExperimentRun, progress: float) -> None:
        exp.progress[run.trial_id] = progress
        exp.searcher.set_trial_progress(run.request_id, progress)
        self.store.set_experiment_progress(exp.id, exp.searcher.progress())

    # ================================================================== checkpoints
    def _on_checkpoint_begin(
        self: Engine, run: TrialRun, exp: ExperimentRun, msg: dict[str, Any]
    ) -> None:
        """The trial is about to make a checkpoint's directory: recorded first, so that if it
        dies before the checkpoint is complete the directory is found and removed. The path is
        the daemon's own (the experiment's storage and the uuid), never one the trial names."""
        import uuid as uuidlib

        uuid_ = str(msg.get("uuid", ""))
        try:
            well_formed = str(uuidlib.UUID(uuid_)) == uuid_
        except ValueError:
            well_formed = False
        if not well_formed:
            raise DetLocalError(f"ckpt_begin: {uuid_[:64]!r} is not a checkpoint uuid")
        self.store.add_incomplete_checkpoint(
            uuid_,
            experiment_id=run.experiment_id,
            trial_id=run.trial_id,
            path=str(exp.checkpoint_dir / uuid_),
        )

    def _own_checkpoint(self: Engine, run: TrialRun, uuid_: str, what: str) -> CheckpointRecord:
        """The record of one of this run's trial's checkpoints (Refused for anyone else's)."""
        ckpt = self.store.get_checkpoint(uuid_)
        if ckpt.trial_id != run.trial_id:
            raise Refused(
                f"checkpoint {uuid_} belongs to trial {ckpt.trial_id} of experiment "
                f"{ckpt.experiment_id}, not to trial {run.trial_id}; a trial may {what} only "
                "its own checkpoints"
            )
        return ckpt

    def _on_checkpoint(
        self: Engine, run: TrialRun, exp: ExperimentRun, msg: dict[str, Any], uid: int
    ) -> None:
        uuid_ = _checked_uuid(msg.get("uuid"))
        try:
            self._own_checkpoint(run, uuid_, "record")
            return  # a resend after a reconnect: already recorded
        except NotFoundError:
            pass
        path = _checked_path(msg.get("path"), uuid_, exp.checkpoint_dir, uid)
        self.store.add_checkpoint(
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

    def _on_ckpt_delete(self: Engine, run: TrialRun, msg: dict[str, Any]) -> None:
        uuid_ = _checked_uuid(msg.get("uuid"))
        try:
            self._own_checkpoint(run, uuid_, "delete")
        except NotFoundError:
            return  # never recorded (or a resend): nothing to mark
        self.store.mark_checkpoint_deleted(uuid_)

    def _on_ckpt_get(self: Engine, run: TrialRun, msg: dict[str, Any]) -> dict[str, Any] | None:
        """The record of one of the trial's own checkpoints, or of the checkpoint it was
        warm-started from; None when det-local has no such checkpoint."""
        uuid_ = _checked_uuid(msg.get("uuid"))
        try:
            ckpt = self.store.get_checkpoint(uuid_)
        except NotFoundError:
            return None
        if (
            ckpt.trial_id != run.trial_id
            and self.store.get_trial(run.trial_id).warm_start_checkpoint != uuid_
        ):
            self._own_checkpoint(run, uuid_, "read")  # refuses, naming the owner
        return ckpt.to_json()

    def _on_op_done(
        self: Engine, run: TrialRun, exp: ExperimentRun, length: int, metric: Any
    ) -> None:
        q = exp.ops.get(run.request_id)
        if not q or q[0] != length:
            raise DetLocalError(
                f"trial {run.trial_id}: report_completed for length {length}, but the current "
                f"operation is {q[0] if q else 'none'}"
            )
        q.popleft()
        if not isinstance(metric, (int, float)) or isinstance(metric, bool):
            raise DetLocalError(
                f"trial {run.trial_id}: op.report_completed() needs a number for searcher metric "
                f"'{exp.config.searcher.metric}', found {metric!r}"
            )
        self._apply(exp, exp.searcher.on_op_completed(run.request_id, length, float(metric)))


def _check_names_own_run(run: TrialRun, msg: dict[str, Any]) -> None:
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


def _checked_uuid(value: Any) -> str:
    try:
        if isinstance(value, str) and str(uuidlib.UUID(value)) == value:
            return value
    except ValueError:
        pass
    raise Refused(
        f"checkpoint uuid {str(value)[:60]!r} is not a UUID (like "
        "'0f8c1d9e-5b7a-4c1e-9d2f-3a6b8c0e1f24')"
    )


def _checked_path(value: Any, uuid_: str, storage: Any, uid: int) -> str:
    """The recorded path of a new checkpoint: its experiment's storage directory / its uuid,
    a real directory (no link) owned by the trial's user (checked under a root daemon)."""
    from pathlib import Path

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
            f"{where} belongs to {_user_name(st.st_uid)}, not to the trial's user "
            f"{_user_name(uid)}; a trial records only directories it made"
        )
    return str(expected)


def _write(writer: asyncio.StreamWriter, msg: dict[str, Any]) -> None:
    """Queue a frame for a client; a client that leaves WRITE_MAX bytes unread is dropped."""
    from det_local import rpc

    try:
        transport = writer.transport
        if transport.is_closing():
            return
        if transport.get_write_buffer_size() > WRITE_MAX:
            transport.abort()  # it does not read its replies: memory is not its to hold
            return
        writer.write(rpc.pack(msg))
    except (ConnectionError, RuntimeError):
        pass


def _user_name(uid: int) -> str:
    import pwd

    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


def _peer_uid(sock: Any) -> int | None:
    import socket as _socket
    import struct

    if sock is None:
        return None
    try:
        creds = sock.getsockopt(_socket.SOL_SOCKET, _socket.SO_PEERCRED, struct.calcsize("3i"))
        _pid, uid, _gid = struct.unpack("3i", creds)
        return int(uid)
    except OSError:
        return None

# mypy: disable-error-code="misc"
# (the mixin methods annotate `self: Engine`; mypy checks them against the whole engine)
"""The trial side of the engine's unix socket: hello (token check), metric reports,
checkpoints, searcher operations, preemption acknowledgements."""

from __future__ import annotations

import asyncio
import math
import secrets
import time
from typing import TYPE_CHECKING, Any

from det_local.errors import DetLocalError, MetricError, NotFoundError
from det_local.store.records import CheckpointRecord

if TYPE_CHECKING:
    from det_local.sched.engine import Engine, ExperimentRun, TrialRun


class TrialSocketMixin:
    async def _on_connection(
        self: Engine, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        from det_local import rpc

        run: TrialRun | None = None
        try:
            while True:
                head = await reader.readexactly(rpc.HEADER.size)
                (size,) = rpc.HEADER.unpack(head)
                if size > rpc.MAX_FRAME:
                    break
                msg = rpc.unpack(await reader.readexactly(size))
                kind = msg.get("t")
                if run is None:
                    if kind == "hello":
                        run = self._hello(msg, writer)
                        if run is None:
                            break
                        continue
                    break
                self._handle(run, msg, writer)
        except (asyncio.IncompleteReadError, ConnectionError, rpc.FrameError):
            pass
        finally:
            if run is not None and writer in run.writers:
                run.writers.remove(writer)
            writer.close()

    def _hello(self: Engine, msg: dict[str, Any], writer: asyncio.StreamWriter) -> TrialRun | None:
        run = self.runs.get(int(msg.get("trial_id", -1)))
        if run is None or not secrets.compare_digest(str(msg.get("token", "")), run.token):
            _write(writer, {"t": "hello", "error": "unknown trial or wrong token"})
            return None
        run.writers.append(writer)
        _write(writer, {"t": "hello", "preempt": run.preempt_sent})
        return run

    def _handle(
        self: Engine, run: TrialRun, msg: dict[str, Any], writer: asyncio.StreamWriter
    ) -> None:
        kind = msg.get("t")
        exp = self.experiments[run.experiment_id]
        value: Any = None
        error: str | None = None
        try:
            if kind == "metrics":
                self._on_metrics(run, exp, msg["reports"])
                return
            if kind == "progress":
                self._on_progress(run, exp, float(msg["progress"]))
                return
            if kind == "status":
                return
            if kind == "ckpt_begin":
                self._on_checkpoint_begin(run, exp, msg)
            elif kind == "checkpoint":
                self._on_checkpoint(run, msg)
            elif kind == "ckpt_delete":
                self.store.mark_checkpoint_deleted(str(msg["uuid"]))
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
            else:
                error = f"unknown request {kind!r}"
        except DetLocalError as err:
            error = str(err)
        if "id" in msg:
            reply: dict[str, Any] = {"t": "reply", "id": msg["id"]}
            if error is not None:
                reply["error"] = error
            else:
                reply["value"] = value
            _write(writer, reply)

    # ================================================================== reports
    def _better(self: Engine, exp: ExperimentRun, value: float, best: float | None) -> float:
        """Best is kept as a smaller-is-better number (negated when larger is better)."""
        return value if best is None or value < best else best

    def _on_metrics(
        self: Engine, run: TrialRun, exp: ExperimentRun, reports: list[list[Any]]
    ) -> None:
        self.store.add_metrics(run.trial_id, run.run_id, reports)
        metric = exp.config.searcher.metric
        sign = 1.0 if exp.config.searcher.smaller_is_better else -1.0
        if reports:
            self.store.set_trial_steps(run.trial_id, max(int(r[1]) for r in reports))
        for group, _steps, metrics, _t, _b in reports:
            if group != "validation":
                continue
            value = metrics.get(metric)
            if (
                isinstance(value, (int, float))
                and not isinstance(value, bool)
                and not math.isnan(value)
            ):
                v = sign * float(value)
                trial = self.store.get_trial(run.trial_id)
                tb = None if trial.best_validation is None else sign * trial.best_validation
                if tb is None or v < tb:
                    self.store.set_best_validation(run.trial_id, float(value))
                exp.best = self._better(exp, v, exp.best)
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

    def _on_checkpoint(self: Engine, run: TrialRun, msg: dict[str, Any]) -> None:
        uuid_ = str(msg["uuid"])
        try:
            self.store.get_checkpoint(uuid_)
            return  # a resend after a reconnect: already recorded
        except NotFoundError:
            pass
        self.store.add_checkpoint(
            CheckpointRecord(
                uuid=uuid_,
                experiment_id=run.experiment_id,
                trial_id=run.trial_id,
                steps_completed=int(msg.get("steps_completed", 0)),
                state="COMPLETED",
                path=str(msg["path"]),
                metadata=dict(msg.get("metadata") or {}),
                resources=dict(msg.get("resources") or {}),
                created_at=time.time(),
            )
        )

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


def _write(writer: asyncio.StreamWriter, msg: dict[str, Any]) -> None:
    from det_local import rpc

    try:
        writer.write(rpc.pack(msg))
    except (ConnectionError, RuntimeError):
        pass


def _peer_uid(sock: Any) -> int | None:
    import socket as _socket
    import struct

    try:
        creds = sock.getsockopt(_socket.SOL_SOCKET, _socket.SO_PEERCRED, struct.calcsize("3i"))
        _pid, uid, _gid = struct.unpack("3i", creds)
        return int(uid)
    except OSError:
        return None

"""How pytorch.Trainer's loop saves and loads its trial's checkpoints (the files themselves are
_checkpoint's): the chief writes, on the training thread or, with async checkpointing, from a
host snapshot on a background thread (one write in flight at a time); every rank learns the
uuid. checkpoint_timings records what each checkpoint cost training."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch

from det_local import __version__
from det_local.trial.pytorch._fit import TrialEnv, TrialState
from det_local.trial.pytorch.checkpoints import _checkpoint

logger = logging.getLogger("determined.pytorch")


def checkpoint_metadata(steps_completed: int) -> dict[str, Any]:
    """metadata.json's fields the loop gives core's store_path."""
    return {
        "determined_version": __version__,
        "steps_completed": steps_completed,
        "framework": f"torch-{torch.__version__}",
        "format": "pickle",
    }


def storage_exclude(core: Any) -> list[Any]:
    """What code/ leaves out: the checkpoint storage, when it lies in the working directory."""
    storage = getattr(core.checkpoint, "_storage", None)
    return [storage] if storage is not None else []


class PyTorchCheckpointer:
    """A PyTorchTrial's checkpoints (the Checkpointer the loop uses)."""

    def __init__(self, env: TrialEnv, timings: list[dict[str, Any]]) -> None:
        self.env = env
        self.timings = timings
        self.async_writes = bool(env.context.experimental._async_checkpointing)
        self.pending: _checkpoint.AsyncWrite | None = None

    def save(self, state: TrialState, extra: dict[str, Any]) -> str:
        env = self.env
        uuid = ""
        if env.is_chief:
            metadata = checkpoint_metadata(state.batches_trained)
            exclude = storage_exclude(env.core)
            if self.async_writes:
                uuid = self._save_async(state, extra, metadata, exclude)
            else:
                started = time.perf_counter()
                store = env.core.checkpoint.store_path(metadata, _unsynced=_checkpoint.UNSYNCED)
                with store as (path, storage_id):
                    _checkpoint.save(
                        path,
                        context=env.context,
                        trial=env.trial,
                        callbacks=env.callbacks,
                        trial_state=state.as_dict(),
                        exclude=exclude,
                        extra=extra,
                    )
                    uuid = storage_id
                self.timings.append(
                    {
                        "uuid": uuid,
                        "steps_completed": state.batches_trained,
                        "async": False,
                        "block_ms": (time.perf_counter() - started) * 1000,
                    }
                )
        uuid = env.dist.broadcast(uuid)
        if not (self.async_writes and env.is_chief):  # an async one's run once it is written
            for cb in env.callbacks.values():
                cb.on_checkpoint_upload_end(uuid=uuid)
        return str(uuid)

    def _save_async(
        self,
        state: TrialState,
        extra: dict[str, Any],
        metadata: dict[str, Any],
        exclude: list[Any],
    ) -> str:
        """Snapshot the state to host memory here; write and report it on a background thread.
        Waits first for the previous write (one in flight at a time)."""
        env = self.env
        started = time.perf_counter()
        self.collect(wait=True)
        copy_started = time.perf_counter()
        checkpoint = _checkpoint.host_copy(_checkpoint.capture(env.context, env.callbacks, extra))
        d2h_ms = (time.perf_counter() - copy_started) * 1000
        trial_state = state.as_dict()
        load_data = _checkpoint.host_copy(_checkpoint.load_data_of(env.context, env.trial))
        code_root = Path.cwd()
        store = env.core.checkpoint.store_path(metadata, _unsynced=_checkpoint.UNSYNCED)
        path, uuid = store.__enter__()

        def job() -> None:
            try:
                _checkpoint.write(
                    path,
                    checkpoint,
                    trial_state=trial_state,
                    load_data=load_data,
                    code_root=code_root,
                    exclude=exclude,
                    fsync=True,
                )
            except BaseException as err:
                store.__exit__(type(err), err, err.__traceback__)  # removes the directory
                raise
            store.__exit__(None, None, None)  # metadata.json, then reported to det-local

        self.pending = _checkpoint.AsyncWrite(
            job, uuid=uuid, steps=state.batches_trained, path=path
        )
        self.timings.append(
            {
                "uuid": uuid,
                "steps_completed": state.batches_trained,
                "async": True,
                "block_ms": (time.perf_counter() - started) * 1000,
                "d2h_ms": d2h_ms,
                "write_ms": None,
            }
        )
        return str(uuid)

    def collect(self, wait: bool) -> None:
        """Finish the background write (waiting for it if `wait`): raise if it failed, else run
        the callbacks' end-of-checkpoint hooks."""
        pending = self.pending
        if pending is None or not (wait or pending.done()):
            return
        self.pending = None
        pending.wait()
        for entry in reversed(self.timings):
            if entry["uuid"] == pending.uuid:
                entry["write_ms"] = pending.write_ms
                logger.info(
                    f"checkpoint {pending.uuid} (batch {pending.steps}) written in the background "
                    f"in {pending.write_ms or 0:.0f} ms; training was blocked "
                    f"{entry['block_ms']:.1f} ms"
                )
                break
        callbacks = self.env.callbacks
        for cb in callbacks.values():
            cb.on_checkpoint_end(str(pending.path))
            cb.on_checkpoint_write_end(str(pending.path))
        for cb in callbacks.values():
            cb.on_checkpoint_upload_end(uuid=pending.uuid)

    def abandon(self) -> None:
        if self.pending is None:
            return
        try:
            self.collect(wait=True)
        except Exception as err:
            logger.error(str(err))

    def load(self, ckpt_dir: Path, uuid: str) -> dict[str, Any]:
        env = self.env
        where = f"checkpoint {uuid}"
        checkpoint = _checkpoint.read_state_dict(ckpt_dir, where)
        load_data = _checkpoint.read_load_data(ckpt_dir) or {}
        _checkpoint.restore(
            checkpoint,
            where=where,
            context=env.context,
            trial=env.trial,
            callbacks=env.callbacks,
            saved_spec=load_data.get("trial_cls_spec"),
        )
        return dict(checkpoint.get("det_local") or {})

"""How deepspeed.Trainer's loop saves and loads a DeepSpeedTrial's checkpoints: every rank
writes its part, trial.save(context, path) (each engine's save_checkpoint(path, tag="model<i>"))
and det_state_dict_rank<r>.pth (RNG and callback state), plus the chief's trial_state.pkl
(with the loader batches drawn), load_data.json and code/; load is the reverse, on every rank.
Always on the training thread."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch

from det_local.trial.pytorch._callback import PyTorchCallback
from det_local.trial.pytorch._fit import TrialEnv, TrialState
from det_local.trial.pytorch._training_data import TrainingData
from det_local.trial.pytorch.checkpoints import _checkpoint
from det_local.trial.pytorch.checkpoints._checkpointer import checkpoint_metadata, storage_exclude

logger = logging.getLogger("determined.pytorch.deepspeed")

LOADER_BATCHES = "det_local_loader_batches"  # trial_state.pkl: loader batches drawn


class DeepSpeedCheckpointer:
    """A DeepSpeedTrial's checkpoints (the Checkpointer the loop uses)."""

    def __init__(self, env: TrialEnv, data: TrainingData, timings: list[dict[str, Any]]) -> None:
        self.env = env
        self.data = data
        self.timings = timings

    def _loader_batches(self) -> int:
        """The most loader batches any rank has drawn (a collective)."""
        it = self.data.train_iter
        drawn = it.drawn if it is not None else None
        counts = [c for c in self.env.dist.allgather(drawn) if c is not None]
        return max(counts) if counts else 0

    def save(self, state: TrialState, extra: dict[str, Any]) -> str:
        env = self.env
        started = time.perf_counter()
        metadata = checkpoint_metadata(state.batches_trained)
        trial_state = state.as_dict()
        trial_state[LOADER_BATCHES] = self._loader_batches()
        store = env.core.checkpoint.store_path(metadata, shard=True, _unsynced=_checkpoint.UNSYNCED)
        with store as (path, uuid):
            self._save(Path(path), trial_state, extra)
        if env.is_chief:
            self.timings.append(
                {
                    "uuid": uuid,
                    "steps_completed": state.batches_trained,
                    "async": False,
                    "block_ms": (time.perf_counter() - started) * 1000,
                }
            )
        uuid = env.dist.broadcast(str(uuid))
        for cb in env.callbacks.values():
            cb.on_checkpoint_upload_end(uuid=uuid)
        return str(uuid)

    def _save(self, path: Path, trial_state: dict[str, Any], extra: dict[str, Any]) -> None:
        """This rank's part of the checkpoint in `path` (the chief's includes the trial's
        files)."""
        env = self.env
        callbacks = env.callbacks
        state: dict[str, Any] = {
            "rng_state": _checkpoint.capture_rng(env.context.device),
            "callbacks": {name: cb.state_dict() for name, cb in callbacks.items()},
        }
        if extra:
            state["det_local"] = extra
        for cb in callbacks.values():
            cb.on_checkpoint_save_start(state)
        _checkpoint.torch_save(state, path / f"det_state_dict_rank{env.dist.rank}.pth")
        env.trial.save(env.context, path)
        if env.is_chief:
            _checkpoint.write_code(path, storage_exclude(env.core))
            _checkpoint.write_trial_files(
                path,
                trial_state=trial_state,
                load_data=_checkpoint.load_data_of(env.context, env.trial, "DeepSpeedTrial"),
            )
        for cb in callbacks.values():
            cb.on_checkpoint_end(str(path))
        if env.is_chief:
            for cb in callbacks.values():
                cb.on_checkpoint_write_end(str(path))

    def load(self, ckpt_dir: Path, uuid: str) -> dict[str, Any]:
        env = self.env
        where = f"checkpoint {uuid}"
        own = Path(ckpt_dir) / f"det_state_dict_rank{env.dist.rank}.pth"
        state: dict[str, Any] = {}
        if own.exists():
            state = _checkpoint.load_dict_file(
                own, where, lambda p: torch.load(p, map_location="cpu", weights_only=False)
            )
        else:
            logger.warning(
                f"{where} has no det_state_dict_rank{env.dist.rank}.pth (written by fewer "
                "ranks?): this rank's RNG and callback state start fresh"
            )
        for cb in env.callbacks.values():
            cb.on_checkpoint_load_start(state)
        env.trial.load(env.context, Path(ckpt_dir))
        if "rng_state" in state:
            _checkpoint.restore_rng(state["rng_state"], env.context.device)
        saved_callbacks = state.get("callbacks") or {}
        for name, cb in env.callbacks.items():
            if name in saved_callbacks:
                cb.load_state_dict(saved_callbacks[name])
            elif state and type(cb).load_state_dict is not PyTorchCallback.load_state_dict:
                logger.warning(
                    f"callback '{name}' implements load_state_dict() but {where} holds no state "
                    "for it: it starts fresh"
                )
        return dict(state.get("det_local") or {})

    def collect(self, wait: bool) -> None:
        """Nothing is written in the background."""

    def abandon(self) -> None:
        """Nothing is written in the background."""

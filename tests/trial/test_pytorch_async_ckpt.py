"""context.experimental.enable_async_checkpointing(): the training thread only snapshots the
state to host memory; a background thread writes it. A checkpoint holds exactly the state at its
step however far training has moved on, resuming from one is bit-exact, a failed write raises on
the training thread, and fit() (and a stop) return only once the last write is done."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from det_local.errors import CheckpointError
from det_local.trial import pytorch
from det_local.trial.pytorch.checkpoints import _checkpoint

WAIT = 30.0  # bound on any wait for the other thread


class Noisy(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(7)
        self.x = torch.randn(30, 4, generator=g)
        self.y = torch.randn(30, 1, generator=g)

    def __len__(self) -> int:
        return 30

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.x[i], self.y[i], i


class Events(pytorch.PyTorchCallback):
    def __init__(self, log: list[str]) -> None:
        self.log = log

    def on_checkpoint_write_end(self, checkpoint_dir: str) -> None:
        self.log.append("write_end")

    def on_checkpoint_upload_end(self, uuid: str) -> None:
        self.log.append("upload_end")

    def on_trial_shutdown(self) -> None:
        self.log.append("shutdown")


class AdamTrial(pytorch.PyTorchTrial):
    """Shuffled data, dropout, Adam and an LR schedule (6 batches an epoch); records every batch
    it sees and its weights and optimizer state after each batch."""

    def __init__(
        self,
        context: pytorch.PyTorchTrialContext,
        async_ckpt: bool = True,
        stop_at: int | None = None,
        log: list[str] | None = None,
    ) -> None:
        self.context = context
        self.stop_at = stop_at
        self.log = log if log is not None else []
        if async_ckpt:
            context.experimental.enable_async_checkpointing()
        model = torch.nn.Sequential(
            torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(16, 1)
        )
        self.model = context.wrap_model(model)
        self.opt = context.wrap_optimizer(torch.optim.Adam(self.model.parameters(), lr=0.01))
        self.sched = context.wrap_lr_scheduler(
            torch.optim.lr_scheduler.StepLR(self.opt, step_size=1, gamma=0.9),
            pytorch.LRScheduler.StepMode.STEP_EVERY_EPOCH,
        )
        self.seen: list[list[int]] = []
        self.weights: dict[int, dict[str, torch.Tensor]] = {}
        self.adam: dict[int, dict[str, torch.Tensor]] = {}
        self.batches_done = 0
        self.progress = threading.Condition()

    def train_batch(self, batch: Any, epoch_idx: int, batch_idx: int) -> Any:
        x, y, idx = batch
        self.seen.append(idx.tolist())
        loss = torch.nn.functional.mse_loss(self.model(x), y)
        self.context.backward(loss)
        self.context.step_optimizer(self.opt)
        done = batch_idx + 1
        self.weights[done] = {k: v.clone() for k, v in self.model.state_dict().items()}
        self.adam[done] = {
            f"{p}.{k}": v.clone()
            for p, s in self.opt.state_dict()["state"].items()
            for k, v in s.items()
        }
        with self.progress:
            self.batches_done = done
            self.progress.notify_all()
        if done == self.stop_at:
            self.context.set_stop_requested(True)
        return loss

    def evaluate_batch(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        x, y, _ = batch
        return {"val_loss": torch.nn.functional.mse_loss(self.model(x), y)}

    def build_training_data_loader(self) -> Any:
        return pytorch.DataLoader(Noisy(), batch_size=5, shuffle=True)

    def build_validation_data_loader(self) -> Any:
        return pytorch.DataLoader(Noisy(), batch_size=10)

    def build_callbacks(self) -> dict[str, pytorch.PyTorchCallback]:
        return {"events": Events(self.log)}


def fit(
    storage: Path, seed: int = 0, trial_kwargs: dict[str, Any] | None = None, **fit_kwargs: Any
) -> tuple[AdamTrial, pytorch.Trainer]:
    torch.manual_seed(seed)  # off-cluster nothing seeds
    with pytorch.init(
        hparams={"global_batch_size": 5},
        checkpoint_storage=str(storage),
        enable_tensorboard_logging=False,
    ) as context:
        trial = AdamTrial(context, **(trial_kwargs or {}))
        trainer = pytorch.Trainer(trial, context)
        trainer.fit(**fit_kwargs)
    return trial, trainer


def checkpoints(storage: Path) -> dict[int, Path]:
    """steps_completed -> directory of every reported checkpoint (metadata.json written)."""
    out = {}
    for d in storage.iterdir() if storage.exists() else []:
        meta = d / "metadata.json"
        if meta.exists():
            out[json.loads(meta.read_text())["steps_completed"]] = d
    return out


def load(ckpt: Path) -> dict[str, Any]:
    return torch.load(ckpt / "state_dict.pth", weights_only=False)


def adam_state(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {
        f"{p}.{k}": v for p, s in state["optimizers_state_dict"][0]["state"].items()
        for k, v in s.items()
    }  # fmt: skip


def assert_tensors_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(torch.as_tensor(a[k]), torch.as_tensor(b[k])), k


# ---------------------------------------------------------------------------- snapshots
def test_async_checkpoints_hold_the_state_at_their_step_while_training_moves_on(
    storage: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each write starts only once training has moved two batches past the checkpoint (or
    training is over), so a checkpoint that shared live tensors would hold later weights."""
    holder: dict[str, AdamTrial] = {}
    trained_at_write: dict[int, int] = {}
    real_write = _checkpoint.write

    def late_write(ckpt_dir: Path, checkpoint: dict[str, Any], **kw: Any) -> None:
        steps = kw["trial_state"]["batches_trained"]
        trial = holder["trial"]
        with trial.progress:
            assert trial.progress.wait_for(
                lambda: trial.batches_done >= min(steps + 2, 12), timeout=WAIT
            )
            trained_at_write[steps] = trial.batches_done
        assert threading.current_thread() is not threading.main_thread()
        real_write(ckpt_dir, checkpoint, **kw)

    monkeypatch.setattr(_checkpoint, "write", late_write)
    real_init = AdamTrial.__init__

    def init(self: AdamTrial, *args: Any, **kwargs: Any) -> None:
        real_init(self, *args, **kwargs)
        holder["trial"] = self

    monkeypatch.setattr(AdamTrial, "__init__", init)
    trial, trainer = fit(storage, max_length=pytorch.Batch(12), checkpoint_period=pytorch.Batch(4))

    found = checkpoints(storage)
    assert sorted(found) == [4, 8, 12]
    assert sorted(trained_at_write) == [4, 8, 12]
    assert trained_at_write[4] >= 6 and trained_at_write[8] >= 10  # training had moved on
    for steps, ckpt in found.items():
        state = load(ckpt)
        assert_tensors_equal(state["models_state_dict"][0], trial.weights[steps])
        assert_tensors_equal(adam_state(state), trial.adam[steps])
        assert all(t.device.type == "cpu" for t in state["models_state_dict"][0].values())
        assert sorted(p.name for p in ckpt.iterdir()) == [
            "code", "load_data.json", "metadata.json", "state_dict.pth", "trial_state.pkl",
        ]  # fmt: skip
    timings = trainer.checkpoint_timings
    assert [t["steps_completed"] for t in timings] == [4, 8, 12]
    assert all(t["async"] and t["write_ms"] is not None for t in timings)
    assert all(0 <= t["d2h_ms"] <= t["block_ms"] for t in timings)


def test_host_copy_snapshots_tensors_and_keeps_ties_and_metadata() -> None:
    model = torch.nn.Linear(3, 3)
    state: Any = model.state_dict()
    state["tied"] = state["weight"]
    extra: dict[str, Any] = {"nested": [(state["bias"], 1, "x")], "mutable": {"list": [1, 2]}}
    snap: Any = _checkpoint.host_copy({"model": state, "extra": extra})
    with torch.no_grad():
        model.weight.add_(1)
        model.bias.add_(1)
    extra["mutable"]["list"].append(3)
    assert not torch.equal(snap["model"]["weight"], model.weight)
    assert snap["model"]["tied"] is snap["model"]["weight"]
    assert snap["model"]._metadata == state._metadata  # load_state_dict reads it
    assert torch.equal(snap["extra"]["nested"][0][0] + 1, model.bias.detach())
    assert snap["extra"]["mutable"]["list"] == [1, 2]


# ---------------------------------------------------------------------------- resume
def test_resume_from_an_async_checkpoint_is_bit_exact_like_a_sync_one(storage: Path) -> None:
    straight, _ = fit(
        storage / "a", trial_kwargs={"async_ckpt": False}, max_length=pytorch.Batch(17)
    )
    # stopped at batch 7 (mid-epoch 2): the async checkpoint at 7 is written before fit returns
    fit(
        storage / "s", trial_kwargs={"async_ckpt": False, "stop_at": 7},
        max_length=pytorch.Batch(17),
    )  # fmt: skip
    first, _ = fit(storage / "b", trial_kwargs={"stop_at": 7}, max_length=pytorch.Batch(17))
    async_ckpt, sync_ckpt = checkpoints(storage / "b")[7], checkpoints(storage / "s")[7]
    a_state, s_state = load(async_ckpt), load(sync_ckpt)
    assert_tensors_equal(a_state["models_state_dict"][0], s_state["models_state_dict"][0])
    assert_tensors_equal(adam_state(a_state), adam_state(s_state))
    assert torch.equal(a_state["rng_state"]["cpu_rng_state"], s_state["rng_state"]["cpu_rng_state"])
    assert a_state["lr_schedulers_state_dict"] == s_state["lr_schedulers_state_dict"]
    # resumed with another seed: weights, RNG, shuffle all come from the async checkpoint
    second, _ = fit(
        storage / "b", seed=999, max_length=pytorch.Batch(17), latest_checkpoint=async_ckpt.name
    )
    assert first.seen + second.seen == straight.seen
    assert_tensors_equal(second.model.state_dict(), straight.model.state_dict())
    assert_tensors_equal(second.adam[17], straight.adam[17])
    assert second.sched.state_dict() == straight.sched.state_dict()


# ---------------------------------------------------------------------------- failures
def test_a_failed_background_write_raises_on_the_training_thread(
    storage: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_save = _checkpoint.torch_save
    attempts: list[int] = []

    def disk_full(obj: Any, path: Path, fsync: bool = False) -> None:
        steps = len(attempts)
        attempts.append(steps)
        if steps == 0:
            raise OSError(28, "No space left on device")
        real_save(obj, path, fsync)

    monkeypatch.setattr(_checkpoint, "torch_save", disk_full)
    with pytest.raises(CheckpointError) as info:
        fit(storage, max_length=pytorch.Batch(12), checkpoint_period=pytorch.Batch(2))
    message = str(info.value)
    assert "\n" not in message
    assert "batch 2" in message and "No space left on device" in message
    assert "failed to write in the background" in message
    assert checkpoints(storage) == {}  # nothing half-written is reported
    assert not any(storage.iterdir())  # the failed directory was removed

    # the last checkpoint's failure comes out of fit() itself
    fails_last: list[int] = []

    def last_fails(obj: Any, path: Path, fsync: bool = False) -> None:
        fails_last.append(1)
        if len(fails_last) == 2:
            raise PermissionError(13, "Permission denied", str(path))
        real_save(obj, path, fsync)

    monkeypatch.setattr(_checkpoint, "torch_save", last_fails)
    with pytest.raises(CheckpointError, match=r"batch 4\).*Permission denied"):
        fit(storage / "last", max_length=pytorch.Batch(4), checkpoint_period=pytorch.Batch(2))
    assert sorted(checkpoints(storage / "last")) == [2]


# ---------------------------------------------------------------------------- waiting
def test_fit_and_a_stop_wait_for_the_last_write_one_write_at_a_time(
    storage: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_save = _checkpoint.torch_save
    log: list[str] = []
    in_flight: list[int] = []
    most = [0]
    lock = threading.Lock()

    def slow_disk(obj: Any, path: Path, fsync: bool = False) -> None:
        with lock:
            in_flight.append(1)
            most[0] = max(most[0], len(in_flight))
        time.sleep(0.2)  # a slow disk: training goes on meanwhile
        real_save(obj, path, fsync)
        with lock:
            in_flight.pop()
            log.append("written")

    monkeypatch.setattr(_checkpoint, "torch_save", slow_disk)
    # checkpoints at 2 and 4; stop requested at 5: the exit checkpoint waits for 4's write and
    # fit() for the exit checkpoint's
    trial, trainer = fit(
        storage,
        trial_kwargs={"stop_at": 5, "log": log},
        max_length=pytorch.Batch(12),
        checkpoint_period=pytorch.Batch(2),
    )
    assert trial.batches_done == 5
    found = checkpoints(storage)
    assert sorted(found) == [2, 4, 5]
    for steps, ckpt in found.items():
        assert_tensors_equal(load(ckpt)["models_state_dict"][0], trial.weights[steps])
    assert most[0] == 1
    assert log[-1] == "shutdown"
    assert log.count("written") == 3
    writes = [i for i, e in enumerate(log) if e == "written"]
    ends = [i for i, e in enumerate(log) if e == "write_end"]
    uploads = [i for i, e in enumerate(log) if e == "upload_end"]
    assert len(ends) == len(uploads) == 3
    assert all(w < e < u for w, e, u in zip(writes, ends, uploads, strict=True))
    # the training thread was blocked for the copy, not for the 200 ms writes (except where a
    # write was still in flight at the next checkpoint)
    assert trainer.checkpoint_timings[0]["block_ms"] < 200

"""pytorch.Trainer off-cluster (local mode, checkpoints in a temporary directory): the loop's
order and arithmetic on a one-weight model, reducers, callbacks, LR scheduler step modes, exact
resume, warm start, checkpoint layout and loading, test mode."""

from __future__ import annotations

import json
import pickle
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from det_local.errors import CheckpointError
from det_local.trial import pytorch
from det_local.trial.pytorch import _metrics

LR = 0.001
BATCH = 16  # OnesDataset has 64 records: 4 batches an epoch


# ---------------------------------------------------------------------------- fixtures
class OnesDataset(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.tensor([1.0]), torch.tensor([1.0])


class TriangleLabelSum(pytorch.MetricReducer):
    """sum(label_sum * batch_idx) over a workload (validation counts its own batches)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.sum: Any = 0
        self.count = 0

    def update(self, label_sum: torch.Tensor, batch_idx: int | None) -> None:
        self.sum += label_sum * (batch_idx if batch_idx is not None else self.count)
        self.count += 1

    def per_slot_reduce(self) -> Any:
        return self.sum

    def cross_slot_reduce(self, per_slot_metrics: list[Any]) -> Any:
        return sum(per_slot_metrics)


def triangle_label_sum(updates: list[Any]) -> Any:
    return sum(
        label_sum * (batch_idx if batch_idx is not None else i)
        for i, (label_sum, batch_idx) in enumerate(updates)
    )


class OneVarTrial(pytorch.PyTorchTrial):
    """y = w*x, w starts at 0, every record is (1, 1): with MSE and SGD at rate R each optimizer
    step moves w to w + 2R(1 - w), so after n steps w = 1 - (1 - 2R)^n."""

    def __init__(self, context: pytorch.PyTorchTrialContext, **kw: Any) -> None:
        self.context = context
        self.kw = kw
        model = torch.nn.Linear(1, 1, False)
        model.weight.data.fill_(0)
        self.model = context.wrap_model(model)
        self.opt = context.wrap_optimizer(torch.optim.SGD(self.model.parameters(), LR))
        self.loss_fn = torch.nn.MSELoss()
        self.cls_reducer = context.wrap_reducer(TriangleLabelSum(), name="cls_reducer")
        self.fn_reducer = context.wrap_reducer(triangle_label_sum, name="fn_reducer")
        self.schedulers = [
            context.wrap_lr_scheduler(
                torch.optim.lr_scheduler.LambdaLR(self.opt, lambda e: 1.0), mode, frequency=freq
            )
            for mode, freq in kw.get("schedulers", [])
        ]
        self.evaluated = 0
        self.positions: list[tuple[bool, bool, int, int]] = []

    def train_batch(self, batch: Any, epoch_idx: int, batch_idx: int) -> Any:
        data, label = batch
        c = self.context
        self.positions.append(
            (c.is_epoch_start(), c.is_epoch_end(), c.current_train_epoch(), c.current_train_batch())
        )
        self.cls_reducer.update(sum(label), batch_idx)
        self.fn_reducer.update((sum(label), batch_idx))
        w_before = self.model.weight.data.item()
        loss_exp = (label[0] - data[0] * w_before) ** 2
        w_exp = w_before + 2 * LR * data[0] * (label[0] - data[0] * w_before)
        loss = self.loss_fn(self.model(data), label)
        if batch_idx == self.kw.get("nan_at"):
            loss = loss * float("nan")
        self.context.backward(loss)
        self.context.step_optimizer(self.opt)
        if batch_idx == self.kw.get("stop_at"):
            self.context.set_stop_requested(True)
        return {
            "loss": loss,
            "loss_exp": loss_exp,
            "w_before": w_before,
            "w_after": self.model.weight.data.item(),
            "w_exp": w_exp,
        }

    def evaluate_batch(self, batch: Any) -> dict[str, Any]:
        data, label = batch
        self.evaluated += 1
        self.cls_reducer.update(sum(label), None)
        self.fn_reducer.update((sum(label), None))
        output = self.model(data)
        return {
            "val_loss": self.loss_fn(output, label),
            "records": len(data),
            "w_max": output.max(),
            "w_min": output.min(),
        }

    def evaluation_reducer(self) -> Any:
        return {
            "val_loss": pytorch.Reducer.AVG,
            "records": pytorch.Reducer.SUM,
            "w_max": pytorch.Reducer.MAX,
            "w_min": pytorch.Reducer.MIN,
        }

    def build_training_data_loader(self) -> Any:
        return pytorch.DataLoader(OnesDataset(), batch_size=self.context.get_per_slot_batch_size())

    def build_validation_data_loader(self) -> Any:
        return pytorch.DataLoader(OnesDataset(), batch_size=self.context.get_per_slot_batch_size())

    def build_callbacks(self) -> dict[str, pytorch.PyTorchCallback]:
        return dict(self.kw.get("callbacks", {}))


class Recorder:
    """The reports a local-mode trainer makes (through core's own checks)."""

    def __init__(self, context: pytorch.PyTorchTrialContext) -> None:
        self.training: list[tuple[int, dict[str, Any], list[dict[str, Any]]]] = []
        self.validation: list[tuple[int, dict[str, Any]]] = []
        self.progress: list[float] = []
        train = context._core.train
        report_t, report_v = train.report_training_metrics, train.report_validation_metrics

        def training(steps_completed: int, metrics: Any, batch_metrics: Any = None) -> None:
            report_t(steps_completed, metrics, batch_metrics)
            self.training.append((steps_completed, dict(metrics), list(batch_metrics or [])))

        def validation(steps_completed: int, metrics: Any) -> None:
            report_v(steps_completed, metrics)
            self.validation.append((steps_completed, dict(metrics)))

        train.report_training_metrics = training
        train.report_validation_metrics = validation
        train.report_progress = self.progress.append


def fit(
    trial_cls: type,
    storage: Path,
    hparams: dict[str, Any] | None = None,
    trial_kwargs: dict[str, Any] | None = None,
    aggregation_frequency: int = 1,
    **fit_kwargs: Any,
) -> tuple[Any, Recorder]:
    with pytorch.init(
        hparams=hparams or {"global_batch_size": BATCH},
        checkpoint_storage=str(storage),
        aggregation_frequency=aggregation_frequency,
    ) as context:
        trial = trial_cls(context, **(trial_kwargs or {}))
        rec = Recorder(context)
        pytorch.Trainer(trial, context).fit(**fit_kwargs)
    return trial, rec


def checkpoints(storage: Path) -> list[tuple[int, str]]:
    """(steps_completed, uuid) of every checkpoint in storage, by steps."""
    if not storage.exists():
        return []
    out = []
    for d in storage.iterdir():
        meta = json.loads((d / "metadata.json").read_text())
        out.append((meta["steps_completed"], d.name))
    return sorted(out)


def w_after(n: int) -> float:
    return 1 - (1 - 2 * LR) ** n


# ---------------------------------------------------------------------------- the loop
def test_onevar_arithmetic_reducers_validation_metrics_and_loop_order(storage: Path) -> None:
    trial, rec = fit(
        OneVarTrial,
        storage,
        max_length=pytorch.Batch(10),
        reporting_period=pytorch.Batch(4),
        validation_period=pytorch.Batch(5),
    )
    # training metrics are reported at every boundary: REPORT 4, 8; VALIDATE 5; TRAIN/VALIDATE 10
    assert [(s, len(b)) for s, _, b in rec.training] == [(4, 4), (5, 1), (8, 3), (10, 2)]
    rows = [row for _, _, b in rec.training for row in b]
    for i, row in enumerate(rows):
        assert abs(row["loss"] - row["loss_exp"][0]) < 1e-6, i  # a shape-(1,) tensor: a list
        assert abs(row["w_after"] - row["w_exp"][0]) < 1e-6, i
        assert abs(row["w_after"] - w_after(i + 1)) < 1e-6, i
    steps, avg, batch_rows = rec.training[0]
    assert avg["loss"] == pytest.approx(sum(r["loss"] for r in batch_rows) / 4)
    assert (avg["batches"], avg["epochs"]) == (4, 1)
    # custom reducers: sum(BATCH * batch_idx) over each workload's batches
    # (sum(label) is a shape-(1,) tensor, so the reduced values are one-element lists)
    assert [m["cls_reducer"] for _, m, _ in rec.training] == [
        [BATCH * sum(range(0, 4))],
        [BATCH * 4],
        [BATCH * sum(range(5, 8))],
        [BATCH * sum(range(8, 10))],
    ]
    assert [m["fn_reducer"] for _, m, _ in rec.training] == [
        m["cls_reducer"] for _, m, _ in rec.training
    ]
    # validation: several metrics, each with its reducer, plus batches/epochs
    assert [s for s, _ in rec.validation] == [5, 10]
    for steps, m in rec.validation:
        assert m["val_loss"] == pytest.approx((1 - w_after(steps)) ** 2, rel=1e-5)
        assert m["records"] == 64
        assert m["w_max"] == pytest.approx(w_after(steps), rel=1e-5) == m["w_min"]
        assert m["cls_reducer"] == m["fn_reducer"] == [BATCH * sum(range(4))]
        assert (m["batches"], m["epochs"]) == (steps, steps // 4)
    # progress on TRAIN/REPORT boundaries; local "best" falls back to "all": a checkpoint per
    # validation
    assert rec.progress == [0.4, 0.8, 1.0]
    assert [s for s, _ in checkpoints(storage)] == [5, 10]
    assert trial.model.weight.item() == pytest.approx(w_after(10), rel=1e-6)
    assert trial.positions[:5] == [
        (True, False, 0, 0), (False, False, 0, 1), (False, False, 0, 2), (False, True, 0, 3),
        (True, False, 1, 4),
    ]  # fmt: skip


class AutoAMPTrial(OneVarTrial):
    def __init__(self, context: pytorch.PyTorchTrialContext, **kw: Any) -> None:
        context.experimental.use_amp()
        super().__init__(context, **kw)


class ManualScalerTrial(OneVarTrial):
    def __init__(self, context: pytorch.PyTorchTrialContext, **kw: Any) -> None:
        self.scaler = context.wrap_scaler(torch.amp.GradScaler("cuda", enabled=False))
        super().__init__(context, **kw)

    def train_batch(self, batch: Any, epoch_idx: int, batch_idx: int) -> Any:
        data, label = batch
        loss = self.loss_fn(self.model(data), label)
        self.context.backward(self.scaler.scale(loss))
        self.context.step_optimizer(
            self.opt,
            clip_grads=lambda params: torch.nn.utils.clip_grad_norm_(params, 1e9),
            scaler=self.scaler,
        )
        self.scaler.update()
        return loss


def test_amp_on_a_cpu_device_trains_as_float32_and_checkpoints_the_scaler(storage: Path) -> None:
    # Determined's AMP is CUDA-only; on a CPU device autocast and scaling stay off
    for cls in (AutoAMPTrial, ManualScalerTrial):
        trial, _ = fit(cls, storage / cls.__name__, max_length=pytorch.Batch(4))
        assert trial.model.weight.item() == pytest.approx(w_after(4), rel=1e-6)
        ((_, uuid),) = checkpoints(storage / cls.__name__)
        state = torch.load(storage / cls.__name__ / uuid / "state_dict.pth", weights_only=False)
        assert "scaler_state_dict" in state
        trial, _ = fit(
            cls, storage / cls.__name__, max_length=pytorch.Batch(6), latest_checkpoint=uuid
        )
        assert trial.model.weight.item() == pytest.approx(w_after(6), rel=1e-6)

    class LateScaler(OneVarTrial):
        def __init__(self, context: pytorch.PyTorchTrialContext, **kw: Any) -> None:
            super().__init__(context, **kw)
            context.experimental.use_amp()

    with pytest.raises(
        pytorch.InvalidTrialError, match=r"call wrap_scaler\(\) .* before wrap_model"
    ):
        fit(LateScaler, storage, max_length=pytorch.Batch(1))


class HookCounter(pytorch.PyTorchCallback):
    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.calls: list[tuple[str, Any]] = []

    def _hit(self, name: str, arg: Any = None) -> None:
        self.counts[name] += 1
        self.calls.append((name, arg))

    def on_trial_startup(self, first_batch_idx: int, checkpoint_uuid: str | None) -> None:
        self._hit("trial_startup", (first_batch_idx, checkpoint_uuid))

    def on_trial_shutdown(self) -> None:
        self._hit("trial_shutdown")

    def on_training_start(self) -> None:
        self._hit("training_start")

    def on_training_epoch_start(self, epoch_idx: int) -> None:
        self._hit("epoch_start", epoch_idx)

    def on_training_epoch_end(self, epoch_idx: int) -> None:
        self._hit("epoch_end", epoch_idx)

    def on_training_workload_end(self, avg_metrics: Any, batch_metrics: Any) -> None:
        self._hit("workload_end", avg_metrics["batches"])

    def on_validation_start(self) -> None:
        self._hit("validation_start")

    def on_validation_epoch_start(self) -> None:
        self._hit("validation_epoch_start")

    def on_validation_epoch_end(self, outputs: Any) -> None:
        self._hit("validation_epoch_end", len(outputs))

    def on_validation_end(self, metrics: Any) -> None:
        self._hit("validation_end", sorted(metrics))

    def on_checkpoint_load_start(self, checkpoint: Any) -> None:
        self._hit("load_start", sorted(checkpoint))

    def on_checkpoint_save_start(self, checkpoint: Any) -> None:
        self._hit("save_start")

    def on_checkpoint_write_end(self, checkpoint_dir: str) -> None:
        self._hit("write_end", Path(checkpoint_dir).name)

    def on_checkpoint_upload_end(self, uuid: str) -> None:
        self._hit("upload_end", uuid)

    def state_dict(self) -> dict[str, Any]:
        return {"counts": dict(self.counts)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.counts = Counter(state_dict["counts"])


def test_callbacks_are_called_in_order_and_their_state_is_checkpointed(storage: Path) -> None:
    cb = HookCounter()
    fit(
        OneVarTrial,
        storage,
        trial_kwargs={"callbacks": {"counter": cb}},
        max_length=pytorch.Epoch(2),
        validation_period=pytorch.Epoch(1),
        reporting_period=pytorch.Batch(2),
    )
    names = [n for n, _ in cb.calls]
    assert cb.calls[0] == ("trial_startup", (0, None)) and names[1] == "training_start"
    assert names[-1] == "trial_shutdown"
    assert [a for n, a in cb.calls if n == "epoch_start"] == [0, 1]
    assert [a for n, a in cb.calls if n == "epoch_end"] == [0, 1]
    assert [a for n, a in cb.calls if n == "workload_end"] == [2, 4, 6, 8]
    assert [a for n, a in cb.calls if n == "validation_epoch_end"] == [4, 4]
    metric_names = ["cls_reducer", "fn_reducer", "records", "val_loss", "w_max", "w_min"]
    assert [a for n, a in cb.calls if n == "validation_end"] == [metric_names] * 2
    ckpts = checkpoints(storage)
    assert [a for n, a in cb.calls if n == "write_end"] == [u for _, u in ckpts]
    assert [a for n, a in cb.calls if n == "upload_end"] == [u for _, u in ckpts]
    # order within one validation + checkpoint
    i = names.index("validation_start")
    assert names[i : i + 7] == [
        "validation_start",
        "validation_epoch_start",
        "validation_epoch_end",
        "validation_end",
        "save_start",
        "write_end",
        "upload_end",
    ]
    expected = Counter(
        trial_startup=1, training_start=1, epoch_start=2, epoch_end=2, workload_end=4,
        validation_start=2, validation_epoch_start=2, validation_epoch_end=2, validation_end=2,
        save_start=2, write_end=2, upload_end=2, trial_shutdown=1,
    )  # fmt: skip
    assert cb.counts == expected

    # the callback's state travels in the checkpoint and comes back on resume
    last = ckpts[-1][1]
    state = torch.load(storage / last / "state_dict.pth", weights_only=False)
    # state_dict() is taken before this checkpoint's own on_checkpoint_save_start
    assert state["callbacks"]["counter"]["counts"]["save_start"] == 1
    resumed = HookCounter()
    fit(
        OneVarTrial,
        storage,
        trial_kwargs={"callbacks": {"counter": resumed}},
        max_length=pytorch.Epoch(3),
        latest_checkpoint=last,
    )
    assert resumed.calls[0] == ("trial_startup", (8, last))
    assert resumed.calls[1][0] == "load_start"
    assert set(resumed.calls[1][1]) >= {"callbacks", "models_state_dict", "rng_state"}
    # the loaded counts replace the fresh ones, then this run's hooks add to them
    assert resumed.counts["trial_startup"] == 1 and resumed.counts["epoch_start"] == 3


def test_lr_scheduler_step_modes_with_gradient_aggregation(storage: Path) -> None:
    mode = pytorch.LRScheduler.StepMode
    schedulers = [
        (mode.STEP_EVERY_BATCH, 1),
        (mode.STEP_EVERY_BATCH, 3),
        (mode.STEP_EVERY_OPTIMIZER_STEP, 1),
        (mode.STEP_EVERY_OPTIMIZER_STEP, 2),
        (mode.STEP_EVERY_EPOCH, 1),
        (mode.MANUAL_STEP, 1),
    ]
    trial, rec = fit(
        OneVarTrial,
        storage,
        trial_kwargs={"schedulers": schedulers},
        aggregation_frequency=2,
        max_length=pytorch.Batch(10),
    )
    # 10 batches, 4 per epoch, an optimizer step every 2nd batch (5 steps)
    assert [s.last_epoch for s in trial.schedulers] == [10, 3, 5, 2, 2, 0]
    # the weight moved once per optimizer step with the averaged (here: equal) gradients
    assert trial.model.weight.item() == pytest.approx(w_after(5), rel=1e-6)
    rows = [row for _, _, b in rec.training for row in b]
    assert [r["w_after"] != r["w_before"] for r in rows] == [False, True] * 5


def test_test_mode_trains_and_validates_one_batch(
    storage: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    trial, rec = fit(OneVarTrial, storage, max_length=pytorch.Batch(50), test_mode=True)
    assert [s for s, _, _ in rec.training] == [1]
    assert [s for s, _ in rec.validation] == [1] and trial.evaluated == 1
    assert [s for s, _ in checkpoints(storage)] == [1]

    # restored in test mode, it trains one batch more
    ((_, uuid),) = checkpoints(storage)
    trial, rec = fit(
        OneVarTrial, storage, max_length=pytorch.Batch(50), test_mode=True, latest_checkpoint=uuid
    )
    assert [s for s, _, _ in rec.training] == [2] and [s for s, _ in rec.validation] == [2]
    assert [s for s, _ in checkpoints(storage)] == [1, 2]

    monkeypatch.setenv("DET_LOCAL_TEST_MODE", "1")  # what `det-local run --test` sets
    trial, rec = fit(OneVarTrial, storage / "env", max_length=pytorch.Epoch(3))
    assert [s for s, _, _ in rec.training] == [1] and trial.evaluated == 1
    assert [s for s, _ in checkpoints(storage / "env")] == [1]


def test_step_zero_validation_and_schedules(storage: Path) -> None:
    trial, rec = fit(
        OneVarTrial,
        storage,
        max_length=pytorch.Batch(12),
        step_zero_validation=True,
        validation_period=pytorch.Batch([2, 9]),
        checkpoint_period=pytorch.Batch([3]),
        checkpoint_policy="none",
    )
    assert [s for s, _ in rec.validation] == [0, 2, 9, 12]
    assert rec.validation[0][1]["val_loss"] == pytest.approx(1.0)
    # "none": no checkpoint for validations; the schedule's and the final one remain
    assert [s for s, _ in checkpoints(storage)] == [3, 12]
    assert [s for s, _, _ in rec.training] == [2, 3, 9, 12]


class FullDatasetTrial(OneVarTrial):
    def evaluate_full_dataset(self, data_loader: Any) -> dict[str, Any]:
        n = sum(len(b[0]) for b in data_loader)
        return {"val_loss": torch.tensor(0.5), "records": n, "vec": torch.tensor([1.0, 2.0])}


FullDatasetTrial.evaluate_batch = pytorch.PyTorchTrial.evaluate_batch  # type: ignore[method-assign]


def test_evaluate_full_dataset_and_epoch_lengths(storage: Path) -> None:
    trial, rec = fit(FullDatasetTrial, storage, max_length=pytorch.Epoch(2))
    assert rec.validation == [
        (8, {"val_loss": 0.5, "records": 64, "vec": [1.0, 2.0], "cls_reducer": 0,
             "fn_reducer": 0, "batches": 8, "epochs": 2}),
    ]  # fmt: skip
    assert trial.model.weight.item() == pytest.approx(w_after(8), rel=1e-6)


def test_training_metrics_stay_on_the_device_until_a_report(
    storage: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Per batch, the loop only detaches metrics; the one host transfer (`to_host`) runs at
    reporting boundaries. Reading a value (item/tolist/cpu/bool) before that would be a device
    synchronisation per batch on a GPU."""
    reads: list[tuple[str, int]] = []
    batches_done = [0]

    class Spy(torch.Tensor):
        @classmethod
        def __torch_function__(
            cls, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            name = getattr(func, "__name__", str(func))
            if name in ("item", "tolist", "cpu", "__bool__", "numpy", "__float__"):
                reads.append((name, batches_done[0]))
            return super().__torch_function__(func, types, args, kwargs or {})

    class SpyTrial(OneVarTrial):
        def train_batch(self, batch: Any, epoch_idx: int, batch_idx: int) -> Any:
            out = super().train_batch(batch, epoch_idx, batch_idx)
            batches_done[0] = batch_idx + 1
            return {
                "loss": out["loss"].as_subclass(Spy),
                "extra": (out["loss"] * 2).as_subclass(Spy),
            }

    drains: list[int] = []
    real_to_host = _metrics.to_host

    def counting_to_host(rows: Any) -> Any:
        drains.append(batches_done[0])
        return real_to_host(rows)

    monkeypatch.setattr(_metrics, "to_host", counting_to_host)
    _, rec = fit(SpyTrial, storage, max_length=pytorch.Batch(12), reporting_period=pytorch.Batch(5))
    assert drains[:3] == [5, 10, 12]  # then validation's one transfer
    assert reads and all(at in (5, 10, 12) for _, at in reads), reads
    assert [s for s, _, _ in rec.training] == [5, 10, 12]
    assert rec.training[0][1]["extra"] == pytest.approx(2 * rec.training[0][1]["loss"])


# ---------------------------------------------------------------------------- exact resume
class Noisy(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(123)
        self.x = torch.randn(30, 4, generator=g)
        self.y = torch.randn(30, 1, generator=g)

    def __len__(self) -> int:
        return 30

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.x[i], self.y[i], i


class DropoutTrial(pytorch.PyTorchTrial):
    """Shuffled data, dropout, Adam and an LR schedule: every RNG and state a resume must get
    back. Batch 5 records, 6 batches an epoch."""

    def __init__(self, context: pytorch.PyTorchTrialContext, stop_at: int | None = None) -> None:
        self.context = context
        self.stop_at = stop_at
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

    def train_batch(self, batch: Any, epoch_idx: int, batch_idx: int) -> Any:
        x, y, idx = batch
        self.seen.append(idx.tolist())
        loss = torch.nn.functional.mse_loss(self.model(x), y)
        self.context.backward(loss)
        self.context.step_optimizer(self.opt)
        if batch_idx + 1 == self.stop_at:
            self.context.set_stop_requested(True)
        return loss

    def evaluate_batch(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        x, y, _ = batch
        return {"val_loss": torch.nn.functional.mse_loss(self.model(x), y)}

    def build_training_data_loader(self) -> Any:
        return pytorch.DataLoader(Noisy(), batch_size=5, shuffle=True)

    def build_validation_data_loader(self) -> Any:
        return pytorch.DataLoader(Noisy(), batch_size=10)


def run_dropout(storage: Path, seed: int = 0, **kw: Any) -> tuple[DropoutTrial, Recorder]:
    stop_at = kw.pop("stop_at", None)
    torch.manual_seed(seed)  # off-cluster nothing seeds; det-local seeds with the trial seed
    trial, rec = fit(
        DropoutTrial, storage, hparams={"global_batch_size": 5}, trial_kwargs={"stop_at": stop_at},
        **kw,
    )  # fmt: skip
    return trial, rec


def assert_same_training_state(a: DropoutTrial, b: DropoutTrial) -> None:
    for (name, pa), pb in zip(
        a.model.state_dict().items(), b.model.state_dict().values(), strict=True
    ):
        assert torch.equal(pa, pb), name
    sa, sb = a.opt.state_dict(), b.opt.state_dict()
    for k in sa["state"]:
        for name, va in sa["state"][k].items():
            assert torch.equal(torch.as_tensor(va), torch.as_tensor(sb["state"][k][name])), name
    assert a.sched.state_dict() == b.sched.state_dict()


def test_stop_and_resume_is_bit_identical_to_an_uninterrupted_run(storage: Path) -> None:
    straight, rec_a = run_dropout(
        storage / "a", max_length=pytorch.Batch(17), validation_period=pytorch.Batch(4)
    )
    # stopped at batch 7 (mid-epoch 2): it reports, checkpoints and returns
    first, rec_b1 = run_dropout(
        storage / "b", max_length=pytorch.Batch(17), validation_period=pytorch.Batch(4), stop_at=7
    )
    assert [s for s, _, _ in rec_b1.training] == [4, 7]
    (ckpt_steps, uuid), *_ = [c for c in checkpoints(storage / "b") if c[0] == 7]
    assert first.seen == straight.seen[:7]
    # seeded differently: the weights, RNG states and the shuffle's seed come from the checkpoint
    second, rec_b2 = run_dropout(
        storage / "b",
        seed=999,
        max_length=pytorch.Batch(17),
        validation_period=pytorch.Batch(4),
        latest_checkpoint=uuid,
    )
    assert first.seen + second.seen == straight.seen  # same shuffled batches, none repeated
    assert_same_training_state(straight, second)
    assert [s for s, _, _ in rec_b2.training] == [8, 12, 16, 17]
    assert rec_b2.training[-1][1] == rec_a.training[-1][1]  # identical losses reported
    assert rec_b2.validation[-1] == rec_a.validation[-1]


def test_resume_from_a_periodic_checkpoint_is_exact_whatever_the_validations(
    storage: Path,
) -> None:
    straight, _ = run_dropout(
        storage / "a", max_length=pytorch.Batch(17), validation_period=pytorch.Batch(4)
    )
    # first run: 5 batches, ends with a validation and a checkpoint at 5
    run_dropout(storage / "c", max_length=pytorch.Batch(5), checkpoint_policy="none")
    ((_, uuid),) = checkpoints(storage / "c")
    # second run: no validation until the end; validations never move the training RNG
    resumed, rec = run_dropout(storage / "c", max_length=pytorch.Batch(17), latest_checkpoint=uuid)
    assert_same_training_state(straight, resumed)
    assert straight.seen[5:] == resumed.seen
    assert [s for s, _ in rec.validation] == [17]


def test_checkpoint_from_another_trial_is_a_warm_start(storage: Path) -> None:
    fit(OneVarTrial, storage, max_length=pytorch.Batch(5))
    ((_, uuid),) = checkpoints(storage)
    state_file = storage / uuid / "trial_state.pkl"
    state = pickle.loads(state_file.read_bytes())
    assert state == {
        "trial_id": 0, "last_ckpt": 5, "step_id": 0, "last_val": 5, "batches_trained": 5,
        "epochs_trained": 1,
    }  # fmt: skip
    state["trial_id"] = 99  # written by trial 99: this trial only starts from its weights
    state_file.write_bytes(pickle.dumps(state))
    trial, rec = fit(
        OneVarTrial,
        storage,
        max_length=pytorch.Batch(3),
        reporting_period=pytorch.Batch(1),
        latest_checkpoint=uuid,
    )
    assert [s for s, _, _ in rec.training] == [1, 2, 3]  # counters start over
    first_row = rec.training[0][2][0]
    assert first_row["w_before"] == pytest.approx(w_after(5), rel=1e-6)  # weights kept
    assert trial.model.weight.item() == pytest.approx(w_after(8), rel=1e-6)


def test_checkpoint_layout(storage: Path) -> None:
    Path("model_notes.txt").write_text("kept")
    Path(".detignore").write_text("secret/\n")
    Path("secret").mkdir()
    Path("secret/key").write_text("no")
    fit(OneVarTrial, storage, max_length=pytorch.Batch(2))
    ((_, uuid),) = checkpoints(storage)
    ckpt = storage / uuid
    assert sorted(p.name for p in ckpt.iterdir()) == [
        "code", "load_data.json", "metadata.json", "state_dict.pth", "trial_state.pkl",
    ]  # fmt: skip
    meta = json.loads((ckpt / "metadata.json").read_text())
    assert meta["steps_completed"] == 2 and meta["format"] == "pickle"
    assert meta["framework"] == f"torch-{torch.__version__}" and meta["determined_version"]
    load_data = json.loads((ckpt / "load_data.json").read_text())
    assert load_data == {
        "trial_type": "PyTorchTrial",
        "experiment_config": None,
        "hparams": {"global_batch_size": BATCH},
        "trial_cls_spec": f"{__name__}:OneVarTrial",
        "is_trainer": True,
    }
    assert (ckpt / "code" / "model_notes.txt").read_text() == "kept"
    assert not (ckpt / "code" / "secret").exists()
    state = torch.load(ckpt / "state_dict.pth", weights_only=False)
    assert set(state) == {
        "models_state_dict", "optimizers_state_dict", "lr_schedulers_state_dict", "callbacks",
        "rng_state",
    }  # fmt: skip
    assert set(state["rng_state"]) >= {"cpu_rng_state", "np_rng_state", "random_rng_state"}
    assert state["models_state_dict"][0]["weight"].item() == pytest.approx(w_after(2), rel=1e-6)


def test_ddp_module_prefix_is_fixed_both_ways(tmp_path: Path) -> None:
    import torch.distributed as dist

    from det_local.trial.pytorch.checkpoints._checkpoint import load_models

    plain = torch.nn.Linear(2, 1)
    source = torch.nn.Linear(2, 1)
    ddp_style = {"module." + k: v for k, v in source.state_dict().items()}
    load_models([plain], {"models_state_dict": [ddp_style]}, "checkpoint x", None, object)
    assert torch.equal(plain.weight, source.weight)

    # a file store: no port to choose (one free when chosen may be taken before it is bound)
    store = tmp_path / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        wrapped = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 1))
        load_models(
            [wrapped], {"models_state_dict": [source.state_dict()]}, "checkpoint x", None, object
        )
        assert torch.equal(wrapped.module.weight, source.weight)
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------- loading a trial
MODEL_DEF = """
import torch
from determined import pytorch


class Ones(torch.utils.data.Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        return torch.ones(3), torch.ones(1)


class SavedTrial(pytorch.PyTorchTrial):
    def __init__(self, context, width=3):
        self.context = context
        self.model = context.wrap_model(torch.nn.Linear(width, 1))
        self.opt = context.wrap_optimizer(torch.optim.SGD(self.model.parameters(), 0.1))

    def train_batch(self, batch, epoch_idx, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.model(x), y)
        self.context.backward(loss)
        self.context.step_optimizer(self.opt)
        return loss

    def evaluate_batch(self, batch):
        x, y = batch
        return {"val_loss": torch.nn.functional.mse_loss(self.model(x), y)}

    def build_training_data_loader(self):
        return pytorch.DataLoader(Ones(), batch_size=4)

    def build_validation_data_loader(self):
        return pytorch.DataLoader(Ones(), batch_size=4)
"""


def test_load_trial_from_checkpoint_path_round_trip(
    storage: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import sys

    from tests.support.paths import COMPAT

    monkeypatch.syspath_prepend(str(COMPAT))  # `from determined import pytorch` in model_def
    Path("model_def.py").write_text(MODEL_DEF)
    monkeypatch.syspath_prepend(str(Path.cwd()))
    import model_def  # type: ignore[import-not-found]

    trained, _ = fit(
        model_def.SavedTrial, storage, hparams={"lr": 0.1}, max_length=pytorch.Batch(3)
    )
    ((_, uuid),) = checkpoints(storage)
    del sys.modules["model_def"]
    Path("model_def.py").unlink()  # the class now comes from the checkpoint's code/

    loaded = pytorch.load_trial_from_checkpoint_path(str(storage / uuid))
    assert type(loaded).__name__ == "SavedTrial" and type(loaded) is not model_def.SavedTrial
    assert torch.equal(loaded.model.weight, trained.model.weight.detach())
    assert loaded.context.get_hparams() == {"lr": 0.1}
    assert "model_def" not in sys.modules  # import_from_path cleaned up
    again = pytorch.load_trial_from_checkpoint_path(
        storage / uuid, trial_class=model_def.SavedTrial, trial_kwargs={"width": 3}
    )
    assert torch.equal(again.model.bias, trained.model.bias.detach())
    with pytest.raises(CheckpointError, match="weights do not fit"):
        pytorch.load_trial_from_checkpoint_path(
            storage / uuid, trial_class=OtherTrial, trial_kwargs={}
        )
    context = pytorch.CheckpointLoadContext(hparams={"x": 1})
    assert context.get_hparam("x") == 1 and context.distributed.size == 1


# ---------------------------------------------------------------------------- bad input
class OtherTrial(OneVarTrial):
    """A different model: its weights cannot take OneVarTrial's."""

    def __init__(self, context: pytorch.PyTorchTrialContext, **kw: Any) -> None:
        self.context = context
        self.kw = kw
        self.model = context.wrap_model(torch.nn.Linear(3, 2))
        self.opt = context.wrap_optimizer(torch.optim.SGD(self.model.parameters(), LR))


def test_bad_trials_name_the_class_and_method(storage: Path) -> None:
    class NoTrainBatch(pytorch.PyTorchTrial):
        def __init__(self, context: Any) -> None:
            pass

        def build_training_data_loader(self) -> Any: ...

        def build_validation_data_loader(self) -> Any: ...

    with pytest.raises(
        pytorch.InvalidTrialError,
        match=r"^NoTrainBatch does not define train_batch\(\), which every PyTorchTrial must",
    ):
        fit(NoTrainBatch, storage, max_length=pytorch.Batch(1))

    class NoEvaluate(OneVarTrial):
        evaluate_batch = pytorch.PyTorchTrial.evaluate_batch

    with pytest.raises(
        pytorch.InvalidTrialError,
        match=r"NoEvaluate defines neither evaluate_batch\(\) nor evaluate_full_dataset\(\)",
    ):
        fit(NoEvaluate, storage, max_length=pytorch.Batch(1))

    class BothEvaluate(OneVarTrial):
        def evaluate_full_dataset(self, data_loader: Any) -> dict[str, Any]:
            return {}

    with pytest.raises(pytorch.InvalidTrialError, match="BothEvaluate defines both"):
        fit(BothEvaluate, storage, max_length=pytorch.Batch(1))

    class SaysHello(OneVarTrial):
        def train_batch(self, batch: Any, epoch_idx: int, batch_idx: int) -> Any:
            super().train_batch(batch, epoch_idx, batch_idx)
            return "hello"

    with pytest.raises(
        pytorch.InvalidTrialError,
        match=r"SaysHello.train_batch\(\) returned a str; return the loss \(a tensor or number\)",
    ):
        fit(SaysHello, storage, max_length=pytorch.Batch(1))

    class ScalarLoss(OneVarTrial):
        def train_batch(self, batch: Any, epoch_idx: int, batch_idx: int) -> Any:
            return float(super().train_batch(batch, epoch_idx, batch_idx)["loss"].detach())

    _, rec = fit(ScalarLoss, storage / "ok", max_length=pytorch.Batch(1))
    assert set(rec.training[0][1]) == {"loss", "cls_reducer", "fn_reducer", "batches", "epochs"}

    class BadEvaluate(OneVarTrial):
        def evaluate_batch(self, batch: Any) -> Any:
            return [1.0]

    with pytest.raises(
        pytorch.InvalidTrialError, match=r"BadEvaluate.evaluate_batch\(\) returned a list"
    ):
        fit(BadEvaluate, storage, max_length=pytorch.Batch(1))

    with pytest.raises(pytorch.InvalidTrialError, match=r"fit\(max_length=...\) is required"):
        fit(OneVarTrial, storage)


def test_unwrapped_optimizers_and_models_are_named(storage: Path) -> None:
    class RawOptimizer(OneVarTrial):
        def __init__(self, context: Any, **kw: Any) -> None:
            super().__init__(context, **kw)
            self.raw = torch.optim.SGD(self.model.parameters(), LR)

        def train_batch(self, batch: Any, epoch_idx: int, batch_idx: int) -> Any:
            data, label = batch
            loss = self.loss_fn(self.model(data), label)
            self.context.backward(loss)
            self.context.step_optimizer(self.raw)
            return loss

    with pytest.raises(
        pytorch.InvalidTrialError,
        match=r"step_optimizer\(\) got a SGD optimizer that was never passed to "
        r"context.wrap_optimizer\(\) \(wrapped: SGD\)",
    ):
        fit(RawOptimizer, storage, max_length=pytorch.Batch(1))

    class NoOptimizer(OneVarTrial):
        def __init__(self, context: Any, **kw: Any) -> None:
            self.context, self.kw = context, kw
            self.model = context.wrap_model(torch.nn.Linear(1, 1))

    with pytest.raises(pytorch.InvalidTrialError, match="NoOptimizer wrapped no optimizer"):
        fit(NoOptimizer, storage, max_length=pytorch.Batch(1))

    class NoModel(OneVarTrial):
        def __init__(self, context: Any, **kw: Any) -> None:
            self.context, self.kw = context, kw

    with pytest.raises(pytorch.InvalidTrialError, match="NoModel wrapped no model"):
        fit(NoModel, storage, max_length=pytorch.Batch(1))

    class SchedulerOnRaw(OneVarTrial):
        def __init__(self, context: Any, **kw: Any) -> None:
            super().__init__(context, **kw)
            raw = torch.optim.Adam(self.model.parameters())
            context.wrap_lr_scheduler(
                torch.optim.lr_scheduler.StepLR(raw, 1), pytorch.LRScheduler.StepMode.MANUAL_STEP
            )

    with pytest.raises(
        pytorch.InvalidTrialError, match=r"StepLR's optimizer \(Adam\) was never passed"
    ):
        fit(SchedulerOnRaw, storage, max_length=pytorch.Batch(1))

    class TorchLoader(OneVarTrial):
        def build_training_data_loader(self) -> Any:
            return torch.utils.data.DataLoader(OnesDataset(), batch_size=BATCH)

    with pytest.raises(
        pytorch.InvalidTrialError,
        match=r"TorchLoader.build_training_data_loader\(\) returned a DataLoader, not a "
        r"determined.pytorch.DataLoader",
    ):
        fit(TorchLoader, storage, max_length=pytorch.Batch(1))

    class TorchLoaderAllowed(TorchLoader):
        def __init__(self, context: Any, **kw: Any) -> None:
            super().__init__(context, **kw)
            context.experimental.disable_dataset_reproducibility_checks()

    _, rec = fit(TorchLoaderAllowed, storage / "ok", max_length=pytorch.Batch(2))
    assert [s for s, _, _ in rec.training] == [2]
    # a loader that does not repeat runs out: training finishes there (validated, checkpointed)
    _, rec = fit(TorchLoaderAllowed, storage / "short", max_length=pytorch.Batch(10))
    assert [s for s, _, _ in rec.training] == [s for s, _ in rec.validation] == [4]
    assert [s for s, _ in checkpoints(storage / "short")] == [4]


def test_nan_loss_stops_at_the_next_report_and_keeps_earlier_checkpoints(storage: Path) -> None:
    with pytest.raises(pytorch.NonFiniteLossError) as err:
        fit(
            OneVarTrial,
            storage,
            trial_kwargs={"nan_at": 5},
            max_length=pytorch.Batch(12),
            checkpoint_period=pytorch.Batch(2),
            reporting_period=pytorch.Batch(4),
        )
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(
        "OneVarTrial.train_batch() returned a NaN loss at batch_idx=5 (epoch 1; found when "
        "reporting batches 4-5)"
    )
    assert "lower the learning rate" in message and "check the data" in message
    assert [s for s, _ in checkpoints(storage)] == [2, 4]  # nothing NaN was saved


def test_checkpoints_that_do_not_fit_are_refused_with_names(storage: Path) -> None:
    fit(OneVarTrial, storage, max_length=pytorch.Batch(2))
    ((_, uuid),) = checkpoints(storage)
    with pytest.raises(CheckpointError) as err:
        fit(OtherTrial, storage, max_length=pytorch.Batch(3), latest_checkpoint=uuid)
    message = str(err.value)
    assert message.startswith(
        f"checkpoint {uuid} was written by trial class OneVarTrial ({__name__}:OneVarTrial), "
        "not OtherTrial, and its weights do not fit"
    )
    assert "\n" not in message

    state_file = storage / uuid / "state_dict.pth"
    state_file.write_bytes(state_file.read_bytes()[:100])  # truncated
    with pytest.raises(CheckpointError) as err2:
        fit(OneVarTrial, storage, max_length=pytorch.Batch(3), latest_checkpoint=uuid)
    message = str(err2.value)
    assert message.startswith(f"checkpoint {uuid}: {state_file} cannot be loaded (")
    assert "corrupt or truncated" in message and "\n" not in message
    assert [u for _, u in checkpoints(storage)] == [uuid]  # the loader wrote nothing


def test_tensorboard_writer_names_the_missing_package(storage: Path) -> None:
    import importlib.util

    if importlib.util.find_spec("tensorboard") is not None:
        pytest.skip("tensorboard is installed")
    with pytorch.init(hparams={"global_batch_size": BATCH}, checkpoint_storage=str(storage)) as ctx:
        with pytest.raises(ImportError, match="needs the 'tensorboard' package.*pip install"):
            ctx.get_tensorboard_writer()
        with pytest.raises(pytorch.InvalidTrialError, match=r"get_trial_seed\(\): no trial seed"):
            ctx.get_trial_seed()
        assert (ctx.get_trial_id(), ctx.get_experiment_id()) == (0, 0)
        assert ctx.get_per_slot_batch_size() == ctx.get_global_batch_size() == BATCH
        with pytest.raises(pytorch.InvalidTrialError, match="no such hyperparameter"):
            ctx.get_hparam("lr")

"""The PyTorch Trainer API on two ranks without the daemon, as in Determined's Trainer guide:
`torchrun --nproc_per_node=2 train.py` (the script builds its DistributedContext), and the same
script under det-local's launcher with no DistributedContext given (pytorch.init() picks up the
torchrun world). DDP over gloo; a custom MetricReducer (F1) is computed across ranks from the
pooled counts, not averaged; the result equals the one-process run with the same global
batch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from det_local.launch.ports import allocate_ports
from tests.support import paths

REPO = paths.REPO
COMPAT = REPO / "det_local" / "compat"

TRAIN = r"""
import json, os, sys
import torch
import torch.distributed as dist
import determined as det
from determined import core, pytorch

N = 64


class F1(pytorch.MetricReducer):
    def __init__(self):
        self.reset()

    def reset(self):
        self.tp = self.fp = self.fn = 0

    def update(self, pred, label):
        self.tp += int(((pred == 1) & (label == 1)).sum())
        self.fp += int(((pred == 1) & (label == 0)).sum())
        self.fn += int(((pred == 0) & (label == 1)).sum())

    def per_slot_reduce(self):
        return self.tp, self.fp, self.fn

    def cross_slot_reduce(self, per_slot):
        tp, fp, fn = (sum(x) for x in zip(*per_slot))
        return 2 * tp / (2 * tp + fp + fn) if tp + fp + fn else None  # training: no counts


class Data(torch.utils.data.Dataset):
    def __len__(self):
        return N

    def __getitem__(self, i):
        return torch.tensor([i / N]), torch.tensor([float(i % 3 == 0)]), torch.tensor(i)


class Trial(pytorch.PyTorchTrial):
    def __init__(self, context):
        self.context = context
        model = torch.nn.Linear(1, 1)
        torch.nn.init.constant_(model.weight, 0.5)
        torch.nn.init.constant_(model.bias, 0.0)
        self.model = context.wrap_model(model)
        self.opt = context.wrap_optimizer(torch.optim.SGD(self.model.parameters(), lr=0.5))
        self.f1 = context.wrap_reducer(F1(), name="f1")
        self.seen = []

    def train_batch(self, batch, epoch_idx, batch_idx):
        x, y, idx = batch
        self.seen += idx.tolist()
        loss = torch.nn.functional.mse_loss(self.model(x), y)
        self.context.backward(loss)
        self.context.step_optimizer(self.opt)
        return {"loss": loss}

    def evaluate_batch(self, batch):
        x, y, idx = batch
        self.f1.update((idx % 2 == 0).long(), y.long())
        return {"val_loss": torch.nn.functional.mse_loss(self.model(x), y)}

    def build_training_data_loader(self):
        return pytorch.DataLoader(Data(), batch_size=self.context.get_per_slot_batch_size())

    def build_validation_data_loader(self):
        return pytorch.DataLoader(Data(), batch_size=self.context.get_per_slot_batch_size())


out = sys.argv[1]
distributed = None
if sys.argv[2] == "explicit":  # Determined's Trainer guide
    dist.init_process_group("gloo")
    distributed = core.DistributedContext.from_torch_distributed()
with pytorch.init(
    distributed=distributed, hparams={"global_batch_size": 8}, checkpoint_storage=out + "/ckpt"
) as context:
    validations = []
    report = context._core.train.report_validation_metrics

    def record(steps_completed, metrics):
        validations.append(metrics)
        report(steps_completed, metrics)

    context._core.train.report_validation_metrics = record
    trial = Trial(context)
    pytorch.Trainer(trial, context).fit(max_length=pytorch.Batch(6))
    rank = context.distributed.get_rank()
    model = trial.model.module if hasattr(trial.model, "module") else trial.model
    facts = {
        "size": context.distributed.get_size(),
        "ddp": hasattr(trial.model, "module"),
        "per_slot": context.get_per_slot_batch_size(),
        "weight": model.weight.item(),
        "bias": model.bias.item(),
        "seen": trial.seen,
        "validations": validations,
    }
    json.dump(facts, open(f"{out}/facts-{rank}.json", "w"))
"""


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(COMPAT), str(REPO)])
    env.update({k: str(v) for k, v in allocate_ports().items()})
    for name in ("DET_LOCAL_INFO_DIR", "DET_LOCAL_SOCKET", "DET_SLOT_IDS"):
        env.pop(name, None)
    return env


def _facts(path: Path, rank: int) -> dict:
    return json.loads((path / f"facts-{rank}.json").read_text())


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("single")
    (out / "train.py").write_text(TRAIN)
    subprocess.run(
        [sys.executable, "train.py", str(out), "auto"], cwd=out, env=_env(), check=True, timeout=120
    )
    return _facts(out, 0)


def _expected_f1() -> float:
    tp = sum(1 for i in range(64) if i % 2 == 0 and i % 3 == 0)
    fp = sum(1 for i in range(64) if i % 2 == 0 and i % 3 != 0)
    fn = sum(1 for i in range(64) if i % 2 != 0 and i % 3 == 0)
    return 2 * tp / (2 * tp + fp + fn)


def _check_two_ranks(out: Path, single: dict) -> None:
    chief, worker = _facts(out, 0), _facts(out, 1)
    assert chief["size"] == worker["size"] == 2
    assert chief["ddp"] and chief["per_slot"] == 4
    # each rank trained on its own half of every global batch
    assert sorted(chief["seen"] + worker["seen"]) == sorted(single["seen"])
    assert not set(chief["seen"]) & set(worker["seen"])
    # DDP: same model on both ranks, and the same as one process with the same global batch
    for key in ("weight", "bias"):
        assert chief[key] == pytest.approx(worker[key], abs=1e-7)
        assert chief[key] == pytest.approx(single[key], abs=1e-5)
    # F1 from the pooled counts of both ranks (not the mean of per-rank F1s)
    (val,) = chief["validations"]
    assert val["f1"] == pytest.approx(_expected_f1())
    assert single["validations"][0]["f1"] == pytest.approx(_expected_f1())
    assert val["val_loss"] == pytest.approx(single["validations"][0]["val_loss"], rel=1e-4)
    assert worker["validations"] == []  # only the chief reports


def test_torchrun_trainer_guide(tmp_path: Path, single: dict) -> None:
    (tmp_path / "train.py").write_text(TRAIN)
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
         "--master_port", _env()["C10D_PORT"], "train.py", str(tmp_path), "explicit"],
        cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    _check_two_ranks(tmp_path, single)


def test_det_local_launcher_without_a_context(tmp_path: Path, single: dict) -> None:
    (tmp_path / "train.py").write_text(TRAIN)
    env = _env()
    env["DET_SLOT_IDS"] = "[0, 1]"
    proc = subprocess.run(
        [sys.executable, "-m", "det_local.launch.torch_distributed",
         "python3", "train.py", str(tmp_path), "auto"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    _check_two_ranks(tmp_path, single)

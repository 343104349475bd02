"""GPU checks anyone with an NVIDIA machine can rerun (issue 28): ``make gpu-check`` runs them
with bench/trainer_overhead.py --device cuda and prints one summary (bench/gpu_check.py). Each
test is marked ``gpu`` and skipped without an NVIDIA GPU (NVML and torch.cuda both see one).

A trial through a root daemon on the real GPU (its UUID in CUDA_VISIBLE_DEVICES, training on
cuda:0); warm trials on the GPU (CUDA initialised only after the fork, in the trial); AMP through
the Trainer with its GradScaler checkpointed and restored; two trials sharing the machine's GPUs
each getting its own (two GPUs or more); the --device cuda benchmark."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support.paths import REPO
from tests.support.trials.warm import serial_grid, trial_facts
from tests.support.world import Env, wait_for


def _nvml_uuids() -> list[str]:
    """The UUIDs of this machine's NVIDIA GPUs (NVML), [] without one."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            out = []
            for i in range(pynvml.nvmlDeviceGetCount()):
                uuid = pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(i))
                out.append(uuid.decode() if isinstance(uuid, bytes) else str(uuid))
            return out
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - no driver, no library: no GPU
        return []


def _torch_cuda() -> bool:
    """torch sees a GPU (asked in a child: CUDA is never initialised in the test process)."""
    code = "import torch; print(torch.cuda.is_available())"
    try:
        r = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
        )
    except (OSError, subprocess.SubprocessError):
        return False
    return r.stdout.strip() == "True"


UUIDS = _nvml_uuids()
HAVE_GPU = bool(UUIDS) and _torch_cuda()
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not HAVE_GPU, reason="needs an NVIDIA GPU (NVML and torch.cuda)"),
]

# Trains a few steps on cuda:0 and writes what it saw to OUT/<trial id>.json.
ON_GPU = r"""
import sys
warm = "torch" in sys.modules
import json, os, time
import torch
import determined as det

trial_id = int(os.environ["DET_TRIAL_ID"])
home = os.environ["DET_LOCAL_HOME"]
gates = dict(item.split(":") for item in os.environ.get("WAIT_ZYGOTE", "").split(",") if item)
zsock = os.path.join(home, "run", "z", gates.get(str(trial_id), "-"), "s")
deadline = time.monotonic() + 120
while str(trial_id) in gates and not os.path.exists(zsock):
    assert time.monotonic() < deadline, "no zygote"
    time.sleep(0.05)
initialised_at_start = torch.cuda.is_initialized()
model = torch.nn.Linear(64, 8).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(5):
    opt.zero_grad()
    loss = model(torch.randn(32, 64, device="cuda")).square().mean()
    loss.backward()
    opt.step()
facts = {
    "warm": warm,
    "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
    "count": torch.cuda.device_count(),
    "device": str(next(model.parameters()).device),
    "name": torch.cuda.get_device_name(0),
    "initialised_at_start": initialised_at_start,
}
with open(os.path.join(os.environ["OUT"], f"{trial_id}.json"), "w") as f:
    json.dump(facts, f)
gate = os.environ.get("HOLD")
while gate and not os.path.exists(gate):
    assert time.monotonic() < deadline + 120, "no release"
    time.sleep(0.05)
with det.core.init() as core:
    core.train.report_training_metrics(steps_completed=1, metrics={"loss": float(loss)})
"""


def _gpu_search(dl: Env, out: Path, n: int, env: dict[str, str], **resources: Any) -> Path:
    cfg = serial_grid(out, env, n)
    cfg["resources"] = {"slots_per_trial": 1, **resources}
    path, ctx = dl.context(ON_GPU, cfg)
    return path


def test_a_trial_through_a_root_daemon_trains_on_its_gpu(dl: Env) -> None:
    out = dl.tmp / "out"
    out.mkdir()
    dl.daemon_start()
    cfg = _gpu_search(dl, out, 1, {})
    r = dl.det("experiment", "create", cfg, cfg.parent)
    assert r.rc == 0, r
    wait_for(lambda: dl.experiment(1).state.value == "COMPLETED", timeout=300, what="the trial")
    seen = trial_facts(out)[1]
    assert seen["visible"] in UUIDS and seen["visible"].startswith("GPU-"), seen
    assert seen["count"] == 1 and seen["device"] == "cuda:0", seen
    [job] = dl.jobs()
    assert len(job.slots) == 1


def test_warm_trials_initialise_cuda_after_the_fork_and_train_on_it(dl: Env) -> None:
    out = dl.tmp / "out"
    out.mkdir()
    cfg = _gpu_search(dl, out, 3, {"WAIT_ZYGOTE": "1:1.1"})
    r = dl.det("run", "-q", cfg, cfg.parent, timeout=600)
    assert r.rc == 0, r
    facts = trial_facts(out)
    assert [facts[i]["warm"] for i in (1, 2, 3)] == [False, True, True], facts
    for seen in facts.values():
        # the zygote never initialised CUDA: each trial did, after the fork, on its own GPU
        assert seen["initialised_at_start"] is False, seen
        assert seen["device"] == "cuda:0" and seen["visible"] in UUIDS, seen
    assert not [e for e in dl.events(1) if "cold" in e], dl.events(1)


def test_two_trials_each_get_their_own_gpu(dl: Env) -> None:
    if len(UUIDS) < 2:
        pytest.skip(f"needs two GPUs; this machine has {len(UUIDS)}")
    out = dl.tmp / "out"
    out.mkdir()
    dl.daemon_start()
    release = dl.tmp / "release"
    cfg = serial_grid(out, {"HOLD": str(release), "DET_LOCAL_WARM_START": "off"}, 2)
    cfg["searcher"]["max_concurrent_trials"] = 2
    cfg["resources"] = {"slots_per_trial": 1}
    path, ctx = dl.context(ON_GPU, cfg)
    assert dl.det("experiment", "create", path, ctx).rc == 0
    wait_for(lambda: len(trial_facts(out)) == 2, timeout=300, what="both trials on their GPUs")
    facts = trial_facts(out)
    release.touch()
    wait_for(lambda: dl.experiment(1).state.value == "COMPLETED", timeout=300, what="the end")
    visible = sorted(f["visible"] for f in facts.values())
    assert len(set(visible)) == 2 and set(visible) <= set(UUIDS), facts
    assert all(f["count"] == 1 and f["device"] == "cuda:0" for f in facts.values()), facts


AMP_TRIAL = r"""
import torch
from determined import pytorch


class AmpTrial(pytorch.PyTorchTrial):
    def __init__(self, context):
        self.context = context
        init_scale = float(context.get_hparam("init_scale"))
        self.scaler = context.wrap_scaler(torch.amp.GradScaler("cuda", init_scale=init_scale))
        self.model = context.wrap_model(torch.nn.Linear(32, 4))
        self.opt = context.wrap_optimizer(torch.optim.SGD(self.model.parameters(), lr=0.01))

    def train_batch(self, batch, epoch_idx, batch_idx):
        x, y = batch
        with torch.autocast("cuda", dtype=torch.float16):
            loss = torch.nn.functional.cross_entropy(self.model(x), y)
        self.context.backward(self.scaler.scale(loss))
        self.context.step_optimizer(self.opt, scaler=self.scaler)
        self.scaler.update()
        return {"loss": loss, "scale": self.scaler.get_scale()}

    def evaluate_batch(self, batch):
        x, y = batch
        return {"val_loss": torch.nn.functional.cross_entropy(self.model(x), y)}

    def _data(self):
        g = torch.Generator().manual_seed(0)
        ds = torch.utils.data.TensorDataset(
            torch.randn(64, 32, generator=g), torch.randint(0, 4, (64,), generator=g)
        )
        return pytorch.DataLoader(ds, batch_size=8)

    build_training_data_loader = _data
    build_validation_data_loader = _data
"""

AMP_FIT = r"""
import json, sys
import torch
from determined import pytorch
from amp_trial import AmpTrial

storage, latest, batches, init = sys.argv[1], sys.argv[2] or None, int(sys.argv[3]), sys.argv[4]
hparams = {"global_batch_size": 8, "init_scale": float(init)}
with pytorch.init(hparams=hparams, checkpoint_storage=storage) as context:
    trial = AmpTrial(context)
    pytorch.Trainer(trial, context).fit(
        max_length=pytorch.Batch(batches),
        latest_checkpoint=latest,
        checkpoint_period=pytorch.Batch(4),
    )
    print(json.dumps({"scale": trial.scaler.get_scale(),
                      "device": str(next(trial.model.parameters()).device),
                      "state": {k: v for k, v in trial.scaler.state_dict().items()
                                if isinstance(v, (int, float))}}))
"""


def test_amp_through_the_trainer_checkpoints_and_restores_the_scaler(tmp_path: Path) -> None:
    (tmp_path / "amp_trial.py").write_text(AMP_TRIAL)
    (tmp_path / "fit.py").write_text(AMP_FIT)
    storage = tmp_path / "ckpts"
    env = {**os.environ, "PYTHONPATH": f"{REPO / 'det_local' / 'compat'}{os.pathsep}{REPO}"}

    def fit(latest: str, batches: int, init_scale: float) -> dict[str, Any]:
        r = subprocess.run(
            [sys.executable, "fit.py", str(storage), latest, str(batches), str(init_scale)],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        assert r.returncode == 0, r.stderr[-3000:]
        return dict(json.loads(r.stdout.strip().splitlines()[-1]))

    first = fit("", 8, 2.0**10)
    assert first["device"] == "cuda:0"
    ckpts = sorted(
        (json.loads((d / "metadata.json").read_text())["steps_completed"], d)
        for d in storage.iterdir()
    )
    steps, last = ckpts[-1]
    assert steps == 8
    import torch

    saved = torch.load(last / "state_dict.pth", map_location="cpu", weights_only=False)
    scaler_state = saved["scaler_state_dict"]
    assert scaler_state["scale"] == first["scale"]
    # a run resumed at batch 8 whose own GradScaler starts elsewhere (init_scale 16) has the
    # checkpoint's: its scale and growth tracker
    resumed = fit(last.name, 8, 16.0)
    assert resumed["state"] == first["state"], (first, resumed)
    assert resumed["scale"] == first["scale"] != 16.0


def test_trainer_overhead_bench_runs_on_the_gpu(tmp_path: Path) -> None:
    r = subprocess.run(
        [sys.executable, str(REPO / "bench" / "trainer_overhead.py"), "--device", "cuda",
         "--runs", "3", "--batches", "200", "--warmup", "30"],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert "skipped" not in result, result
    for kind in ("cuda", "amp"):
        assert result[f"{kind}_raw_ms_per_batch"] > 0 and result[f"{kind}_trainer_ms_per_batch"] > 0
    assert result["fp32_weights_identical"] is True, result

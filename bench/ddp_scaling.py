"""DDP scaling on CPU slots: training samples/s at 2 ranks against 1 rank, for
examples/digits_pytorch run by det-local and for a hand-written DDP script, in the same run.

(a) det-local: a copy of examples/digits_pytorch, its distributed.yaml with slots_per_trial 1
    and 2 (entrypoint ``python3 -m determined.launch.torch_distributed python3 train.py
    --batches N``), each run by ``det-local run -q`` on 2 CPU slots (embedded engine,
    throwaway DET_LOCAL_HOME);
(b) raw: plain ``torch.distributed`` + DDP over gloo, launched with ``torchrun
    --nproc_per_node 1|2``: the same data (scikit-learn digits, same 80/20 split), the same MLP
    (64-64-10, SGD lr 0.05 momentum 0.9), the same global batch (64, 32 per rank at 2 ranks),
    DistributedSampler with shuffle and drop_last, and the loss averaged across ranks every 100
    batches, as det-local's Trainer reports it.

What is timed, both ways, is the training phase only, by the trial's own clock, in windows of
100 batches from batch 100 (the first 100 are warm-up) to batch N. For det-local the window
ends are the ``time`` of the chief's training-metric reports in the store (taken in the trial
when it reports, after the cross-rank gather), less the pause at the window's start: the
validation the example runs every 100 batches and the checkpoint Trainer.fit() takes after a
best-so-far validation (the pause lasts from the training report to the later of the
validation report's time and the checkpoint's record time at that batch); for raw, rank 0's
clock after the same cross-rank loss average. Process start-up, rendezvous, the final
validation and checkpoint are outside. A run's samples/s is 100 x 64 / its median window (a
burst of other work on a shared box spoils a window, not the run); speedup = samples/s at 2
ranks / samples/s at 1 rank.

Intra-op threads: every worker of both ways gets OMP_NUM_THREADS = one CPU slot's share of the
cores (cores // 2 with the 2 CPU slots used here), which is what det-local itself gives a trial
on CPU slots (a 1-slot trial: its share; a 2-slot trial: the whole machine split among its 2
ranks); --omp-threads N sets another value for both. Without it the comparison would not be
like for like: the raw 1-rank run would use every core while det-local's 1-slot trial holds
half the machine. On a box shared with other work, 2 intra-op threads on 2 cores collapse when
a core is taken away (OpenMP's barriers wait on the descheduled thread: 15x slower here).

The four modes alternate, --runs times each after one dropped warm-up of each; the figures are
medians. On a small CPU box the 2-rank speedup may be below 1 for both: the tiny MLP's gloo
all-reduce costs more than the halved compute saves. The target compares the two speedups.

Target: det_local_speedup >= 0.95 x raw_speedup.

Usage: python3 bench/ddp_scaling.py [--runs 5] [--batches 1100] [--omp-threads N]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from _common import det_local_cmd, env_with_home  # noqa: E402

from det_local.launch.ports import allocate_ports  # noqa: E402
from det_local.store.db import Store  # noqa: E402

EXAMPLE = REPO / "examples" / "digits_pytorch"
GLOBAL_BATCH = 64
WINDOW = 100  # the example reports training metrics (and validates) every 100 batches
WARMUP_BATCHES = WINDOW
MODES = ("det_local_1", "det_local_2", "raw_1", "raw_2")

# The hand-written DDP script: what a user writes without det-local.
RAW = r"""
import json, os, sys, time
import torch
import torch.distributed as dist
from sklearn.datasets import load_digits
from torch import nn

out, total, warmup, every = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)

digits = load_digits()
x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
y = torch.tensor(digits.target, dtype=torch.long)
order = torch.randperm(len(x), generator=torch.Generator().manual_seed(1234))
train = torch.utils.data.TensorDataset(x[order[int(len(x) * 0.2):]], y[order[int(len(x) * 0.2):]])
sampler = torch.utils.data.distributed.DistributedSampler(
    train, num_replicas=world, rank=rank, shuffle=True, seed=0, drop_last=True
)
loader = torch.utils.data.DataLoader(
    train, batch_size=GLOBAL_BATCH // world, sampler=sampler, drop_last=True
)

model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Dropout(0.0), nn.Linear(64, 10))
if world > 1:
    model = nn.parallel.DistributedDataParallel(model)
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
loss_fn = nn.CrossEntropyLoss()

stamps = {}
losses = []
batches, epoch = 0, 0
while batches < total:
    sampler.set_epoch(epoch)
    for data, labels in loader:
        loss = loss_fn(model(data), labels)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
        batches += 1
        if batches % every == 0:  # log the loss averaged over ranks, as a trainer reports it
            avg = torch.stack(losses).mean()
            if world > 1:
                dist.all_reduce(avg)
                avg /= world
            losses = []
            if rank == 0 and batches >= warmup:
                stamps[batches] = time.time()
        if batches >= total:
            break
    epoch += 1
if rank == 0:
    with open(out, "w") as f:
        json.dump({"stamps": stamps, "loss": avg.item()}, f)
dist.barrier()
os._exit(0)  # skip gloo's teardown: its exit-time races (SIGABRT) are not what is measured
""".replace("GLOBAL_BATCH", str(GLOBAL_BATCH))


OMP_THREADS: int | None = None  # --omp-threads


def clean_env(home: str) -> dict[str, str]:
    env = env_with_home(home)
    env.update(DET_LOCAL_FAKE_GPUS="0", DET_LOCAL_CPU_SLOTS="2", PYTHONUNBUFFERED="1")
    env.pop("OMP_NUM_THREADS", None)  # torchrun's own default, both ways
    if OMP_THREADS is not None:  # the embedded engine passes its environment to the trials
        env["OMP_NUM_THREADS"] = str(OMP_THREADS)
    for var in ("DET_LOCAL_SOCKET", "DET_LOCAL_TOKEN", "DET_LOCAL_INFO_DIR", "DET_SLOT_IDS"):
        env.pop(var, None)
    return env


def write_configs(ctx: Path, batches: int) -> dict[int, Path]:
    """distributed.yaml with 1 and 2 slots; the same global batch size."""
    base = yaml.safe_load((EXAMPLE / "distributed.yaml").read_text())
    assert base["hyperparameters"]["global_batch_size"] == GLOBAL_BATCH, base
    configs = {}
    for slots in (1, 2):
        cfg = dict(base)
        cfg["name"] = f"ddp_scaling_{slots}"
        cfg["resources"] = {"slots_per_trial": slots}
        cfg["entrypoint"] = re.sub(r"--batches \d+", f"--batches {batches}", base["entrypoint"])
        assert f"--batches {batches}" in cfg["entrypoint"], cfg["entrypoint"]
        path = ctx / f"ddp_scaling_{slots}.yaml"
        path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        configs[slots] = path
    return configs


def run_det_local(home: str, config: Path, ctx: Path, batches: int) -> float:
    """samples/s of one `det-local run`, from the chief's metric report times."""
    proc = subprocess.run(
        [*det_local_cmd(), "run", "-q", str(config), str(ctx)],
        env=clean_env(home),
        capture_output=True,
        text=True,
    )
    found = re.search(r"Created experiment (\d+)", proc.stdout + proc.stderr)
    if proc.returncode != 0 or not found:
        raise SystemExit(
            f"det-local run {config.name} failed ({proc.returncode}): "
            f"{(proc.stdout + proc.stderr)[-3000:]}"
        )
    store = Store(Path(home) / "det-local.db", readonly=True)
    try:
        (trial,) = store.list_trials(int(found.group(1)))
        training = {m.steps_completed: m.time for m in store.list_metrics(trial.id, "training")}
        validation = {m.steps_completed: m.time for m in store.list_metrics(trial.id, "validation")}
        checkpoints = {
            c.steps_completed: c.created_at for c in store.list_checkpoints(trial_id=trial.id)
        }
    finally:
        store.close()
    windows = []
    for s in range(WARMUP_BATCHES, batches, WINDOW):
        # less the pause at its start: a validation, and the checkpoint that follows it when it
        # was the best so far (Trainer.fit's checkpoint_policy "best"); each ends when its report
        # reaches the store
        pause = max(validation[s], checkpoints.get(s, 0.0)) - training[s]
        windows.append(training[s + WINDOW] - training[s] - pause)
    return WINDOW * GLOBAL_BATCH / statistics.median(windows)


def run_raw(workdir: Path, ranks: int, batches: int) -> float:
    """samples/s of the hand-written DDP script under torchrun."""
    out = workdir / "raw.json"
    out.unlink(missing_ok=True)
    env = clean_env(str(workdir / "unused-home"))
    ports = allocate_ports()
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
        "--nproc_per_node", str(ranks), "--master_addr", "127.0.0.1",
        "--master_port", str(ports["C10D_PORT"]),
        str(workdir / "raw_ddp.py"), str(out), str(batches), str(WARMUP_BATCHES), str(WINDOW),
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True)
    if proc.returncode != 0 or not out.exists():
        raise SystemExit(
            f"raw DDP at {ranks} ranks failed ({proc.returncode}): {proc.stderr[-3000:]}"
        )
    stamps = {int(k): v for k, v in json.loads(out.read_text())["stamps"].items()}
    windows = [stamps[s + WINDOW] - stamps[s] for s in range(WARMUP_BATCHES, batches, WINDOW)]
    return WINDOW * GLOBAL_BATCH / statistics.median(windows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument(
        "--batches", type=int, default=1100, help="batches per run, a multiple of 100 over 100"
    )
    parser.add_argument(
        "--omp-threads",
        type=int,
        help="OMP_NUM_THREADS for every worker (default: one CPU slot's share, cores // 2)",
    )
    args = parser.parse_args()
    global OMP_THREADS
    OMP_THREADS = args.omp_threads or max(1, (os.cpu_count() or 1) // 2)
    if args.batches % 100 or args.batches <= WARMUP_BATCHES:
        parser.error("--batches must be a multiple of 100, more than 100")
    with tempfile.TemporaryDirectory(prefix="det-local-bench-ddp-") as tmp:
        home = os.path.join(tmp, "home")
        ctx = Path(tmp) / "digits_pytorch"
        shutil.copytree(EXAMPLE, ctx, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        configs = write_configs(ctx, args.batches)
        workdir = Path(tmp) / "raw"
        workdir.mkdir()
        (workdir / "raw_ddp.py").write_text(RAW)

        def measure(mode: str) -> float:
            kind, ranks = mode.rsplit("_", 1)
            if kind == "det_local":
                return run_det_local(home, configs[int(ranks)], ctx, args.batches)
            return run_raw(workdir, int(ranks), args.batches)

        rates: dict[str, list[float]] = {mode: [] for mode in MODES}
        for mode in MODES:  # warm-up: page cache, .pyc files
            measure(mode)
        for i in range(args.runs):
            order = MODES if i % 2 == 0 else tuple(reversed(MODES))
            for mode in order:
                rates[mode].append(measure(mode))
                print(f"run {i + 1} {mode}: {rates[mode][-1]:.0f} samples/s", flush=True)

    med = {mode: statistics.median(values) for mode, values in rates.items()}
    det_speedup = med["det_local_2"] / med["det_local_1"]
    raw_speedup = med["raw_2"] / med["raw_1"]
    for mode in MODES:
        print(f"{mode:12s} samples/s: {' '.join(f'{v:.0f}' for v in rates[mode])}")
    result: dict[str, Any] = {
        "det_local_speedup": round(det_speedup, 3),
        "raw_speedup": round(raw_speedup, 3),
        "ratio": round(det_speedup / raw_speedup, 3),
        "samples_per_s": {mode: round(v, 1) for mode, v in med.items()},
        "det_local_vs_raw_at_2": round(med["det_local_2"] / med["raw_2"], 3),
        "det_local_vs_raw_at_1": round(med["det_local_1"] / med["raw_1"], 3),
        "global_batch_size": GLOBAL_BATCH,
        "timed_batches": args.batches - WARMUP_BATCHES,
        "window_batches": WINDOW,
        "runs": args.runs,
        "omp_threads": OMP_THREADS,
        "cpus": os.cpu_count(),
        "target_met": det_speedup >= 0.95 * raw_speedup,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()

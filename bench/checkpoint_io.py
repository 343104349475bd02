"""Checkpoint I/O: saving and restoring a ~300 MB PyTorchTrial state through det-local's own
checkpoint code, next to the disk's bandwidth measured with dd in the same directory, same run.

The state is a 6 x Linear(2048, 2048) model with Adam's state (weights + exp_avg + exp_avg_sq,
about 302 MB), wrapped by a PyTorchTrial under pytorch.init() off-cluster.

* save: _checkpoint.capture() + _checkpoint.write(fsync=True), the function the Trainer's
  checkpoints run (async ones with fsync), against ``dd if=/dev/zero bs=1M count=300
  conv=fdatasync``: both include getting the data onto the disk.
* restore: _checkpoint.read_state_dict() + _checkpoint.restore() (torch.load, then the weights
  and optimizer state loaded into the trial), against ``dd of=/dev/null bs=1M``; both files are
  dropped from the page cache first (posix_fadvise DONTNEED after an fsync).
* training blocked per checkpoint: Trainer.fit() with and without
  context.experimental.enable_async_checkpointing(), from Trainer.checkpoint_timings; each fit
  trains one batch and checkpoints once, so no earlier write is waited for. d2h_ms is the bare
  copy of every state tensor (clone, on a CPU) that an async snapshot cannot avoid, timed just
  before each async fit; async_block_minus_d2h_ms is the median of their paired differences.
* save_crc_mb_s: plain torch.save (zip CRC-32 on, as before) + fsync, for comparison.

MB is 10^6 bytes, as dd prints. Each figure is the median of --runs rounds; within a round the
measurements alternate. Targets: save_mb_s >= 0.7 * disk_write_mb_s, restore_mb_s >= 0.7 *
disk_read_mb_s, async_block_ms <= d2h_ms (within noise).

Usage: python3 bench/checkpoint_io.py [--runs 7] [--dir DIR (default: the temp directory)]
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
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from det_local.trial import pytorch  # noqa: E402
from det_local.trial.pytorch.checkpoints import _checkpoint  # noqa: E402

WIDTH, LAYERS, BATCH = 2048, 6, 4
DD_MB = 300


class BigTrial(pytorch.PyTorchTrial):
    def __init__(self, context: pytorch.PyTorchTrialContext) -> None:
        self.context = context
        torch.manual_seed(0)
        layers: list[torch.nn.Module] = []
        for _ in range(LAYERS):
            layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU()]
        self.model = context.wrap_model(torch.nn.Sequential(*layers))
        self.opt = context.wrap_optimizer(torch.optim.Adam(self.model.parameters(), lr=1e-4))

    def train_batch(self, batch: Any, epoch_idx: int, batch_idx: int) -> Any:
        (x,) = batch
        loss = self.model(x).pow(2).mean()
        self.context.backward(loss)
        self.context.step_optimizer(self.opt)
        return loss

    def evaluate_batch(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        return {"val": 0.0}

    def build_training_data_loader(self) -> Any:
        data = torch.utils.data.TensorDataset(torch.randn(BATCH * 4, WIDTH))
        return pytorch.DataLoader(data, batch_size=BATCH)

    def build_validation_data_loader(self) -> Any:
        data = torch.utils.data.TensorDataset(torch.zeros(BATCH, WIDTH))
        return pytorch.DataLoader(data, batch_size=BATCH)


# ---------------------------------------------------------------------------- helpers
def drop_cache(path: Path) -> None:
    """Write the file's pages back and drop them from the page cache (no root needed)."""
    paths = [p for p in path.rglob("*") if p.is_file()] if path.is_dir() else [path]
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def dd_seconds(argv: list[str]) -> float:
    proc = subprocess.run(argv, capture_output=True, text=True, check=True)
    match = re.search(r"copied, ([0-9.]+) s", proc.stderr)
    if not match:
        raise SystemExit(f"cannot read dd's timing from: {proc.stderr.strip()}")
    return float(match.group(1))


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def ms(seconds: float) -> float:
    return seconds * 1000


def med(values: list[float], digits: int = 1) -> float:
    return round(statistics.median(values), digits)


def fit_once(trainer: pytorch.Trainer, storage: Path) -> dict[str, Any]:
    trainer.fit(max_length=pytorch.Batch(1), checkpoint_policy="none")
    timing = trainer.checkpoint_timings[-1]
    shutil.rmtree(storage / timing["uuid"])
    os.sync()  # no write-back left over to slow the next measurement
    return timing


# ---------------------------------------------------------------------------- main
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--dir", default=None, help="where to write (default: temp directory)")
    args = parser.parse_args()
    import logging

    logging.disable(logging.WARNING)
    root = Path(tempfile.mkdtemp(prefix="det-local-ckpt-bench-", dir=args.dir))
    cwd = os.getcwd()
    try:
        work = root / "work"  # the trial's working directory (a checkpoint copies it to code/)
        work.mkdir()
        os.chdir(work)
        result = run(root, args.runs)
    finally:
        os.chdir(cwd)
        shutil.rmtree(root, ignore_errors=True)
    print(
        f"state {result['state_mb']} MB in {result['dir']} (median of {args.runs}):\n"
        f"  disk (dd): write+fdatasync {result['disk_write_mb_s']} MB/s, "
        f"read {result['disk_read_mb_s']} MB/s\n"
        f"  det-local save+fsync {result['save_mb_s']} MB/s ({result['save_ms']} ms, "
        f"{result['save_vs_disk']:.0%} of disk; torch.save with CRC: "
        f"{result['save_crc_mb_s']} MB/s)\n"
        f"  det-local restore {result['restore_mb_s']} MB/s ({result['restore_ms']} ms, "
        f"{result['restore_vs_disk']:.0%} of disk)\n"
        f"  training blocked per checkpoint: sync {result['sync_save_ms']} ms, async "
        f"{result['async_block_ms']} ms (host copy alone {result['d2h_ms']} ms)"
    )
    print(json.dumps(result))


def run(root: Path, runs: int) -> dict[str, Any]:
    storage = root / "checkpoints"
    with pytorch.init(
        hparams={"global_batch_size": BATCH},
        checkpoint_storage=str(storage),
        enable_tensorboard_logging=False,
    ) as context:
        trial = BigTrial(context)
        trainer = pytorch.Trainer(trial, context)
        fit_once(trainer, storage)  # warm-up; Adam's state exists from here on
        tensors = [
            t
            for state in (trial.model.state_dict(), trial.opt.state_dict()["state"])
            for t in _tensors(state)
        ]
        state_bytes = sum(t.numel() * t.element_size() for t in tensors)

        disk_w, disk_r, save, save_crc, restore, load_only, d2h, nbytes = ([] for _ in range(8))
        sync_block: list[float] = []
        async_timings: list[dict[str, Any]] = []
        for i in range(runs):
            # the disk
            f = root / f"dd-{i}"
            disk_w.append(
                dd_seconds(
                    ["dd", "if=/dev/zero", f"of={f}", "bs=1M", f"count={DD_MB}", "conv=fdatasync"]
                )
            )
            drop_cache(f)
            disk_r.append(dd_seconds(["dd", f"if={f}", "of=/dev/null", "bs=1M"]))
            f.unlink()

            # det-local's writer, fsync included
            ckpt = root / f"ckpt-{i}"
            started = time.perf_counter()
            checkpoint = _checkpoint.capture(context, {})
            _checkpoint.write(
                ckpt,
                checkpoint,
                trial_state={"batches_trained": 1},
                load_data=_checkpoint.load_data_of(context, trial),
                fsync=True,
            )
            save.append(time.perf_counter() - started)
            del checkpoint
            nbytes.append(dir_bytes(ckpt))

            # ... and reading it back into the trial
            drop_cache(ckpt)
            started = time.perf_counter()
            loaded = _checkpoint.read_state_dict(ckpt, "bench")
            load_only.append(time.perf_counter() - started)
            _checkpoint.restore(
                loaded, where="bench", context=context, trial=trial, callbacks={}, saved_spec=None
            )
            restore.append(time.perf_counter() - started)
            del loaded
            shutil.rmtree(ckpt)

            # plain torch.save, CRC on (the writer before det-local turned it off)
            f = root / f"crc-{i}.pth"
            started = time.perf_counter()
            torch.save(_checkpoint.capture(context, {}), str(f))
            fd = os.open(f, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
            save_crc.append(time.perf_counter() - started)
            f.unlink()

            # training blocked: a sync checkpoint, then the bare host copy next to an async one
            context.experimental._async_checkpointing = False
            sync_block.append(fit_once(trainer, storage)["block_ms"])
            started = time.perf_counter()
            copies = [t.detach().to("cpu", copy=True) for t in tensors]
            d2h.append(time.perf_counter() - started)
            del copies
            context.experimental.enable_async_checkpointing()
            async_timings.append(fit_once(trainer, storage))

    mb = statistics.median(nbytes) / 1e6
    dd_mb = DD_MB * 2**20 / 1e6
    result: dict[str, Any] = {
        "save_mb_s": round(mb / statistics.median(save)),
        "restore_mb_s": round(mb / statistics.median(restore)),
        "disk_write_mb_s": round(dd_mb / statistics.median(disk_w)),
        "disk_read_mb_s": round(dd_mb / statistics.median(disk_r)),
        "async_block_ms": med([t["block_ms"] for t in async_timings]),
        "d2h_ms": med([ms(s) for s in d2h]),
        "sync_save_ms": med(sync_block),
        "async_snapshot_ms": med([t["d2h_ms"] for t in async_timings]),
        "async_write_ms": med([t["write_ms"] for t in async_timings]),
        "save_ms": med([ms(s) for s in save]),
        "restore_ms": med([ms(s) for s in restore]),
        "torch_load_ms": med([ms(s) for s in load_only]),
        "save_crc_mb_s": round(mb / statistics.median(save_crc)),
        "state_mb": round(state_bytes / 1e6, 1),
        "checkpoint_mb": round(mb, 1),
        "runs": runs,
        "dir": str(root),
        "sync_save_includes_fsync": True,  # core records a checkpoint only once it is fsynced
        "cache_drop": "fsync + posix_fadvise(DONTNEED)",
        "torch": torch.__version__,
        "async_block_runs_ms": [round(t["block_ms"], 1) for t in async_timings],
        "d2h_runs_ms": [round(ms(c), 1) for c in d2h],
    }
    result["save_vs_disk"] = round(result["save_mb_s"] / result["disk_write_mb_s"], 3)
    result["restore_vs_disk"] = round(result["restore_mb_s"] / result["disk_read_mb_s"], 3)
    result["async_block_vs_d2h"] = round(result["async_block_ms"] / result["d2h_ms"], 3)
    result["async_block_minus_d2h_ms"] = med(
        [t["block_ms"] - ms(c) for t, c in zip(async_timings, d2h, strict=True)], 2
    )
    return result


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []


if __name__ == "__main__":
    main()

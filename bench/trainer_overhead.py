"""Trainer overhead: the same MLP, data and seed trained three ways in one run, timed per batch.

(a) a hand-written PyTorch loop; (b) det-local's pytorch.Trainer off-cluster (pytorch.init +
Trainer.fit, the trial imported as ``from determined import pytorch`` through det-local's
compat package); (c) Determined 0.38.1's own Trainer in local mode, from a virtual environment
this benchmark creates once (``pip install torch==<this torch> determined==0.38.1``) and keeps
under ~/.cache/det-local-bench/. The trial class is the same source for (b) and (c).

Method (after Fabric's parity tests): one thread (torch.set_num_threads(1)); every run trains
--batches batches from scratch and the time per batch is the median interval between the starts
of consecutive train steps after --warmup batches; validation, checkpoints and metric reports
fall outside that window (reporting_period is larger than the run). Each worker process
alternates its modes --runs times after a dropped warm-up run of each; the figures are the
medians over runs. (a) and (b) share one process; (c) runs in the Determined environment with a
hand-written loop beside it as that process's own baseline. The det-local Trainer and the loop
see the same batches in the same order, so their final weights must be bit-identical.

The model runs' differences are at the edge of this machine's noise, so each process also times
the loop alone: a trial whose step is a token op against the loader with the same op, over
longer runs (det_local_loop_us_per_batch, determined_loop_us_per_batch: median paired
differences). The *_paired_overhead_ms figures are medians of per-round differences.

Launch-bound pair (issue 28): a model whose step costs tens of microseconds (MLP
16-16-4, batch 8), where every microsecond the Trainer spends between two train_batch calls
shows: launch_raw (a hand-written loop) against launch_trainer (the Trainer), --batches x 4
batches each, in the same alternating rounds; each is also run once more per round timed in
its thread's CPU time (cpu_launch_*: immune to waiting for a core on a shared machine).

On a GPU (--device cuda; skipped with a message where there is no CUDA device): the issue's
4-layer MLP (1024 -> 4096 x 3 -> 10), batch 256, data already on the GPU (a dataset that gives
a batch with one index_select), fp32 (cuda_raw/cuda_trainer) and AMP (amp_raw/amp_trainer:
autocast fp16 and a GradScaler, the Trainer's through context.wrap_scaler and
step_optimizer(scaler=...)), alternating rounds, medians of per-batch intervals.

Targets: det_local_ms_per_batch <= raw_ms_per_batch * 1.02 + 0.02; det_local < determined;
weights_identical; launch_trainer <= launch_raw * 1.02 + 5 us; on a GPU, fp32 and AMP trainer
<= raw * 1.02.

Usage: python3 bench/trainer_overhead.py [--batches 400] [--warmup 50] [--runs 11]
       [--skip-determined] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
DETERMINED_VERSION = "0.38.1"
CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "det-local-bench"

SEED = 1234
DIM, HIDDEN, CLASSES, BATCH = 128, 256, 10, 64
EPOCH_BATCHES = 50
EMPTY_FACTOR = 4  # the loop-only runs are this many times longer (their batches are short)
LAUNCH_DIM, LAUNCH_HIDDEN, LAUNCH_CLASSES, LAUNCH_BATCH = 16, 16, 4, 8  # launch-bound CPU pair
GPU_DIM, GPU_HIDDEN, GPU_CLASSES, GPU_BATCH = 1024, 4096, 10, 256  # the GPU pairs


# ---------------------------------------------------------------------------- worker side
def _build(torch: Any) -> tuple[Any, Any]:
    """The model and optimizer, from the global seed."""
    torch.manual_seed(SEED)
    model = torch.nn.Sequential(
        torch.nn.Linear(DIM, HIDDEN),
        torch.nn.ReLU(),
        torch.nn.Linear(HIDDEN, HIDDEN),
        torch.nn.ReLU(),
        torch.nn.Linear(HIDDEN, CLASSES),
    )
    return model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


def _dataset(torch: Any, batches: int = EPOCH_BATCHES) -> Any:
    g = torch.Generator().manual_seed(SEED + 1)
    n = batches * BATCH
    return torch.utils.data.TensorDataset(
        torch.randn(n, DIM, generator=g), torch.randint(0, CLASSES, (n,), generator=g)
    )


def _per_batch_ms(times: list[float], warmup: int) -> float:
    steps = [b - a for a, b in zip(times[warmup:], times[warmup + 1 :], strict=False)]
    return statistics.median(steps) * 1000


def _run_raw(torch: Any, batches: int) -> tuple[list[float], Any]:
    model, opt = _build(torch)
    loader = torch.utils.data.DataLoader(_dataset(torch), batch_size=BATCH)
    times: list[float] = []
    model.train()
    while len(times) < batches:
        for x, y in loader:
            times.append(time.perf_counter())
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            if len(times) == batches:
                break
    return times, model


def _run_empty_raw(torch: Any, batches: int) -> tuple[list[float], Any]:
    """The loader alone and a token step: the floor the loop-only figures are measured from."""
    loader = torch.utils.data.DataLoader(_dataset(torch), batch_size=BATCH)
    times: list[float] = []
    while len(times) < batches:
        for x, _ in loader:
            times.append(time.perf_counter())
            x.sum()
            if len(times) == batches:
                break
    return times, None


def _run_empty_trainer(torch: Any, batches: int) -> tuple[list[float], Any]:
    from determined import pytorch

    base = _trial_class(torch, pytorch)

    class EmptyTrial(base):  # type: ignore[misc,valid-type]
        def train_batch(self, batch: Any, epoch_idx: int, batch_idx: int) -> Any:
            self.times.append(time.perf_counter())
            return {"loss": batch[0].sum()}

    return _fit(pytorch, EmptyTrial, batches).times, None


def _trial_class(torch: Any, pytorch: Any) -> type:
    class MLPTrial(pytorch.PyTorchTrial):  # type: ignore[misc,name-defined]
        def __init__(self, context: Any) -> None:
            self.context = context
            model, opt = _build(torch)
            self.model = context.wrap_model(model)
            self.opt = context.wrap_optimizer(opt)
            self.times: list[float] = []

        def train_batch(self, batch: Any, epoch_idx: int, batch_idx: int) -> Any:
            self.times.append(time.perf_counter())
            x, y = batch
            loss = torch.nn.functional.cross_entropy(self.model(x), y)
            self.context.backward(loss)
            self.context.step_optimizer(self.opt)
            return {"loss": loss}

        def evaluate_batch(self, batch: Any) -> dict[str, Any]:
            x, y = batch
            return {"val_loss": torch.nn.functional.cross_entropy(self.model(x), y)}

        def build_training_data_loader(self) -> Any:
            return pytorch.DataLoader(_dataset(torch), batch_size=BATCH)

        def build_validation_data_loader(self) -> Any:
            return pytorch.DataLoader(_dataset(torch, 1), batch_size=BATCH)

    return MLPTrial


def _run_trainer(torch: Any, batches: int) -> tuple[list[float], Any]:
    from determined import pytorch  # det-local's compat package, or Determined itself

    trial = _fit(pytorch, _trial_class(torch, pytorch), batches)
    return trial.times, trial.model


def _fit(pytorch: Any, trial_cls: type, batches: int) -> Any:
    with pytorch.init(
        hparams={"global_batch_size": BATCH}, enable_tensorboard_logging=False
    ) as context:
        trial = trial_cls(context)
        pytorch.Trainer(trial, context).fit(
            max_length=pytorch.Batch(batches),
            reporting_period=pytorch.Batch(10 * batches),
            checkpoint_policy="none",
        )
    return trial


# ---------------------------------------------------------------------------- launch-bound / GPU
class _Spec:
    """One pair's model, data and step (launch-bound CPU, fp32 GPU or AMP GPU)."""

    def __init__(self, torch: Any, kind: str) -> None:
        self.torch = torch
        self.kind = kind
        self.device = torch.device("cpu" if kind == "launch" else "cuda")
        self.amp = kind == "amp"
        if kind == "launch":
            self.dims = (LAUNCH_DIM, LAUNCH_HIDDEN, LAUNCH_CLASSES, LAUNCH_BATCH, 1)
        else:
            self.dims = (GPU_DIM, GPU_HIDDEN, GPU_CLASSES, GPU_BATCH, 3)

    def build(self) -> tuple[Any, Any]:
        torch = self.torch
        dim, hidden, classes, _, depth = self.dims
        torch.manual_seed(SEED)
        layers: list[Any] = [torch.nn.Linear(dim, hidden), torch.nn.ReLU()]
        for _ in range(depth - 1):
            layers += [torch.nn.Linear(hidden, hidden), torch.nn.ReLU()]
        model = torch.nn.Sequential(*layers, torch.nn.Linear(hidden, classes)).to(self.device)
        return model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def dataset(self) -> Any:
        torch = self.torch
        dim, _, classes, batch, _ = self.dims
        g = torch.Generator().manual_seed(SEED + 1)
        n = EPOCH_BATCHES * batch
        x = torch.randn(n, dim, generator=g).to(self.device)
        y = torch.randint(0, classes, (n,), generator=g).to(self.device)
        if self.device.type == "cpu":
            return torch.utils.data.TensorDataset(x, y)
        return _DeviceBatches(torch, x, y)

    def loader_args(self) -> dict[str, Any]:
        extra = {} if self.device.type == "cpu" else {"collate_fn": _as_is}
        return {"batch_size": self.dims[3], **extra}

    def scaler(self) -> Any:
        return self.torch.amp.GradScaler("cuda") if self.amp else None

    def autocast(self) -> Any:
        import contextlib

        if not self.amp:
            return contextlib.nullcontext()
        return self.torch.autocast("cuda", dtype=self.torch.float16)


class _DeviceBatches:
    """Data already on the GPU: a batch is one index_select per tensor (torch's DataLoader
    fetches a batch through __getitems__ and the collate_fn passes it on)."""

    def __init__(self, torch: Any, x: Any, y: Any) -> None:
        self.torch, self.x, self.y = torch, x, y

    def __len__(self) -> int:
        return int(self.x.shape[0])

    def __getitem__(self, i: int) -> Any:
        return self.x[i], self.y[i]

    def __getitems__(self, idxs: list[int]) -> Any:
        index = self.torch.tensor(idxs, device=self.x.device)
        return self.x.index_select(0, index), self.y.index_select(0, index)


CPU_CLOCK = False  # the launch pair's second figure: this thread's CPU time, not wall time


def _now() -> float:
    """Wall time, or this thread's CPU time while CPU_CLOCK is set: on a shared machine the
    launch-bound pair's differences drown in other processes' load; CPU time does not count the
    time this process waited for a core."""
    return time.thread_time() if CPU_CLOCK else time.perf_counter()


def _as_is(batch: Any) -> Any:
    return batch


def _run_pair_raw(spec: _Spec, batches: int) -> tuple[list[float], Any]:
    torch = spec.torch
    model, opt = spec.build()
    scaler = spec.scaler()
    loader = torch.utils.data.DataLoader(spec.dataset(), **spec.loader_args())
    times: list[float] = []
    model.train()
    while len(times) < batches:
        for x, y in loader:
            times.append(_now())
            opt.zero_grad()
            with spec.autocast():
                loss = torch.nn.functional.cross_entropy(model(x), y)
            if scaler is not None:
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
            else:
                loss.backward()
                opt.step()
            if len(times) == batches:
                break
    if spec.device.type == "cuda":
        torch.cuda.synchronize()
    return times, model


def _run_pair_trainer(spec: _Spec, batches: int) -> tuple[list[float], Any]:
    from determined import pytorch

    torch = spec.torch

    class PairTrial(pytorch.PyTorchTrial):  # type: ignore[misc,name-defined]
        def __init__(self, context: Any) -> None:
            self.context = context
            self.scaler = spec.scaler()
            if self.scaler is not None:
                self.scaler = context.wrap_scaler(self.scaler)
            model, opt = spec.build()
            self.model = context.wrap_model(model)
            self.opt = context.wrap_optimizer(opt)
            self.times: list[float] = []

        def train_batch(self, batch: Any, epoch_idx: int, batch_idx: int) -> Any:
            self.times.append(_now())
            x, y = batch
            with spec.autocast():
                loss = torch.nn.functional.cross_entropy(self.model(x), y)
            if self.scaler is not None:
                self.context.backward(self.scaler.scale(loss))
                self.context.step_optimizer(self.opt, scaler=self.scaler)
                self.scaler.update()
            else:
                self.context.backward(loss)
                self.context.step_optimizer(self.opt)
            return {"loss": loss}

        def evaluate_batch(self, batch: Any) -> dict[str, Any]:
            return {"val_loss": torch.zeros(())}

        def build_training_data_loader(self) -> Any:
            return pytorch.DataLoader(spec.dataset(), **spec.loader_args())

        def build_validation_data_loader(self) -> Any:
            return pytorch.DataLoader(spec.dataset(), **spec.loader_args())

    trial = _fit(pytorch, PairTrial, batches)
    if spec.device.type == "cuda":
        torch.cuda.synchronize()
    return trial.times, trial.model


PAIRS = {"launch": "launch", "cuda": "fp32", "amp": "amp"}


def median(values: list[float]) -> float:
    return round(statistics.median(values), 4)


def worker(modes: list[str], batches: int, warmup: int, runs: int, weights: str | None) -> None:
    import logging

    import torch

    global CPU_CLOCK
    torch.set_num_threads(1)
    if hasattr(os, "sched_setaffinity") and len(os.sched_getaffinity(0)) > 1:
        os.sched_setaffinity(0, {max(os.sched_getaffinity(0))})  # no migrations mid-run
    logging.disable(logging.WARNING)  # local-mode notices, on both sides
    run = {
        "raw": _run_raw,
        "trainer": _run_trainer,
        "empty_raw": _run_empty_raw,
        "empty_trainer": _run_empty_trainer,
    }
    for kind in ("launch", "cuda", "amp"):
        spec = _Spec(torch, kind)
        run[f"{kind}_raw"] = lambda _t, n, spec=spec: _run_pair_raw(spec, n)
        run[f"{kind}_trainer"] = lambda _t, n, spec=spec: _run_pair_trainer(spec, n)
    results: dict[str, list[float]] = {m: [] for m in modes}
    final: dict[str, Any] = {}
    for i in range(runs + 1):  # the first round is a warm-up
        for mode in modes if i % 2 == 0 else list(reversed(modes)):
            long = mode.startswith(("empty", "launch"))
            n = batches * EMPTY_FACTOR if long else batches
            times, model = run[mode](torch, n)
            if i > 0:
                results[mode].append(_per_batch_ms(times, warmup))
            if mode.startswith("launch"):  # again, timed in CPU time
                CPU_CLOCK = True
                cpu_times, _ = run[mode](torch, n)
                CPU_CLOCK = False
                if i > 0:
                    results.setdefault(f"cpu_{mode}", []).append(_per_batch_ms(cpu_times, warmup))
            if model is not None:
                final.setdefault(
                    mode, {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
                )
    if weights:
        torch.save(final, weights)
    import determined

    print(
        json.dumps({"runs": results, "determined": getattr(determined, "__version__", "det-local")})
    )


# ---------------------------------------------------------------------------- parent side
MODES = ["raw", "trainer", "empty_raw", "empty_trainer", "launch_raw", "launch_trainer"]
CUDA_MODES = ["cuda_raw", "cuda_trainer", "amp_raw", "amp_trainer"]


def _paired_ms(runs: dict[str, list[float]], a: str, b: str) -> float:
    """Median over rounds of a - b (the two ran next to each other in each round)."""
    return round(statistics.median(x - y for x, y in zip(runs[a], runs[b], strict=True)), 4)


def _loop_us(runs: dict[str, list[float]]) -> float:
    """The loop-only overhead in microseconds: trainer with a token step - the loader alone."""
    return round(_paired_ms(runs, "empty_trainer", "empty_raw") * 1000, 2)


def _determined_python(torch_version: str) -> tuple[str | None, str | None]:
    """The venv's python with Determined installed (created on first use), or (None, error)."""
    py = f"py{sys.version_info[0]}{sys.version_info[1]}"
    venv = CACHE / f"determined-{DETERMINED_VERSION}-torch-{torch_version}-{py}"
    python = venv / "bin" / "python"
    marker = venv / ".complete"
    if marker.exists() and python.exists():
        return str(python), None
    shutil.rmtree(venv, ignore_errors=True)
    CACHE.mkdir(parents=True, exist_ok=True)
    print(f"creating {venv} (once): pip install torch=={torch_version} determined==...")
    try:
        subprocess.run(
            [sys.executable, "-m", "venv", str(venv)], check=True, capture_output=True, timeout=300
        )
        proc = subprocess.run(
            [
                str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                f"torch=={torch_version}", f"determined=={DETERMINED_VERSION}",
            ],
            capture_output=True, text=True, timeout=1200,
        )  # fmt: skip
        if proc.returncode != 0:
            errors = [ln for ln in proc.stderr.splitlines() if "ERROR" in ln] or [
                proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "no output"
            ]
            return None, f"pip install failed ({proc.returncode}): {errors[-1][:300]}"
        subprocess.run(
            [str(python), "-c", "import determined.pytorch, torch"],
            check=True, capture_output=True, timeout=300,
        )  # fmt: skip
    except (subprocess.SubprocessError, OSError) as err:
        shutil.rmtree(venv, ignore_errors=True)
        return None, f"could not create the Determined environment: {err}"
    marker.write_text("ok\n")
    return str(python), None


def _spawn(
    python: str,
    modes: list[str],
    args: argparse.Namespace,
    tmp: str,
    pythonpath: str | None,
    weights: str | None = None,
) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DET_")}
    env.update(
        HOME=tmp, XDG_DATA_HOME=os.path.join(tmp, "data"), OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1", PYTHONHASHSEED="0",
    )  # fmt: skip
    env.pop("PYTHONPATH", None)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    work = tempfile.mkdtemp(dir=tmp)  # the working directory a checkpoint copies to code/
    argv = [
        python, os.path.abspath(__file__), "--worker", ",".join(modes),
        "--batches", str(args.batches), "--warmup", str(args.warmup), "--runs", str(args.runs),
    ]  # fmt: skip
    if weights:
        argv += ["--weights", weights]
    proc = subprocess.run(argv, env=env, cwd=work, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"worker {modes} failed ({proc.returncode}): {proc.stderr[-1500:]}")
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", type=int, default=400)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--runs", type=int, default=11)
    parser.add_argument("--skip-determined", action="store_true")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--weights", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker.split(","), args.batches, args.warmup, args.runs, args.weights)
        return

    import torch

    if args.device == "cuda":
        cuda_main(args, torch)
        return
    torch_version = torch.__version__.split("+")[0]
    determined_python: str | None = None
    determined_error: str | None = "skipped (--skip-determined)"
    if not args.skip_determined:
        determined_python, determined_error = _determined_python(torch_version)

    with tempfile.TemporaryDirectory(prefix="det-local-bench-") as tmp:
        weights = os.path.join(tmp, "weights.pt")
        compat = f"{REPO / 'det_local' / 'compat'}{os.pathsep}{REPO}"
        ours = _spawn(sys.executable, MODES, args, tmp, compat, weights)
        final = torch.load(weights, weights_only=True)
        identical = final["raw"].keys() == final["trainer"].keys() and all(
            torch.equal(final["raw"][k], final["trainer"][k]) for k in final["raw"]
        )
        theirs: dict[str, Any] | None = None
        if determined_python is not None:
            try:
                theirs = _spawn(determined_python, MODES[:4], args, tmp, None)
            except (RuntimeError, subprocess.SubprocessError) as err:
                determined_error = " ".join(str(err).split())[-400:]
            else:
                determined_error = None

    raw = median(ours["runs"]["raw"])
    det_local = median(ours["runs"]["trainer"])
    determined = median(theirs["runs"]["trainer"]) if theirs else None
    target = round(raw * 1.02 + 0.02, 4)
    launch = _pair(ours["runs"], "launch", 1.02, 0.005)
    launch_cpu = _pair(ours["runs"], "cpu_launch", 1.02, 0.005)
    result: dict[str, Any] = {
        "raw_ms_per_batch": raw,
        "det_local_ms_per_batch": det_local,
        "determined_ms_per_batch": determined,
        "determined_process_raw_ms_per_batch": median(theirs["runs"]["raw"]) if theirs else None,
        "weights_identical": identical,
        "det_local_overhead_ms": round(det_local - raw, 4),
        "det_local_paired_overhead_ms": _paired_ms(ours["runs"], "trainer", "raw"),
        "determined_paired_overhead_ms": _paired_ms(theirs["runs"], "trainer", "raw")
        if theirs
        else None,
        "det_local_loop_us_per_batch": _loop_us(ours["runs"]),
        "determined_loop_us_per_batch": _loop_us(theirs["runs"]) if theirs else None,
        "target_det_local_max_ms": target,
        "det_local_within_target": det_local <= target,
        "det_local_faster_than_determined": None if determined is None else det_local < determined,
        "determined_error": determined_error,
        "determined_version": theirs["determined"] if theirs else None,
        **launch,
        **launch_cpu,
        "torch": torch.__version__,
        "batches": args.batches,
        "warmup": args.warmup,
        "runs": args.runs,
        "raw_runs_ms": [round(v, 4) for v in ours["runs"]["raw"]],
        "det_local_runs_ms": [round(v, 4) for v in ours["runs"]["trainer"]],
        "determined_runs_ms": [round(v, 4) for v in theirs["runs"]["trainer"]] if theirs else None,
    }
    dets = (
        f"{determined:.4f} ms" if determined is not None else f"not measured ({determined_error})"
    )
    print(
        f"per batch, median of {args.runs} runs of {args.batches} batches of {BATCH} (MLP "
        f"{DIM}-{HIDDEN}-{HIDDEN}-{CLASSES}, 1 thread):\n"
        f"  hand-written loop    {raw:.4f} ms\n"
        f"  det-local Trainer    {det_local:.4f} ms ({det_local - raw:+.4f} ms; target <= "
        f"{target:.4f})\n"
        f"  Determined {DETERMINED_VERSION} Trainer {dets}"
    )
    print(
        "loop alone (token step, loader subtracted): det-local "
        f"{result['det_local_loop_us_per_batch']} us/batch, Determined "
        f"{result['determined_loop_us_per_batch']} us/batch"
    )
    print(
        f"launch-bound (MLP {LAUNCH_DIM}-{LAUNCH_HIDDEN}-{LAUNCH_CLASSES}, batch {LAUNCH_BATCH}): "
        f"loop {launch['launch_raw_ms_per_batch'] * 1000:.1f} us, Trainer "
        f"{launch['launch_trainer_ms_per_batch'] * 1000:.1f} us (paired "
        f"{launch['launch_paired_overhead_ms'] * 1000:+.1f} us; target <= "
        f"{launch['launch_target_max_ms'] * 1000:.1f} us)"
    )
    print(
        f"  the same in CPU time: loop {launch_cpu['cpu_launch_raw_ms_per_batch'] * 1000:.1f} us, "
        f"Trainer {launch_cpu['cpu_launch_trainer_ms_per_batch'] * 1000:.1f} us (paired "
        f"{launch_cpu['cpu_launch_paired_overhead_ms'] * 1000:+.1f} us)"
    )
    print(f"final weights det-local vs loop: {'identical' if identical else 'DIFFERENT'}")
    print(json.dumps(result))


def _pair(runs: dict[str, list[float]], kind: str, factor: float, plus_ms: float) -> dict[str, Any]:
    """One pair's figures: medians, the paired overhead, the target (factor x raw + plus_ms)."""
    raw = median(runs[f"{kind}_raw"])
    trainer = median(runs[f"{kind}_trainer"])
    target = round(raw * factor + plus_ms, 4)
    return {
        f"{kind}_raw_ms_per_batch": raw,
        f"{kind}_trainer_ms_per_batch": trainer,
        f"{kind}_paired_overhead_ms": _paired_ms(runs, f"{kind}_trainer", f"{kind}_raw"),
        f"{kind}_ratio": round(trainer / raw, 4) if raw else None,
        f"{kind}_target_max_ms": target,
        f"{kind}_within_target": trainer <= target,
        f"{kind}_raw_runs_ms": [round(v, 4) for v in runs[f"{kind}_raw"]],
        f"{kind}_trainer_runs_ms": [round(v, 4) for v in runs[f"{kind}_trainer"]],
    }


def cuda_main(args: argparse.Namespace, torch: Any) -> None:
    """--device cuda: the fp32 and AMP pairs on the GPU; a message and a skip without one."""
    if not torch.cuda.is_available():
        why = f"no CUDA device (torch {torch.__version__}, cuda {torch.version.cuda})"
        print(f"skipped: {why}; run it on a machine with an NVIDIA GPU")
        print(json.dumps({"device": "cuda", "skipped": why}))
        return
    with tempfile.TemporaryDirectory(prefix="det-local-bench-") as tmp:
        compat = f"{REPO / 'det_local' / 'compat'}{os.pathsep}{REPO}"
        weights = os.path.join(tmp, "weights.pt")
        ours = _spawn(sys.executable, CUDA_MODES, args, tmp, compat, weights)
        final = torch.load(weights, weights_only=True)
    identical = {
        kind: all(
            torch.equal(final[f"{kind}_raw"][k], final[f"{kind}_trainer"][k])
            for k in final[f"{kind}_raw"]
        )
        for kind in ("cuda", "amp")
    }
    fp32 = _pair(ours["runs"], "cuda", 1.02, 0.0)
    amp = _pair(ours["runs"], "amp", 1.02, 0.0)
    result = {
        "device": torch.cuda.get_device_name(0),
        **fp32,
        **amp,
        "fp32_weights_identical": identical["cuda"],
        "amp_weights_identical": identical["amp"],
        "torch": torch.__version__,
        "batches": args.batches,
        "warmup": args.warmup,
        "runs": args.runs,
    }
    print(
        f"{result['device']}, MLP {GPU_DIM}-{GPU_HIDDEN}x3-{GPU_CLASSES}, batch {GPU_BATCH}, data "
        f"on the GPU, median of {args.runs} alternating rounds:\n"
        f"  fp32: loop {fp32['cuda_raw_ms_per_batch']:.4f} ms, Trainer "
        f"{fp32['cuda_trainer_ms_per_batch']:.4f} ms (x{fp32['cuda_ratio']})\n"
        f"  AMP:  loop {amp['amp_raw_ms_per_batch']:.4f} ms, Trainer "
        f"{amp['amp_trainer_ms_per_batch']:.4f} ms (x{amp['amp_ratio']})"
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()

"""Launch overhead: time to the first training batch of a 2-rank CPU job, started by det-local's
launcher and by plain torchrun, in the same run.

(a) ``python -m torch.distributed.run --nproc_per_node 2 ... train.py``;
(b) ``python -m det_local.launch.torch_distributed python3 train.py`` with DET_SLOT_IDS=[0,1]
    (what a det-local trial's entrypoint runs: torchrun under det-local's supervisor, each
    worker under wrap_rank).

The same worker script both ways: ``init_process_group("gloo")``,
``DistributedContext.from_torch_distributed()`` (the Core API's construction collective), a
DDP-wrapped MLP, one forward/backward/step on a batch; each rank writes the wall-clock time
when that first step is done. A run's figure is the latest rank's time minus the time just
before the launcher process was started. Each port set is fresh (allocate_ports) so runs never
wait on TIME_WAIT sockets. Modes alternate, --runs times each after one dropped warm-up of
each; the figures are medians.

Target: det_local_s <= torchrun_s + 0.5.

Usage: python3 bench/launch_overhead.py [--runs 9]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from det_local.launch.ports import allocate_ports  # noqa: E402

WORKER = r"""
import os, sys, time
import torch
import torch.distributed as dist
from determined.core import DistributedContext

dist.init_process_group("gloo")
ctx = DistributedContext.from_torch_distributed()
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(
    torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x, y = torch.randn(16, 32), torch.randn(16, 1)
loss = torch.nn.functional.mse_loss(model(x), y)
loss.backward()
opt.step()
stamp = time.time()
with open(os.path.join(sys.argv[1], f"first-batch-{ctx.rank}"), "w") as f:
    f.write(repr(stamp))
ctx.close()
dist.barrier()
os._exit(0)  # skip gloo's teardown: its exit-time races are not what is measured
"""


def run_once(mode: str, workdir: Path) -> float:
    for old in workdir.glob("first-batch-*"):
        old.unlink()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "det_local" / "compat"), str(REPO)])
    env["OMP_NUM_THREADS"] = "1"
    ports = allocate_ports()
    env.update({k: str(v) for k, v in ports.items()})
    script = ["python3", "train.py", str(workdir)]
    if mode == "torchrun":
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
            "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
            "--master_port", str(ports["C10D_PORT"]), *script[1:],
        ]  # fmt: skip
    else:
        env["DET_SLOT_IDS"] = "[0, 1]"
        cmd = [sys.executable, "-m", "det_local.launch.torch_distributed", *script]
    start = time.time()
    proc = subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{mode} failed ({proc.returncode}): {proc.stderr[-3000:]}")
    stamps = [float(p.read_text()) for p in workdir.glob("first-batch-*")]
    if len(stamps) != 2:
        raise SystemExit(f"{mode}: expected 2 ranks' first-batch times, got {len(stamps)}")
    return max(stamps) - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=9)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="det-local-bench-launch-") as tmp:
        workdir = Path(tmp)
        (workdir / "train.py").write_text(WORKER)
        times: dict[str, list[float]] = {"torchrun": [], "det_local": []}
        for mode in times:  # warm-up: page cache, .pyc files
            run_once(mode, workdir)
        for _ in range(args.runs):
            for mode in times:
                times[mode].append(run_once(mode, workdir))
    torchrun_s = statistics.median(times["torchrun"])
    det_local_s = statistics.median(times["det_local"])
    paired = statistics.median(
        d - t for d, t in zip(times["det_local"], times["torchrun"], strict=True)
    )
    print(f"torchrun runs (s):  {' '.join(f'{t:.3f}' for t in times['torchrun'])}")
    print(f"det-local runs (s): {' '.join(f'{t:.3f}' for t in times['det_local'])}")
    result = {
        "torchrun_s": round(torchrun_s, 3),
        "det_local_s": round(det_local_s, 3),
        "overhead_s": round(det_local_s - torchrun_s, 3),
        "paired_overhead_s": round(paired, 3),
        "runs": args.runs,
        "cpus": os.cpu_count(),
        "target_met": det_local_s <= torchrun_s + 0.5,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()

"""The deepspeed and horovod launchers with stand-in `deepspeed` / `horovodrun` executables on
PATH (neither is installed here): the exact command built, what the workers see, the
DeepSpeed batch-size check, the one-line errors when the tool is missing, and supervision
when the framework's launcher does not stop the other workers itself."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

from det_local.launch.ports import allocate_ports
from tests.support import paths

REPO = paths.REPO
COMPAT = REPO / "det_local" / "compat"
TIMEOUT = 60

# Behaves like DeepSpeed's runner + launch.py on one node: reads the hostfile, starts one
# worker per slot with DeepSpeed's variables and CUDA_VISIBLE_DEVICES as indices, waits.
FAKE_DEEPSPEED = r"""#!{python}
import json, os, subprocess, sys
out = os.environ["OUT"]
argv = sys.argv[1:]
with open(os.path.join(out, "deepspeed-call.json"), "w") as f:
    json.dump({"argv": argv, "hostfile": open(argv[argv.index("-H") + 1]).read(),
               "cuda": os.environ.get("CUDA_VISIBLE_DEVICES")}, f)
slots = int(open(argv[argv.index("-H") + 1]).read().split("slots=")[1])
cmd = argv[argv.index("--") + 1:]
procs = []
for i in range(slots):
    env = dict(os.environ, RANK=str(i), WORLD_SIZE=str(slots), LOCAL_RANK=str(i),
               LOCAL_SIZE=str(slots), CROSS_RANK="0", CROSS_SIZE="1",
               CUDA_VISIBLE_DEVICES=",".join(str(j) for j in range(slots)))
    procs.append(subprocess.Popen(cmd, env=env))
sys.exit(max(p.wait() for p in procs))
"""

FAKE_HOROVODRUN = r"""#!{python}
import json, os, subprocess, sys
argv = sys.argv[1:]
with open(os.path.join(os.environ["OUT"], "horovodrun-call.json"), "w") as f:
    json.dump(argv, f)
n = int(argv[argv.index("-np") + 1])
cmd = argv[argv.index("--") + 1:]
procs = [subprocess.Popen(cmd, env=dict(os.environ, HOROVOD_RANK=str(i))) for i in range(n)]
sys.exit(max(p.wait() for p in procs))
"""

WORKER = r"""
import json, os, sys, time
from determined.core import DistributedContext
out = sys.argv[1]
mode = sys.argv[2] if len(sys.argv) > 2 else ""
rank = int(os.environ.get("RANK") or os.environ["HOROVOD_RANK"])
open(os.path.join(out, f"pid-{rank}"), "w").write(str(os.getpid()))
facts = {k: os.environ.get(k) for k in ("CUDA_VISIBLE_DEVICES", "USE_DEEPSPEED", "USE_HOROVOD",
                                         "DET_CHIEF_IP", "DET_DEEPSPEED_HOSTFILE_PATH")}
if "RANK" in os.environ:
    ctx = DistributedContext.from_deepspeed()
    facts["allgather"] = ctx.allgather(rank)
print("worker", rank, flush=True)
json.dump(facts, open(os.path.join(out, f"facts-{rank}.json"), "w"))
if mode == "fail":
    if rank == 1:
        open(os.path.join(out, "failed-at"), "w").write(str(time.time()))
        sys.exit(2)
    time.sleep(600)
"""


def _setup(tmp_path: Path, tools: dict[str, str], slots: int, **extra: str) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in tools.items():
        path = bin_dir / name
        path.write_text(text.replace("{python}", sys.executable))
        path.chmod(path.stat().st_mode | stat.S_IXUSR)
    (tmp_path / "worker.py").write_text(WORKER)
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join(
        [str(bin_dir), os.path.dirname(sys.executable), "/usr/bin", "/bin"]
    )
    env["PYTHONPATH"] = os.pathsep.join([str(COMPAT), str(REPO)])
    env["DET_SLOT_IDS"] = json.dumps(list(range(slots)))
    env["OUT"] = str(tmp_path)
    env.update({k: str(v) for k, v in allocate_ports().items()})
    env.pop("CUDA_VISIBLE_DEVICES", None)
    env.update(extra)
    return env


def _launch(
    tmp_path: Path, launcher: str, args: list[str], env: dict[str, str]
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", f"determined.launch.{launcher}", *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )


def test_deepspeed_command_and_workers(tmp_path: Path) -> None:
    env = _setup(
        tmp_path,
        {"deepspeed": FAKE_DEEPSPEED},
        slots=2,
        CUDA_VISIBLE_DEVICES="GPU-aaa,GPU-bbb",
        DET_LOCAL_INFO_DIR=str(tmp_path),
    )
    proc = _launch(tmp_path, "deepspeed", ["python3", "worker.py", str(tmp_path)], env)
    assert proc.returncode == 0, proc.stderr
    call = json.loads((tmp_path / "deepspeed-call.json").read_text())
    hostfile = str(tmp_path / "deepspeed-hostfile.txt")
    assert call["argv"] == [
        "-H", hostfile, "--master_addr", "127.0.0.1", "--master_port", env["C10D_PORT"],
        "--no_python", "--no_local_rank", "--no_ssh_check", "--",
        sys.executable, "-m", "det_local.launch.wrap_rank", "RANK", "--",
        "python3", "worker.py", str(tmp_path),
    ]  # fmt: skip
    assert call["hostfile"] == "localhost slots=2\n"
    for rank in (0, 1):
        facts = json.loads((tmp_path / f"facts-{rank}.json").read_text())
        # DeepSpeed set indices 0,1; wrap_rank maps them back to the trial's own GPUs
        assert facts["CUDA_VISIBLE_DEVICES"] == "GPU-aaa,GPU-bbb"
        assert facts["USE_DEEPSPEED"] == "1"
        assert facts["DET_DEEPSPEED_HOSTFILE_PATH"] == hostfile
        assert facts["allgather"] == [0, 1]
        assert f"[rank={rank}] worker {rank}\n" in proc.stdout


def test_deepspeed_batch_size_must_fit_the_slots(tmp_path: Path) -> None:
    env = _setup(tmp_path, {"deepspeed": FAKE_DEEPSPEED}, slots=2)
    config = {
        "train_batch_size": 32,
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 2,
    }
    (tmp_path / "ds_config.json").write_text(json.dumps(config))
    proc = _launch(
        tmp_path,
        "deepspeed",
        ["python3", "worker.py", str(tmp_path), "--deepspeed_config", "ds_config.json"],
        env,
    )
    assert proc.returncode == 1
    assert proc.stderr == (
        "det-local: error: DeepSpeed config ds_config.json: train_batch_size 32 != "
        "train_micro_batch_size_per_gpu 4 x gradient_accumulation_steps 2 x 2 slots (= 16); "
        "set resources.slots_per_trial: 4, or train_batch_size: 16\n"
    )
    assert not (tmp_path / "deepspeed-call.json").exists()  # nothing was started
    # the same config through the hyperparameters, fixed by overwrite_deepspeed_args
    hparams = {"deepspeed_config": "ds_config.json", "overwrite_deepspeed_args": {}}
    env["DET_HPARAMS"] = json.dumps(hparams)
    proc = _launch(tmp_path, "deepspeed", ["python3", "worker.py", str(tmp_path)], env)
    assert "deepspeed_config" not in proc.stderr and "ds_config.json" in proc.stderr
    hparams["overwrite_deepspeed_args"] = {"train_batch_size": 16}
    env["DET_HPARAMS"] = json.dumps(hparams)
    proc = _launch(tmp_path, "deepspeed", ["python3", "worker.py", str(tmp_path)], env)
    assert proc.returncode == 0, proc.stderr
    env["DET_HPARAMS"] = json.dumps({"deepspeed_config": "missing.json"})
    proc = _launch(tmp_path, "deepspeed", ["python3", "worker.py", str(tmp_path)], env)
    assert "DeepSpeed config 'missing.json' (from the deepspeed_config hyperparameter)" in (
        proc.stderr
    )


def test_deepspeed_supervision_stops_the_rest(tmp_path: Path) -> None:
    """The stand-in (like pdsh-launched DeepSpeed) never stops the other workers: the
    supervisor does, within 5 s, and the launcher exits with the failed worker's status."""
    env = _setup(tmp_path, {"deepspeed": FAKE_DEEPSPEED}, slots=3)
    proc = _launch(tmp_path, "deepspeed", ["python3", "worker.py", str(tmp_path), "fail"], env)
    ended = time.time()
    assert proc.returncode == 2
    assert ended - float((tmp_path / "failed-at").read_text()) < 5.0
    assert "det-local: rank 1 exited with code 2; stopping the other workers" in proc.stderr
    for pid_file in tmp_path.glob("pid-*"):
        assert not _alive(int(pid_file.read_text()))


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except OSError:
        return False


def test_not_installed(tmp_path: Path) -> None:
    env = _setup(tmp_path, {}, slots=2)
    # a PATH with python3 only: the test extra installs DeepSpeed (its `deepspeed` command sits
    # next to this interpreter), and a machine may have either tool elsewhere on PATH
    (tmp_path / "bin" / "python3").symlink_to(sys.executable)
    env["PATH"] = str(tmp_path / "bin")
    for launcher, message in (
        ("deepspeed", "DeepSpeed is not installed in this environment"),
        ("horovod", "Horovod is not installed in this environment"),
    ):
        proc = _launch(tmp_path, launcher, ["python3", "worker.py"], env)
        assert proc.returncode == 1
        assert proc.stderr.startswith(f"det-local: error: {message}")
        assert "python3 -m determined.launch.torch_distributed" in proc.stderr
        assert len(proc.stderr.splitlines()) == 1


def test_horovod_command(tmp_path: Path) -> None:
    config = {
        "optimizations": {"tensor_fusion_threshold": 32, "tensor_fusion_cycle_time": 5},
        "data": {"__det_dtrain_args": ["--log-level", "INFO"]},
    }
    env = _setup(
        tmp_path, {"horovodrun": FAKE_HOROVODRUN}, slots=2, DET_EXPERIMENT_CONFIG=json.dumps(config)
    )
    proc = _launch(tmp_path, "horovod", ["--mpi", "--", "python3", "worker.py", str(tmp_path)], env)
    assert proc.returncode == 0, proc.stderr
    argv = json.loads((tmp_path / "horovodrun-call.json").read_text())
    assert argv == [
        "-np", "2", "-p", env["DTRAIN_SSH_PORT"], "-H", "localhost:2",
        "--start-timeout", "1200", "--gloo-timeout-seconds", "240",
        "--fusion-threshold-mb", "32", "--cycle-time-ms", "5", "--cache-capacity", "1024",
        "--no-hierarchical-allreduce", "--no-hierarchical-allgather",
        "--log-level", "INFO", "--mpi", "--",
        sys.executable, "-m", "det_local.launch.wrap_rank",
        "HOROVOD_RANK,OMPI_COMM_WORLD_RANK,PMI_RANK", "--",
        "python3", "worker.py", str(tmp_path),
    ]  # fmt: skip
    for rank in (0, 1):
        assert json.loads((tmp_path / f"facts-{rank}.json").read_text())["USE_HOROVOD"] == "1"
        assert f"[rank={rank}] worker {rank}\n" in proc.stdout


def test_autohorovod_one_slot_runs_the_script(tmp_path: Path) -> None:
    env = _setup(tmp_path, {}, slots=1, HOROVOD_RANK="0")
    proc = _launch(
        tmp_path, "horovod", ["--autohorovod", "python3", "worker.py", str(tmp_path)], env
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "worker 0\n"

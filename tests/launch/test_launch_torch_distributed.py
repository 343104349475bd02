"""`python3 -m det_local.launch.torch_distributed` (and `determined.launch.torch_distributed`):
real torchrun, real gloo, real worker processes. Covers what each worker sees, rank-prefixed
output, overrides, nested launchers, and the failure semantics: one worker exits 1 while
others hang (one in a gloo recv, one ignoring SIGTERM) or segfaults; the launcher stops them all
within 5 s, exits non-zero and leaves no process behind."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from det_local.launch import legacy_trial_argv, torch_distributed
from det_local.launch import ports as ports_mod
from det_local.launch._args import LaunchError
from det_local.launch.ports import PORT_VARS, allocate_ports
from tests.support import paths

REPO = paths.REPO
COMPAT = REPO / "det_local" / "compat"
TIMEOUT = 90

WORKER = r"""
import json, os, signal, sys, time
from pathlib import Path
import torch
import torch.distributed as dist
from determined.core import DistributedContext

out = Path(sys.argv[1])
mode = sys.argv[2] if len(sys.argv) > 2 else ""
rank = int(os.environ["RANK"])
(out / f"pid-{rank}").write_text(str(os.getpid()))
dist.init_process_group("gloo")
ctx = DistributedContext.from_torch_distributed()
total = torch.tensor([float(rank + 1)])
dist.all_reduce(total)
facts = {
    "rank": ctx.rank, "size": ctx.size, "local_rank": ctx.local_rank,
    "allgather": ctx.allgather(rank), "sum": total.item(),
    "env": {k: os.environ.get(k) for k in (
        "USE_TORCH_DISTRIBUTED", "DET_CHIEF_IP", "MASTER_ADDR", "MASTER_PORT",
        "INTER_TRAIN_PROCESS_COMM_PORT_1", "LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE", "NESTED",
    )},
}
(out / f"facts-{rank}.json").write_text(json.dumps(facts))
print(f"hello from {rank}\rprogress 50%\rprogress 100%", flush=True)
print(f"warning from {rank}", file=sys.stderr, flush=True)
if mode == "fail":
    if rank == 1:
        (out / "failed-at").write_text(str(time.time()))
        sys.exit(1)
    if rank == 2:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        time.sleep(600)
    if rank == 0:
        dist.recv(torch.zeros(1), src=2)  # rank 2 never sends: hangs in the collective
if mode == "segv" and rank == 1:
    (out / "failed-at").write_text(str(time.time()))
    os.kill(os.getpid(), signal.SIGSEGV)
if mode in ("segv", "sleep"):
    time.sleep(600)
ctx.close()
dist.barrier()  # leave together: gloo aborts a rank whose peer tore down first
dist.destroy_process_group()
"""


def _env(slots: int, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(COMPAT), str(REPO)])
    env["DET_SLOT_IDS"] = json.dumps(list(range(slots)))
    env.update({k: str(v) for k, v in allocate_ports().items()})
    env.update(extra)
    return env


def _launch(
    tmp_path: Path, args: list[str], slots: int, module: str = "det_local", **extra: str
) -> subprocess.Popen[str]:
    (tmp_path / "worker.py").write_text(WORKER)
    return subprocess.Popen(
        [sys.executable, "-m", f"{module}.launch.torch_distributed", *args],
        cwd=tmp_path,
        env=_env(slots, **extra),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _facts(tmp_path: Path, rank: int) -> dict:
    return json.loads((tmp_path / f"facts-{rank}.json").read_text())


def _worker_pids(tmp_path: Path) -> list[int]:
    return [int(p.read_text()) for p in tmp_path.glob("pid-*")]


def _assert_all_gone(pids: list[int]) -> None:
    deadline = time.monotonic() + 2
    for pid in pids:
        while psutil.pid_exists(pid):
            try:
                if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                    break
            except psutil.NoSuchProcess:
                break
            assert time.monotonic() < deadline, f"worker {pid} outlived the launcher"
            time.sleep(0.02)


def test_two_workers_over_gloo(tmp_path: Path) -> None:
    proc = _launch(tmp_path, ["python3", "worker.py", str(tmp_path)], slots=2)
    out, err = proc.communicate(timeout=TIMEOUT)
    assert proc.returncode == 0, err
    env = _env(0)  # only for the shape of the ports
    for rank in (0, 1):
        facts = _facts(tmp_path, rank)
        assert facts["size"] == 2 and facts["rank"] == rank
        assert facts["allgather"] == [0, 1]
        assert facts["sum"] == 3.0
        assert facts["env"]["USE_TORCH_DISTRIBUTED"] == "1"
        assert facts["env"]["DET_CHIEF_IP"] == "127.0.0.1"
        assert facts["env"]["LOCAL_WORLD_SIZE"] == "2"
        assert facts["env"]["GROUP_WORLD_SIZE"] == "1"
        assert facts["env"]["INTER_TRAIN_PROCESS_COMM_PORT_1"] is not None
        # \r ends a line: each progress refresh is its own prefixed line
        for line in (f"hello from {rank}", "progress 50%", "progress 100%"):
            assert f"[rank={rank}] {line}\n" in out
        assert f"[rank={rank}] warning from {rank}\n" in err
    assert set(env) >= set(PORT_VARS)
    # every line the workers printed carries its rank
    assert all(line.startswith("[rank=") for line in out.splitlines() if line)


def test_nested_launcher_under_determined_name(tmp_path: Path) -> None:
    """`env ... nice -n 1 python3 -m determined.launch.torch_distributed ...`, as an
    entrypoint with numactl would be; overrides end with `--`."""
    (tmp_path / "worker.py").write_text(WORKER)
    env = _env(2)
    port = env["C10D_PORT"]
    cmd = [
        "env",
        "NESTED=yes",
        "nice",
        "-n",
        "1",
        sys.executable,
        "-m",
        "determined.launch.torch_distributed",
        "--monitor-interval",
        "0.2",
        "--",
        "python3",
        "worker.py",
        str(tmp_path),
    ]
    proc = subprocess.run(
        cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=TIMEOUT
    )
    assert proc.returncode == 0, proc.stderr
    for rank in (0, 1):
        facts = _facts(tmp_path, rank)
        assert facts["env"]["NESTED"] == "yes"
        assert facts["env"]["MASTER_PORT"] == port  # the trial's own rendezvous port


def test_overrides_win(tmp_path: Path) -> None:
    proc = _launch(
        tmp_path, ["--nproc_per_node", "1", "--", "python3", "worker.py", str(tmp_path)], slots=2
    )
    _, err = proc.communicate(timeout=TIMEOUT)
    assert proc.returncode == 0, err
    assert _facts(tmp_path, 0)["size"] == 1
    assert not (tmp_path / "facts-1.json").exists()


def test_one_fails_others_hang(tmp_path: Path) -> None:
    """Rank 1 exits 1; rank 0 hangs in a gloo recv from rank 2, which ignores SIGTERM and
    sleeps. Everything is gone within 5 s of the failure; the launcher exits non-zero."""
    proc = _launch(tmp_path, ["python3", "worker.py", str(tmp_path), "fail"], slots=3)
    out, err = proc.communicate(timeout=TIMEOUT)
    ended = time.time()
    failed_at = float((tmp_path / "failed-at").read_text())
    assert proc.returncode != 0
    assert ended - failed_at < 5.0, err
    assert "det-local: rank 1 exited with code 1; stopping the other workers" in err
    _assert_all_gone(_worker_pids(tmp_path))
    assert len(_worker_pids(tmp_path)) == 3


def test_segfault(tmp_path: Path) -> None:
    proc = _launch(tmp_path, ["python3", "worker.py", str(tmp_path), "segv"], slots=2)
    _, err = proc.communicate(timeout=TIMEOUT)
    ended = time.time()
    assert proc.returncode == 128 + signal.SIGSEGV
    assert "[rank=1] det-local: the worker was killed by SIGSEGV" in err
    assert "det-local: rank 1 was killed by SIGSEGV (segmentation fault)" in err
    assert ended - float((tmp_path / "failed-at").read_text()) < 5.0
    _assert_all_gone(_worker_pids(tmp_path))


def test_sigterm_to_launcher_ends_everything(tmp_path: Path) -> None:
    """What the daemon's kill does: SIGTERM to the launcher; workers go, nothing is left."""
    proc = _launch(tmp_path, ["python3", "worker.py", str(tmp_path), "sleep"], slots=2)
    deadline = time.monotonic() + TIMEOUT
    while len(list(tmp_path.glob("facts-*"))) < 2:
        assert time.monotonic() < deadline and proc.poll() is None, proc.stderr
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=15)
    assert proc.returncode != 0
    _assert_all_gone(_worker_pids(tmp_path))


# ---------------------------------------------------------------------------- bad input
def _run(args: list[str], module: str = "det_local", cwd: Path | None = None) -> tuple[int, str]:
    proc = subprocess.run(
        [sys.executable, "-m", f"{module}.launch.{args[0]}", *args[1:]],
        cwd=cwd,
        env=_env(2),
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    return proc.returncode, proc.stderr


@pytest.mark.parametrize("module", ["det_local", "determined"])
def test_unknown_launcher(module: str) -> None:
    code, err = _run(["torch_distributd", "python3", "x.py"], module)
    assert code != 0
    assert f"unknown launcher 'torch_distributd' ({module}.launch.torch_distributd)" in err
    assert "did you mean 'torch_distributed'?" in err
    code, err = _run(["nope"], module)
    assert "unknown launcher 'nope'" in err and f"{module}.launch.deepspeed" in err


def test_bad_command_lines(tmp_path: Path) -> None:
    (tmp_path / "ok.py").write_text("")
    cases = {
        ("--nproc_per_node", "4", "python3", "ok.py"): (
            "'--nproc_per_node' looks like an override for torch.distributed.run, but the "
            "overrides are not ended by `--`; write e.g. `python3 -m "
            "det_local.launch.torch_distributed --nproc_per_node 4 -- python3 train.py`"
        ),
        ("python3", "missing.py"): "script 'missing.py' does not exist in",
        ("./missing.sh",): "'./missing.sh' does not exist",
        ("ok.py",): "'ok.py' is not a command on PATH; did you mean `python3 ok.py`?",
        ("no-such-program-x",): "program 'no-such-program-x' was not found on PATH",
        ("--trial", "not a trial"): "is not of the form module:TrialClass",
        ("--trial", "m:T", "extra"): "extra arguments after --trial m:T",
        ("--",): "no SCRIPT to launch",
    }
    for args, message in cases.items():
        code, err = _run(["torch_distributed", *args], cwd=tmp_path)
        assert code == 1, (args, err)
        assert err.startswith("det-local: error: "), (args, err)
        assert message in err, (args, err)
        assert len(err.strip().splitlines()) == 1, err


def test_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    """The exact torchrun command, and --trial becoming the harness."""
    monkeypatch.setenv("DET_SLOT_IDS", "[3, 5]")
    monkeypatch.setenv("C10D_PORT", "41234")
    cmd, env, nproc = torch_distributed.plan(["--", "--trial", "model_def:MyTrial"])
    assert nproc == 2
    assert env == {"USE_TORCH_DISTRIBUTED": "1", "DET_CHIEF_IP": "127.0.0.1"}
    assert cmd == [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
        "--nproc_per_node", "2", "--node_rank", "0", "--max_restarts", "0",
        "--master_addr", "127.0.0.1", "--master_port", "41234",
        "--module", "det_local.launch.wrap_rank", "RANK", "--",
        sys.executable, "-m", "det_local.trial.harness", "model_def:MyTrial",
    ]  # fmt: skip
    monkeypatch.delenv("DET_SLOT_IDS")
    monkeypatch.delenv("C10D_PORT")
    cmd, _, nproc = torch_distributed.plan(["--max_restarts", "2", "--", "true"])
    assert nproc == 1
    assert cmd[cmd.index("--master_port") + 1] == "29400"
    assert cmd[cmd.index("--master_port") + 2 :][:2] == ["--max_restarts", "2"]
    # a script's own `--` is not taken for the end of overrides
    cmd, _, _ = torch_distributed.plan(["true", "--", "x"])
    assert cmd[-3:] == ["true", "--", "x"]
    monkeypatch.setenv("DET_SLOT_IDS", "not json")
    with pytest.raises(LaunchError, match="DET_SLOT_IDS"):
        torch_distributed.plan(["true"])


def test_legacy_trial_argv() -> None:
    assert legacy_trial_argv("m:T", 1, "py") == ["py", "-m", "det_local.trial.harness", "m:T"]
    assert legacy_trial_argv("m:T", 4, "py") == [
        "py", "-m", "det_local.launch.torch_distributed", "--trial", "m:T",
    ]  # fmt: skip


def test_allocate_ports() -> None:
    first = allocate_ports()
    assert list(first) == list(PORT_VARS)
    assert len(set(first.values())) == 4
    second = allocate_ports(in_use=first.values())
    assert not set(second.values()) & set(first.values())
    assert all(re.fullmatch(r"\d+", str(p)) for p in second.values())


def test_allocated_ports_lie_below_the_ephemeral_range() -> None:
    """The kernel hands released ephemeral ports to the next bind(0)/connect() (gloo binds several
    per rank), so det-local's ports come from below that range, where nobody gets them by chance."""
    low, _ = ports_mod.ephemeral_range()
    for _ in range(20):
        ports = allocate_ports()
        assert all(ports_mod._LOWEST <= p < low for p in ports.values()), ports
        assert not set(ports.values()) & set(ports_mod.DEFAULTS.values())


def test_allocate_ports_skips_a_port_in_use(monkeypatch: pytest.MonkeyPatch) -> None:
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen(1)
    busy = holder.getsockname()[1]
    real = ports_mod._candidates
    monkeypatch.setattr(ports_mod, "_candidates", lambda avoid: [busy] + (real(avoid) or []))
    try:
        assert busy not in allocate_ports().values()
    finally:
        holder.close()


def test_allocate_ports_falls_back_to_the_kernel(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """An ephemeral range that starts low leaves no room below it: the kernel picks."""
    (tmp_path / "range").write_text("1024\t65535\n")
    monkeypatch.setattr(ports_mod, "_RANGE_FILE", tmp_path / "range")
    assert ports_mod.ephemeral_range() == (1024, 65535)
    ports = allocate_ports()
    assert len(set(ports.values())) == 4
    assert all(1024 <= p <= 65535 for p in ports.values())
    (tmp_path / "range").write_text("garbage")
    assert ports_mod.ephemeral_range() == (32768, 60999)


def test_rendezvous_port_in_use(tmp_path: Path) -> None:
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen(1)
    port = holder.getsockname()[1]
    try:
        (tmp_path / "w.py").write_text("")
        env = _env(2, C10D_PORT=str(port))
        proc = subprocess.run(
            [sys.executable, "-m", "det_local.launch.torch_distributed", "python3", "w.py"],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=TIMEOUT,
        )  # fmt: skip
        assert proc.returncode == 1
        assert proc.stderr.startswith(
            f"det-local: error: the rendezvous port C10D_PORT={port} is in use"
        )
    finally:
        holder.close()
    assert torch_distributed.master_port(["--master_port", "1", "--master-port=7", "--module"]) == 7

"""The slot inventory (det_local.sched.queue.hardware) and `det-local slots` (det_local.cli.slots).

There is no GPU on most test machines, so NVML is replaced by a small fake `pynvml` module
(installed in sys.modules) that answers like the real bindings; everything else is real:
foreign processes are real child processes, found through psutil.
"""

from __future__ import annotations

import getpass
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import psutil
import pytest
import typer
from typer.testing import CliRunner

from det_local.errors import DetLocalError
from det_local.sched.queue import hardware as slots
from det_local.sched.queue.hardware import (
    CPU_SLOTS_ENV,
    FAKE_FOREIGN_ENV,
    FAKE_GPUS_ENV,
    busy_foreign,
    describe,
    detect_foreign,
    discover,
    fake_uuid,
)
from tests.support.nvml import (
    FakeNvml,
    NVMLLibraryMismatchError,
    install,
    two_h100s,
)

ME = psutil.Process().username()


@pytest.fixture(autouse=True)
def no_gpu(monkeypatch: pytest.MonkeyPatch) -> FakeNvml:
    """Every test starts on a machine without a GPU (even where the real one has some)."""
    for name in (FAKE_GPUS_ENV, FAKE_FOREIGN_ENV, CPU_SLOTS_ENV):
        monkeypatch.delenv(name, raising=False)
    return install(monkeypatch, FakeNvml([], init_error="Driver Not Loaded"))


@pytest.fixture
def child() -> Iterator[subprocess.Popen[bytes]]:
    """A real process of ours that a test can pretend holds a GPU."""
    p = subprocess.Popen(["sleep", "60"])
    yield p
    p.kill()
    p.wait()


# ---------------------------------------------------------------------------- fake inventory
def test_fake_inventory_of_n(monkeypatch: pytest.MonkeyPatch, no_gpu: FakeNvml) -> None:
    monkeypatch.setenv(FAKE_GPUS_ENV, "3")
    inv = discover(cpu_slots=5)  # GPUs present: cpu_slots does not matter
    assert inv.source == "fake" and inv.size() == 3
    assert [s.index for s in inv.slots] == [0, 1, 2]
    assert {s.kind for s in inv.slots} == {"gpu"}
    assert {s.name for s in inv.slots} == {"Fake GPU"}
    assert {s.memory_total_mb for s in inv.slots} == {16384}
    uuids = [str(s.uuid) for s in inv.slots]
    assert uuids == [fake_uuid(0), fake_uuid(1), fake_uuid(2)] == [s.uuid for s in discover().slots]
    assert len(set(uuids)) == 3 and all(u.startswith("GPU-fake-0000-") for u in uuids)
    assert uuids[2].endswith("2")
    assert no_gpu.inits == 0  # NVML is not consulted when the inventory is fake


def test_fake_gpus_zero_hides_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FAKE_GPUS_ENV, "0")
    nvml = install(monkeypatch, FakeNvml(two_h100s()))
    inv = discover()
    assert inv.source == "cpu" and inv.size() == 1
    assert nvml.inits == 0 and FAKE_GPUS_ENV in inv.note


# ---------------------------------------------------------------------------- CPU slots
def test_cpu_slots_from_default_env_and_argument(monkeypatch: pytest.MonkeyPatch) -> None:
    inv = discover()
    assert inv.source == "cpu" and inv.size() == 1
    (slot,) = inv.slots
    assert (slot.index, slot.kind, slot.uuid, slot.name) == (0, "cpu", None, "cpu")
    assert slot.memory_total_mb is None and slot.utilization_pct is None
    assert "Driver Not Loaded" in inv.note and CPU_SLOTS_ENV in inv.note

    monkeypatch.setenv(CPU_SLOTS_ENV, "4")
    inv = discover()
    assert [s.index for s in inv.slots] == [0, 1, 2, 3] and {s.kind for s in inv.slots} == {"cpu"}
    assert CPU_SLOTS_ENV in inv.note

    assert discover(cpu_slots=2).size() == 2  # the argument (daemon/runner setting) wins
    monkeypatch.setenv(CPU_SLOTS_ENV, " ")  # empty counts as unset
    assert discover().size() == 1


@pytest.mark.parametrize("value", ["0", "-2", "two", "1.5"])
def test_invalid_cpu_slots_env(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(CPU_SLOTS_ENV, value)
    with pytest.raises(DetLocalError) as err:
        discover()
    msg = str(err.value)
    assert "\n" not in msg
    assert f"{CPU_SLOTS_ENV}={value!r}" in msg and "1 or more" in msg and "unset it" in msg


@pytest.mark.parametrize("value", ["-1", "lots"])
def test_invalid_fake_gpus_env(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(FAKE_GPUS_ENV, value)
    with pytest.raises(DetLocalError, match=FAKE_GPUS_ENV):
        discover()


@pytest.mark.parametrize("value", [0, -1, True, "2"])
def test_invalid_cpu_slots_argument(value: Any) -> None:
    with pytest.raises(DetLocalError, match="cpu_slots must be a whole number"):
        discover(cpu_slots=value)


# ---------------------------------------------------------------------------- visible devices
def test_visible_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FAKE_GPUS_ENV, "4")
    gpus = discover()
    assert gpus.visible_devices([2]) == fake_uuid(2)
    assert gpus.visible_devices([3, 1]) == f"{fake_uuid(3)},{fake_uuid(1)}"
    assert gpus.visible_devices([]) == ""  # a trial with no GPU slot sees no GPU
    with pytest.raises(ValueError, match="no slot 4"):
        gpus.visible_devices([4])
    with pytest.raises(ValueError, match="repeat"):
        gpus.visible_devices([1, 1])

    monkeypatch.delenv(FAKE_GPUS_ENV)
    cpus = discover(cpu_slots=3)
    assert cpus.visible_devices([0, 2]) == ""  # empty: hides every GPU


# ---------------------------------------------------------------------------- NVML
def test_nvml_inventory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CPU_SLOTS_ENV, "8")  # ignored: there are GPUs
    nvml = install(monkeypatch, FakeNvml(two_h100s()))
    inv = discover()
    assert inv.source == "nvml" and inv.size() == 2 and inv.note == ""
    a, b = inv.slots
    assert a == slots.Slot(
        index=0,
        kind="gpu",
        uuid="GPU-11111111-2222-3333-4444-555555555555",  # bytes from older pynvml decoded
        name="NVIDIA H100 80GB HBM3",
        memory_total_mb=81920,
        memory_used_mb=1024,
        utilization_pct=37,
    )
    assert (b.index, b.uuid, b.memory_used_mb) == (1, "GPU-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee", 0)
    assert b.utilization_pct is None  # "Not Supported" is not an error
    assert inv.visible_devices([1, 0]) == f"{b.uuid},{a.uuid}"
    assert nvml.inits == nvml.shutdowns == 1


def test_nvml_init_error_falls_back_to_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    install(monkeypatch, FakeNvml(two_h100s(), init_error="NVML Shared Library Not Found"))
    monkeypatch.setenv(CPU_SLOTS_ENV, "2")
    inv = discover()
    assert inv.source == "cpu" and inv.size() == 2
    assert "NVML Shared Library Not Found" in inv.note
    assert detect_foreign(inv, ()) == inv


def test_nvml_without_devices_or_module(monkeypatch: pytest.MonkeyPatch) -> None:
    nvml = install(monkeypatch, FakeNvml([]))
    assert discover().source == "cpu"
    assert nvml.inits == nvml.shutdowns == 1
    monkeypatch.setitem(sys.modules, "pynvml", None)  # `import pynvml` raises ImportError
    inv = discover()
    assert inv.source == "cpu" and "pynvml" in inv.note


def test_nvml_lost_gpu_is_left_out(monkeypatch: pytest.MonkeyPatch) -> None:
    install(monkeypatch, FakeNvml(two_h100s(lost=True)))
    inv = discover()
    assert inv.source == "nvml" and inv.size() == 1
    assert inv.slots[0].index == 0 and str(inv.slots[0].uuid).startswith("GPU-aaaaaaaa")
    assert "GPU 0" in inv.note and "GPU is lost" in inv.note


def test_nvml_foreign_processes(
    monkeypatch: pytest.MonkeyPatch, child: subprocess.Popen[bytes]
) -> None:
    stranger = subprocess.Popen(["sleep", "60"])  # stands for someone else's process
    try:
        gpus = two_h100s(compute=[child.pid, stranger.pid, 4_000_000], graphics=[stranger.pid])
        gpus[1].graphics = [child.pid]
        nvml = install(monkeypatch, FakeNvml(gpus))
        inv = discover()
        found = detect_foreign(inv, our_pids={child.pid})
        a, b = found.slots
        # listed by compute and graphics alike: once; a pid not visible here: user unknown
        assert a.foreign_pids == tuple(sorted([stranger.pid, 4_000_000]))
        assert dict(zip(a.foreign_pids, a.foreign_users, strict=True)) == {
            stranger.pid: ME,
            4_000_000: "unknown",
        }
        assert b.foreign_pids == () and b.foreign_users == ()
        assert (a.name, a.memory_used_mb) == (inv.slots[0].name, inv.slots[0].memory_used_mb)
        assert busy_foreign(found, True) == {0}
        assert busy_foreign(found, False) == set()
        assert nvml.inits == nvml.shutdowns == 2

        # Older drivers: the unversioned call (backed by _v3) is missing -> its _v2 is used.
        def mismatch(h: Any) -> Any:
            raise NVMLLibraryMismatchError("use a versioned function")

        m: Any = nvml.module
        m.nvmlDeviceGetComputeRunningProcesses = mismatch
        m.nvmlDeviceGetComputeRunningProcesses_v2 = lambda h: nvml.procs(h.compute)
        assert detect_foreign(inv, our_pids={child.pid}).slots[0].foreign_pids == a.foreign_pids

        # NVML gone between discovery and detection: nothing found, nothing raised.
        nvml.init_error = "Driver Not Loaded"
        assert busy_foreign(detect_foreign(inv, ()), True) == set()
    finally:
        stranger.kill()
        stranger.wait()


# ---------------------------------------------------------------------------- fake foreign
def test_foreign_process_on_fake_gpu(
    monkeypatch: pytest.MonkeyPatch, child: subprocess.Popen[bytes]
) -> None:
    monkeypatch.setenv(FAKE_GPUS_ENV, "2")
    monkeypatch.setenv(FAKE_FOREIGN_ENV, f"1:{child.pid}")
    inv = discover()
    assert all(s.foreign_pids == () for s in inv.slots)  # discover alone does not look

    found = detect_foreign(inv, our_pids=())
    assert found.slots[0].foreign_pids == ()
    assert found.slots[1].foreign_pids == (child.pid,)
    assert found.slots[1].foreign_users == (ME,) and getpass.getuser() == ME
    assert busy_foreign(found, count_foreign_as_busy=True) == {1}
    assert busy_foreign(found, count_foreign_as_busy=False) == set()

    # Its parent (this test process) is ours: so is it.
    ours = detect_foreign(inv, our_pids={os.getpid()})
    assert busy_foreign(ours, True) == set()

    # The process ends: the GPU is free again.
    child.kill()
    child.wait()
    assert busy_foreign(detect_foreign(inv, our_pids=()), True) == set()


def test_descendants_and_process_group_count_as_ours(monkeypatch: pytest.MonkeyPatch) -> None:
    """A trial's worker is ours while the trial lives, even re-parented away from it (same
    process group); once the trial is gone a worker left on the GPU is foreign (busy)."""
    # `sh` leads its own process group (as the executor starts trials); the subshell starts a
    # worker and exits, so the worker is re-parented away from sh but stays in its group.
    trial = subprocess.Popen(
        ["sh", "-c", "(sleep 60 & echo $!); exec sleep 60"],
        stdout=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        assert trial.stdout is not None
        worker = int(trial.stdout.readline())
        assert psutil.Process(worker).ppid() != trial.pid
        assert os.getpgid(worker) == trial.pid
        monkeypatch.setenv(FAKE_GPUS_ENV, "1")
        monkeypatch.setenv(FAKE_FOREIGN_ENV, f"0:{worker},0:{trial.pid}")
        inv = discover()
        assert detect_foreign(inv, our_pids={trial.pid}).slots[0].foreign_pids == ()
        assert slots.is_ours(worker, {trial.pid})

        trial.kill()
        trial.wait()
        left = detect_foreign(inv, our_pids=())  # the trial is over: no pids of ours
        assert left.slots[0].foreign_pids == (worker,)
        assert busy_foreign(left, True) == {0}
    finally:
        try:
            os.killpg(trial.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        trial.wait()


def test_grandchild_of_ours_is_ours(monkeypatch: pytest.MonkeyPatch) -> None:
    parent = subprocess.Popen(
        ["sh", "-c", "sleep 60 & echo $!; wait"], stdout=subprocess.PIPE, start_new_session=True
    )
    try:
        assert parent.stdout is not None
        grandchild = int(parent.stdout.readline())
        assert slots.is_ours(grandchild, {parent.pid})
        assert not slots.is_ours(grandchild, {os.getpid() + 10_000_000})
        assert not slots.is_ours(grandchild, {1})  # init adopts everything: never an anchor
    finally:
        os.killpg(parent.pid, signal.SIGKILL)
        parent.wait()


@pytest.mark.parametrize(
    "value, match",
    [
        ("1", "not SLOT:PID"),
        ("a:3", "not SLOT:PID"),
        ("0:-4", "not SLOT:PID"),
        ("5:1", "fake GPU 5"),
    ],
)
def test_invalid_fake_foreign_env(monkeypatch: pytest.MonkeyPatch, value: str, match: str) -> None:
    monkeypatch.setenv(FAKE_GPUS_ENV, "2")
    monkeypatch.setenv(FAKE_FOREIGN_ENV, value)
    with pytest.raises(DetLocalError, match=match) as err:
        detect_foreign(discover(), ())
    assert FAKE_FOREIGN_ENV in str(err.value)


def test_dead_fake_foreign_pid_is_ignored(monkeypatch: pytest.MonkeyPatch) -> None:
    p = subprocess.Popen(["true"])
    p.wait()
    monkeypatch.setenv(FAKE_GPUS_ENV, "1")
    monkeypatch.setenv(FAKE_FOREIGN_ENV, f"0:{p.pid}")
    assert detect_foreign(discover(), ()).slots[0].foreign_pids == ()


# ---------------------------------------------------------------------------- describe and CLI
def test_describe_rows(monkeypatch: pytest.MonkeyPatch, child: subprocess.Popen[bytes]) -> None:
    monkeypatch.setenv(FAKE_GPUS_ENV, "3")
    monkeypatch.setenv(FAKE_FOREIGN_ENV, f"2:{child.pid}")
    inv = detect_foreign(discover(), ())
    rows = describe(inv, {0: "experiment 3 trial 7"})
    assert [r["used_by"] for r in rows] == [
        "experiment 3 trial 7",
        "",
        f"other: {ME} (pid {child.pid})",
    ]
    assert rows[2]["foreign"] == [{"pid": child.pid, "user": ME}]
    assert rows[0]["allocation"] == "experiment 3 trial 7" and rows[1]["allocation"] is None
    assert describe(inv)[0]["used_by"] == ""


def _app() -> typer.Typer:
    from det_local.cli.slots import slots_command

    app = typer.Typer()
    app.command("slots")(slots_command)
    return app


JSON_KEYS = [
    "index",
    "kind",
    "uuid",
    "name",
    "memory_total_mb",
    "memory_used_mb",
    "utilization_pct",
    "foreign",
    "allocation",
    "used_by",
    # the holding job (issue 30): who, since when, idle for how long, flagged
    "job_id",
    "job_kind",
    "held_since",
    "held_for_s",
    "idle_for_s",
    "idle_flagged",
    "disabled",  # `slot disable` (drained)
]


def test_cli_json_and_table(
    monkeypatch: pytest.MonkeyPatch, child: subprocess.Popen[bytes]
) -> None:
    monkeypatch.setenv(FAKE_GPUS_ENV, "2")
    monkeypatch.setenv(FAKE_FOREIGN_ENV, f"1:{child.pid}")
    runner = CliRunner()
    res = runner.invoke(_app(), ["--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert [list(r) for r in data] == [JSON_KEYS, JSON_KEYS]
    assert data[1]["foreign"] == [{"pid": child.pid, "user": ME}]
    assert data[0]["uuid"] == fake_uuid(0) and data[0]["memory_total_mb"] == 16384

    res = runner.invoke(_app(), [])
    assert res.exit_code == 0, res.output
    lines = res.stdout.splitlines()
    assert [c.strip() for c in lines[0].split("|")] == [
        "Slot",
        "Kind",
        "Name",
        "UUID",
        "Memory",
        "Util",
        "Used by",
    ]
    assert f"other: {ME} (pid {child.pid})" in lines[3]
    assert "GPU-fake-000..0001" in lines[3] and "0/16384 MiB" in lines[3] and "0%" in lines[3]
    assert lines[-1].startswith(f"{FAKE_GPUS_ENV}=2")


def test_cli_cpu_table() -> None:
    res = CliRunner().invoke(_app(), [])
    assert res.exit_code == 0, res.output
    lines = res.stdout.splitlines()
    assert [c.strip() for c in lines[2].split("|")][:6] == ["0", "cpu", "cpu", "-", "-", "-"]
    assert "Driver Not Loaded" in lines[-1] and CPU_SLOTS_ENV in lines[-1]


def test_cli_invalid_env_is_one_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CPU_SLOTS_ENV, "0")
    res = CliRunner().invoke(_app(), [])
    assert isinstance(res.exception, DetLocalError) and CPU_SLOTS_ENV in str(res.exception)


def test_light_imports() -> None:
    """The CLI module and the inventory module load neither NVML nor psutil."""
    code = (
        "import sys; import det_local.cli.slots, det_local.sched.queue.hardware; "
        "print(sorted(m for m in ('pynvml', 'psutil', 'torch') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    assert out.strip() == "[]"


def test_cli_in_a_fresh_process(child: subprocess.Popen[bytes]) -> None:
    env = {**os.environ, FAKE_GPUS_ENV: "2", FAKE_FOREIGN_ENV: f"0:{child.pid}"}
    code = "from det_local.cli.slots import slots_command; slots_command(True, False)"
    r = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stderr
    assert [row["foreign"] for row in json.loads(r.stdout)] == [
        [{"pid": child.pid, "user": ME}],
        [],
    ]


# ---------------------------------------------------------------------------- real GPU
_REAL_PYNVML: Any = None


def _has_gpu() -> bool:
    global _REAL_PYNVML
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            found = bool(pynvml.nvmlDeviceGetCount())
        finally:
            pynvml.nvmlShutdown()
    except Exception:
        return False
    _REAL_PYNVML = pynvml
    return found


@pytest.mark.gpu
@pytest.mark.skipif(not _has_gpu(), reason="needs an NVIDIA GPU")
def test_real_nvml(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", _REAL_PYNVML)
    inv = discover()
    assert inv.source == "nvml" and inv.size() >= 1
    for s in inv.slots:
        assert s.kind == "gpu" and s.uuid and s.uuid.startswith("GPU-")
        assert s.memory_total_mb and s.memory_total_mb > 0
    found = detect_foreign(inv, our_pids={os.getpid()})
    assert found.size() == inv.size()
    visible = inv.visible_devices(list(range(inv.size())))
    assert visible.split(",") == [s.uuid for s in inv.slots]

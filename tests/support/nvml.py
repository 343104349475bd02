"""A fake `pynvml` module over a list of fake GPUs (their memory, utilisation, processes and
NVML's errors), installed in sys.modules for one test (`install`)."""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass, field
from typing import Any

import pytest


# ---------------------------------------------------------------------------- a fake pynvml
class NVMLError(Exception):
    def __init__(self, text: str) -> None:
        super().__init__(text)


class NVMLLibraryMismatchError(Exception):
    """Like the real one: not a subclass of NVMLError."""


@dataclass
class FakeGpu:
    uuid: str | bytes
    name: str | bytes
    total: int = 80 * 1024 * 1024 * 1024
    used: int = 1024 * 1024 * 1024
    util: int | None = 37  # None: utilisation not supported
    compute: list[int] = field(default_factory=list)
    graphics: list[int] = field(default_factory=list)
    lost: bool = False


class FakeNvml:
    """The pynvml calls slots.py makes, over a list of FakeGpu; records init/shutdown balance."""

    def __init__(self, gpus: list[FakeGpu], init_error: str | None = None) -> None:
        self.gpus = gpus
        self.init_error = init_error
        self.inits = 0
        self.shutdowns = 0
        self.module = types.ModuleType("pynvml")
        m: Any = self.module
        m.NVMLError = NVMLError
        m.NVMLLibraryMismatchError = NVMLLibraryMismatchError
        m.nvmlInit = self.init
        m.nvmlShutdown = self.shutdown
        m.nvmlDeviceGetCount = lambda: len(self.gpus)
        m.nvmlDeviceGetHandleByIndex = self.by_index
        m.nvmlDeviceGetHandleByUUID = self.by_uuid
        m.nvmlDeviceGetUUID = lambda h: h.uuid
        m.nvmlDeviceGetName = lambda h: h.name
        m.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(
            total=h.total, free=h.total - h.used, used=h.used
        )
        m.nvmlDeviceGetUtilizationRates = self.util
        m.nvmlDeviceGetComputeRunningProcesses = lambda h: self.procs(h.compute)
        m.nvmlDeviceGetGraphicsRunningProcesses = lambda h: self.procs(h.graphics)

    def init(self) -> None:
        if self.init_error:
            raise NVMLError(self.init_error)
        self.inits += 1

    def shutdown(self) -> None:
        self.shutdowns += 1

    def by_index(self, i: int) -> FakeGpu:
        if not 0 <= i < len(self.gpus):
            raise NVMLError("Invalid Argument")
        if self.gpus[i].lost:
            raise NVMLError("GPU is lost")
        return self.gpus[i]

    def by_uuid(self, uuid: str) -> FakeGpu:
        for g in self.gpus:
            if (g.uuid.decode() if isinstance(g.uuid, bytes) else g.uuid) == uuid:
                return g
        raise NVMLError("Not Found")

    def util(self, h: FakeGpu) -> Any:
        if h.util is None:
            raise NVMLError("Not Supported")
        return types.SimpleNamespace(gpu=h.util, memory=5)

    @staticmethod
    def procs(pids: list[int]) -> list[Any]:
        return [types.SimpleNamespace(pid=p, usedGpuMemory=1 << 20) for p in pids]


def install(monkeypatch: pytest.MonkeyPatch, nvml: FakeNvml) -> FakeNvml:
    monkeypatch.setitem(sys.modules, "pynvml", nvml.module)
    return nvml


def two_h100s(**first: Any) -> list[FakeGpu]:
    """Two GPUs: the first speaks bytes (older pynvml), the second str and no utilisation;
    `first` overrides fields of the first."""
    a = FakeGpu(uuid=b"GPU-11111111-2222-3333-4444-555555555555", name=b"NVIDIA H100 80GB HBM3")
    for k, v in first.items():
        setattr(a, k, v)
    b = FakeGpu(
        uuid="GPU-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee",
        name="NVIDIA H100 80GB HBM3",
        used=0,
        util=None,
    )
    return [a, b]

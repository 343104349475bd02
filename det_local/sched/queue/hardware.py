"""The slot inventory: which GPUs (or CPU slots) this machine has, and who else is using them.

A *slot* is what the scheduler hands out: one whole GPU, or on a machine without GPUs one CPU
slot. Slots are numbered 0..n-1 (det-local's slot id); a GPU slot is tied to its hardware by
UUID, never by index, because CUDA's device order need not match NVML's and a trial gets
``CUDA_VISIBLE_DEVICES`` as UUIDs (`Inventory.visible_devices`).

Where the inventory comes from, first match wins (`discover`):

1. ``DET_LOCAL_FAKE_GPUS=N``: N fake GPUs, for tests (the only fake, at the hardware edge).
   ``N=0`` hides the GPUs: NVML is not consulted and CPU slots are used.
2. NVML (``pynvml``, from nvidia-ml-py): index, UUID, name, memory and utilisation. Any NVML
   failure (no library, no driver, no device) falls back quietly to CPU slots; the reason is
   kept in `Inventory.note` for ``det-local slots`` to show.
3. CPU slots: the ``cpu_slots`` argument, else ``DET_LOCAL_CPU_SLOTS=N``, else 1.

GPUs that processes det-local did not start are using are found by `detect_foreign` and turned
into busy slots by `busy_foreign` when the daemon is configured to count them (a GPU someone
else's notebook holds is not free, whatever our own records say).

This module imports only the standard library at load time: pynvml and psutil are imported by
the functions that need them, so that the CLI stays light.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any

from det_local.errors import DetLocalError
from det_local.store.states import JobState

log = logging.getLogger(__name__)

FAKE_GPUS_ENV = "DET_LOCAL_FAKE_GPUS"
FAKE_FOREIGN_ENV = "DET_LOCAL_FAKE_GPU_FOREIGN"
CPU_SLOTS_ENV = "DET_LOCAL_CPU_SLOTS"

# One CPU slot by default: a CPU trial normally uses every core (PyTorch starts one intra-op
# thread per core), so one slot stands for the whole machine and two trials at once would only
# fight over the cores. Users with small trials raise it (DET_LOCAL_CPU_SLOTS=N or cpu_slots).
DEFAULT_CPU_SLOTS = 1

FAKE_GPU_NAME = "Fake GPU"
FAKE_GPU_MEMORY_MB = 16384

GPU = "gpu"
CPU = "cpu"
SOURCE_NVML = "nvml"
SOURCE_FAKE = "fake"
SOURCE_CPU = "cpu"

UNKNOWN_USER = "unknown"
_MIB = 1024 * 1024
_NO_ALLOCATIONS: Mapping[int, str] = MappingProxyType({})


@dataclass(frozen=True)
class Slot:
    """One schedulable slot: a whole GPU, or one CPU slot."""

    index: int  # 0..n-1, det-local's slot id
    kind: str  # "gpu" | "cpu"
    uuid: str | None  # GPU UUID ("GPU-..."), None for CPU slots
    name: str  # "NVIDIA H100 80GB HBM3" / "cpu"
    memory_total_mb: int | None  # MiB, as nvidia-smi shows them
    memory_used_mb: int | None
    utilization_pct: int | None
    # Processes on this GPU that det-local did not start (filled by detect_foreign), and their
    # users: the two tuples are parallel (foreign_users[i] runs foreign_pids[i]).
    foreign_pids: tuple[int, ...] = ()
    foreign_users: tuple[str, ...] = ()
    # The GPU's device node is /dev/nvidia<minor> (char major 195): what the job cgroups'
    # device fence denies to jobs that do not hold it. None for CPU slots, or where NVML does
    # not say (then no GPU is fenced). A fake GPU's minor is its index.
    minor: int | None = None


@dataclass(frozen=True)
class Inventory:
    slots: tuple[Slot, ...]
    source: str  # "nvml" | "fake" | "cpu"
    # Why this source, for people: e.g. why there are no GPUs ("NVML: Driver Not Loaded").
    note: str = ""

    def size(self) -> int:
        return len(self.slots)

    def slot(self, index: int) -> Slot:
        if not 0 <= index < len(self.slots):
            raise ValueError(f"no slot {index}: this machine has slots 0..{len(self.slots) - 1}")
        return self.slots[index]

    def cpu_threads(self, n_slots: int) -> int | None:
        """Intra-op threads for a job holding n_slots CPU slots: its share of this machine's
        cores (at least 1). None for GPU slots (torch's own default then). Without it every
        torch process starts one thread per core, and two 1-slot trials on a 2-core machine
        run each other an order of magnitude slower."""
        if self.source != SOURCE_CPU or not self.slots:
            return None
        try:
            cores = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            cores = os.cpu_count() or 1
        return max(1, cores * max(1, n_slots) // len(self.slots))

    def visible_devices(self, indices: Sequence[int]) -> str:
        """The CUDA_VISIBLE_DEVICES value that gives a process exactly these slots.

        GPU slots: their UUIDs joined by "," (UUIDs, not indices: CUDA's device order can
        differ from NVML's). CPU slots, or no slots at all: "" (an empty value hides every GPU,
        so a CPU trial cannot wander onto one).
        """
        if len(set(indices)) != len(indices):
            raise ValueError(f"slot indices repeat: {list(indices)}")
        chosen = [self.slot(i) for i in indices]
        return ",".join(s.uuid for s in chosen if s.kind == GPU and s.uuid)


# ---------------------------------------------------------------------------- discovery
def discover(*, cpu_slots: int | None = None) -> Inventory:
    """This machine's slots: fake GPUs, else NVML GPUs, else CPU slots (see the module doc).

    `cpu_slots` (from the daemon's or the runner's settings) wins over DET_LOCAL_CPU_SLOTS; both
    matter only when there is no GPU. Raises DetLocalError for an invalid setting.
    """
    if cpu_slots is not None and (
        isinstance(cpu_slots, bool) or not isinstance(cpu_slots, int) or cpu_slots < 1
    ):
        raise DetLocalError(
            f"cpu_slots must be a whole number, 1 or more (got {cpu_slots!r}): it is how many "
            "CPU trials may run at once on a machine without GPUs"
        )
    fake = _env_count(FAKE_GPUS_ENV, minimum=0, what="the number of fake GPUs to pretend to have")
    if fake is not None and fake > 0:
        return _fake_inventory(fake)
    if fake == 0:
        note = f"{FAKE_GPUS_ENV}=0 hides the GPUs"
    else:
        slots, note = _nvml_inventory()
        if slots:
            return Inventory(tuple(slots), SOURCE_NVML, note)
    return _cpu_inventory(cpu_slots, note)


def _env_count(name: str, *, minimum: int, what: str) -> int | None:
    """A whole-number environment setting; unset or empty -> None; anything else invalid raises."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        value = None
    if value is None or value < minimum:
        raise DetLocalError(
            f"{name}={raw!r} is not valid: set it to {what} (a whole number, {minimum} or more), "
            "or unset it"
        )
    return value


def _fake_inventory(n: int) -> Inventory:
    slots = tuple(
        Slot(
            index=i,
            kind=GPU,
            uuid=fake_uuid(i),
            name=FAKE_GPU_NAME,
            memory_total_mb=FAKE_GPU_MEMORY_MB,
            memory_used_mb=0,
            utilization_pct=0,
            minor=i,
        )
        for i in range(n)
    )
    return Inventory(slots, SOURCE_FAKE, f"{FAKE_GPUS_ENV}={n}: a fake inventory for tests")


def fake_uuid(i: int) -> str:
    """The deterministic UUID of fake GPU `i` (shaped like a real one: GPU-8-4-4-4-12)."""
    return f"GPU-fake-0000-0000-0000-{i:012d}"


def _cpu_inventory(cpu_slots: int | None, why: str) -> Inventory:
    if cpu_slots is not None:
        n, origin = cpu_slots, "cpu_slots setting"
    else:
        env = _env_count(CPU_SLOTS_ENV, minimum=1, what="how many CPU trials may run at once")
        n, origin = (env, CPU_SLOTS_ENV) if env is not None else (DEFAULT_CPU_SLOTS, "default")
    slots = tuple(
        Slot(
            index=i,
            kind=CPU,
            uuid=None,
            name=CPU,
            memory_total_mb=None,
            memory_used_mb=None,
            utilization_pct=None,
        )
        for i in range(n)
    )
    plural = "slot" if n == 1 else "slots"
    note = f"no GPU ({why}); {n} CPU {plural} ({origin})" if why else f"{n} CPU {plural}"
    if origin == "default":
        note += f"; set {CPU_SLOTS_ENV}=N to run N CPU trials at once"
    return Inventory(slots, SOURCE_CPU, note)


def cpu_slots_remedy(
    inventory: Inventory, slots: int, *, daemon: bool, settings_path: str | None = None
) -> str | None:
    """For a request over the machine's slots: how to run it unchanged on CPU slots (None where
    the slots are GPUs, which a setting cannot add). The daemon's settings file wins over the
    environment (see `discover`), so it is named when it sets cpu_slots."""
    if inventory.source != SOURCE_CPU:
        return None
    unchanged = f"to run it unchanged on {slots} CPU slots"
    if settings_path is not None:
        again = "and restart the daemon " if daemon else ""
        return f"set slots.cpu_slots: {slots} in {settings_path} {again}{unchanged}"
    if daemon:
        return f"restart the daemon with {CPU_SLOTS_ENV}={slots} {unchanged}"
    return f"set {CPU_SLOTS_ENV}={slots} {unchanged}"


def _text(value: Any) -> str:
    """NVML strings: bytes from older pynvml releases, str from newer ones."""
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return str(value)


def _nvml_errors(nv: Any) -> tuple[type[BaseException], ...]:
    """What pynvml raises: NVMLError and (not a subclass of it) NVMLLibraryMismatchError."""
    errors: list[type[BaseException]] = [OSError]
    for name in ("NVMLError", "NVMLLibraryMismatchError"):
        cls = getattr(nv, name, None)
        if isinstance(cls, type) and issubclass(cls, BaseException):
            errors.append(cls)
    return tuple(errors)


def _nvml_inventory() -> tuple[list[Slot], str]:
    """The GPUs NVML reports, and a note for people; ([], why) when NVML cannot be used."""
    import glob
    import sys

    if (
        "pynvml" not in sys.modules
        and not os.path.exists("/proc/driver/nvidia")
        and not glob.glob("/dev/nvidia[0-9]*")
    ):  # no NVIDIA driver: skip loading NVML (it costs ~15 ms at every start)
        return [], "no NVIDIA driver found (/proc/driver/nvidia)"
    try:
        import pynvml as nv
    except ImportError as err:  # nvidia-ml-py is a dependency, but be kind to odd installs
        return [], f"pynvml cannot be imported: {err}"
    errors = _nvml_errors(nv)
    try:
        nv.nvmlInit()
    except errors as err:
        log.debug("NVML unavailable: %s", err)
        return [], f"NVML: {err}"
    try:
        try:
            count = int(nv.nvmlDeviceGetCount())
        except errors as err:
            return [], f"NVML: {err}"
        if count == 0:
            return [], "NVML found no GPU"
        slots: list[Slot] = []
        skipped: list[str] = []
        for i in range(count):
            try:
                handle = nv.nvmlDeviceGetHandleByIndex(i)
                uuid = _text(nv.nvmlDeviceGetUUID(handle))
                name = _text(nv.nvmlDeviceGetName(handle))
            except errors as err:  # e.g. "GPU is lost": leave it out, keep the others
                skipped.append(f"NVML GPU {i} left out: {err}")
                continue
            mem = _optional(errors, nv.nvmlDeviceGetMemoryInfo, handle)
            util = _optional(errors, nv.nvmlDeviceGetUtilizationRates, handle)
            get_minor = getattr(nv, "nvmlDeviceGetMinorNumber", None)
            minor = None if get_minor is None else _optional(errors, get_minor, handle)
            slots.append(
                Slot(
                    index=len(slots),
                    kind=GPU,
                    uuid=uuid,
                    name=name,
                    memory_total_mb=None if mem is None else int(mem.total) // _MIB,
                    memory_used_mb=None if mem is None else int(mem.used) // _MIB,
                    utilization_pct=None if util is None else int(util.gpu),
                    minor=None if minor is None else int(minor),
                )
            )
        return slots, "; ".join(skipped)
    finally:
        try:
            nv.nvmlShutdown()
        except errors:
            pass


def _optional(errors: tuple[type[BaseException], ...], read: Callable[..., Any], *args: Any) -> Any:
    """A reading some GPUs do not support (utilisation under MIG, say): None when it fails."""
    try:
        return read(*args)
    except errors as err:
        log.debug("NVML reading not available: %s", err)
        return None


def read_usage(inv: Inventory) -> Inventory:
    """The inventory with each NVML GPU's memory in use and utilisation read now (discovery
    read them once, when the engine started): what `slots` and the dashboard show. A GPU NVML
    cannot read now keeps no figure (None) rather than a stale one; fake and CPU slots are
    returned as they are."""
    if inv.source != SOURCE_NVML:
        return inv
    try:
        import pynvml as nv
    except ImportError:
        return inv
    errors = _nvml_errors(nv)
    try:
        nv.nvmlInit()
    except errors as err:
        log.warning("cannot read GPU usage: NVML: %s", err)
        return inv
    slots = []
    try:
        for slot in inv.slots:
            if slot.kind != GPU or not slot.uuid:
                slots.append(slot)
                continue
            handle = _optional(errors, nv.nvmlDeviceGetHandleByUUID, slot.uuid)
            mem = None if handle is None else _optional(errors, nv.nvmlDeviceGetMemoryInfo, handle)
            util = (
                None
                if handle is None
                else _optional(errors, nv.nvmlDeviceGetUtilizationRates, handle)
            )
            slots.append(
                replace(
                    slot,
                    memory_used_mb=None if mem is None else int(mem.used) // _MIB,
                    utilization_pct=None if util is None else int(util.gpu),
                )
            )
    finally:
        try:
            nv.nvmlShutdown()
        except errors:
            pass
    return replace(inv, slots=tuple(slots))


# ---------------------------------------------------------------------------- foreign processes
def detect_foreign(inv: Inventory, our_pids: Collection[int]) -> Inventory:
    """The inventory with each GPU's foreign processes (and their users) filled in.

    A process on a GPU is det-local's when it, one of its ancestors, or the leader of its process
    group is in `our_pids`. Pass the pids of the trial and command processes det-local started
    (they lead their process groups), not the daemon's own pid: workers a killed trial left behind
    are re-parented away from it and must show up as foreign, since they still hold the GPU.

    NVML: the compute and graphics processes of each GPU. Fake inventory: the pids listed in
    DET_LOCAL_FAKE_GPU_FOREIGN="SLOT:PID,SLOT:PID" (pids that have exited are ignored, as NVML
    would no longer list them). CPU slots: nothing to detect.

    Inside a container NVML reports the host's pids: one this process cannot see counts as
    foreign, user "unknown" (busy, to be safe). Our own trials would show that way too while
    they run, so a daemon in a container should share the host's pid namespace.
    """
    if inv.source == SOURCE_NVML:
        on_gpu = _nvml_processes(inv)
    elif inv.source == SOURCE_FAKE:
        on_gpu = _fake_processes(inv)
    else:
        return inv
    ours = frozenset(our_pids)
    slots = []
    for slot in inv.slots:
        foreign = [pid for pid in sorted(set(on_gpu.get(slot.index, ()))) if not is_ours(pid, ours)]
        slots.append(
            replace(
                slot,
                foreign_pids=tuple(foreign),
                foreign_users=tuple(user_of(pid) for pid in foreign),
            )
        )
    return replace(inv, slots=tuple(slots))


def busy_foreign(inv: Inventory, count_foreign_as_busy: bool) -> set[int]:
    """The slots to treat as busy because of foreign processes (none unless configured to)."""
    if not count_foreign_as_busy:
        return set()
    return {s.index for s in inv.slots if s.foreign_pids}


def is_ours(pid: int, our_pids: Collection[int]) -> bool:
    """`pid` is in `our_pids`, descends from one, or belongs to a process group one leads."""
    if pid in our_pids:
        return True
    import psutil

    # pid 0/1 (init, or a daemon running as a container's init) adopts every orphan: as an
    # "ancestor" it would make every process ours.
    anchors = {p for p in our_pids if p > 1}
    if not anchors:
        return False
    try:
        if any(parent.pid in anchors for parent in psutil.Process(pid).parents()):
            return True
    except psutil.Error:
        # gone or invisible (another pid namespace: getpgid fails too, not ours), or one of
        # its parents exited while the chain was walked (it is being re-parented): its process
        # group still says whose it is
        pass
    try:
        return os.getpgid(pid) in anchors
    except OSError:
        return False


def user_of(pid: int) -> str:
    """Who runs `pid`: the user name, else the numeric uid, else "unknown"."""
    import psutil

    try:
        proc = psutil.Process(pid)
    except psutil.Error:  # exited, or invisible to us (another pid namespace, hidepid)
        return UNKNOWN_USER
    try:
        return str(proc.username())
    except psutil.AccessDenied:
        pass
    except psutil.Error:
        return UNKNOWN_USER
    try:
        return str(proc.uids().real)
    except psutil.Error:
        return UNKNOWN_USER


def _nvml_processes(inv: Inventory) -> dict[int, list[int]]:
    """Slot index -> pids NVML lists on that GPU (compute and graphics)."""
    try:
        import pynvml as nv
    except ImportError:
        return {}
    errors = _nvml_errors(nv)
    try:
        nv.nvmlInit()
    except errors as err:
        log.warning("cannot list GPU processes: NVML: %s", err)
        return {}
    out: dict[int, list[int]] = {}
    try:
        for slot in inv.slots:
            if slot.kind != GPU or not slot.uuid:
                continue
            try:
                handle = nv.nvmlDeviceGetHandleByUUID(slot.uuid)
            except errors as err:
                log.debug("cannot list processes on GPU %s: NVML: %s", slot.uuid, err)
                continue
            pids: list[int] = []
            for kind in ("Compute", "Graphics"):
                pids += _running_pids(nv, errors, handle, kind)
            out[slot.index] = pids
    finally:
        try:
            nv.nvmlShutdown()
        except errors:
            pass
    return out


def _running_pids(
    nv: Any, errors: tuple[type[BaseException], ...], handle: Any, kind: str
) -> list[int]:
    """nvmlDeviceGet{kind}RunningProcesses, falling back to its older versions (older drivers
    lack the _v3 entry point the unversioned call uses)."""
    base = f"nvmlDeviceGet{kind}RunningProcesses"
    last: BaseException | None = None
    for name in (base, f"{base}_v2", f"{base}_v1"):
        fn = getattr(nv, name, None)
        if fn is None:
            continue
        try:
            return [int(p.pid) for p in fn(handle) or ()]
        except errors as err:
            last = err
    if last is not None:
        log.debug("cannot list %s processes on a GPU: NVML: %s", kind.lower(), last)
    return []


def _fake_processes(inv: Inventory) -> dict[int, list[int]]:
    """DET_LOCAL_FAKE_GPU_FOREIGN="SLOT:PID,..." as slot index -> live pids."""
    import psutil

    raw = os.environ.get(FAKE_FOREIGN_ENV, "").strip()
    out: dict[int, list[int]] = {}
    for entry in filter(None, (e.strip() for e in raw.split(","))):
        idx_text, sep, pid_text = entry.partition(":")
        try:
            idx, pid = int(idx_text), int(pid_text)
        except ValueError:
            idx = pid = -1
        if not sep or idx < 0 or pid <= 0:
            raise DetLocalError(
                f'{FAKE_FOREIGN_ENV}: {entry!r} is not SLOT:PID; write it like "1:4242,0:4243"'
            )
        if idx >= inv.size():
            raise DetLocalError(
                f"{FAKE_FOREIGN_ENV}: {entry!r} names fake GPU {idx}, but there are "
                f"{inv.size()} (slots 0..{inv.size() - 1}); raise {FAKE_GPUS_ENV} or fix the slot"
            )
        try:
            alive = psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            alive = False
        if alive:
            out.setdefault(idx, []).append(pid)
    return out


# ---------------------------------------------------------------------------- description
def describe(
    inv: Inventory, allocations: Mapping[int, str] = _NO_ALLOCATIONS
) -> list[dict[str, Any]]:
    """One plain row per slot, for `det-local slots` (table and --json alike).

    `allocations` maps a slot index to what det-local runs there ("experiment 3 trial 7",
    "command 2"). Keys: index, kind, uuid, name, memory_total_mb, memory_used_mb,
    utilization_pct, foreign ([{pid, user}]), allocation (str or None) and used_by (the
    allocation and the foreign processes as one line: "other: alice (pid 123)").
    """
    rows: list[dict[str, Any]] = []
    for slot in inv.slots:
        foreign = [
            {"pid": pid, "user": user}
            for pid, user in zip(slot.foreign_pids, slot.foreign_users, strict=False)
        ]
        allocation = allocations.get(slot.index)
        used_by = [allocation] if allocation else []
        used_by += [f"other: {f['user']} (pid {f['pid']})" for f in foreign]
        rows.append(
            {
                "index": slot.index,
                "kind": slot.kind,
                "uuid": slot.uuid,
                "name": slot.name,
                "memory_total_mb": slot.memory_total_mb,
                "memory_used_mb": slot.memory_used_mb,
                "utilization_pct": slot.utilization_pct,
                "foreign": foreign,
                "allocation": allocation,
                "used_by": "; ".join(used_by),
            }
        )
    return rows


def slot_holders(jobs: Sequence[Any]) -> dict[int, str]:
    """slot index -> who holds it ("experiment E trial T (user)" or "command J (user)"), from
    the store's active jobs: `slots` and the cluster view show the same words."""
    held: dict[int, str] = {}
    for job in jobs:
        if job.state != JobState.SCHEDULED:
            continue
        who = (
            f"experiment {job.experiment_id} trial {job.trial_id} ({job.user})"
            if job.trial_id is not None
            else f"command {job.id} ({job.user})"
        )
        for index in job.slots:
            held[index] = who
    return held

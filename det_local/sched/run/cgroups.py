"""Containment: each job in its own cgroup, so that kill reaches every process it started, a
slot is free only once they are all gone, and (where the v1 devices controller exists) a job
cannot open another job's GPU.

Modes (`detect`, shown by `det-local daemon status`):

- ``v2``: a writable cgroup2 hierarchy (``/sys/fs/cgroup`` on a unified system, or the
  ``unified`` mount of a hybrid one) whose cgroups have ``cgroup.kill`` (Linux 5.14+). Kill is
  one write to ``cgroup.kill``; "empty" is ``populated 0`` in ``cgroup.events``.
- ``v1``: the v1 freezer controller. Kill freezes the group, SIGKILLs every pid in it, thaws it,
  and repeats until it is empty (a frozen process cannot fork a new one meanwhile).
- ``off``: no writable hierarchy, not root, or turned off (daemon.yaml ``cgroups: false`` or
  ``DET_LOCAL_CGROUPS=0``); jobs are tracked by their session / process group as before, and a
  process that leaves it with ``setsid`` escapes kill.

A job's cgroup is ``<mount>/det-local/<home hash>/job-<id>-<run>``, created by the daemon before
the job starts. A zygote (warm starts, `sched/warm/zygotes.py`) has one of its own beside them,
``zygote-<experiment>.<serial>``, denied every GPU: its trials leave it for their jobs'
cgroups. The job's wrapper (which stays root; see `executor`) writes its own pid into it before
it runs anything, so every descendant is born inside. Users cannot move a process out:
``cgroup.procs`` of the det-local subtree belongs to root.

Cost: making and removing a cgroup is ~0.05 ms; what costs is the kernel moving the wrapper into
it (writing cgroup.procs takes the global cgroup_threadgroup_rwsem for writing, which waits for
an RCU grace period): ~14 ms on an idle machine, ~2 ms when job starts follow each other, and
forks elsewhere wait meanwhile. On Linux 6.0+ the cgroup2 mount option ``favordynmods`` is the
kernel's remedy (an admin's choice: it makes every fork slightly dearer); ``cgroups: false``
turns containment off where start latency matters more than containment.

GPU fencing: where the v1 ``devices`` controller is mounted, the job's devices cgroup denies the
NVIDIA device nodes (char major 195) of every GPU that is not the job's own, as Slurm's
ConstrainDevices does; ``/dev/nvidiactl``, ``nvidia-uvm`` and the rest stay allowed. On a
cgroup2-only machine this needs eBPF, which det-local does not load: there
``CUDA_VISIBLE_DEVICES`` is advisory.
"""

from __future__ import annotations

import glob
import hashlib
import os
import signal
import stat
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

V2, V1, OFF = "v2", "v1", "off"
ENV = "DET_LOCAL_CGROUPS"
NVIDIA_MAJOR = 195
_NVIDIA_CTL_MINORS = (254, 255)  # nvidia-modeset, nvidiactl: every job needs them
_FREEZE_WAIT_S = 0.2


@dataclass(frozen=True)
class Containment:
    """How this daemon contains its jobs (one per engine)."""

    mode: str  # v2 | v1 | off
    why: str  # for people: where the cgroups are, or why there are none
    base: Path | None = None  # <mount>/det-local/<home hash> of the tracking hierarchy
    devices: Path | None = None  # the same under the v1 devices controller: GPU fencing
    gpu_minors: tuple[int, ...] = ()  # /dev/nvidiaN nodes found on this machine

    @property
    def on(self) -> bool:
        return self.mode != OFF

    def describe(self) -> str:
        if not self.on:
            return f"off ({self.why}); jobs are tracked by their process group"
        fence = (
            "GPU fencing by the v1 devices controller"
            if self.devices is not None
            else "no device controller: CUDA_VISIBLE_DEVICES is advisory"
        )
        return f"cgroup {self.mode} at {self.base}; {fence}"

    def as_dict(self) -> dict[str, object]:
        return {
            "mode": self.mode,
            "why": self.why,
            "base": str(self.base) if self.base else None,
            "gpu_fencing": self.devices is not None,
            "text": self.describe(),
        }

    def job(self, job_id: int, run_id: int) -> JobCgroup | None:
        """The cgroup of one run of a job (it may not exist); None when cgroups are off."""
        return self.named(f"job-{job_id}-{run_id}")

    def named(self, name: str) -> JobCgroup | None:
        """The cgroup `name` under this home's (it may not exist); None when cgroups are off."""
        if self.base is None:
            return None
        dev = self.devices / name if self.devices is not None else None
        return JobCgroup(self.mode, self.base / name, dev)

    def create(self, job_id: int, run_id: int, deny_minors: Iterable[int] = ()) -> JobCgroup | None:
        """Make the run's cgroup (emptying a stale one of the same name first); the devices
        cgroup denies the GPUs in `deny_minors`. OSError when it cannot be made."""
        return self.create_named(f"job-{job_id}-{run_id}", deny_minors)

    def create_named(self, name: str, deny_minors: Iterable[int] = ()) -> JobCgroup | None:
        """`create` for any cgroup of this home (a zygote's: ``zygote-<name>``)."""
        cg = self.named(name)
        if cg is None:
            return None
        deny = sorted(set(deny_minors))
        if not deny:
            cg.devices = None  # nothing to fence (a CPU inventory): one cgroup less to make
        for d in cg.dirs():
            try:
                os.mkdir(d, 0o755)
            except FileExistsError:
                cg.kill()
        if cg.devices is not None:
            for minor in deny:
                _write(cg.devices / "devices.deny", f"c {NVIDIA_MAJOR}:{minor} rwm")
        return cg

    def leftovers(self, keep: set[str], prefix: str = "job-") -> list[JobCgroup]:
        """Job cgroups of this home not named in `keep` (runs of an earlier daemon whose jobs
        have ended): the caller kills and removes them. With ``prefix="zygote-"``: zygotes'."""
        if self.base is None:
            return []
        out = []
        try:
            names = [p.name for p in self.base.iterdir() if p.name.startswith(prefix)]
        except OSError:
            return []
        for name in names:
            if name in keep:
                continue
            dev = self.devices / name if self.devices is not None else None
            out.append(JobCgroup(self.mode, self.base / name, dev))
        return out

    def remove_base(self) -> None:
        for d in (self.base, self.devices):
            if d is not None:
                try:
                    os.rmdir(d)
                except OSError:
                    pass


@dataclass
class JobCgroup:
    mode: str
    path: Path  # the tracking cgroup (v2, or the v1 freezer)
    devices: Path | None = None  # the v1 devices cgroup (GPU fencing)
    drain_started: float | None = field(default=None, compare=False)

    def dirs(self) -> list[Path]:
        return [self.path] + ([self.devices] if self.devices is not None else [])

    def procs_files(self) -> list[str]:
        """Where the wrapper writes its own pid, before it starts the command."""
        return [str(d / "cgroup.procs") for d in self.dirs()]

    def exists(self) -> bool:
        return self.path.is_dir()

    def pids(self) -> list[int]:
        try:
            data = (self.path / "cgroup.procs").read_bytes()
        except OSError:
            return []
        return [int(x) for x in data.split()]

    def populated(self) -> bool:
        if self.mode == V2:
            try:
                for line in (self.path / "cgroup.events").read_text().splitlines():
                    if line.startswith("populated "):
                        return line.split()[1] != "0"
            except OSError:
                return False
        return bool(self.pids())

    def signal(self, sig: int) -> bool:
        """Send sig to every process in the group; False if it was empty."""
        pids = self.pids()
        for pid in pids:
            try:
                os.kill(pid, sig)
            except OSError:
                pass
        return bool(pids)

    def kill(self) -> None:
        """SIGKILL every process in the group, the ones that left the session included.
        v2: one write to cgroup.kill. v1: freeze, kill each pid, thaw (one round: the caller
        calls again while the group is populated)."""
        if not self.exists():
            return
        if self.mode == V2:
            try:
                _write(self.path / "cgroup.kill", "1")
                return
            except OSError:
                pass  # an old kernel without cgroup.kill: one pid at a time
            self.signal(signal.SIGKILL)
            return
        state = self.path / "freezer.state"
        try:
            _write(state, "FROZEN")
            deadline = time.monotonic() + _FREEZE_WAIT_S
            while state.read_text().strip() != "FROZEN" and time.monotonic() < deadline:
                time.sleep(0.001)
            self.signal(signal.SIGKILL)
        except OSError:
            self.signal(signal.SIGKILL)
        finally:
            try:
                _write(state, "THAWED")
            except OSError:
                pass

    def remove(self) -> bool:
        """rmdir the (empty) cgroups; True once they are gone."""
        ok = True
        for d in self.dirs():
            try:
                os.rmdir(d)
            except FileNotFoundError:
                pass
            except OSError:
                ok = False
        return ok


def remove_home(home: Path, timeout: float = 5.0) -> None:
    """Kill and remove every cgroup of this home (a test's teardown; an admin retiring a
    home): the runs a kill -9'd daemon left behind included."""
    digest = home_hash(home)
    for point, kind, opts in _mounts():
        if kind == "cgroup" and not opts & {"freezer", "devices"}:
            continue
        base = Path(point) / "det-local" / digest
        try:
            children = [p for p in base.iterdir() if p.is_dir()]
        except OSError:
            continue
        for child in children:
            cg = JobCgroup(V2 if kind == "cgroup2" else V1, child)
            deadline = time.monotonic() + timeout
            while cg.populated() and time.monotonic() < deadline:
                cg.kill()
                time.sleep(0.01)
            cg.remove()
        try:
            os.rmdir(base)
        except OSError:
            pass


def _write(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def home_hash(home: Path) -> str:
    return hashlib.sha1(os.fsencode(str(home))).hexdigest()[:16]


def _mounts() -> list[tuple[str, str, set[str]]]:
    """(mount point, fs type, options) of the cgroup mounts."""
    out = []
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 4 and parts[2] in ("cgroup", "cgroup2"):
                    point = parts[1].replace("\\040", " ")
                    out.append((point, parts[2], set(parts[3].split(","))))
    except OSError:
        pass
    return out


def _make_base(mount: str, digest: str) -> Path:
    base = Path(mount) / "det-local" / digest
    base.mkdir(parents=True, exist_ok=True)
    return base


def parse_setting(value: object, source: str) -> str:
    """auto | v2 | v1 | off from a setting (true/false too); ValueError with a message."""
    if value is True or value is None:
        return "auto"
    if value is False:
        return OFF
    text = str(value).strip().lower()
    if text in ("", "auto", "1", "true", "yes", "on"):
        return "auto"
    if text in ("0", "false", "no", "off"):
        return OFF
    if text in (V1, V2):
        return text
    raise ValueError(f"{source}: expected auto, v2, v1 or off (false), found {value!r}")


def detect(home: Path, setting: str = "auto", *, need_setpriv: bool = False) -> Containment:
    """How jobs of this home are contained (see the module doc); never raises."""
    if setting == OFF:
        return Containment(OFF, "turned off by the cgroups setting")
    if os.geteuid() != 0:
        return Containment(OFF, "the daemon does not run as root")
    if need_setpriv and _setpriv() is None:
        return Containment(OFF, "setpriv (util-linux) was not found on PATH")
    digest = home_hash(home)
    mounts = _mounts()
    errors: list[str] = []
    base: Path | None = None
    mode = OFF
    if setting in ("auto", V2):
        for point, kind, _ in mounts:
            if kind != "cgroup2":
                continue
            try:
                b = _make_base(point, digest)
            except OSError as err:
                errors.append(f"{point}: {err.strerror}")
                continue
            if (b / "cgroup.kill").exists() or (b.parent / "cgroup.kill").exists():
                base, mode = b, V2
                break
            errors.append(f"{point}: no cgroup.kill (Linux 5.14+)")
    if base is None and setting in ("auto", V1):
        for point, kind, opts in mounts:
            if kind == "cgroup" and "freezer" in opts:
                try:
                    base, mode = _make_base(point, digest), V1
                    break
                except OSError as err:
                    errors.append(f"{point}: {err.strerror}")
    if base is None:
        why = "; ".join(errors) or (
            "no cgroup hierarchy is mounted"
            if setting == "auto"
            else f"no usable cgroup {setting} hierarchy"
        )
        return Containment(OFF, why)
    devices: Path | None = None
    for point, kind, opts in mounts:
        if kind == "cgroup" and "devices" in opts:
            try:
                devices = _make_base(point, digest)
            except OSError:
                devices = None
            break
    return Containment(mode, str(base), base, devices, _gpu_minors())


def _gpu_minors() -> tuple[int, ...]:
    minors = []
    for node in glob.glob("/dev/nvidia[0-9]*"):
        try:
            st = os.stat(node)
        except OSError:
            continue
        if stat.S_ISCHR(st.st_mode) and os.major(st.st_rdev) == NVIDIA_MAJOR:
            minor = os.minor(st.st_rdev)
            if minor not in _NVIDIA_CTL_MINORS:
                minors.append(minor)
    return tuple(sorted(minors))


_SETPRIV: list[str | None] = []


def _setpriv() -> str | None:
    if not _SETPRIV:
        import shutil

        found = shutil.which("setpriv") or shutil.which("setpriv", path="/usr/bin:/bin")
        _SETPRIV.append(found)
    return _SETPRIV[0]


def setpriv() -> str | None:
    """The setpriv program that drops a root wrapper's privileges for its command."""
    return _setpriv()

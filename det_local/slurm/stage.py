"""Staging a Slurm pool's runs on the shared filesystem (`resource_pools.NAME.slurm.stage_dir`),
and the channel's address in their environment (`slurm.channel`).

With ``stage_dir`` a run's files the compute node needs live under
``<stage_dir>/det-local-<name>/`` instead of the daemon's state directory. The name is
HMAC-SHA256 of the run's info directory under a key derived from the daemon's secret key
(`store/private.py`): the same at every start of this daemon (a restart adopts the run and
removes its directory), but nobody else can predict it, so another user of the world-writable
stage_dir cannot make it first (a plain hash of the path could be). `config check` shows
``det-local-<keyed name>`` there instead (it reads no key and makes none):

* ``context/``: a copy of the trial's context snapshot (its working directory; a command keeps
  its own directory, which must be on a shared path);
* ``info/``: a copy of the run's info directory (``get_cluster_info()``'s facts; the job's
  ``slurm-exit.<jobid>`` is written there);
* ``output.log``: the job's output (``--output``). A pump thread copies what it gains into the
  run's own log in the state directory (what `trial logs -f`, the dashboard and log policies
  read), in bounded reads, as the run's user's file only (opened relative to the directory
  det-local made, never through a link, its owner checked); the rest is copied when the job
  has ended, before its exit is handled.

The directory is made by the daemon (mode 0700) and given to the run's user once filled; it is
removed when the run has ended (its log already copied). A root daemon needs to write to
``stage_dir`` (an NFS export with root_squash refuses it: run the daemon as the user there).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import pwd
import shutil
import stat
import threading
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from det_local.errors import ConfigError, TrialError
from det_local.sched.run import userfiles
from det_local.sched.run.launchplan import LaunchPlan
from det_local.slurm import client, offloop, tbcopy
from det_local.slurm.config import SlurmPool

LOG = "output.log"
OFFSET_FILE = "staged-log.offset"  # in the run's own info dir: how much of the log was copied
CHUNK = 1024 * 1024  # bytes of a staged log copied per run and pass
FINAL_MAX = 64 * 1024 * 1024  # copied at most when the job has ended
INTERVAL_S = 0.25


PREVIEW_NAME = "det-local-<keyed name>"  # config check: no daemon key read (or made) for it
_NAME_LABEL = b"det-local slurm stage_dir names"


def name_key(daemon_key: bytes) -> bytes:
    """The key staged directory names are made with: derived from the daemon's key, used for
    nothing else (a name never tells anything about a trial's token)."""
    return hmac.new(daemon_key, _NAME_LABEL, hashlib.sha256).digest()


def root_of(pool: SlurmPool, local_info_dir: str, key: bytes | None) -> Path:
    """The run's staged directory: keyed by ``key`` (`name_key`); None: the placeholder a
    preview shows."""
    assert pool.stage_dir is not None
    if key is None:
        return Path(pool.stage_dir) / PREVIEW_NAME
    digest = hmac.new(key, local_info_dir.encode(), hashlib.sha256).hexdigest()[:32]
    return Path(pool.stage_dir) / f"det-local-{digest}"


def legacy_root_of(pool: SlurmPool, local_info_dir: str) -> Path:
    """Where a det-local before keyed names staged the run (a plain hash of the path): a run it
    started is still adopted after the upgrade."""
    assert pool.stage_dir is not None
    digest = hashlib.sha256(local_info_dir.encode()).hexdigest()[:16]
    return Path(pool.stage_dir) / f"det-local-{digest}"


def adopted_root(pool: SlurmPool, local_info_dir: str, key: bytes) -> Path:
    """An adopted run's staged directory: the keyed name, or (a run an older det-local started)
    the legacy one when only that exists (its owner is checked before it is read)."""
    root = root_of(pool, local_info_dir, key)
    legacy = legacy_root_of(pool, local_info_dir)
    if not os.path.lexists(root) and os.path.lexists(legacy):
        return legacy
    return root


def for_pool(plan: LaunchPlan, pool: SlurmPool, key: bytes | None) -> LaunchPlan:
    """The plan as the compute node runs it: the channel's address for the socket, the staged
    paths for the working directory, log and info directory (named with ``key``, `root_of`).
    The plan itself when the pool has neither."""
    if pool.channel is None and pool.stage_dir is None:
        return plan
    env = dict(plan.env)
    if pool.channel is not None and "DET_LOCAL_SOCKET" in env:
        env["DET_LOCAL_SOCKET"] = pool.channel.url
        env["DET_MASTER"] = pool.channel.url
    if pool.stage_dir is None:
        return replace(plan, env=env)
    root = root_of(pool, plan.info_dir, key)
    info = root / "info"
    if "DET_LOCAL_INFO_DIR" in env:
        env["DET_LOCAL_INFO_DIR"] = str(info)
        env["DET_LOCAL_TENSORBOARD_DIR"] = str(info / "tensorboard")
    cwd = str(root / "context") if "DET_TRIAL_ID" in env else plan.cwd
    return replace(plan, env=env, cwd=cwd, log_path=str(root / LOG), info_dir=str(info))


def check_stage_dir(pool: SlurmPool, uid: int | None) -> None:
    """At submission: the pool's stage_dir is a directory the submitter can write (one line)."""
    if pool.stage_dir is None:
        return
    path = pool.stage_dir
    where = f"resource_pools.{pool.name}.slurm.stage_dir {path}"
    if not os.path.isdir(path):
        raise ConfigError(
            f"{where} does not exist: create it on the filesystem the compute nodes share, "
            "writable by the pool's users"
        )
    if uid is None or uid == os.geteuid():
        ok = os.access(path, os.W_OK | os.X_OK)
        name = pwd.getpwuid(os.geteuid()).pw_name
    else:
        # as the submitter: `test` run by runuser in a thread (slurm/offloop.py), never on
        # the engine's loop, its process group killed if it hangs (a stuck filesystem)
        name = pwd.getpwuid(uid).pw_name
        runuser = shutil.which("runuser") or "/usr/sbin/runuser"
        test = [runuser, "-u", name, "--", "test", "-w", str(path), "-a", "-x", str(path)]
        ok = offloop.refusal(tuple(test), _refused_by(test), f"{where}: test -w") is None
    if not ok:
        raise ConfigError(
            f"{where} is not writable by user {name}: the pool's runs stage their context, "
            "log and info files there; make it writable by them (e.g. chmod 1777) or choose "
            "another"
        )


STAGE_CHECK_TIMEOUT_S = 30.0  # a stage_dir's check as the submitter (a slow NFS answers late)


def _refused_by(test: list[str]) -> Callable[[], str | None]:
    """The work of a stage_dir check: "not writable" when `test` says so; None when it does,
    or did not answer in STAGE_CHECK_TIMEOUT_S (the run's own staging then says what is
    wrong)."""

    def work() -> str | None:
        try:
            done = client.bounded(test, None, None, STAGE_CHECK_TIMEOUT_S)
        except client.Unreachable:
            return None
        return None if done.returncode == 0 else "not writable"

    return work


def _clear(root: Path) -> None:
    """A leftover of an earlier try (a crash between staging and submission): removed, a link
    or file as itself, never followed."""
    try:
        st = os.lstat(root)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(root)
    else:
        os.unlink(root)


def stage_run(local: LaunchPlan, staged: LaunchPlan, owner: userfiles.Owner | None) -> None:
    """Fill the run's staged directory from its local plan, then give it to the run's user."""
    root = Path(staged.log_path).parent
    try:
        for attempt in range(3):  # a leftover of this daemon's, being removed meanwhile
            _clear(root)
            try:
                os.mkdir(root, 0o700)
                break
            except FileExistsError:
                if attempt == 2:
                    raise
        if "DET_TRIAL_ID" in local.env:
            shutil.copytree(local.cwd, root / "context", symlinks=True)
        shutil.copytree(local.info_dir, root / "info", symlinks=True)
        os.close(os.open(root / LOG, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644))
        if owner is not None:
            for top, dirs, files in os.walk(root, topdown=False):
                for name in dirs + files:
                    os.chown(os.path.join(top, name), owner.uid, owner.gid, follow_symlinks=False)
            os.chown(root, owner.uid, owner.gid, follow_symlinks=False)
    except OSError as err:
        raise TrialError(
            f"cannot stage the run in {root} (slurm.stage_dir): {err.strerror or err}"
        ) from None


@dataclass
class Pumped:
    dir_fd: int  # the staged directory det-local made (held: a rename does not move it)
    root: Path
    local_log: Path
    offset_file: Path
    owner: userfiles.Owner | None
    offset: int = 0
    local_info: Path | None = None  # the run's own info directory (TensorBoard files)
    tb_inodes: dict[str, int] = field(default_factory=dict)  # tbcopy's, from pass to pass


class LogPump:
    """Copies staged logs into the runs' own logs, and their TensorBoard files into the runs'
    own info directories (`slurm/tbcopy.py`), every INTERVAL_S, from a thread. Only that thread
    (or `stop`, once it has ended) closes a run's directory descriptor."""

    def __init__(self) -> None:
        self.runs: dict[int, Pumped] = {}
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.thread: threading.Thread | None = None
        # ended runs (their last TensorBoard bytes, then their staged directory removed when
        # ``mine``), and replaced ones (``mine`` None: their descriptor closed only)
        self.removals: list[tuple[Pumped, set[int] | None]] = []

    def start(self) -> None:
        if self.thread is None:
            self.thread = threading.Thread(target=self._loop, name="slurm-log-pump", daemon=True)
            self.thread.start()

    def stop(self) -> None:
        self.stopping.set()
        if self.thread is not None:
            self.thread.join(timeout=30)
            if self.thread.is_alive():
                return  # a pass stuck on a network filesystem: its runs' files stay
        with self.lock:  # what ended meanwhile goes now (a daemon stopping, a run just ended)
            removals, self.removals = self.removals, []
        for run, mine in removals:
            _retire(run, mine)

    def add(
        self, job_id: int, root: Path, local_log: Path, info_dir: str, owner: userfiles.Owner | None
    ) -> None:
        try:
            fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return  # gone (removed by someone): nothing to copy
        want = os.geteuid() if owner is None else owner.uid
        if os.fstat(fd).st_uid != want:
            os.close(fd)
            return
        offset_file = Path(info_dir, OFFSET_FILE)
        try:
            offset = int(offset_file.read_text().strip())
        except (OSError, ValueError):
            offset = 0
        run = Pumped(fd, root, local_log, offset_file, owner, offset, Path(info_dir))
        with self.lock:
            old = self.runs.pop(job_id, None)
            self.runs[job_id] = run
            if old is not None:
                self.removals.append((old, None))

    def _loop(self) -> None:
        while not self.stopping.wait(INTERVAL_S):
            with self.lock:
                jobs = list(self.runs.items())
                removals, self.removals = self.removals, []
            for job_id, run in jobs:
                self.pump(job_id, CHUNK)
                _tensorboard(run, tbcopy.PASS_BYTES)
            for run, mine in removals:
                _retire(run, mine)

    def pump(self, job_id: int, limit: int) -> None:
        with self.lock:  # one copier at a time: offsets stay exact
            run = self.runs.get(job_id)
            if run is not None:
                _copy(run, limit)

    def finish(self, job_id: int) -> None:
        """The job has ended: copy the rest of its log (bounded) now; its last TensorBoard
        bytes are copied and its staged directory removed by the pump's thread (a context
        copy on a network filesystem may take a while)."""
        self.pump(job_id, FINAL_MAX)
        with self.lock:
            run = self.runs.pop(job_id, None)
            if run is None:
                return
            mine = {os.geteuid()} | ({run.owner.uid} if run.owner is not None else set())
            self.removals.append((run, mine))


def _tensorboard(run: Pumped, limit: int) -> None:
    if run.local_info is None:
        return
    try:
        info = os.open(run.local_info, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return
    try:
        want = {os.geteuid()} | ({run.owner.uid} if run.owner is not None else set())
        if os.fstat(info).st_uid in want:
            tbcopy.copy(run.dir_fd, info, run.owner, limit, run.tb_inodes)
    except OSError:
        pass
    finally:
        os.close(info)


def _retire(run: Pumped, mine: set[int] | None) -> None:
    """An ended run: its last TensorBoard bytes, its descriptor closed, its directory removed
    (``mine``: the owners it may have); a replaced one: its descriptor closed."""
    if mine is not None:
        _tensorboard(run, tbcopy.FINAL_BYTES)
    os.close(run.dir_fd)
    if mine is not None:
        _remove(run.root, mine)


def _remove(root: Path, owners: set[int]) -> None:
    try:
        if os.lstat(root).st_uid in owners:
            shutil.rmtree(root)  # never through a link (rmtree refuses one)
    except OSError:
        pass


def owner_of_job(uid: int, umask: int | None) -> userfiles.Owner | None:
    """A job's Owner when adopted (a root daemon's job of another user), from its record."""
    if uid == 0 or os.geteuid() != 0:
        return None
    try:
        gid = pwd.getpwuid(uid).pw_gid
    except KeyError:
        gid = uid
    return userfiles.Owner(uid, gid, userfiles.DEFAULT_UMASK if umask is None else umask, None)


def _write_offset(path: Path, offset: int) -> None:
    """In the run's own info directory (its user's under a root daemon): never via a link."""
    try:
        fd = os.open(
            path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644
        )
    except OSError:
        return
    with os.fdopen(fd, "w") as f:
        f.write(str(offset))


def _copy(run: Pumped, limit: int) -> None:
    try:
        fd = os.open(
            LOG, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=run.dir_fd
        )
    except OSError:
        return
    try:
        st = os.fstat(fd)
        want = os.geteuid() if run.owner is None else run.owner.uid
        if not stat.S_ISREG(st.st_mode) or st.st_uid != want or st.st_size <= run.offset:
            return
        moved = 0
        out = userfiles.open_log(run.local_log, run.owner)
        try:
            while moved < limit:
                data = os.pread(fd, min(CHUNK, limit - moved), run.offset)
                if not data:
                    break
                os.write(out, data)
                run.offset += len(data)
                moved += len(data)
        finally:
            os.close(out)
        if moved:
            _write_offset(run.offset_file, run.offset)
    except (OSError, TrialError):
        return
    finally:
        os.close(fd)

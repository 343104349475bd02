"""Warm trial starts, the daemon's half: one zygote (`trial/zygote.py`) per experiment, started
as the trial's user through the same wrapper and privilege drop as a trial, and each later trial
of the experiment forked from it instead of spawned cold.

Which trials: :func:`warm_spec` decides from the trial's plan alone, else gives the reason it
stays cold. A trial is warm when all of these hold: warm starts are on for the daemon (the
daemon's environment ``DET_LOCAL_WARM_STARTS``, default on; 0/false/off turns them off) and for
the experiment (``DET_LOCAL_WARM_START`` in its ``environment_variables``: 1/on forces them on,
0/off off; unset means on for searches, i.e. a searcher other than ``single``); the entrypoint is
a plain ``python[3] script.py [args]`` string (no shell syntax, no launcher, no startup hook,
which could change the environment). A search's trial that cannot be forked says why once per
experiment (an event).

Other users' trials (a root daemon for a lab): the zygote is spawned exactly as the trial would
be (`executor.spawn`: root wrapper, setpriv to the trial's uid, gid, supplementary groups, its
umask, ``env -C`` into its cwd, its stable environment), in a cgroup of its own beside the jobs'
(``zygote-<experiment>.<serial>``, denied every GPU) where the trial would get one, so it is
visible and killable; its wrapper's exit file is in root's ``run/z/``, its socket and log in a
directory of the user's (``run/z/<experiment>.<serial>/``). Each forked trial is moved into its
job's cgroup before it runs. The key holds the uid, gid, groups and umask: a trial of another
user never reaches this zygote. The zygote is the user's process (they can trace or replace
it), so nothing it says is acted on unchecked (`sched/warm/zygotetrust.py`): a zygote whose socket,
listener, answer or forked pid does not check out is stopped, its trial and the experiment's
next ones start cold, and one warning says why.

Launchers stay cold. ``python3 -m determined.launch.torch_distributed`` (and deepspeed, horovod,
torchrun) is a supervisor process that starts ``torch.distributed.run``, whose elastic agent
starts every worker itself with ``subprocess.Popen`` (a script or ``--module`` entrypoint is a
"binary" to torchelastic: its fork-based start methods take only Python functions); DeepSpeed's
runner and horovodrun do the same through their own subprocess launchers. The process worth
forking (a worker that imports torch) is a grandchild of the trial process, created by code
det-local does not own, so there is nothing a zygote could stand in for; forking the launcher
itself would save only its own short start. Such a search's trials say so once per experiment.

What is preloaded: the modules the entrypoint script imports at its top level (absolute
imports, as written: ``import a.b`` and ``from a.b import c`` both preload ``a.b``), found with
``ast``, never by running anything. The context's own modules are not preloaded (the user's code
runs in the trial), but the ones the script imports at top level are read the same way, and so
on (at most :data:`MAX_OWN_FILES` files): a script whose ``import torch`` sits in its
``model_def.py`` gets torch preloaded. Plus ``determined``, plus ``DET_LOCAL_PRELOAD``
(comma-separated) from the experiment's environment variables. Imports inside functions or
``if`` blocks, and relative imports, are left to the trial. The daemon (root, for a lab) reads
these files itself, so it reads only regular files inside the context snapshot that the trial's
user owns (or anyone may read), at most :data:`MAX_SOURCE_BYTES` each, opened without following
a symlink at any step (`store/safe_open.read_bounded_in`): a script outside the snapshot (an
absolute path, ``..``), a symlink, a FIFO, a device or a huge (or sparse) file means a cold
start, and the reason is said once.

Threads after the preload: forking copies one thread only, so a zygote forks only when no
thread runs beside its main one that a fork is not known to be safe with (its list and the
switches are `trial/zygote.py`'s ``FORK_SAFE_THREADS`` and ``quiet_allocators``), per kind:

* jemalloc's background thread (``jemalloc_bg_thd``), started as libarrow loads, i.e. by
  ``import pyarrow``, ``pandas`` or ``sklearn`` wherever pyarrow is installed (measured: torch,
  numpy and scipy start none). Switched off in the zygote through jemalloc's own configuration
  (``JE_ARROW_MALLOC_CONF=background_thread:false``, appended to any the user gave, set in the
  zygote's os.environ before the preload; the trial's environment is its plan's, without it).
  This changes nothing a forked trial would otherwise have: jemalloc's atfork child handler turns
  background threads off in every forked child (measured: a child of a process with the thread
  running allocates through pyarrow and starts none), so the trial runs without one either way
  (a cold trial has it; it only purges freed pages off the allocating threads). A jemalloc that
  does not read that variable (another build, or one in LD_PRELOAD) keeps its thread: tolerated,
  since jemalloc holds all its locks across a fork in its own pthread_atfork handlers.
* OpenBLAS and OpenMP pools (numpy, torch): stopped by their own atfork handlers at the
  zygote's probe fork, before it checks.
* anything else: not known to be safe; the experiment's trials start cold, said once with the
  threads' names.

A zygote serves the trials whose environment, apart from the per-trial variables (``DET_*``,
``CUDA_VISIBLE_DEVICES``, the run's ports), user, interpreter, working directory and module list
are its own (:attr:`WarmSpec.key`); a trial with another key replaces the experiment's zygote.
The first trial of a key starts cold while its zygote imports; a zygote that is not ready, gone
(killed: a new one is started) or refusing means a cold start. A zygote that exits with a reason
(a preload that fails) is not started again for that key: the reason is logged once.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shlex
import shutil
import signal
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from det_local.sched.run import executor, userfiles
from det_local.sched.run.cgroups import JobCgroup
from det_local.sched.run.launchplan import LaunchPlan
from det_local.sched.warm import zygotetrust as trust
from det_local.store.paths import Paths
from det_local.store.safe_open import UnsafeFile, read_bounded, read_bounded_in
from det_local.wire import rpc

DAEMON_SWITCH = "DET_LOCAL_WARM_STARTS"  # the daemon's environment
EXPERIMENT_SWITCH = "DET_LOCAL_WARM_START"  # an experiment's environment_variables
PRELOAD_VAR = "DET_LOCAL_PRELOAD"  # an experiment's extra modules to preload
ALWAYS = ("determined",)
ANSWER_TIMEOUT_S = 2.0  # a zygote's whole answer to a fork request, connection included
SOCKET_MAX = 100  # sun_path holds 108 bytes
PER_TRIAL = {"CUDA_VISIBLE_DEVICES"}
_PYTHON = re.compile(r"^(?:\S*/)?python(?:3(?:\.\d+)?)?$")
_SHELL_SYNTAX = set("|&;<>()$`\\\"'*?[]#~=%{}\n")
LAUNCHER_PROGRAMS = {"torchrun", "deepspeed", "horovodrun"}
_OFF = {"0", "false", "off", "no"}
_ON = {"1", "true", "on", "yes"}


@dataclass(frozen=True)
class WarmSpec:
    """How a trial is forked: the zygote it needs (key) and the argv the child runs."""

    experiment_id: int
    argv: list[str]  # [python, script.py, args...]
    preload: tuple[str, ...]
    key: str = field(repr=False)


@dataclass(frozen=True)
class Cold:
    """Why a trial starts cold; ``quiet``: by choice (not a search, switched off), not noted."""

    why: str
    quiet: bool = False


def daemon_enabled(environ: dict[str, str] | None = None) -> bool:
    value = (environ if environ is not None else os.environ).get(DAEMON_SWITCH, "")
    return value.strip().lower() not in _OFF


def warm_spec(plan: LaunchPlan) -> WarmSpec | Cold:
    """The trial's warm start, or why it starts cold (one line)."""
    env = plan.env
    switch = env.get(EXPERIMENT_SWITCH, "").strip().lower()
    if switch in _OFF:
        return Cold(f"{EXPERIMENT_SWITCH} is off for this experiment", quiet=True)
    try:
        config = json.loads(env.get("DET_EXPERIMENT_CONFIG", "{}"))
        experiment_id = int(env["DET_EXPERIMENT_ID"])
    except (ValueError, KeyError):
        return Cold("not a trial", quiet=True)
    searcher = (config.get("searcher") or {}).get("name", "single")
    if switch not in _ON and searcher == "single":
        return Cold("a single-trial experiment (not a search)", quiet=True)
    why = _cold_reason(plan, config)
    if why is not None:
        return Cold(why)
    return _spec(plan, experiment_id, str(config["entrypoint"]))


def _cold_reason(plan: LaunchPlan, config: dict[str, object]) -> str | None:
    """Why a search's trial cannot be forked (None: it can)."""
    entrypoint = config.get("entrypoint")
    if not isinstance(entrypoint, str):
        return "the entrypoint is not a plain `python script.py` string"
    if plan.argv[:1] != ["sh"]:
        return "the context has a startup hook or the entrypoint is not a command string"
    if _SHELL_SYNTAX & set(entrypoint.strip()):
        return "the entrypoint uses shell syntax"
    words = shlex.split(entrypoint)
    launcher = _launcher(words)
    if launcher is not None:
        return (
            f"its entrypoint is a launcher ({launcher}), whose workers are started by the "
            "launcher itself as new processes (see sched/warm/zygotes.py)"
        )
    if len(words) < 2 or not _PYTHON.match(words[0]) or not words[1].endswith(".py"):
        return "the entrypoint is not `python script.py` (a launcher or another program)"
    return None


def _launcher(words: list[str]) -> str | None:
    """The launcher an entrypoint runs (`python -m <launcher>`, torchrun, deepspeed), if any."""
    if words and Path(words[0]).name in LAUNCHER_PROGRAMS:
        return Path(words[0]).name
    if len(words) >= 3 and _PYTHON.match(words[0]) and words[1] == "-m":
        module = words[2]
        if module in ("torch.distributed.run", "torch.distributed.launch") or module.startswith(
            ("determined.launch.", "det_local.launch.")
        ):
            return module
    return None


def _spec(plan: LaunchPlan, experiment_id: int, entrypoint: str) -> WarmSpec | Cold:
    env = plan.env
    words = shlex.split(entrypoint)
    # the daemon (root, for a lab) reads the script and the context's modules it imports for
    # their imports: only regular files inside the context snapshot that the user could read,
    # at most MAX_SOURCE_BYTES each, never through a symlink (store/safe_open.read_bounded_in)
    owner = plan.uid if os.geteuid() == 0 else None
    try:
        source = read_source(Path(plan.cwd), words[1], owner, "script")
        if source is None:
            return Cold(f"its script {words[1]} is not a file of the context")
        imported = top_imports(source, Path(plan.cwd), owner)
    except UnsafeFile as err:
        return Cold(f"{err} (a warm start reads only the context snapshot's own files)")
    extra = [m.strip() for m in env.get(PRELOAD_VAR, "").split(",") if m.strip()]
    modules = tuple(dict.fromkeys([*imported, *ALWAYS, *extra]))
    stable = stable_env(plan)
    key = json.dumps(
        [experiment_id, plan.uid, plan.gid, plan.groups, plan.umask, plan.cwd, words[0], stable]
        + [list(modules)]
    )
    return WarmSpec(experiment_id, words, modules, key)


def stable_env(plan: LaunchPlan) -> dict[str, str]:
    """The part of a trial's environment its experiment's other trials share: the zygote's own
    environment (and its key). Not the run's ids, token, hyperparameters, devices or ports: a
    zygote holds nothing of one trial (/proc/PID/environ of a warm trial shows this, not the
    trial's own variables, which its os.environ has)."""
    return {
        k: v
        for k, v in sorted(plan.env.items())
        if (not k.startswith("DET_") or k == "DET_LOCAL_HOME")
        and k not in PER_TRIAL
        and k not in plan.ports
    }


def read_source(context: Path, rel: str, owner: int | None, what: str) -> bytes | None:
    """A source file of the context snapshot, read safely (`read_bounded_in`); None when it
    does not exist. UnsafeFile for anything else than a regular file of ``owner``'s inside the
    snapshot of at most MAX_SOURCE_BYTES (an absolute path, ``..``, a symlink, a FIFO, a device,
    a huge or sparse file)."""
    try:
        return read_bounded_in(context, rel, MAX_SOURCE_BYTES, owner=owner, what=what)
    except FileNotFoundError:
        return None


def top_imports(source: bytes, context: Path, owner: int | None = None) -> list[str]:
    """The modules a script imports at its top level (absolute imports only), less its
    context's own modules, whose own top-level imports are followed instead (the user's code is
    left to run in the trial). The context's files are read with `read_source`."""
    own: set[str] = set()
    with os.scandir(context) as entries:
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                own.add(entry.name)
            elif entry.name.endswith(".py"):
                own.add(entry.name[:-3])
    names: list[str] = []
    files: list[str] = []
    pending = [source]
    while pending:
        for module, imported in _imports(pending.pop(0)):
            if module.split(".")[0] not in own:
                names.append(module)
                continue
            for rel in _own_files(module, imported):
                if rel not in files and len(files) < MAX_OWN_FILES:
                    data = read_source(context, rel, owner, "module")
                    if data is not None:
                        files.append(rel)
                        pending.append(data)
    return [n for n in dict.fromkeys(names) if n != "__future__"]


MAX_OWN_FILES = 32  # the context's own modules read for their imports, per entrypoint
MAX_SOURCE_BYTES = 1024 * 1024  # a source file read for its imports (else: a cold start)


def _imports(source: bytes) -> list[tuple[str, list[str]]]:
    """(module, names imported from it) of a source's absolute top-level imports."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    out: list[tuple[str, list[str]]] = []
    for node in tree.body:
        if isinstance(node, ast.Import):
            out += [(alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.module, [alias.name for alias in node.names]))
    return out


def _own_files(module: str, imported: list[str]) -> list[str]:
    """The context's files (relative paths) that importing MODULE (and, from it, IMPORTED,
    which may be its submodules) may run: each package's __init__.py on the way, then the
    module itself; those that exist are read."""
    parts = module.split(".")
    dotted = [parts[: i + 1] for i in range(len(parts))]
    dotted += [[*parts, name] for name in imported if name != "*"]
    out = []
    for names in dotted:
        base = "/".join(names)
        out += [f"{base}.py", f"{base}/__init__.py"]
    return out


@dataclass
class Zygote:
    key: str
    proc: executor.JobProc  # its wrapper (root's, the daemon's child), with its cgroup
    socket: Path
    log: Path
    uid: int | None
    ids: trust.Ids  # what it and its trials run as


class ZygotePool:
    """The live zygotes, one per experiment; ``fork`` is the warm start."""

    def __init__(
        self,
        paths: Paths,
        note: Callable[..., None],
        cgroup_for: Callable[[LaunchPlan, str], JobCgroup | None] = lambda plan, name: None,
    ) -> None:
        self.paths = paths
        self.note = note
        self.cgroup_for = cgroup_for  # a zygote's own cgroup (None: none), named after it
        self.zygotes: dict[int, Zygote] = {}  # experiment id -> its zygote
        self.failed: dict[str, str] = {}  # key -> why its zygote cannot serve (noted once)
        self.cold_noted: set[int] = set()  # experiments whose trials were said to start cold
        self.stopping: list[Zygote] = []  # stopped zygotes, to be reaped
        self.serial = 0

    # ------------------------------------------------------------------ starting
    def start(self, spec: WarmSpec, plan: LaunchPlan) -> None:
        """Start the experiment's zygote for this key (replacing one with another key): as the
        trial's user, through `executor.spawn` like a trial, in a cgroup of its own where the
        trial would have one."""
        self.stop(spec.experiment_id)
        self.serial += 1
        zdir = self.paths.run_dir / "z" / f"{spec.experiment_id}.{self.serial}"
        while os.path.lexists(zdir) or os.path.lexists(_exit_file(zdir)):  # an earlier daemon's
            self.serial += 1
            zdir = zdir.with_name(f"{spec.experiment_id}.{self.serial}")
        sock = zdir / "s"
        if len(str(sock)) > SOCKET_MAX:
            self._fail(spec, f"its socket path {sock} is too long for a unix socket")
            return
        owner = userfiles.owner_of(plan)
        zdir.parent.mkdir(parents=True, exist_ok=True)
        zdir.mkdir(mode=0o700)
        if owner is not None:
            os.chown(zdir, owner.uid, owner.gid)
        env = stable_env(plan)
        zplan = replace(
            plan,
            argv=[
                spec.argv[0],
                "-m",
                "det_local.trial.zygote",
                str(sock),
                str(os.getpid()),
                str(os.geteuid()),
                ",".join(spec.preload),
            ],
            env=env,
            slots=[],
            log_path=str(zdir / "log"),
            info_dir=str(zdir),
            ports={},
        )
        cgroup = None
        try:
            cgroup = self.cgroup_for(plan, zdir.name)
            # its exit file in root's directory (z/), never in the user's own (z/<name>/)
            proc = executor.spawn(0, zplan, _exit_file(zdir), cgroup=cgroup)
        except Exception as err:  # noqa: BLE001 - a zygote that cannot start: trials go cold
            if cgroup is not None:
                cgroup.remove()
            why = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
            self._fail(spec, f"it could not start: {why}")
            return
        ids = trust.expected_ids(plan.uid, plan.gid)
        self.zygotes[spec.experiment_id] = Zygote(spec.key, proc, sock, zdir / "log", plan.uid, ids)

    def _fail(self, spec: WarmSpec, why: str) -> None:
        if spec.key not in self.failed:
            self.failed[spec.key] = why
            self.note(
                f"experiment {spec.experiment_id}: warm starts off, its trials start cold: {why}",
                experiment_id=spec.experiment_id,
                level="WARNING",
            )

    def cold(self, experiment_id: int, cold: Cold) -> None:
        """A search's trial that cannot be forked: why, once per experiment."""
        if cold.quiet or experiment_id in self.cold_noted:
            return
        self.cold_noted.add(experiment_id)
        self.note(
            f"experiment {experiment_id}: its trials start cold: {cold.why}",
            experiment_id=experiment_id,
        )

    # ------------------------------------------------------------------ forking
    def fork(
        self,
        job_id: int,
        plan: LaunchPlan,
        spec: WarmSpec,
        exit_file: Path,
        legacy_exit_file: Path,
        cgroup: JobCgroup | None,
    ) -> executor.JobProc | None:
        """The trial forked from its experiment's zygote, in its cgroup, as a JobProc the
        supervisor watches like a spawned one; None: start it cold (a zygote is started for
        the next trial where there is none)."""
        self.reap()
        if spec.key in self.failed:
            return None
        zygote = self.zygotes.get(spec.experiment_id)
        if zygote is None or zygote.key != spec.key:
            self.start(spec, plan)
            return None
        if executor.exit_code(zygote.proc) is not None:  # gone: why, then a new one
            self._ended(spec, zygote, plan)
            return None
        if not os.path.lexists(zygote.socket):
            return None  # still importing
        return self._request(job_id, plan, spec, zygote, exit_file, legacy_exit_file, cgroup)

    def _ended(self, spec: WarmSpec, zygote: Zygote, plan: LaunchPlan) -> None:
        """The experiment's zygote is gone: said once why it cannot serve (it exited with a
        reason), else this trial starts cold and a new zygote is started for the next."""
        code = zygote.proc.code if zygote.proc.code is not None else executor.exit_code(zygote.proc)
        del self.zygotes[spec.experiment_id]
        executor.close(zygote.proc)
        refused = code in (3, 4, 5)
        if refused:
            self._fail(spec, _last_line(zygote.log, zygote.uid))
        elif code != 0:  # killed (0: it stopped, idle)
            self.note(
                f"experiment {spec.experiment_id}: its zygote ended (status {code}); this "
                "trial starts cold and a new zygote is started",
                experiment_id=spec.experiment_id,
            )
        _remove(zygote)
        if not refused:
            self.start(spec, plan)

    def _request(
        self,
        job_id: int,
        plan: LaunchPlan,
        spec: WarmSpec,
        zygote: Zygote,
        exit_file: Path,
        legacy_exit_file: Path,
        cgroup: JobCgroup | None,
    ) -> executor.JobProc | None:
        """Ask the zygote for a fork; every answer is checked (`sched/warm/zygotetrust.py`) before
        the daemon acts on it. A zygote that says anything the daemon cannot verify is stopped
        and its key marked failed: this trial and the experiment's next start cold."""
        log = Path(plan.log_path)
        log.parent.mkdir(parents=True, exist_ok=True)
        owner = userfiles.owner_of(plan)
        for old in (exit_file, legacy_exit_file):
            try:
                old.unlink()
            except FileNotFoundError:
                pass
        legacy_exit_file.parent.mkdir(parents=True, exist_ok=True)
        if owner is not None and legacy_exit_file.parent.stat().st_uid != owner.uid:
            os.chown(legacy_exit_file.parent, owner.uid, owner.gid)
        fd = userfiles.open_log(log, owner)
        deadline = time.monotonic() + ANSWER_TIMEOUT_S
        sock: socket.socket | None = None
        pidfd = None
        try:
            sock = trust.connect(zygote.socket, zygote.ids, deadline)
            zygote_pid = trust.check_listener(sock, zygote.proc.pid, zygote.ids)
            socket.send_fds(sock, [b"F"], [fd])
            rpc.send(
                sock,
                {
                    "t": "fork",
                    "argv": spec.argv,
                    "env": plan.env,
                    "cwd": plan.cwd,
                    "umask": plan.umask if plan.umask is not None else _current_umask(),
                    "exit_file": str(legacy_exit_file),
                },
            )
            answer = trust.recv_answer(sock, deadline)
            if answer.get("t") == "refused":  # a zygote's own word: not now (threads running)
                said = str(answer.get("error", ""))[:200].splitlines()[:1] or ["no reason"]
                self.note(f"job {job_id}: the zygote refused a warm start ({said[0]}); cold start")
                return None
            pid = trust.forked_pid(answer)
            pidfd = trust.open_child(pid, zygote_pid, zygote.ids)
            # verified: moved into the job's cgroup, then checked alive (the pid was its own)
            for procs in cgroup.procs_files() if cgroup is not None else []:
                with open(procs, "w") as f:
                    f.write(str(pid))
            if not trust.alive(pidfd):
                raise trust.Untrusted(f"its trial {pid} ended before it was told to start")
            rpc.send(sock, {"t": "go"})
        except trust.Untrusted as err:
            self._distrust(job_id, spec, pidfd, str(err))
            return None
        except OSError as err:  # the connection or the cgroup write failed: this trial cold
            if pidfd is not None:
                _kill(pidfd)
            why = err.strerror if err.strerror else str(err)
            self.note(f"job {job_id}: warm start failed ({why}); cold start", level="WARNING")
            return None
        finally:
            if sock is not None:
                sock.close()
            os.close(fd)
        proc = executor.JobProc(
            job_id, pid, None, pidfd, exit_file, cgroup, legacy_exit_file, plan.uid, forked=True
        )
        proc.started = executor.start_time(pid) or time.time()
        return proc

    def _distrust(self, job_id: int, spec: WarmSpec, pidfd: int | None, why: str) -> None:
        """The zygote said what the daemon cannot verify: what it forked (if verified) is
        killed through its pidfd, the zygote stopped, and the experiment's trials start cold;
        one line."""
        if pidfd is not None:
            _kill(pidfd)
        self.failed[spec.key] = why
        self.stop(spec.experiment_id)
        self.note(
            f"experiment {spec.experiment_id}: warm starts off, its trials start cold (job "
            f"{job_id} too): its zygote is not trusted: {why}",
            experiment_id=spec.experiment_id,
            level="WARNING",
        )

    # ------------------------------------------------------------------ stopping
    def stop(self, experiment_id: int) -> None:
        """SIGTERM the experiment's zygote: it stops accepting, waits for the trials it forked
        (recording their exit statuses), and exits; its wrapper is reaped later (`reap`)."""
        self.reap()
        zygote = self.zygotes.pop(experiment_id, None)
        if zygote is not None:
            executor.signal_group(zygote.proc.pid, 15)
            self.stopping.append(zygote)

    def reap(self) -> None:
        """Reap the wrappers of stopped zygotes that have exited (no zombies left behind) and
        remove their directories."""
        for zygote in list(self.stopping):
            if executor.exit_code(zygote.proc) is not None:
                self.stopping.remove(zygote)
                _remove(zygote)

    def stop_all(self) -> None:
        for experiment_id in list(self.zygotes):
            self.stop(experiment_id)


def _exit_file(zdir: Path) -> Path:
    return zdir.with_name(f"{zdir.name}.exit")


def _remove(zygote: Zygote) -> None:
    """What an ended zygote leaves: its wrapper's descriptor, whatever is left in its cgroup
    (its trials are in their own), its cgroup, its directory and exit file."""
    executor.close(zygote.proc)
    if zygote.proc.cgroup is not None:
        executor.kill_rest(zygote.proc)
        executor.release(zygote.proc)
    shutil.rmtree(zygote.log.parent, ignore_errors=True)  # links are not followed
    try:
        _exit_file(zygote.log.parent).unlink()
    except FileNotFoundError:
        pass


def _kill(pidfd: int) -> None:
    """SIGKILL the process a pidfd names (never a pid that may have been reused)."""
    try:
        signal.pidfd_send_signal(pidfd, signal.SIGKILL)
    except OSError:
        pass
    os.close(pidfd)


def _current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _last_line(log: Path, uid: int | None) -> str:
    try:
        data = read_bounded(log, 64 * 1024, owner=uid, what="zygote log")
    except (OSError, UnsafeFile) as err:
        return f"its log {log} cannot be read: {err}"
    lines = [ln for ln in data.decode(errors="replace").splitlines() if ln.strip()]
    return lines[-1].removeprefix("det-local zygote: ") if lines else "it ended without a word"

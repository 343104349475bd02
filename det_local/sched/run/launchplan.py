"""Launch plans: everything needed to start one run of a trial, as plain data.

``config check`` prints a plan and tests assert on it; ``executor.spawn`` carries it out.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import socket
import sys
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import det_local
from det_local.errors import ConfigError

LEGACY_TRIAL = re.compile(r"^[a-zA-Z0-9_.]+:[a-zA-Z0-9_]+$")
HOOK = "startup-hook.sh"
_PACKAGE_PARENT = str(Path(det_local.__file__).resolve().parent.parent)
COMPAT_DIR = str(Path(det_local.__file__).resolve().parent / "compat")


@dataclass
class LaunchPlan:
    argv: list[str]
    env: dict[str, str]
    cwd: str
    user: str
    slots: list[int]
    log_path: str
    info_dir: str
    ports: dict[str, int] = field(default_factory=dict)
    uid: int | None = None  # run as this user (system mode); None: as the daemon's user
    gid: int | None = None
    groups: list[int] | None = None
    umask: int | None = None  # the submitter's umask: the job's processes run with it
    admin_gid: int | None = None  # system mode: this group may read the job's files (ACL)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


# A string entrypoint's shell outlives its command's shutdown: a job is stopped with SIGTERM to
# its whole process group, and a shell that died at once would end the job's leader, whose
# group then gets SIGKILL before the command (torchrun, the launchers' supervisor) has stopped
# the ranks it started in sessions of their own: they would be orphaned. With these traps the
# shell waits for its command, then exits with the signal's status and runs nothing more.
STOP_TRAPS = "trap 'exit 129' HUP; trap 'exit 130' INT; trap 'exit 143' TERM"


def entrypoint_argv(
    entrypoint: str | list[str], context_dir: Path, *, slots_per_trial: int = 1
) -> list[str]:
    """argv for an entrypoint: strings run through a shell, lists are exec'd, a legacy
    `module:TrialClass` runs in det-local's Trial harness (Determined's determined.exec.harness);
    the context's startup-hook.sh is sourced first, in the same shell."""
    has_hook = (context_dir / HOOK).is_file()
    if isinstance(entrypoint, str) and LEGACY_TRIAL.match(entrypoint.strip()):
        from det_local.launch import legacy_trial_argv

        # one slot: the harness itself; more: torch_distributed around it (as Determined)
        argv = legacy_trial_argv(entrypoint.strip(), slots_per_trial)
        if not has_hook:
            return argv
        return ["bash", "-c", f'. ./{HOOK} || exit $?\nexec "$@"', "det-local-trial", *argv]
    if isinstance(entrypoint, list):
        if not has_hook:
            return list(entrypoint)
        return ["bash", "-c", f'. ./{HOOK} || exit $?\nexec "$@"', "det-local-trial", *entrypoint]
    if not has_hook:
        return ["sh", "-c", f"{STOP_TRAPS}\n{entrypoint}"]
    return ["bash", "-c", f"{STOP_TRAPS}\n. ./{HOOK} || exit $?\n{entrypoint}"]


def check_entrypoint(
    entrypoint: str | list[str] | None,
    context_dir: Path,
    source: str,
    snapshot: Path | None = None,
) -> None:
    """Fail at submission for an entrypoint that cannot start (missing program or script).

    With ``snapshot`` (the copy the trial runs in), a script that is in the context but left
    out of the copy by .detignore is refused too."""
    if not entrypoint:
        raise ConfigError(
            f"entrypoint is missing in {source}: add e.g. 'entrypoint: python3 train.py'"
        )
    if isinstance(entrypoint, str) and LEGACY_TRIAL.match(entrypoint.strip()):
        _check_trial_module(entrypoint.strip(), context_dir, source, snapshot)
        return
    words = shlex.split(entrypoint) if isinstance(entrypoint, str) else list(entrypoint)
    if not words:
        raise ConfigError(
            f"entrypoint in {source} is empty: add e.g. 'entrypoint: python3 train.py'"
        )
    # skip leading VAR=value assignments and common wrappers
    while words and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0]):
        words = words[1:]
    if not words:
        return
    program = words[0]
    if "/" in program:
        target = context_dir / program if not os.path.isabs(program) else Path(program)
        if not target.exists():
            raise ConfigError(
                f"entrypoint in {source}: '{program}' does not exist in the context directory "
                f"{context_dir}; check the path or the CONTEXT argument"
            )
        if not os.path.isabs(program):
            _check_in_snapshot(program, context_dir, snapshot, source)
    elif shutil.which(program) is None and not (context_dir / HOOK).is_file():
        raise ConfigError(
            f"entrypoint in {source}: program '{program}' was not found on PATH; install it or "
            "fix the entrypoint"
        )
    if re.match(r"^python[0-9.]*$", os.path.basename(program)) and len(words) > 1:
        script = next((w for w in words[1:] if not w.startswith("-")), None)
        if words[1] in ("-m", "-c") or script is None:
            return
        if os.path.isabs(script):
            return
        if not (context_dir / script).exists():
            raise ConfigError(
                f"entrypoint in {source}: script '{script}' is not in the context directory "
                f"{context_dir}; check the entrypoint or the CONTEXT argument"
            )
        _check_in_snapshot(script, context_dir, snapshot, source)


def trial_module_files(module: str) -> tuple[str, str]:
    """The two files a Trial entrypoint's module can be, relative to the context: `a/b.py` and
    `a/b/__init__.py` for `a.b` (dotted names are packages)."""
    rel = module.replace(".", "/")
    return f"{rel}.py", f"{rel}/__init__.py"


def _check_trial_module(
    entrypoint: str, context_dir: Path, source: str, snapshot: Path | None
) -> None:
    """A legacy `module:TrialClass` entrypoint: the module's file must be in the context (and in
    the experiment's copy of it); the class itself is checked when the trial imports it."""
    module = entrypoint.partition(":")[0]
    as_file, as_package = trial_module_files(module)
    found = next((f for f in (as_file, as_package) if (context_dir / f).is_file()), None)
    if found is None:
        raise ConfigError(
            f"entrypoint '{entrypoint}' in {source}: module '{module}' is not in the context "
            f"directory {context_dir}: expected {as_file} (or {as_package}) there; check the "
            "entrypoint or the CONTEXT argument"
        )
    _check_in_snapshot(found, context_dir, snapshot, source)


def _check_in_snapshot(rel: str, context_dir: Path, snapshot: Path | None, source: str) -> None:
    if snapshot is not None and not (snapshot / rel).exists():
        raise ConfigError(
            f"entrypoint in {source}: '{rel}' is in {context_dir} but "
            f"{context_dir / '.detignore'} leaves it out of the experiment's copy; remove the "
            "pattern that matches it"
        )


# What a trial takes from its submitter's environment (captured at submission), as Determined's
# trials take nothing but the config's environment_variables: enough for a shell and a locale.
# Nothing of the daemon's own environment reaches a job. DET_LOCAL_METRIC_LINES=0 turns off the
# trial's metric lines (det_local/trial/core/_metric_lines.py) from the submitting shell.
SUBMITTER_VARS = ("PATH", "LANG", "TZ", "TERM", "DET_LOCAL_DEBUG", "DET_LOCAL_METRIC_LINES")
SUBMITTER_PREFIXES = ("LC_",)
DEFAULT_PATH = "/usr/local/bin:/usr/bin:/bin"
LOGIN_VARS = ("HOME", "USER", "LOGNAME")


def allowed_submitter_vars(env: Mapping[str, str]) -> dict[str, str]:
    """The allow-listed variables of a submitter's environment (what a client sends, and what
    the daemon keeps of whatever it is sent)."""
    return {
        str(k): str(v)
        for k, v in env.items()
        if k in SUBMITTER_VARS or str(k).startswith(SUBMITTER_PREFIXES)
    }


def base_env(captured: Mapping[str, str] | None, uid: int | None) -> dict[str, str]:
    """A trial's environment before det-local's own variables: the allow-listed variables of
    its submitter (``captured``: None for a submission that sent none), PATH defaulting to
    DEFAULT_PATH, and HOME, USER, LOGNAME from the passwd entry of the user it runs as."""
    env = allowed_submitter_vars(captured or {})
    env.setdefault("PATH", DEFAULT_PATH)
    import pwd

    try:
        pw = pwd.getpwuid(os.getuid() if uid is None else uid)
    except KeyError:  # no passwd entry (a container): what the submitter had
        for name in LOGIN_VARS:
            if captured and name in captured:
                env[name] = str(captured[name])
        return env
    env.update(HOME=pw.pw_dir, USER=pw.pw_name, LOGNAME=pw.pw_name)
    return env


def trial_extra(
    config: dict[str, Any],
    *,
    base: Mapping[str, str],
    home: str,
    threads: int | None,
    visible_devices: str,
    ports: Mapping[str, str],
    test_mode: bool,
    rendezvous: Mapping[str, str] | None = None,
) -> list[str]:
    """The `extra` of :func:`trial_env`, as K=V strings in the order they apply: the config's
    environment_variables, then det-local's own (threads, test mode, devices, ports, and a
    multi-node trial's rendezvous variables)."""
    user = config_env_vars(config)
    return (
        user
        + [f"DET_LOCAL_HOME={home}"]
        + thread_env(threads, base, user)
        + (["DET_LOCAL_TEST_MODE=1"] if test_mode else [])
        + [f"CUDA_VISIBLE_DEVICES={visible_devices}"]
        + [f"{k}={v}" for k, v in ports.items()]
        + [f"{k}={v}" for k, v in (rendezvous or {}).items()]
    )


def trial_env(
    *,
    base: dict[str, str],
    experiment_id: int,
    trial_id: int,
    run_id: int,
    seed: int,
    hparams: dict[str, Any],
    config: dict[str, Any],
    steps_completed: int,
    latest_checkpoint: str | None,
    slots: list[int],
    socket_path: str,
    token: str,
    info_dir: str,
    checkpoint_dir: str,
    user: str,
    extra: list[str],
) -> dict[str, str]:
    env = dict(base)
    allocation = f"{experiment_id}.{trial_id}.{run_id}"
    exe_dir = os.path.dirname(sys.executable)
    env["PATH"] = exe_dir + os.pathsep + env.get("PATH", os.defpath)
    pythonpath = [COMPAT_DIR, _PACKAGE_PARENT]
    if env.get("PYTHONPATH"):
        pythonpath.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(pythonpath)
    env["PYTHONUNBUFFERED"] = "1"
    env.update(
        {
            "DET_LOCAL_SOCKET": socket_path,
            "DET_LOCAL_TOKEN": token,
            "DET_LOCAL_INFO_DIR": info_dir,
            "DET_LOCAL_CHECKPOINT_DIR": checkpoint_dir,
            "DET_LOCAL_TENSORBOARD_DIR": os.path.join(info_dir, "tensorboard"),
            "DET_MASTER": "unix://" + socket_path,
            "DET_CLUSTER_ID": "det-local",
            "DET_AGENT_ID": socket.gethostname(),
            "DET_USER": user,
            "DET_TASK_TYPE": "TRIAL",
            "DET_TASK_ID": f"{experiment_id}.{trial_id}",
            "DET_ALLOCATION_ID": allocation,
            "DET_EXPERIMENT_ID": str(experiment_id),
            "DET_TRIAL_ID": str(trial_id),
            "DET_TRIAL_RUN_ID": str(run_id),
            "DET_TRIAL_SEED": str(seed),
            "DET_HPARAMS": json.dumps(hparams),
            "DET_EXPERIMENT_CONFIG": json.dumps(config),
            "DET_STEPS_COMPLETED": str(steps_completed),
            "DET_SLOT_IDS": json.dumps(slots),
        }
    )
    if latest_checkpoint:
        env["DET_LATEST_CHECKPOINT"] = latest_checkpoint
    else:
        env.pop("DET_LATEST_CHECKPOINT", None)
    for item in extra:
        key, sep, value = item.partition("=")
        if sep:
            env[key] = value
    return env


def config_env_vars(config: dict[str, Any]) -> list[str]:
    """environment.environment_variables for a CPU/GPU-agnostic local run, as K=V strings."""
    env_vars = (config.get("environment") or {}).get("environment_variables") or []
    if isinstance(env_vars, dict):
        env_vars = env_vars.get("cuda") or env_vars.get("cpu") or []
    return [str(v) for v in env_vars]


OMP_DEFAULT_MARK = "DET_LOCAL_OMP_DEFAULT"  # set when det-local chose OMP_NUM_THREADS


def thread_env(threads: int | None, *given: Iterable[str]) -> list[str]:
    """OMP_NUM_THREADS=<threads> (and the mark saying det-local chose it) unless the user set
    OMP_NUM_THREADS in any of `given` (environment names or K=V strings), or threads is None."""
    if threads is None:
        return []
    for names in given:
        for item in names:
            if item.partition("=")[0] == "OMP_NUM_THREADS":
                return []
    return [f"OMP_NUM_THREADS={threads}", f"{OMP_DEFAULT_MARK}=1"]

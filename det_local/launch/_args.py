"""What the launchers share: their command line, the trial's slots, the worker command."""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from dataclasses import dataclass
from typing import Any

from det_local.errors import DetLocalError

LEGACY_TRIAL = re.compile(r"^[a-zA-Z0-9_.]+:[a-zA-Z0-9_]+$")
HARNESS_MODULE = "det_local.trial.harness"
WRAP_RANK_MODULE = "det_local.launch.wrap_rank"
_PYTHON = re.compile(r"^python[0-9.]*$")


class LaunchError(DetLocalError):
    """A launcher cannot start the trial's workers; the message says what to change."""


@dataclass
class Launch:
    overrides: list[str]  # passed to the framework's launcher
    script: list[str]  # what each worker runs (the harness for --trial)
    trial: str | None = None


def parse(argv: list[str], prog: str, framework: str, *, overrides: bool = True) -> Launch:
    """``[OVERRIDES... --] (--trial TRIAL | SCRIPT...)`` as Determined's launchers take it.

    Overrides are options, so they are recognised only when the first argument is one: a
    script's own ``--`` (``python3 train.py -- x``) is left alone."""
    prog = invoked_as(prog)
    usage = (
        f"usage: python3 -m {prog} "
        + ("[OVERRIDES... --] " if overrides else "")
        + "(--trial TRIAL | SCRIPT...)"
    )
    args = list(argv)
    if args[:1] in (["-h"], ["--help"]):
        print(usage)
        if overrides:
            print(
                f"OVERRIDES are passed to {framework} as they are; end them with `--`.\n"
                "SCRIPT is the command each worker runs, e.g. `python3 train.py`;\n"
                "--trial module:TrialClass trains a legacy Trial class in det-local's harness."
            )
        raise SystemExit(0)
    extra: list[str] = []
    first = args[0] if args else ""
    if first.startswith("-") and first != "--trial" and not first.startswith("--trial="):
        if first != "--" and not overrides:
            raise LaunchError(
                f"{prog} takes no overrides, but got {first!r}; {usage.removeprefix('usage: ')}"
            )
        if "--" not in args:
            raise LaunchError(
                f"{first!r} looks like an override for {framework}, but the overrides are not "
                f"ended by `--`; write e.g. `python3 -m {prog} {' '.join(args[:2])} -- "
                "python3 train.py`"
            )
        split = args.index("--")
        extra, args = args[:split], args[split + 1 :]
    trial: str | None = None
    if args[:1] == ["--trial"] or (args and args[0].startswith("--trial=")):
        if args[0] == "--trial":
            if len(args) < 2:
                raise LaunchError(f"--trial needs a value such as model_def:MyTrial; {usage}")
            trial, rest = args[1], args[2:]
        else:
            trial, rest = args[0].partition("=")[2], args[1:]
        if rest:
            raise LaunchError(
                f"extra arguments after --trial {trial}: {' '.join(rest)}; --trial takes no SCRIPT"
            )
        if not LEGACY_TRIAL.match(trial):
            raise LaunchError(
                f"--trial {trial!r} is not of the form module:TrialClass (e.g. model_def:MyTrial)"
            )
        script = [sys.executable, "-m", HARNESS_MODULE, trial]
    else:
        script = args
    if not script:
        raise LaunchError(f"no SCRIPT to launch; {usage.removeprefix('usage: ')}")
    if trial is None:
        check_script(script)
    return Launch(extra, script, trial)


def invoked_as(prog: str) -> str:
    """The module name the user ran: ``determined.launch.X`` through compat, else ``prog``."""
    main = sys.argv[0] if sys.argv else ""
    if os.sep + os.path.join("determined", "launch", "") in main:
        return "determined.launch." + prog.rpartition(".")[2]
    return prog


def check_script(script: list[str]) -> None:
    """Fail before starting any worker when the command cannot run: a missing program, or
    a missing ``python3 SCRIPT.py``."""
    program = script[0]
    cwd = os.getcwd()
    if "/" in program:
        if not os.path.exists(program):
            raise LaunchError(f"{program!r} does not exist (in {cwd}); check the path")
        if not os.access(program, os.X_OK) or os.path.isdir(program):
            hint = f"; did you mean `python3 {program}`?" if program.endswith(".py") else ""
            raise LaunchError(f"{program!r} is not an executable file{hint}")
    elif shutil.which(program) is None:
        if os.path.exists(program):
            hint = f"`python3 {program}`" if program.endswith(".py") else f"`./{program}`"
            raise LaunchError(f"{program!r} is not a command on PATH; did you mean {hint}?")
        raise LaunchError(f"program {program!r} was not found on PATH; install it or fix SCRIPT")
    if _PYTHON.match(os.path.basename(program)):
        target = _python_target(script[1:])
        if target is not None and not os.path.exists(target):
            raise LaunchError(
                f"script {target!r} does not exist in {cwd}; check the entrypoint (paths are "
                "relative to the context directory)"
            )


def _python_target(args: list[str]) -> str | None:
    """The script a python command line runs, or None (-m, -c, stdin, or options only)."""
    takes_value = {"-W", "-X", "--check-hash-based-pycs"}
    i = 0
    while i < len(args):
        a = args[i]
        if a in ("-m", "-c", "-") or a.startswith(("-m", "-c")):
            return None
        if a in takes_value:
            i += 2
            continue
        if a.startswith("-"):
            i += 1
            continue
        return a
    return None


def slot_count() -> int:
    """The trial's slots: len(DET_SLOT_IDS) (a JSON list), at least 1; 1 off det-local."""
    raw = os.environ.get("DET_SLOT_IDS")
    if not raw:
        return 1
    try:
        slots = json.loads(raw)
    except ValueError:
        raise LaunchError(f"DET_SLOT_IDS={raw!r} is not a JSON list of slot ids") from None
    if not isinstance(slots, list):
        raise LaunchError(f"DET_SLOT_IDS={raw!r} is not a JSON list of slot ids")
    return max(1, len(slots))


NNODES_ENV = "DET_LOCAL_NNODES"
NODE_RANK_ENV = "DET_LOCAL_NODE_RANK"


def chief_ip() -> str:
    """Where the chief is reached: DET_CHIEF_IP (set for a trial whose ranks run on several
    machines: the chief's LAN address), else this machine."""
    return os.environ.get("DET_CHIEF_IP") or "127.0.0.1"


def nnodes() -> int:
    """How many machines the trial's ranks run on: DET_LOCAL_NNODES, 1 when unset."""
    raw = os.environ.get(NNODES_ENV)
    if not raw:
        return 1
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise LaunchError(
            f"{NNODES_ENV}={raw!r} is not a number of machines (an integer >= 1); det-local "
            f"sets it for a multi-node trial: unset it to run on this machine alone"
        )
    return value


def nodes() -> tuple[int, int]:
    """(nnodes, node_rank), both checked: what every launcher reads before it starts."""
    return nnodes(), node_rank()


def node_rank() -> int:
    """This machine's index among the trial's: DET_LOCAL_NODE_RANK, 0 when unset; it must lie
    in 0..DET_LOCAL_NNODES-1."""
    count = nnodes()
    raw = os.environ.get(NODE_RANK_ENV)
    if not raw:
        return 0
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if not 0 <= value < count:
        raise LaunchError(
            f"{NODE_RANK_ENV}={raw!r} is not a node rank in 0..{count - 1} "
            f"({NNODES_ENV}={count}); give each machine of the trial its own rank, the chief 0"
        )
    return value


def port(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if not raw:
        return default
    try:
        return int(raw)
    except ValueError:
        raise LaunchError(f"{name}={raw!r} is not a port number") from None


def worker_command(rank_spec: str, script: list[str]) -> list[str]:
    return [sys.executable, "-m", WRAP_RANK_MODULE, rank_spec, "--", *script]


def run_main(main: object, argv: list[str] | None = None) -> int:
    """Run a launcher's main; a LaunchError is one line on stderr and exit status 1."""
    assert callable(main)
    try:
        code: int = main(sys.argv[1:] if argv is None else argv)
        return code
    except LaunchError as err:
        sys.stderr.write(f"det-local: error: {err}\n")
        sys.stderr.flush()
        return err.exit_code


def json_env(name: str) -> dict[str, Any]:
    """A JSON object det-local put in the environment (DET_HPARAMS, DET_EXPERIMENT_CONFIG);
    {} when it is missing or not an object (a launcher run by hand)."""
    raw = os.environ.get(name)
    if not raw:
        return {}
    try:
        value = json.loads(raw)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}

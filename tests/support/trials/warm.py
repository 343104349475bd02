"""A trial that writes what it sees (environment, cgroup, whether torch was preloaded) to
$OUT/<trial id>.json, for the warm-start tests: the serial grid that runs it and its facts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# Writes what the trial sees to OUT/<trial id>.json, reports once. The first trial waits (bounded)
# for the zygote to be ready, so that the later ones are forked from it.
SCRIPT = r"""
import sys
warm = "torch" in sys.modules  # preloaded: a warm start
import json, os, sys, threading, time
import torch
import determined as det

home = os.environ["DET_LOCAL_HOME"]
trial_id = int(os.environ["DET_TRIAL_ID"])
# WAIT_ZYGOTE: "trial:zygote dir,...": that trial waits until that zygote is ready
gates = dict(item.split(":") for item in os.environ.get("WAIT_ZYGOTE", "").split(",") if item)
zdir = os.path.join(home, "run", "z", gates.get(str(trial_id), "-"))
deadline = time.monotonic() + 60
def ready(zdir):  # its socket is bound a moment before "ready (pid N" reaches its log
    try:
        with open(os.path.join(zdir, "log")) as f:
            return "ready (pid " in f.read()
    except FileNotFoundError:
        return False
while str(trial_id) in gates and not (os.path.exists(os.path.join(zdir, "s")) and ready(zdir)):
    assert time.monotonic() < deadline, "no zygote"
    time.sleep(0.05)
if os.environ.get("KILL_ZYGOTE") == str(trial_id):
    with open(os.path.join(zdir, "log")) as f:
        os.kill(int(f.read().split("ready (pid ")[1].split(",")[0]), 9)
leaked = getattr(torch, "_det_local_leak", None)
torch._det_local_leak = trial_id
with open("/proc/self/cgroup") as f:
    cgroup = f.read()
facts = {
    "warm": warm,
    "env": {k: v for k, v in os.environ.items()},
    "cwd": os.getcwd(),
    "ids": [os.getuid(), os.geteuid(), os.getgid(), os.getegid(), sorted(os.getgroups())],
    "pgid": os.getpgid(0),
    "sid": os.getsid(0),
    "argv": sys.argv,
    "path0": sys.path[0],
    "main": __name__,
    "umask": os.umask(0o022),
    "cgroup": cgroup,
    "leaked": leaked,
    "threads": torch.get_num_threads(),
    "cuda_init": torch.cuda.is_initialized(),
    "stdin_tty": os.isatty(0),
}
out = os.environ["OUT"]
# written whole, then renamed: the test reads the directory while trials run
with open(os.path.join(out, f".{trial_id}.tmp"), "w") as f:
    json.dump(facts, f)
os.rename(os.path.join(out, f".{trial_id}.tmp"), os.path.join(out, f"{trial_id}.json"))
while os.environ.get("GATE") == str(trial_id) and not os.path.exists(os.path.join(out, "gate")):
    assert time.monotonic() < deadline + 60, "no gate"
    time.sleep(0.05)
with det.core.init() as core:
    core.train.report_training_metrics(steps_completed=1, metrics={"loss": float(trial_id)})
sys.exit(int(os.environ.get("EXIT_CODE", "0")))
"""


PER_TRIAL = {
    "DET_LOCAL_TOKEN",
    "DET_LOCAL_INFO_DIR",
    "DET_LOCAL_TENSORBOARD_DIR",
    "DET_TASK_ID",
    "DET_ALLOCATION_ID",
    "DET_TRIAL_ID",
    "DET_TRIAL_RUN_ID",
    "DET_TRIAL_SEED",
    "DET_HPARAMS",
    # the run's ports, chosen free for each run
    "C10D_PORT",
    "DTRAIN_SSH_PORT",
    "INTER_TRAIN_PROCESS_COMM_PORT_1",
    "INTER_TRAIN_PROCESS_COMM_PORT_2",
}


def serial_grid(out: Path, env: dict[str, str], n: int = 3) -> dict[str, Any]:
    """A grid search of n trials, one at a time, writing their facts to `out`."""
    return {
        "searcher": {"name": "grid", "metric": "loss", "max_length": 1, "max_concurrent_trials": 1},
        "hyperparameters": {"x": {"type": "categorical", "vals": list(range(n))}},
        "environment": {
            "environment_variables": [f"OUT={out}", *(f"{k}={v}" for k, v in env.items())]
        },
        "resources": {"max_slots": 1},
    }


def trial_facts(out: Path) -> dict[int, dict[str, Any]]:
    return {int(p.stem): json.loads(p.read_text()) for p in sorted(out.glob("*.json"))}

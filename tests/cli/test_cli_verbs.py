"""Determined's verbs (issue 15, items 5 and 8) through the real CLI: `experiment create`,
`experiment set priority`, the short group names, one line for an unknown command, --version,
shell completion, CONFIG CONTEXT in the help, OMP_NUM_THREADS for shells and commands on CPU
slots, and `tensorboard start` without "waits for 0 slot(s)"."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from importlib.metadata import version

import pytest

from det_local.store.db import Store
from det_local.store.paths import Paths
from det_local.store.states import State
from tests.support.world import Env, wait_for

CORES = len(os.sched_getaffinity(0))


def _one_line(r: object, rc: int, expected: str) -> None:
    assert r.rc == rc, r  # type: ignore[attr-defined]
    assert r.out == "", r  # type: ignore[attr-defined]
    assert r.err == expected + "\n", r  # type: ignore[attr-defined]


# ---------------------------------------------------------------------------- unknown commands
@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["experimnt"], "det-local: no command 'experimnt'; did you mean 'experiment'?"),
        (["exp", "list"], "det-local: no command 'exp'; did you mean 'experiment'?"),
        (["checkpont"], "det-local: no command 'checkpont'; did you mean 'checkpoint'?"),
        (["experiment", "lst"], "det-local experiment: no command 'lst'; did you mean 'list'?"),
        (["e", "lst"], "det-local e: no command 'lst'; did you mean 'list'?"),
        (
            ["experiment", "set", "prio", "1", "2"],
            "det-local experiment set: no command 'prio'; did you mean 'priority'?",
        ),
        (["frobnicate"], "det-local: no command 'frobnicate' (`det-local -h` lists them)"),
        (["run"], "det-local run: Missing argument 'CONFIG'. (`det-local run -h` for help)"),
        (
            ["experiment", "describe", "x"],
            "det-local experiment describe: Invalid value for 'EXPERIMENT_ID': 'x' is not a "
            "valid int. (`det-local experiment describe -h` for help)",
        ),
    ],
)
def test_a_usage_error_is_one_line(dl: Env, args: list[str], expected: str) -> None:
    _one_line(dl.det(*args), 2, expected)


# ---------------------------------------------------------------------------- short names
def test_determined_short_names(dl: Env) -> None:
    p = Paths(dl.home).ensure()
    store = Store(p.db)
    exp = store.create_experiment(name="short", config={})
    store.create_trial(exp, hparams={"lr": 0.1}, seed=1)
    store.close()
    pairs = [
        (["e", "ls"], ["experiment", "list"]),
        (["t", "ls", exp], ["trial", "list", exp]),
        (["c", "ls", exp], ["checkpoint", "list", exp]),
        (["j", "ls"], ["job", "list"]),
        (["command", "ls"], ["cmd", "list"]),
    ]
    for short, full in pairs:
        a, b = dl.det(*short, "--json"), dl.det(*full, "--json")
        assert a.rc == b.rc == 0 and a.out == b.out, (short, a, b)
    assert json.loads(dl.det("e", "ls", "--json").out)[0]["name"] == "short"
    # the help lists each group once, its short names beside it
    help_text = dl.det("-h").out
    for shown in ("experiment (e)", "trial (t)", "checkpoint (c)", "job (j)", "cmd (command)"):
        assert f"  {shown}  " in help_text, help_text
    assert "\n  e " not in help_text
    assert "list (ls)" in dl.det("experiment", "-h").out
    assert "activate (unpause)" in dl.det("e", "-h").out


def test_version(dl: Env) -> None:
    r = dl.det("--version")
    assert (r.rc, r.out, r.err) == (0, f"det-local {version('det-local')}\n", "")


def test_help_shows_config_context(dl: Env) -> None:
    for args, usage in [
        (["run"], "det-local run [OPTIONS] CONFIG CONTEXT"),
        (["experiment", "create"], "det-local experiment create [OPTIONS] CONFIG CONTEXT"),
        (["config", "check"], "det-local config check [OPTIONS] CONFIG [CONTEXT]"),
        (["e", "set", "priority"], "det-local e set priority [OPTIONS] EXPERIMENT_ID PRIORITY"),
        (["tensorboard", "start"], "det-local tensorboard start [OPTIONS] EXPERIMENT_ID..."),
    ]:
        r = dl.det(*args, "-h")
        assert r.rc == 0, r
        assert r.out.splitlines()[0] == f"Usage: {usage}", r.out
        assert "{" not in r.out.splitlines()[0]


# ---------------------------------------------------------------------------- completion
def _det_local_on_path(dl: Env) -> dict[str, str]:
    """An environment whose PATH has a `det-local` running this worktree's CLI."""
    bin_dir = dl.tmp / "bin"
    bin_dir.mkdir(exist_ok=True)
    exe = bin_dir / "det-local"
    exe.write_text(f'#!/bin/sh\nexec {sys.executable} -m det_local.cli.main "$@"\n')
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    return {**dl.env, "PATH": f"{bin_dir}:{dl.env['PATH']}"}


def _bash_complete(env: dict[str, str], *words: str) -> list[str]:
    """What bash offers for `det-local WORDS<TAB>` with the sourced script."""
    script = (
        "source <(det-local completion bash)\n"
        f"COMP_WORDS=(det-local {' '.join(words)})\n"
        f"COMP_CWORD={len(words)}\n"
        "_det_local_completion det-local\n"
        'printf "%s\\n" "${COMPREPLY[@]}"\n'
    )
    r = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stderr == "", r
    return [w for w in r.stdout.splitlines() if w]


def test_bash_completion(dl: Env) -> None:
    env = _det_local_on_path(dl)
    assert _bash_complete(env, "exp") == ["experiment"]
    offered = _bash_complete(env, "experiment", "l")
    assert {"list", "label"} <= set(offered) and all(w.startswith("l") for w in offered)
    assert "describe" in _bash_complete(env, "trial", "")


def test_zsh_and_fish_scripts_and_a_bad_shell(dl: Env) -> None:
    env = _det_local_on_path(dl)
    zsh = dl.det("completion", "zsh")
    assert zsh.rc == 0 and "compdef _det_local_completion det-local" in zsh.out
    assert "_DET_LOCAL_COMPLETE=complete_zsh" in zsh.out
    fish = dl.det("completion", "fish")
    assert fish.rc == 0 and "complete --command det-local" in fish.out
    # the protocol zsh's script speaks: the words so far in _TYPER_COMPLETE_ARGS
    r = subprocess.run(
        ["det-local"],
        env={**env, "_DET_LOCAL_COMPLETE": "complete_zsh", "_TYPER_COMPLETE_ARGS": "det-local tri"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0 and "trial" in r.stdout and "experiment" not in r.stdout, r
    _one_line(
        dl.det("completion", "tcsh"),
        1,
        "error: completion: no shell 'tcsh'; choose one of bash, zsh, fish",
    )


# ---------------------------------------------------------------------------- create, priority
def test_experiment_create_without_and_with_a_daemon(dl: Env) -> None:
    cfg, ctx = dl.trainer({"batches": 4, "ckpt_every": 2}, {"name": "created"})
    r = dl.det("experiment", "create", cfg, ctx)
    _one_line(
        r,
        1,
        f"error: no det-local daemon is running for {dl.home}: `det-local daemon start` first, "
        "or `det-local experiment create -f` runs the experiment in this terminal",
    )
    # -f with no daemon: runs here, as `det-local run` does
    r = dl.det("e", "create", "-f", cfg, ctx)
    assert r.rc == 0, r
    assert (
        r.out.startswith("Created experiment 1\n") and "Experiment 1 (created) COMPLETED" in r.out
    )
    r = dl.det("e", "create", "--test", "--follow", cfg, ctx)
    assert r.rc == 0 and "Test mode: PASSED" in r.out, r

    dl.daemon_start(DET_LOCAL_FAKE_GPUS="1")
    r = dl.det("experiment", "create", cfg, ctx)
    assert (r.rc, r.out) == (0, "Created experiment 3\n"), r  # at once: the daemon runs it
    wait_for(
        lambda: dl.experiment(3).state == State.COMPLETED, timeout=60, what="experiment 3 to end"
    )
    r = dl.det("experiment", "create", "-f", cfg, ctx)
    assert r.rc == 0 and "Experiment 4 (created) COMPLETED" in r.out, r


def test_experiment_set_priority(dl: Env) -> None:
    dl.daemon_start(DET_LOCAL_FAKE_GPUS="1")
    dl.cmd(*dl.held("hold"), name="hold")  # holds the only slot: the trial stays queued
    wait_for(lambda: dl.order() == ["hold"], what="the command to start")
    cfg, ctx = dl.trainer({"batches": 2}, {"name": "prio"})
    assert dl.det("experiment", "create", cfg, ctx).rc == 0
    wait_for(lambda: [j for j in dl.jobs() if j.kind == "TRIAL"], what="the trial's job")
    r = dl.det("e", "set", "priority", 1, 7)
    assert (r.rc, r.out, r.err) == (0, "experiment 1: priority 7\n", ""), r
    trial_jobs = [j for j in dl.json("job", "list") if j["kind"] == "TRIAL"]
    assert [j["priority"] for j in trial_jobs] == [7]
    r = dl.det("e", "set", "priority", 1, 1000)
    assert r.rc == 1 and r.out == "" and r.err.count("\n") == 1, r
    assert (
        r.err == "error: priority 1000 is outside 1-99 (1 is the most important, 42 the default)\n"
    )
    r = dl.det("e", "set", "priority", 99, 5)
    assert r.rc == 1 and r.err.count("\n") == 1 and "99" in r.err, r
    dl.release("hold")
    wait_for(lambda: dl.experiment(1).state == State.COMPLETED, timeout=60, what="the trial")


# ---------------------------------------------------------------------------- small truths
def test_shell_and_command_on_cpu_slots_get_omp_num_threads(dl: Env) -> None:
    dl.env.pop("OMP_NUM_THREADS", None)
    dl.daemon_start(DET_LOCAL_CPU_SLOTS="2")
    share = max(1, CORES // 2)

    def shell(extra: dict[str, str]) -> str:
        out = dl.tmp / "shell.out"
        env = {**dl.env, "SHELL": "/bin/sh", **extra}
        proc = subprocess.run(
            [sys.executable, "-m", "det_local.cli.main", "shell", "start"],
            input=f'echo "$OMP_NUM_THREADS" > {out}\nexit 0\n',
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 0, proc.stderr
        return out.read_text().strip()

    assert shell({}) == str(share)
    assert shell({"OMP_NUM_THREADS": "3"}) == "3"  # the user's setting wins
    r = dl.det("cmd", "run", "-f", "--", "sh", "-c", 'echo "omp=$OMP_NUM_THREADS"')
    assert r.rc == 0 and r.out.splitlines()[-1] == f"omp={share}", r


def test_tensorboard_start_does_not_wait_for_0_slots(dl: Env) -> None:
    p = Paths(dl.home).ensure()
    store = Store(p.db)
    exp = store.create_experiment(name="tb", config={})
    trial = store.create_trial(exp, hparams={}, seed=1)
    store.set_trial_state(trial, State.COMPLETED)
    store.set_experiment_state(exp, State.COMPLETED)  # ended: the daemon has nothing to resume
    store.close()
    # a stand-in for TensorBoard (not installed here): a process that serves nothing
    bin_dir = dl.tmp / "tb-bin"
    bin_dir.mkdir()
    fake = bin_dir / "tensorboard"
    fake.write_text("#!/bin/sh\nexec sleep 120\n")
    fake.chmod(0o755)
    dl.env["PATH"] = f"{bin_dir}:{dl.env['PATH']}"
    dl.daemon_start(DET_LOCAL_FAKE_GPUS="1")
    r = dl.det("tensorboard", "start", exp)
    assert r.rc == 0, r
    assert "slot(s)" not in r.out and "waits" not in r.out, r
    head, stop = r.out.splitlines()
    assert head.startswith("tensorboard (job 1): http://127.0.0.1:"), r
    assert stop == "stop it with: det-local cmd kill 1"
    assert dl.det("cmd", "kill", 1).rc == 0
    dl.wait_job(1)

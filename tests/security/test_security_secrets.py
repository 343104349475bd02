"""No secret where another user can read it, and a clean environment for every job.

With a real root daemon and real users (test_multiuser's fixtures): a trial's token and a
command's captured environment never reach the world-readable database (its WAL and shm files
included) nor any file under DET_LOCAL_HOME that another user can open; cluster.json is 0600 and
the trial's user's; the daemon's own environment reaches no job; a trial gets exactly the
allow-listed variables of its submitter plus the config's and det-local's; and all of it holds
across a kill -9 of the daemon and across the upgrade from a database that held the secrets.

The test users cannot run Python: jobs are `sh -c` scripts writing `env` into files (umask 077:
their output is not the leak under test), which the test (root) reads.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pwd
import secrets
import shutil
import socket
import sqlite3
import stat
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import det_local.cli.cmd
import det_local.cli.job
from det_local import api
from det_local.sched.intake import spool
from det_local.sched.run.launchplan import COMPAT_DIR
from det_local.store.paths import Paths
from det_local.store.states import State
from det_local.wire import rpc
from tests.support.users import A, B, Shared
from tests.support.world import Env, wait_for

DAEMON_SECRET = "daemon-only-" + secrets.token_hex(12)
AWS_SECRET = "aws-" + secrets.token_hex(16)

# alice's whole environment when she submits (what `cmd run` captures, what a submission sends)
ALICE_PATH = "/usr/local/bin:/usr/bin:/bin:/opt/alice-tools/bin"
ALICE_ENV = {
    "PATH": ALICE_PATH,
    "LANG": "C.UTF-8",
    "LC_MESSAGES": "C",
    "TZ": "Europe/Paris",
    "TERM": "dumb",
    "HOME": "/not/from/passwd",
    "NOT_ALLOWED_VAR": "must-not-reach-a-trial",
    "AWS_SECRET_ACCESS_KEY": AWS_SECRET,
}
ALLOWED_KEYS = {"PATH", "LANG", "LC_MESSAGES", "TZ", "TERM"}
SHELL_VARS = {"PWD", "SHLVL", "_", "OLDPWD"}  # what `sh` itself adds to `env`'s output
# det-local's own variables that are not DET_*: the interpreter's paths, the slots, the
# rendezvous ports, the threads on CPU slots
DET_LOCAL_VARS = {
    "PYTHONPATH",
    "PYTHONUNBUFFERED",
    "CUDA_VISIBLE_DEVICES",
    "OMP_NUM_THREADS",
    "C10D_PORT",
    "INTER_TRAIN_PROCESS_COMM_PORT_1",
    "INTER_TRAIN_PROCESS_COMM_PORT_2",
    "DTRAIN_SSH_PORT",
}


@pytest.fixture
def sec(dl: Env, request: pytest.FixtureRequest) -> Iterator[Shared]:
    """`shared`, with a daemon whose own environment holds a secret."""
    dl.env["DET_DAEMON_ONLY_SECRET"] = DAEMON_SECRET
    yield request.getfixturevalue("shared")


def read_env(path: Path) -> dict[str, str]:
    env = {}
    for line in path.read_text().splitlines():
        key, sep, value = line.partition("=")
        if sep and key.replace("_", "").isalnum():
            env[key] = value
    return env


def _as_alice(fn: Any, *args: Any) -> Any:
    """In the child: alice's environment is exactly ALICE_ENV (and the shared home)."""
    home = os.environ["DET_LOCAL_HOME"]
    os.environ.clear()
    os.environ.update(ALICE_ENV, DET_LOCAL_HOME=home)
    return fn(*args)


def _cmd_run(argv: list[str]) -> int:
    """What `det-local cmd run -- ARGV` sends: the submitter's whole environment."""
    payload = {"argv": argv, "cwd": os.getcwd(), "env": dict(os.environ), "slots": 1}
    return int(api.control_job("cmd_run", payload))


def _spool_cmd(argv: list[str]) -> str:
    """A `cmd run` written while the daemon is down (the request waits in the spool)."""
    payload = {"argv": argv, "cwd": os.getcwd(), "env": dict(os.environ), "slots": 1}
    return spool.submit(api.paths(), "cmd_run", payload)


def _run_experiment(config: str) -> int:
    return api.run(Path(config), Path(config).parent, follow=False)


def _hello(trial_id: int, token: str) -> dict[str, Any]:
    """Speak as the trial: the daemon's answer to a hello with this token."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(20)
        try:
            s.connect(str(api.paths().socket))
        except OSError as err:  # no daemon (yet)
            return {"error": f"connect: {err}"}
        rpc.send(s, {"t": "hello", "token": token, "trial_id": trial_id, "run_id": 1, "rank": 0})
        return rpc.recv(s) or {"error": "no answer"}


def _authenticates(sec: Shared, trial_id: int, token: str) -> None:
    """alice's trial session is accepted (waiting for a daemon that is starting up)."""
    wait_for(
        lambda: "error" not in sec.as_user(A, _hello, trial_id, token),
        what=f"trial {trial_id}'s session to authenticate",
    )


def _token_from_cluster_json(path: str) -> str:
    return str(json.loads(Path(path).read_text())["session_token"])


def _listings() -> str:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        det_local.cli.job.list_jobs(show_all=True, limit=None, as_json=True, cluster=False)
        det_local.cli.cmd.list_commands(show_all=True, as_json=True)
    return buf.getvalue()


def _try_read(path: str) -> str:
    try:
        Path(path).read_bytes()
    except PermissionError:
        return "denied"
    return "read"


def _scan(home: str, needles: list[str]) -> dict[str, Any]:
    """Every file under `home` that this user can open, read whole: where the needles are."""
    found: list[list[str]] = []
    opened: list[str] = []
    for root, _dirs, files in os.walk(home):  # directories this user cannot list: skipped
        for name in files:
            path = os.path.join(root, name)
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
            except OSError:
                continue
            try:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    continue
                chunks = []
                while chunk := os.read(fd, 1 << 20):
                    chunks.append(chunk)
            finally:
                os.close(fd)
            opened.append(path)
            data = b"".join(chunks)
            found += [[path, n] for n in needles if n.encode() in data]
    # and what the reported attack did: a read-only query of the jobs table
    db = Paths(Path(home)).db
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        cells = conn.execute("SELECT token, env FROM jobs").fetchall()
    finally:
        conn.close()
    return {"found": found, "opened": opened, "cells": cells}


def _context(sec: Shared, name: str, script: str, variables: list[str]) -> Path:
    ctx = sec.out / name
    ctx.mkdir()
    os.chmod(ctx, 0o755)
    config = {
        "name": name,
        "entrypoint": ["sh", "-c", script],
        "max_restarts": 0,
        "searcher": {"name": "single", "metric": "loss", "max_length": 1},
        "environment": {"environment_variables": variables},
    }
    (ctx / "config.yaml").write_text(json.dumps(config))
    os.chmod(ctx / "config.yaml", 0o644)
    return ctx / "config.yaml"


def _held_trial(sec: Shared, name: str) -> tuple[Path, Path]:
    """alice's experiment whose trial writes its environment, then waits for its gate."""
    env_file, gate = sec.out / f"{name}.env", sec.out / f"gate-{name}"
    script = f"umask 077; env > {env_file}.tmp; mv {env_file}.tmp {env_file}; "
    script += f"while [ ! -e {gate} ]; do sleep 0.05; done"
    config = _context(sec, name, script, ["CONFIG_VAR=from-the-config", "LANG=C"])
    assert sec.as_user(A, _as_alice, _run_experiment, str(config)) == 0
    wait_for(env_file.exists, what=f"{name}'s trial to start")
    return env_file, gate


def _env_cmd(name: str, sec: Shared, extra: str = "") -> list[str]:
    out = sec.out / f"{name}.env"
    return ["sh", "-c", f"{extra}umask 077; env > {out}.tmp; mv {out}.tmp {out}"]


def _alice_trial_job(sec: Shared) -> Any:
    store = api.open_store(sec.paths)
    try:
        return next(j for j in store.jobs.list(include_done=True) if j.kind == "TRIAL")
    finally:
        store.close()


def _assert_nothing_for_bob(sec: Shared, needles: list[str]) -> None:
    seen = sec.as_user(B, _scan, str(sec.home), needles)
    assert seen["found"] == [], seen["found"]
    db = str(sec.paths.db)
    assert db in seen["opened"], seen["opened"]  # bob read the database itself...
    for suffix in ("-wal", "-shm"):  # ...and its WAL and shared-memory files
        if os.path.exists(db + suffix):
            assert db + suffix in seen["opened"], seen["opened"]
    assert all(cell is None for row in seen["cells"] for cell in row), seen["cells"]


# ---------------------------------------------------------------------------- the tests
def test_no_secret_is_readable_by_another_user(sec: Shared) -> None:
    """alice's token and her cloud key: nowhere bob can read; cluster.json is 0600, hers."""
    env_file, gate = _held_trial(sec, "t")
    job = sec.as_user(A, _as_alice, _cmd_run, _env_cmd("cmd", sec))
    assert sec.wait_job(job).exit_code == 0
    # (b) alice's command has her own secret
    assert read_env(sec.out / "cmd.env")["AWS_SECRET_ACCESS_KEY"] == AWS_SECRET
    trial_env = read_env(env_file)
    token = trial_env["DET_LOCAL_TOKEN"]
    assert len(token) >= 32
    trial = _alice_trial_job(sec)
    # (f) the token's file: 0600, alice's
    cluster = sec.paths.trial_info_dir(trial.experiment_id, trial.trial_id, 1) / "cluster.json"
    st = cluster.stat()
    assert (oct(stat.S_IMODE(st.st_mode)), st.st_uid) == (oct(0o600), pwd.getpwnam(A).pw_uid)
    assert json.loads(cluster.read_text())["session_token"] == token
    assert sec.as_user(B, _try_read, str(cluster)) == "denied"
    assert sec.as_user(A, _token_from_cluster_json, str(cluster)) == token  # her trial reads it
    # (a) bob reads everything he can under the home: database, WAL, shm, logs, answers...
    _assert_nothing_for_bob(sec, [token, AWS_SECRET])
    # `job list --all --json` and `cmd list --all --json`, as bob: neither
    listed = sec.as_user(B, _listings)
    assert A in listed and token not in listed and AWS_SECRET not in listed
    # the token still works for alice's trial
    _authenticates(sec, trial.trial_id, token)
    assert sec.as_user(B, _hello, trial.trial_id, "0" * 64)["error"]
    gate.touch()
    store = api.open_store(sec.paths)
    wait_for(lambda: store.get_experiment(trial.experiment_id).state == State.COMPLETED)
    store.close()


def test_jobs_get_a_clean_environment(sec: Shared) -> None:
    """(c) the daemon's own environment reaches no job; (d) a trial gets exactly its
    submitter's allow-listed variables, the config's and det-local's."""
    env_file, gate = _held_trial(sec, "clean")
    gate.touch()
    env = read_env(env_file)
    job = sec.as_user(A, _as_alice, _cmd_run, _env_cmd("cmd", sec))
    assert sec.wait_job(job).exit_code == 0
    cmd_env = read_env(sec.out / "cmd.env")
    for seen in (env, cmd_env):
        assert "DET_DAEMON_ONLY_SECRET" not in seen
        assert DAEMON_SECRET not in json.dumps(seen)
    # the command: alice's environment as she had it (and det-local's slot variables)
    assert {k: cmd_env[k] for k in ALICE_ENV} == ALICE_ENV
    # the trial: alice's allow-listed variables...
    home = pwd.getpwnam(A).pw_dir
    assert (env["LC_MESSAGES"], env["TZ"], env["TERM"]) == ("C", "Europe/Paris", "dumb")
    assert env["PATH"] == os.path.dirname(sys.executable) + os.pathsep + ALICE_PATH
    assert (env["HOME"], env["USER"], env["LOGNAME"]) == (home, A, A)  # from passwd
    # ...the config's (over hers)...
    assert (env["CONFIG_VAR"], env["LANG"]) == ("from-the-config", "C")
    # ...det-local's...
    assert env["PYTHONPATH"].split(os.pathsep)[0] == COMPAT_DIR
    assert env["DET_LOCAL_HOME"] == str(sec.home)
    # ...and nothing else
    assert "NOT_ALLOWED_VAR" not in env and "AWS_SECRET_ACCESS_KEY" not in env
    expected = ALLOWED_KEYS | {"HOME", "USER", "LOGNAME", "CONFIG_VAR"} | DET_LOCAL_VARS
    extra = {k for k in env if k not in expected | SHELL_VARS and not k.startswith("DET_")}
    assert extra == set(), extra


def test_secrets_survive_a_daemon_restart_outside_the_database(sec: Shared) -> None:
    """(e) kill -9 of the daemon: a queued command still gets its environment, a request
    written while it was down too, and the adopted trial's session still authenticates;
    and still none of it is in the database."""
    env_file, gate = _held_trial(sec, "t")
    token = read_env(env_file)["DET_LOCAL_TOKEN"]
    trial = _alice_trial_job(sec)
    holder = sec.held(A, "holder")  # the second CPU slot: alice's command waits
    wait_for(lambda: sec.job(holder).state == "SCHEDULED", what="the holder to start")
    queued = sec.as_user(A, _as_alice, _cmd_run, _env_cmd("queued", sec))
    assert sec.job(queued).state == "QUEUED"
    sec.dl.kill_daemon()
    req_id = sec.as_user(A, _as_alice, _spool_cmd, _env_cmd("spooled", sec))
    req = sec.paths.queue / f"{req_id}.req"
    st = req.stat()  # a request holds the submitter's environment: hers alone
    assert (oct(stat.S_IMODE(st.st_mode)), st.st_uid) == (oct(0o600), pwd.getpwnam(A).pw_uid)
    assert sec.as_user(B, _try_read, str(req)) == "denied"

    sec.dl.daemon_start()
    _authenticates(sec, trial.trial_id, token)
    spooled = sec.as_user(A, spool.wait_response, sec.paths, req_id, 20)
    sec.release("holder")
    for job_id, name in ((queued, "queued"), (spooled, "spooled")):
        assert sec.wait_job(job_id).exit_code == 0
        assert read_env(sec.out / f"{name}.env")["AWS_SECRET_ACCESS_KEY"] == AWS_SECRET
    _assert_nothing_for_bob(sec, [token, AWS_SECRET])
    gate.touch()
    store = api.open_store(sec.paths)
    wait_for(lambda: store.get_experiment(trial.experiment_id).state == State.COMPLETED)
    store.close()
    # what the daemon kept privately for those jobs is gone with them
    assert list(sec.paths.job_envs.iterdir()) == []
    assert list(sec.paths.experiment_envs.iterdir()) == []


def test_an_old_database_is_scrubbed_and_its_trials_still_authenticate(sec: Shared) -> None:
    """The upgrade: a database written by a det-local that kept the running trial's token and
    a queued command's environment in the jobs table (and had no daemon key). At the first
    start they move to private files and out of the file's bytes; the running trial, started
    with its old token, is adopted and still authenticates; the command gets its environment."""
    env_file, gate = _held_trial(sec, "t")
    trial = _alice_trial_job(sec)
    holder = sec.held(A, "holder")
    wait_for(lambda: sec.job(holder).state == "SCHEDULED", what="the holder to start")
    queued = sec.as_user(A, _as_alice, _cmd_run, _env_cmd("queued", sec))
    sec.dl.kill_daemon()
    # the old version's state: the token the trial runs with and the command's environment in
    # the jobs table, no private files, so no key from which that token could be derived
    old_token = read_env(env_file)["DET_LOCAL_TOKEN"]
    queued_env = {**ALICE_ENV, "DET_LOCAL_HOME": str(sec.home)}  # what `cmd run` captured
    conn = sqlite3.connect(sec.paths.db)
    with conn:
        conn.execute("UPDATE jobs SET token=? WHERE id=?", (old_token, trial.id))
        conn.execute("UPDATE jobs SET env=? WHERE id=?", (json.dumps(queued_env), queued))
    conn.close()
    shutil.rmtree(sec.home / "private", ignore_errors=True)
    assert old_token.encode() in sec.paths.db.read_bytes() + _wal(sec)

    sec.dl.daemon_start()
    _authenticates(sec, trial.trial_id, old_token)
    sec.release("holder")
    assert sec.wait_job(queued).exit_code == 0
    assert read_env(sec.out / "queued.env")["AWS_SECRET_ACCESS_KEY"] == AWS_SECRET
    _assert_nothing_for_bob(sec, [old_token, AWS_SECRET])
    private = sec.paths.private
    assert oct(stat.S_IMODE(private.stat().st_mode)) == oct(0o700)
    assert oct(stat.S_IMODE(sec.paths.legacy_tokens.stat().st_mode)) == oct(0o600)
    gate.touch()
    store = api.open_store(sec.paths)
    wait_for(lambda: store.get_experiment(trial.experiment_id).state == State.COMPLETED)
    store.close()


def _wal(sec: Shared) -> bytes:
    wal = Path(str(sec.paths.db) + "-wal")
    return wal.read_bytes() if wal.exists() else b""


def test_config_check_shows_the_environment_a_trial_gets(dl: Env) -> None:
    """Embedded mode follows the same rule (a variable of `det-local run`'s environment
    outside the allow-list does not reach the trial), and `config check` shows exactly the
    variables the launch gives."""
    out = dl.tmp / "trial.env"
    cfg, ctx = dl.context(
        "",
        {"entrypoint": f"env > {out}", "environment": {"environment_variables": ["FOO=bar"]}},
    )
    dl.setenv(
        DET_LOCAL_FAKE_GPUS="0",
        DET_LOCAL_CPU_SLOTS="1",
        NOT_ALLOWED_VAR="must-not-reach",
        LC_TIME="C",
        TZ="UTC",
    )
    r = dl.det("config", "check", cfg, ctx, "--json")
    assert r.rc == 0, r
    shown = json.loads(r.out)["plan"]["env"]
    r = dl.det("run", cfg, ctx)
    assert r.rc == 0, r
    got = read_env(out)
    assert set(got) - SHELL_VARS == set(shown)
    assert "NOT_ALLOWED_VAR" not in got and got["LC_TIME"] == "C" and got["TZ"] == "UTC"
    for key in ("PATH", "PYTHONPATH", "FOO", "LC_TIME", "TZ", "HOME", "DET_LOCAL_HOME"):
        assert shown[key] == got[key], key


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except PermissionError as err:
        return f"PermissionError: {err.strerror}"


def test_the_daemon_log_is_private_and_masks_command_lines(shared: Shared) -> None:
    """Issue 34, item 7: run/daemon.log was 0644 and named a command's full command line
    (`sh -c echo x --password=SuperSecret123`), which `cmd list --json` masks."""
    log = shared.paths.run_dir / "daemon.log"
    argv = ["sh", "-c", "echo x", "--password=SuperSecret123", "--api-key", "Hunter22"]
    payload = {
        "argv": argv,
        "cwd": str(shared.out),
        "env": {"PATH": "/usr/bin:/bin"},
        "slots": 1,
        "priority": 42,
        "name": None,
    }
    job = int(shared.as_user(A, api.control_job, "cmd_run", payload))
    said = wait_for(
        lambda: next((ln for ln in log.read_text().splitlines() if f"job {job} ended" in ln), None),
        what="the job's end in the daemon's log",
    )
    masked = "sh -c echo x --password=*** --api-key ***"
    assert f"command '{masked}', user {A}" in said, said
    text = log.read_text()
    assert "SuperSecret123" not in text and "Hunter22" not in text
    # exactly as `cmd list --json` shows it
    listed = json.loads(shared.dl.det("cmd", "list", "--all", "--json").out)
    row = next(r for r in listed if r["id"] == job)
    assert row["name"] == masked and " ".join(row["argv"]) == masked, row
    # its owner's (root's) only, and so for another user unreadable
    assert stat.S_IMODE(log.stat().st_mode) == 0o600
    assert shared.as_user(A, _read, str(log)) == "PermissionError: Permission denied"
    # a log an earlier version left world-readable is re-moded when the daemon starts
    assert shared.dl.det("daemon", "stop").rc == 0
    os.chmod(log, 0o644)
    shared.dl.daemon_start()
    assert stat.S_IMODE(log.stat().st_mode) == 0o600

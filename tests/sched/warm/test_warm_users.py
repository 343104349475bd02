"""Warm trial starts for other users' trials under a root daemon (`sched/warm/zygotes.py`,
`sched/warm/zygotetrust.py`), with real Unix users (`accounts`) running a Python of their own
(`tests.support.userpython.user_python`):
a warm trial sees what a cold one sees, the zygote runs as the
trial's user in a cgroup of its own, another user never reaches it, and a hostile "zygote"
(any program of the user's on its socket) makes the daemon do nothing but start cold."""

from __future__ import annotations

import json
import os
import pwd
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from det_local import api
from det_local.sched.intake import spool
from det_local.sched.run.launchplan import LaunchPlan
from det_local.sched.warm import zygotetrust
from det_local.sched.warm.zygotes import WarmSpec, ZygotePool, warm_spec
from det_local.store.paths import Paths
from tests.support.trials.warm import PER_TRIAL, serial_grid
from tests.support.userpython import user_python  # noqa: F401  (the session fixture)
from tests.support.users import ADMIN, A, B, Shared
from tests.support.world import Env, gone, wait_for

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="creates users: needs root")

# What the trial sees, to OUT/<experiment>-<n>.json (n: 0 for the experiment's first trial to
# run, 1 for the next...). The first waits (bounded) for its experiment's zygote socket and records
# the zygote's ids, umask, cwd and cgroup, read from /proc.
SCRIPT = r"""
import sys
warm = "determined" in sys.modules  # preloaded by the zygote: a forked trial
import glob, json, os, time
import determined as det

home = os.environ["DET_LOCAL_HOME"]
exp = os.environ["DET_EXPERIMENT_ID"]
trial_id = int(os.environ["DET_TRIAL_ID"])
index = 0  # its place in the order the experiment's trials run in (one at a time)
while True:
    try:
        os.close(os.open(f"{os.environ['OUT']}/{exp}-ran-{index}", os.O_CREAT | os.O_EXCL))
        break
    except FileExistsError:
        index += 1
zygote = None
if index == 0:
    deadline = time.monotonic() + 60
    while not (socks := [s for s in glob.glob(f"{home}/run/z/{exp}.*/s")]):
        assert time.monotonic() < deadline, "no zygote"
        time.sleep(0.02)
    log = os.path.join(os.path.dirname(socks[0]), "log")
    while "ready (pid " not in open(log).read():
        assert time.monotonic() < deadline, "no zygote"
        time.sleep(0.02)
    pid = int(open(log).read().split("ready (pid ")[1].split(",")[0])
    status = {}
    for line in open(f"/proc/{pid}/status"):
        key, _, value = line.partition(":")
        if key in ("Uid", "Gid", "Groups", "Umask"):
            status[key] = value.split()
    zygote = {"status": status, "cgroup": open(f"/proc/{pid}/cgroup").read(),
              "cwd": os.readlink(f"/proc/{pid}/cwd")}
facts = {
    "warm": warm,
    "env": dict(os.environ),
    "cwd": os.getcwd(),
    "ids": [os.getuid(), os.geteuid(), os.getgid(), os.getegid(), sorted(os.getgroups())],
    "umask": os.umask(0o022),
    "cgroup": open("/proc/self/cgroup").read(),
    "pgid": os.getpgid(0),
    "sid": os.getsid(0),
    "argv": sys.argv,
    "path0": sys.path[0],
    "stdin_tty": os.isatty(0),
    "zygote": zygote,
}
with open(os.path.join(os.environ["OUT"], f"{exp}-{index}.json"), "w") as f:
    json.dump(facts, f)
with det.core.init() as core:
    core.train.report_training_metrics(steps_completed=1, metrics={"loss": float(trial_id)})
"""

UMASK = 0o027  # not the default: the trial's own must reach the zygote and its forks


def _context(shared: Shared, name: str, python: str, n: int, **env: str) -> tuple[dict, Path]:
    ctx = shared.out / name
    ctx.mkdir()
    (ctx / "train.py").write_text(SCRIPT)
    os.chmod(ctx, 0o755)
    os.chmod(ctx / "train.py", 0o644)
    config = {
        "name": name,
        "entrypoint": f"{python} train.py",
        **serial_grid(shared.out, env, n),
        "max_restarts": 0,
    }
    return config, ctx


def _submit(config: dict[str, Any], context: str) -> Any:
    payload = {"config": config, "context": context, "source": "raw", "umask": UMASK}
    return spool.request(api.paths(), "submit", payload, timeout=30)


def _wait_done(shared: Shared, exp: int, timeout: float = 120) -> None:
    store = api.open_store(shared.paths)
    try:
        wait_for(
            lambda: store.get_experiment(exp).state.terminal,
            timeout=timeout,
            what=f"experiment {exp} to end",
        )
    finally:
        store.close()


def _facts(shared: Shared, exp: int) -> dict[int, dict[str, Any]]:
    """What each trial of the experiment saw, by the order they ran in (0: the first)."""
    out = {}
    for p in shared.out.glob(f"{exp}-*.json"):
        out[int(p.stem.split("-")[1])] = json.loads(p.read_text())
    ids = [int(out[i]["env"]["DET_TRIAL_ID"]) for i in sorted(out)]
    assert ids == sorted(ids), ids  # trial ids are given in the order they start
    return out


def _events(shared: Shared, exp: int) -> list[str]:
    store = api.open_store(shared.paths)
    try:
        return [e[3] for e in store.list_events(exp)]
    finally:
        store.close()


def _jobs(shared: Shared) -> dict[tuple[int, int], Any]:
    store = api.open_store(shared.paths)
    try:
        return {(j.experiment_id, j.trial_id): j for j in store.jobs.list(include_done=True)}
    finally:
        store.close()


@pytest.fixture(autouse=True)
def _checkout_reachable(accounts: None) -> Iterator[None]:
    """The users' trials run `user_python`, but their PYTHONPATH names this checkout's compat/
    first (as every trial's does): were the checkout reachable only while `Shared.as_user`'s
    child runs, a trial's imports could begin in it and go on after it closed again (a clone
    under a 0700 directory: "No module named 'det_local.trial.core._distributed'"). Held for
    the whole test, so a trial sees one det_local from start to end."""
    from tests.support.reach import python_reachable

    with python_reachable(on_blocked=pytest.skip):
        yield


@pytest.fixture(params=["v2", "v1"])
def cgroup_mode(dl: Env, request: pytest.FixtureRequest) -> str:
    """The root daemon's cgroup mode (set before `shared` starts it)."""
    dl.setenv(DET_LOCAL_CGROUPS=request.param)
    return str(request.param)


# ---------------------------------------------------------------------------- same as cold
def test_a_users_warm_trial_sees_what_a_cold_one_sees(
    cgroup_mode: str,
    shared: Shared,
    user_python: Path,  # noqa: F811
) -> None:
    config, ctx = _context(shared, "who", str(user_python), 3)
    exp = shared.as_user(ADMIN, _submit, config, str(ctx))  # ADMIN: a supplementary group too
    _wait_done(shared, exp)
    facts = _facts(shared, exp)
    assert sorted(facts) == [0, 1, 2], _events(shared, exp)
    jobs = {i: _jobs(shared)[exp, int(f["env"]["DET_TRIAL_ID"])] for i, f in facts.items()}
    if f"job-{jobs[0].id}-" not in facts[0]["cgroup"]:
        pytest.skip(f"no cgroup {cgroup_mode} containment here")
    pw = pwd.getpwnam(ADMIN)
    groups = sorted(os.getgrouplist(ADMIN, pw.pw_gid))
    cold = facts[0]
    assert cold["warm"] is False and facts[1]["warm"] is True and facts[2]["warm"] is True
    assert cold["ids"] == [pw.pw_uid, pw.pw_uid, pw.pw_gid, pw.pw_gid, groups]
    assert cold["umask"] == UMASK
    # the zygote: the user's, with their groups and umask, in the trial's cwd, in its own cgroup
    zygote = cold["zygote"]
    assert zygote["status"]["Uid"] == [str(pw.pw_uid)] * 4
    assert zygote["status"]["Gid"] == [str(pw.pw_gid)] * 4
    assert sorted(map(int, zygote["status"]["Groups"])) == groups
    assert zygote["status"]["Umask"] == [f"{UMASK:04o}"]
    assert zygote["cwd"] == cold["cwd"]
    assert f"/zygote-{exp}." in zygote["cgroup"] and "/job-" not in zygote["cgroup"]
    for i in (1, 2):
        warm = facts[i]
        for key in ("cwd", "ids", "umask", "argv", "path0", "stdin_tty"):
            assert warm[key] == cold[key], key
        same = {k: v for k, v in cold["env"].items() if k not in PER_TRIAL}
        assert {k: v for k, v in warm["env"].items() if k not in PER_TRIAL} == same
        assert set(warm["env"]) == set(cold["env"])
        # its job's cgroups, exactly as the cold trial is in its own (v1: every hierarchy)
        job, first = jobs[i], jobs[0]
        mine = warm["cgroup"].replace(f"job-{job.id}-{job.run_id}", "JOB")
        assert mine == cold["cgroup"].replace(f"job-{first.id}-{first.run_id}", "JOB")
        assert "/zygote-" not in warm["cgroup"]
        assert warm["pgid"] == warm["sid"] == job.pid
    r = shared.dl.det("experiment", "describe", str(exp))
    assert r.rc == 0, r
    line = next(ln for ln in r.out.splitlines() if ln.strip().startswith("Trial start: "))
    assert "2 warm (p50 " in line and "1 cold (p50 " in line, line


# ---------------------------------------------------------------------------- another user
def _plan(where: Path, python: Path, user: str, experiment_id: int = 7) -> LaunchPlan:
    pw = pwd.getpwnam(user)
    config = {"entrypoint": f"{python} train.py", "searcher": {"name": "grid"}}
    return LaunchPlan(
        argv=["sh", "-c", f"{python} train.py"],
        env={
            "PATH": "/usr/bin:/bin",
            "DET_EXPERIMENT_ID": str(experiment_id),
            "DET_EXPERIMENT_CONFIG": json.dumps(config),
            "OUT": str(where),
        },
        cwd=str(where),
        user=user,
        slots=[],
        log_path=str(where / "logs" / f"{user}.log"),
        info_dir=str(where),
        uid=pw.pw_uid,
        gid=pw.pw_gid,
        groups=os.getgrouplist(user, pw.pw_gid),
        umask=0o022,
    )


def _zygote_pid(pool: ZygotePool, experiment_id: int) -> int:
    zygote = pool.zygotes[experiment_id]
    wait_for(lambda: os.path.lexists(zygote.socket), timeout=60, what="the zygote's socket")
    # the zygote binds its socket a moment before it writes "ready (pid N, ...)" to its log
    wait_for(lambda: "ready (pid " in zygote.log.read_text(), timeout=30, what="the zygote ready")
    return int(zygote.log.read_text().split("ready (pid ")[1].split(",")[0])


def _uids(pid: int) -> set[int]:
    status = zygotetrust.read_status(pid)
    return set(status.uids)


def test_another_users_trial_never_reaches_the_zygote(
    accounts: None,
    user_python: Path,  # noqa: F811
) -> None:
    where = Path(tempfile.mkdtemp(prefix="det-local-wu-", dir="/tmp"))
    notes: list[str] = []
    pool = ZygotePool(Paths(where / "home"), lambda line, **_: notes.append(line))
    try:
        os.chmod(where, 0o1777)
        (where / "train.py").write_text(
            "import os\nopen(os.path.join(os.environ['OUT'], f'ran-{os.getuid()}'), 'w')"
            ".write(str(os.getgid()))\n"
        )
        os.chmod(where / "train.py", 0o644)
        (where / "logs").mkdir(mode=0o755)
        plan_a, plan_b = _plan(where, user_python, A), _plan(where, user_python, B)
        spec_a, spec_b = warm_spec(plan_a), warm_spec(plan_b)
        assert isinstance(spec_a, WarmSpec) and isinstance(spec_b, WarmSpec)
        assert spec_a.key != spec_b.key  # the same experiment, script and env: the uid differs
        uid_a, uid_b = pwd.getpwnam(A).pw_uid, pwd.getpwnam(B).pw_uid

        def fork(job_id: int, plan: LaunchPlan, spec: WarmSpec) -> Any:
            run = where / "runs" / str(job_id)
            return pool.fork(job_id, plan, spec, run / "exit", run / "legacy-exit", None)

        assert fork(1, plan_a, spec_a) is None  # no zygote yet: started, as A
        zygote_a = _zygote_pid(pool, 7)
        assert _uids(zygote_a) == {uid_a}
        sock_a = pool.zygotes[7].socket
        # root, connecting for B's trial, refuses A's socket whatever the path
        ids_b = zygotetrust.expected_ids(uid_b, pwd.getpwnam(B).pw_gid)
        with pytest.raises(zygotetrust.Untrusted) as err:
            zygotetrust.connect(sock_a, ids_b, time.monotonic() + 2)
        assert str(err.value) == f"its socket {sock_a} is owned by uid {uid_a}, not {uid_b}"
        # B's trial: not forked from A's zygote, which is stopped; B gets a zygote of B's own
        assert fork(2, plan_b, spec_b) is None
        wait_for(lambda: gone(zygote_a), timeout=30, what="A's zygote to stop")
        assert pool.zygotes[7].key == spec_b.key
        zygote_b = _zygote_pid(pool, 7)
        assert _uids(zygote_b) == {uid_b}
        proc = fork(3, plan_b, spec_b)  # now warm: forked by B's zygote, as B
        assert proc is not None and proc.forked
        status = zygotetrust.read_status(proc.pid)
        assert status.ppid == zygote_b and set(status.uids) == {uid_b}
        ran = where / f"ran-{uid_b}"
        # open() makes the file before write() fills it: wait for what it says, not that it is
        wait_for(lambda: ran.exists() and ran.read_text() != "", timeout=30, what="B's warm trial")
        assert ran.read_text() == str(pwd.getpwnam(B).pw_gid)
        assert not (where / f"ran-{uid_a}").exists()
        assert proc.pidfd is not None
        wait_for(lambda: not zygotetrust.alive(proc.pidfd), timeout=30, what="B's trial to end")
        os.close(proc.pidfd)
        assert notes == [], notes
    finally:
        pool.stop_all()
        wait_for(lambda: (pool.reap(), not pool.stopping)[1], timeout=30, what="zygotes to end")
        subprocess.run(["rm", "-rf", str(where)])


# ---------------------------------------------------------------------------- a hostile zygote
# Run as the user in the zygote's place (the experiment's "python3" is theirs): listens on the
# socket path and answers a fork request as FAKE_MODE says; records what the daemon sent after.
FAKE = r"""
import os, socket, sys, time, json
from det_local.wire import rpc

sock_path, daemon_pid = sys.argv[1], int(sys.argv[2])
mode = os.environ["FAKE_MODE"]
record = os.path.join(os.environ["OUT"], f"fake-{mode}.json")
if mode == "symlink":  # the socket path names the daemon's own socket
    os.symlink(os.path.join(os.environ["DET_LOCAL_HOME"], "run", "daemon.sock"), sock_path)
    print(f"det-local zygote: ready (pid {os.getpid()}, 0 modules)", flush=True)
    time.sleep(120)
    sys.exit(0)
listener = socket.socket(socket.AF_UNIX)
listener.bind(sock_path)
if mode == "impostor":  # another process of the user's serves the socket
    if os.fork() != 0:
        time.sleep(120)
        sys.exit(0)
listener.listen()
print(f"det-local zygote: ready (pid {os.getpid()}, 0 modules)", flush=True)
conn, _ = listener.accept()
_, fds, _, _ = socket.recv_fds(conn, 1, 1)
request = rpc.recv(conn)
if mode == "silent":
    time.sleep(120)
elif mode == "garbage":
    conn.sendall(b"\x00\x00\x00\x05garba")
elif mode == "nested":  # within the size limit: empty maps nested 2,000 deep
    body = b"\x81\xa0" * 1999 + b"\x80"
    conn.sendall(len(body).to_bytes(4, "big") + body)
elif mode == "wide":  # a map of 2,000 keys
    body = b"\xde\x07\xd0" + b"\x00\xc0" * 2000
    conn.sendall(len(body).to_bytes(4, "big") + body)
elif mode == "huge":  # a 4 GiB length prefix
    conn.sendall(b"\xff\xff\xff\xff")
else:
    pid = {"daemon": daemon_pid, "victim": int(os.environ.get("FAKE_VICTIM", "0")),
           "self": os.getpid()}.get(mode, 0)
    rpc.send(conn, {"t": "forked", "pid": pid})
conn.settimeout(10)
try:
    after = conn.recv(4096)
except OSError:
    after = b""
with open(record + ".tmp", "w") as f:  # renamed into place: the test never reads half of it
    json.dump({"after": after.decode("latin-1"), "request": request["t"]}, f)
os.replace(record + ".tmp", record)
time.sleep(120)
"""

ATTACKS = {
    "daemon": "it answered pid {daemon}, which is not a trial it forked: its parent is",
    "victim": "it answered pid {victim}, which is not a trial it forked: its parent is",
    "self": "it answered pid ",
    "garbage": "it answered garbage (frame refused: message has 4 bytes after its value",
    "nested": "it answered garbage (frame refused: message nests deeper than 8 levels (at byte 17)",
    "wide": "it answered garbage (frame refused: a map of 2,000 keys is over the limit of 256",
    "huge": "it answered a frame of 4294967295 bytes (at most 4096)",
    "silent": "it did not answer in time",
    "impostor": "its socket is served by pid ",
    "symlink": "is not a socket (a symbolic link or another file)",
}


def test_a_hostile_zygote_gets_a_cold_start_and_nothing_else(
    shared: Shared,
    user_python: Path,  # noqa: F811
) -> None:
    fake_bin = shared.out / "bin"
    fake_bin.mkdir(mode=0o755)
    (shared.out / "fake.py").write_text(FAKE)
    python = fake_bin / "python3"
    python.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = -m ] && [ "$2" = det_local.trial.zygote ]; then\n'
        f'  shift 2; exec {user_python} {shared.out / "fake.py"} "$@"\n'
        "fi\n"
        f'exec {user_python} "$@"\n'
    )
    for path in (python, shared.out / "fake.py"):
        os.chmod(path, 0o755)
    pw_b = pwd.getpwnam(B)
    victim = subprocess.Popen(
        ["setpriv", f"--reuid={pw_b.pw_uid}", f"--regid={pw_b.pw_gid}", "--clear-groups"]
        + ["sleep", "300"]
    )
    daemon = shared.dl.daemon_pid()
    assert daemon is not None
    before = {pid: Path(f"/proc/{pid}/cgroup").read_text() for pid in (victim.pid, daemon)}
    try:
        exps = {}
        for mode in ATTACKS:
            env = {"FAKE_MODE": mode, "FAKE_VICTIM": str(victim.pid)}
            config, ctx = _context(shared, f"fake-{mode}", str(python), 2, **env)
            exps[mode] = shared.as_user(A, _submit, config, str(ctx))
        for mode, exp in exps.items():
            _wait_done(shared, exp)
            facts = _facts(shared, exp)
            assert [facts[i]["warm"] for i in (0, 1)] == [False, False], (mode, facts)
            store = api.open_store(shared.paths)
            states = [t.state.value for t in store.list_trials(exp)]
            store.close()
            assert states == ["COMPLETED", "COMPLETED"], (mode, _events(shared, exp))
            said = [e for e in _events(shared, exp) if "zygote" in e]
            expected = ATTACKS[mode].format(daemon=daemon, victim=victim.pid)
            assert len(said) == 1 and expected in said[0], (mode, said)
            assert said[0].startswith(f"experiment {exp}: warm starts off, its trials start cold")
            assert "\n" not in said[0]
            record = shared.out / f"fake-{mode}.json"
            if record.exists():  # what the daemon sent after the answer: nothing ("go" never)
                assert json.loads(record.read_text())["after"] == "", mode
        # nothing else was touched: the victim and the daemon live on, in their own cgroups
        assert victim.poll() is None and not gone(daemon)
        for pid, cgroup in before.items():
            assert Path(f"/proc/{pid}/cgroup").read_text() == cgroup
    finally:
        victim.kill()
        victim.wait()

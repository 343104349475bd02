"""The shared daemon under hostile input, next to a quiet baseline in the same run (issue 24).

    python3 bench/hostile_input.py [--requests 20] [--frames 3]   (as root: real users)

A root daemon on a temporary home (2 CPU slots), two real users made for the run: MALLORY
floods it, VICTOR keeps using it. VICTOR's prober (a forked process running as him) times, every
0.2 s, `det-local experiment list`'s read (expviews.experiments_json) and a submission (a `true`
command through the spool, answered when committed). Phases:

  quiet  : 5 s of the prober alone (the baseline);
  spool  : MALLORY drops N spool requests of 4 MiB nested empty maps at once, then waits for
           every answer; figures: the daemon's CPU time per request (its own accounting,
           /proc), each answer's round trip, the daemon's RSS growth (peak, sampled), and
           VICTOR's worst latencies meanwhile;
  frame  : MALLORY's own trial (`sleep 600`, its token read from /proc/PID/environ as the
           trial itself would) sends a 16 MiB session frame of nested empty maps, K times (a
           fresh session each: the daemon closes a session after refusing; since issue 34 it
           is over the 4 MiB session limit, refused at its length); same figures.
  within : three users at once (MALLORY, TRENT, URSULA, each with a trial; issue 34), the
           shapes of tests/security/test_hostile_budgets.py: frames: each user's two sessions
           send the costliest frame within the session budget (0.28 MB: 9,990 maps, 89,990
           strings) and one under the large-read size (0.24 MB: 80,000 strings) --rounds
           times, then the issue's bomb (1 MB of empty maps, a million
           values: within the old budget); spool: each user drops 20 requests that cost the
           most to read (0.22 MB: 19,990 arrays and ~60,000 strings; half within the budget,
           half over it at their last values). Figures: RSS growth at the peak, the loop's
           worst second, what was answered, VICTOR's prober meanwhile.

The event loop's longest stall in each phase comes from the daemon's own probe
(`det-local daemon status --json` -> loop_lag_ms; the bench polls run/looplag.json's
max_1s, the worst lag of each second).

Targets: spool: <= 50 ms of daemon CPU per refused request, RSS growth <= 50 MB, VICTOR
answered <= 1 s, loop stall <= 100 ms; frame: RSS growth <= 100 MB, VICTOR answered <= 1 s;
within: frames and spool each RSS growth <= 50 MB and loop stall <= 100 ms, all answered.
  federation: two federated daemons in network namespaces (tests/support/fednet.py, as
           bench/federation.py does); node 1's spool gets the same N bombs (as root) while
           each node's view of the other (last_seen_s: the gap since it last heard it, and its
           state) is polled every 50 ms; 3 s quiet first, as the anchor. Target: no gap over
           1.5 s, never suspect. Skipped with --no-federation.
The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import pwd
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import Daemon  # noqa: E402

MIB = 1024 * 1024
MALLORY, VICTOR = "dlbench_mallory", "dlbench_victor"
TRENT, URSULA = "dlbench_trent", "dlbench_ursula"
THREE = (MALLORY, TRENT, URSULA)  # the within-budget phases' three users (VICTOR watches)
USERS = (MALLORY, VICTOR, TRENT, URSULA)
SPOOL_BOMB = b"\x81\xa0" * (2 * MIB - 1) + b"\x80"  # 4 MiB: {"": {"": ...}}
FRAME_BOMB = b"\x81\xa0" * (8 * MIB - 1) + b"\x80"  # 16 MiB


def _users() -> None:
    for user in USERS:
        subprocess.run(["userdel", "-f", user], capture_output=True)
        subprocess.run(["useradd", "-M", "-N", "-s", "/usr/sbin/nologin", user], check=True)


def _remove_users() -> None:
    for user in USERS:
        subprocess.run(["userdel", "-f", user], capture_output=True)


def _become(user: str, home: str, cwd: str) -> None:
    pw = pwd.getpwnam(user)
    os.environ["DET_LOCAL_HOME"] = home
    os.chdir(cwd)
    os.setgroups([])
    os.setgid(pw.pw_gid)
    os.setuid(pw.pw_uid)


def _as_user(user: str, home: str, cwd: str, fn: Any, *args: Any) -> Any:
    """fn(*args) in a forked child running as `user`; its JSON-able value."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            _become(user, home, cwd)
            data = json.dumps(["ok", fn(*args)]).encode()
        except BaseException as err:  # noqa: BLE001 - reported to the parent
            data = json.dumps(["error", f"{type(err).__name__}: {err}"]).encode()
        while data:
            data = data[os.write(w, data) :]
        os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        data = f.read()
    os.waitpid(pid, 0)
    kind, value = json.loads(data)
    if kind != "ok":
        raise SystemExit(f"as {user}: {value}")
    return value


# ---------------------------------------------------------------------------- VICTOR's prober
class Prober:
    """A process running as VICTOR: every 0.2 s one read of the experiment list and one
    submission, each timed; the parent reads the samples of each phase."""

    def __init__(self, home: str, cwd: str) -> None:
        self.home, self.cwd = home, cwd
        r, w = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:
            os.close(r)
            _become(VICTOR, home, cwd)
            self._loop(w)
        os.close(w)
        self.samples: list[tuple[float, str, float]] = []
        self.reader = threading.Thread(target=self._read, args=(r,), daemon=True)
        self.reader.start()

    def _loop(self, w: int) -> None:
        from det_local import api
        from det_local.views import experiments as expviews

        payload = {
            "argv": ["true"],
            "cwd": self.cwd,
            "env": {"PATH": "/usr/bin:/bin"},
            "slots": 0,
            "priority": 42,
            "name": None,
        }
        out = os.fdopen(w, "w", buffering=1)
        while True:
            t0 = time.monotonic()
            try:
                expviews.experiments_json(all_users=True)
                out.write(f"{time.time()} list {time.monotonic() - t0}\n")
            except Exception:  # noqa: BLE001 - a failure is a sample of its own
                out.write(f"{time.time()} list-failed {time.monotonic() - t0}\n")
            t1 = time.monotonic()
            try:
                api.control_job("cmd_run", payload)
                out.write(f"{time.time()} submit {time.monotonic() - t1}\n")
            except Exception:  # noqa: BLE001
                out.write(f"{time.time()} submit-failed {time.monotonic() - t1}\n")
            time.sleep(max(0.0, 0.2 - (time.monotonic() - t0)))

    def _read(self, r: int) -> None:
        with os.fdopen(r) as f:
            for line in f:
                at, kind, secs = line.split()
                self.samples.append((float(at), kind, float(secs)))

    def window(self, start: float, end: float) -> dict[str, Any]:
        got = [s for s in self.samples if start <= s[0] <= end]
        out: dict[str, Any] = {}
        for kind in ("list", "submit"):
            xs = [s[2] * 1000 for s in got if s[1] == kind]
            out[f"{kind}_n"] = len(xs)
            out[f"{kind}_max_ms"] = round(max(xs), 1) if xs else None
            out[f"{kind}_p50_ms"] = round(sorted(xs)[len(xs) // 2], 1) if xs else None
        out["failed"] = sum(1 for s in got if s[1].endswith("failed"))
        return out

    def stop(self) -> None:
        os.kill(self.pid, 9)
        os.waitpid(self.pid, 0)


# ---------------------------------------------------------------------------- measuring
class Watch:
    """The daemon's RSS (peak, sampled every 20 ms) and its loop's worst stall (its probe's
    max_1s, polled) over one phase; its CPU time at the start and the end."""

    def __init__(self, pid: int, home: str) -> None:
        import psutil

        self.proc = psutil.Process(pid)
        self.lag_file = Path(home) / "run" / "looplag.json"
        self.stop = threading.Event()
        self.rss0 = self.proc.memory_info().rss
        self.peak = self.rss0
        self.cpu0 = sum(self.proc.cpu_times()[:2])
        self.stall = 0.0
        self.start = time.time()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        seen = None
        while not self.stop.is_set():
            self.peak = max(self.peak, self.proc.memory_info().rss)
            try:
                data = json.loads(self.lag_file.read_text())
                if data["at"] != seen and data["at"] >= self.start:
                    seen = data["at"]
                    self.stall = max(self.stall, float(data["max_1s"]))
            except (OSError, ValueError, KeyError):
                pass
            time.sleep(0.02)

    def done(self) -> dict[str, Any]:
        time.sleep(1.2)  # the probe's figures for the last second
        self.stop.set()
        self.thread.join()
        return {
            "rss_before_mb": round(self.rss0 / MIB, 1),
            "rss_growth_peak_mb": round((self.peak - self.rss0) / MIB, 1),
            "daemon_cpu_s": round(sum(self.proc.cpu_times()[:2]) - self.cpu0, 3),
            "loop_stall_max_ms": round(self.stall, 1),
            "end": time.time(),
        }


def drop_bombs(n: int) -> list[float]:
    """As MALLORY: N request files written at once, then each answer's round trip (s)."""
    from det_local import api
    from det_local.errors import DetLocalError
    from det_local.sched.intake import spool

    paths = api.paths()
    ids = []
    t0 = time.monotonic()
    for i in range(n):
        req_id = f"{time.time_ns():020d}-{os.getpid()}-bomb{i}"
        tmp = paths.queue / f".{req_id}.tmp"
        tmp.write_bytes(SPOOL_BOMB)
        os.rename(tmp, paths.queue / f"{req_id}.req")
        ids.append(req_id)
    out = []
    for req_id in ids:
        try:
            spool.wait_response(paths, req_id, timeout=300)
        except DetLocalError as err:
            assert "refused: message nests deeper than" in str(err), err
        out.append(time.monotonic() - t0)
    return out


def send_frames(env: dict[str, str], k: int) -> list[Any]:
    """As MALLORY's trial: K sessions, each sending the 16 MiB bomb; the daemon's answers."""
    from det_local.wire import rpc

    out = []
    for _ in range(k):
        sock = socket.socket(socket.AF_UNIX)
        sock.connect(env["DET_LOCAL_SOCKET"])
        sock.settimeout(120)
        hello = {
            "t": "hello",
            "token": env["DET_LOCAL_TOKEN"],
            "trial_id": int(env["DET_TRIAL_ID"]),
            "run_id": int(env["DET_TRIAL_RUN_ID"]),
        }
        rpc.send(sock, hello)
        rpc.recv(sock)
        t0 = time.monotonic()
        try:
            sock.sendall(struct.pack(">I", len(FRAME_BOMB)) + FRAME_BOMB)
        except OSError:
            pass
        answers = []
        try:
            while (msg := rpc.recv(sock)) is not None:
                answers.append(msg)
        except OSError:
            pass
        out.append([time.monotonic() - t0, answers])
        sock.close()
    return out


def _start_trial(home: str, cwd: str, user: str = MALLORY) -> dict[str, str]:
    """`user`'s experiment running `sleep 600`; its trial's environment."""
    import psutil

    from det_local import api
    from det_local.sched.intake import spool

    ctx = Path(cwd) / f"ctx-{user}"
    ctx.mkdir()
    os.chmod(ctx, 0o755)
    config = {
        "name": user,
        "entrypoint": "sleep 600",
        "max_restarts": 0,
        "searcher": {"name": "single", "metric": "loss", "max_length": 1},
    }

    def submit() -> Any:
        payload = {"config": config, "context": str(ctx), "source": "raw"}
        return spool.request(api.paths(), "submit", payload, timeout=60)

    _as_user(user, home, cwd, submit)
    uid = pwd.getpwnam(user).pw_uid
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for p in psutil.process_iter(["uids", "name"]):
            try:
                if p.info["uids"].real == uid and p.info["name"] == "sleep":
                    raw = Path(f"/proc/{p.pid}/environ").read_bytes().decode()
                    env = dict(kv.split("=", 1) for kv in raw.split("\0") if "=" in kv)
                    if "DET_LOCAL_TOKEN" in env:
                        return env
            except (psutil.Error, OSError):
                continue
        time.sleep(0.1)
    raise SystemExit(f"{user}'s trial did not start")


def _hostile_shapes() -> Any:
    """The within-budget shapes of tests/security/test_hostile_budgets.py (issue 34): its
    WORST frame (9,990 maps and 89,990 strings, the costliest within TRIAL_SESSION) and UNDER
    (80,000 strings, under the large-read size) in BODIES, the issue's
    bomb (1 MB of empty maps: within the old budget), and its spool requests (19,990 arrays and
    ~60,000 strings: within SPOOL_REQUEST, or over it only at their end)."""
    repo = Path(__file__).resolve().parent.parent
    sys.path.insert(0, str(repo))
    from tests.security import test_hostile_budgets as shapes

    return shapes


def _at_once(home: str, cwd: str, calls: list[tuple[str, Any, tuple[Any, ...]]]) -> list[Any]:
    """_as_user(user, ..., fn, *args) for each call, all at once (threads); values in order."""
    out: list[Any] = [None] * len(calls)

    def one(i: int) -> None:
        user, fn, args = calls[i]
        out[i] = _as_user(user, home, cwd, fn, *args)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def within_phases(
    pid: int, home: str, cwd: str, envs: dict[str, str], rounds: int, prober: Prober
) -> Any:
    """Three users at once (THREE; VICTOR's prober goes on meanwhile): (frames) each user's
    two sessions send the WORST frame `rounds` times, then the bomb; (spool) each user drops 20
    costly requests. Each phase: the daemon's RSS growth at its peak, its loop's worst second,
    what was answered, VICTOR's latencies."""
    shapes = _hostile_shapes()
    out: dict[str, Any] = {}
    w = Watch(pid, home)
    t0 = time.monotonic()
    seen = _at_once(home, cwd, [(u, shapes.flood_frames, (envs[u], rounds)) for u in THREE])
    took = time.monotonic() - t0
    f = w.done()
    f.update(prober.window(w.start, f.pop("end")))
    sessions = [s for user in seen for s in user]
    answered = sum(
        1 for s in sessions if isinstance(s, list) for a in s[0] if a.get("value", 1) is None
    )
    refused = [s[1] for s in sessions if isinstance(s, list)]
    out["frames"] = {
        **f,
        "worst_frames_answered": answered,
        "worst_frames_sent": len(sessions) * rounds * len(shapes.BODIES),
        "frame_bytes": [len(b) for b in shapes.BODIES],
        "bombs_refused": sum(1 for r in refused if r and r[0].get("t") == "refused"),
        "bomb_answer": refused[0][0] if refused and refused[0] else None,
        "took_s": round(took, 2),
    }
    w = Watch(pid, home)
    t0 = time.monotonic()
    said = _at_once(home, cwd, [(u, shapes.drop_hostile_requests, (u, 20)) for u in THREE])
    took = time.monotonic() - t0
    f = w.done()
    f.update(prober.window(w.start, f.pop("end")))
    answers = [a for user in said for a in user]
    out["spool"] = {
        **f,
        "requests": len(answers),
        "refused_over_budget": sum(1 for a in answers if "more than 100,000 values" in a),
        "answered_within_budget": sum(1 for a in answers if "unknown request" in a),
        "request_bytes": len(shapes._hostile_request(MALLORY, 29_950)),
        "all_answered_s": round(took, 2),
    }
    return out


def federation_phase(n: int) -> dict[str, Any]:
    """Two federated daemons in network namespaces (tests/support/fednet.py, as
    bench/federation.py); node 1's spool gets N bombs while the gap since each node last heard
    the other (their `peers` rows' last_seen_s) and their states are polled every 50 ms."""
    repo = Path(__file__).resolve().parent.parent
    sys.path.insert(0, str(repo))
    from det_local.federate import keys
    from det_local.federate.client import request
    from det_local.store.paths import Paths
    from tests.support.fednet import Net, sweep

    def rows(home: Path) -> dict[str, dict[str, Any]]:
        try:
            view = request(Paths(home), {"t": "peers"}, timeout=5)
        except Exception:  # noqa: BLE001 - an unanswered poll is a sample too
            return {}
        return {r["id"]: r for r in view.get("peers", [])}

    sweep()
    key = keys.new_key()
    with tempfile.TemporaryDirectory() as tmp, Net(Path(tmp)) as net:
        n1, n2 = net.node(1, key), net.node(2, key)
        for node in (n1, n2):
            node.start(DET_LOCAL_FED_INTERFACES="eth0")
        deadline = time.monotonic() + 60
        while not (
            rows(n1.home).get("n2", {}).get("state") == "alive"
            and rows(n2.home).get("n1", {}).get("state") == "alive"
        ):
            if time.monotonic() > deadline:
                raise SystemExit("the two nodes did not see each other alive within 60 s")
            time.sleep(0.1)
        samples: list[tuple[float, str, float, str]] = []
        stop = threading.Event()

        def poll() -> None:
            while not stop.is_set():
                for me, other, home in (("n1", "n2", n1.home), ("n2", "n1", n2.home)):
                    row = rows(home).get(other)
                    if row is not None:
                        samples.append((time.time(), me, float(row["last_seen_s"]), row["state"]))
                time.sleep(0.05)

        poller = threading.Thread(target=poll, daemon=True)
        poller.start()
        time.sleep(3.0)
        quiet_end = time.time()
        queue = Paths(n1.home).queue
        answers = queue / "responses"
        names = []
        for i in range(n):
            req_id = f"{time.time_ns():020d}-{os.getpid()}-bomb{i}"
            tmp_req = queue / f".{req_id}.tmp"
            tmp_req.write_bytes(SPOOL_BOMB)
            os.rename(tmp_req, queue / f"{req_id}.req")
            names.append(f"{req_id}.resp")
        deadline = time.monotonic() + 120
        while not all((answers / name).exists() for name in names):
            if time.monotonic() > deadline:
                raise SystemExit("node 1 did not answer the flood within 120 s")
            time.sleep(0.02)
        time.sleep(2.0)  # what the flood left behind
        stop.set()
        poller.join()
    quiet = [x for x in samples if x[0] <= quiet_end]
    flood = [x for x in samples if x[0] > quiet_end]

    def figures(xs: list[tuple[float, str, float, str]]) -> dict[str, Any]:
        return {
            "max_gap_s": round(max((x[2] for x in xs), default=0.0), 2),
            "not_alive": sum(1 for x in xs if x[3] != "alive"),
            "samples": len(xs),
        }

    return {"quiet": figures(quiet), "flood": figures(flood)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--frames", type=int, default=3)
    ap.add_argument("--quiet-s", type=float, default=5.0)
    ap.add_argument(
        "--rounds", type=int, default=3, help="WORST frames per session in the within phase."
    )
    ap.add_argument("--keep", action="store_true", help="Keep the home (its daemon.log).")
    ap.add_argument(
        "--no-federation", action="store_true", help="Skip the two-node heartbeat phase."
    )
    args = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("run as root: the bench makes two users and a root daemon")
    # what the children use, imported before they drop root
    import psutil  # noqa: F401

    import det_local.client.control  # noqa: F401
    import det_local.sched.intake.inotify  # noqa: F401
    import det_local.store.db  # noqa: F401  (api opens it lazily: sqlite3 under root's 0700 home)
    import det_local.views.experiments  # noqa: F401  (the prober reads as VICTOR)
    from det_local import api  # noqa: F401
    from det_local.sched.intake import spool  # noqa: F401

    base = tempfile.mkdtemp(prefix="det-local-hostile-", dir="/tmp")
    os.chmod(base, 0o755)
    home, cwd = f"{base}/home", f"{base}/out"
    os.mkdir(cwd)
    os.chmod(cwd, 0o1777)
    _users()
    result: dict[str, Any] = {"requests": args.requests, "frames": args.frames}
    try:
        with Daemon(home, DET_LOCAL_CPU_SLOTS="3", DET_LOCAL_FAKE_GPUS="0") as daemon:
            assert daemon.pid is not None
            env = _start_trial(home, cwd)
            prober = Prober(home, cwd)
            try:
                time.sleep(1.0)  # the prober's first samples
                w = Watch(daemon.pid, home)
                time.sleep(args.quiet_s)
                quiet = w.done()
                result["quiet"] = {**quiet, **prober.window(w.start, quiet.pop("end"))}

                w = Watch(daemon.pid, home)
                rtts = _as_user(MALLORY, home, cwd, drop_bombs, args.requests)
                spool_f = w.done()
                result["spool"] = {
                    **spool_f,
                    **prober.window(w.start, spool_f.pop("end")),
                    "daemon_cpu_ms_per_request": round(
                        spool_f["daemon_cpu_s"] * 1000 / args.requests, 1
                    ),
                    "all_answered_s": round(max(rtts), 2),
                }

                w = Watch(daemon.pid, home)
                answers = _as_user(MALLORY, home, cwd, send_frames, env, args.frames)
                frame_f = w.done()
                result["frame"] = {
                    **frame_f,
                    **prober.window(w.start, frame_f.pop("end")),
                    "refused_in_s": [round(a[0], 3) for a in answers],
                    "answer": answers[0][1][0] if answers and answers[0][1] else None,
                }

                envs = {MALLORY: env}
                for user in (TRENT, URSULA):
                    envs[user] = _start_trial(home, cwd, user)
                result["within"] = within_phases(daemon.pid, home, cwd, envs, args.rounds, prober)
            finally:
                prober.stop()
    finally:
        _remove_users()
        if args.keep:
            result["kept"] = base
        else:
            shutil.rmtree(base, ignore_errors=True)
    if not args.no_federation:
        result["federation"] = federation_phase(args.requests)
    s, f = result["spool"], result["frame"]
    worst = lambda d: max(x for x in (d["list_max_ms"], d["submit_max_ms"]) if x is not None)  # noqa: E731
    result["targets"] = {
        "spool_cpu_per_request_ms<=50": s["daemon_cpu_ms_per_request"] <= 50,
        "spool_rss_growth_mb<=50": s["rss_growth_peak_mb"] <= 50,
        "spool_others_answered_ms<=1000": worst(s) <= 1000 and s["failed"] == 0,
        "spool_loop_stall_ms<=100": s["loop_stall_max_ms"] <= 100,
        "frame_rss_growth_mb<=100": f["rss_growth_peak_mb"] <= 100,
        "frame_others_answered_ms<=1000": worst(f) <= 1000 and f["failed"] == 0,
    }
    wf, ws = result["within"]["frames"], result["within"]["spool"]
    result["targets"].update(
        {
            "within_frames_rss_growth_mb<=50": wf["rss_growth_peak_mb"] <= 50,
            "within_frames_loop_stall_ms<=100": wf["loop_stall_max_ms"] <= 100,
            "within_frames_all_answered": wf["worst_frames_answered"] == wf["worst_frames_sent"],
            "within_spool_rss_growth_mb<=50": ws["rss_growth_peak_mb"] <= 50,
            "within_spool_loop_stall_ms<=100": ws["loop_stall_max_ms"] <= 100,
        }
    )
    if "federation" in result:
        fed = result["federation"]["flood"]
        result["targets"]["federation_gap_s<=1.5"] = fed["max_gap_s"] <= 1.5
        result["targets"]["federation_never_suspect"] = fed["not_alive"] == 0
    print(json.dumps(result))


if __name__ == "__main__":
    main()

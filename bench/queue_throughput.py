"""Queue throughput and start latency of the det-local daemon, next to task-spooler in the same run.

    python3 bench/queue_throughput.py [--jobs 1000] [--cli-jobs 200] [--slots 2] [--samples 200]

Throughput: N `true` jobs on a daemon with DET_LOCAL_CPU_SLOTS=2 on a temporary home, from the
first submission until the last job finished (the latest `ended_at` the daemon recorded), for
  - the Python API: `det_local.api.control_job("cmd_run", ...)` called N times in a row, each
    call returning the job id (the submitter waits for the daemon's answer, as `cmd run` does);
  - the same requests pipelined: all N spool files written first (`sched.intake.spool.submit`), then
    every answer collected (reported as det_local_api_pipelined_jobs_s, for the diagnosis);
  - the CLI: `det-local cmd run -- true`, one process per job (--cli-jobs of them);
  - task-spooler: a private server (`tsp -S 2`), `tsp true` N times, then polling `tsp -l` until
    nothing is queued or running (its figure includes its CLI, a C program).
Start latency on an idle daemon (API): each job is `bash -c 'echo $EPOCHREALTIME > FILE'`, so
the time is taken by the job's own process once it runs (the same clock as the submitter's
time.time()); the submitter then waits until the job is DONE before the next one. The same is
measured for a plain fork/exec of that command (direct_start_*: the floor, bash's start-up
included) and for task-spooler (tsp_latency_*, its client start-up included). The daemon's own
record of the start (jobs.started_at, when the allocation is committed, before the fork) is
reported as alloc_p50_ms.

The det-local phases share one daemon and home, in this order: latency, API, pipelined, CLI; so
the store already holds the earlier phases' jobs (200, 1,200, 2,200 by default), as a real
queue's history would. api_call_ms_first100/last100 (median time of one control_job call) show
whether the cost of a submission stays flat as the store fills.

Targets: det_local_api_jobs_s >= 0.5 x tsp_jobs_s; latency_p50_ms <= 20; latency_p99_ms <= 100.
The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import Daemon, Tsp, det_local_cmd, find_tsp  # noqa: E402

STAMP = "echo $EPOCHREALTIME > {}"  # bash's builtin clock: no extra fork for `date`


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    s = sorted(values)
    k = (len(s) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return round(s[lo] + (s[hi] - s[lo]) * (k - lo), 2)


def payload(argv: list[str], cwd: str) -> dict[str, object]:
    # what `det-local cmd run` sends
    return {
        "argv": argv,
        "cwd": cwd,
        "env": dict(os.environ),
        "slots": 1,
        "priority": 42,
        "name": None,
    }


class StoreView:
    """Read-only queries on the daemon's database."""

    def __init__(self, home: str) -> None:
        self.conn = sqlite3.connect(f"file:{home}/det-local.db?mode=ro", uri=True, timeout=10)

    def wait_done(self, ids: list[int], timeout: float = 600.0) -> tuple[float, int]:
        """Wait until every job in ids is DONE; (latest ended_at, how many exited 0)."""
        lo, hi = min(ids), max(ids)
        deadline = time.monotonic() + timeout
        while True:
            (left,) = self.conn.execute(
                "SELECT COUNT(*) FROM jobs WHERE id BETWEEN ? AND ? AND state != 'DONE'", (lo, hi)
            ).fetchone()
            if left == 0:
                break
            if time.monotonic() > deadline:
                raise SystemExit(f"{left} job(s) still not done after {timeout:.0f}s")
            time.sleep(0.005)
        end, ok = self.conn.execute(
            "SELECT MAX(ended_at), SUM(exit_code = 0) FROM jobs WHERE id BETWEEN ? AND ?",
            (lo, hi),
        ).fetchone()
        return float(end), int(ok or 0)

    def started_at(self, job_id: int) -> float:
        (t,) = self.conn.execute("SELECT started_at FROM jobs WHERE id=?", (job_id,)).fetchone()
        return float(t)


def read_stamp(path: Path, timeout: float = 30.0) -> float:
    deadline = time.monotonic() + timeout
    while True:
        try:
            text = path.read_text().strip()
            if text:
                return float(text.replace(",", "."))
        except FileNotFoundError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"{path} was never written: the job did not run")
        time.sleep(0.001)


# ---------------------------------------------------------------------- det-local
def api_sync(n: int, cwd: str, view: StoreView) -> dict[str, float]:
    from det_local import api

    ids, calls = [], []
    t0 = time.time()
    for _ in range(n):
        t = time.perf_counter()
        ids.append(int(api.control_job("cmd_run", payload(["true"], cwd))))
        calls.append((time.perf_counter() - t) * 1000)
    end, ok = view.wait_done(ids)
    k = min(100, n)
    return {
        "jobs_s": n / (end - t0),
        "ok": ok,
        # does submission cost stay flat as the store fills? (Pueue #573)
        "call_ms_first": percentile(calls[:k], 50),
        "call_ms_last": percentile(calls[-k:], 50),
    }


def api_pipelined(n: int, cwd: str, view: StoreView) -> dict[str, float]:
    from det_local import api
    from det_local.sched.intake import spool

    p = api.paths()
    t0 = time.time()
    reqs = [spool.submit(p, "cmd_run", payload(["true"], cwd)) for _ in range(n)]
    ids = [int(spool.wait_response(p, r, timeout=600)) for r in reqs]
    end, ok = view.wait_done(ids)
    return {"jobs_s": n / (end - t0), "ok": ok}


def cli(n: int, cwd: str, env: dict[str, str], view: StoreView) -> dict[str, float]:
    argv = [*det_local_cmd(), "cmd", "run", "--", "true"]
    ids = []
    t0 = time.time()
    for _ in range(n):
        out = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, check=True)
        ids.append(int(out.stdout.split()[-1]))  # "Queued command ID"
    end, ok = view.wait_done(ids)
    return {"jobs_s": n / (end - t0), "ok": ok}


def latency(samples: int, tmp: Path, view: StoreView) -> dict[str, float]:
    from det_local import api

    out = tmp / "latency"
    out.mkdir()
    lat, alloc, answer = [], [], []
    for i in range(samples):
        f = out / f"det-{i}"
        argv = ["bash", "-c", STAMP.format(shlex.quote(str(f)))]
        t_sub = time.time()
        job_id = int(api.control_job("cmd_run", payload(argv, str(tmp))))
        answer.append((time.time() - t_sub) * 1000)
        started = read_stamp(f)
        view.wait_done([job_id])
        lat.append((started - t_sub) * 1000)
        alloc.append((view.started_at(job_id) - t_sub) * 1000)
        time.sleep(0.01)  # idle again
    return {
        "p50": percentile(lat, 50),
        "p99": percentile(lat, 99),
        "max": round(max(lat), 2),
        "alloc_p50": percentile(alloc, 50),
        "answer_p50": percentile(answer, 50),
    }


# ---------------------------------------------------------------------- anchors
def direct_latency(samples: int, tmp: Path) -> dict[str, float]:
    lat = []
    for i in range(samples):
        f = tmp / "latency" / f"direct-{i}"
        t_sub = time.time()
        proc = subprocess.Popen(["bash", "-c", STAMP.format(shlex.quote(str(f)))])
        proc.wait()
        lat.append((read_stamp(f) - t_sub) * 1000)
    return {"p50": percentile(lat, 50), "p99": percentile(lat, 99)}


def tsp_wait_all(tsp: Tsp, timeout: float = 600.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        lines = tsp("-l").splitlines()[1:]
        if not any(line.split()[1] in ("running", "queued") for line in lines if line.split()):
            return
        if time.monotonic() > deadline:
            raise SystemExit("task-spooler jobs still running after {timeout:.0f}s")
        time.sleep(0.005)


def tsp_throughput(exe: str, n: int, slots: int, tmp: Path) -> dict[str, float]:
    with Tsp(exe, str(tmp / "tsp-throughput"), slots) as tsp:
        t0 = time.time()
        for _ in range(n):
            tsp("true")
        tsp_wait_all(tsp)
        elapsed = time.time() - t0
        lines = tsp("-l").splitlines()[1:]
        ok = sum(
            1 for line in lines if line.split()[1:2] == ["finished"] and line.split()[3] == "0"
        )
    return {"jobs_s": n / elapsed, "ok": ok}


def tsp_latency(exe: str, samples: int, slots: int, tmp: Path) -> dict[str, float]:
    lat = []
    with Tsp(exe, str(tmp / "tsp-latency"), slots) as tsp:
        for i in range(samples):
            f = tmp / "latency" / f"tsp-{i}"
            t_sub = time.time()
            job = tsp("bash", "-c", STAMP.format(shlex.quote(str(f)))).strip()
            started = read_stamp(f)
            tsp("-w", job, check=False)
            lat.append((started - t_sub) * 1000)
            time.sleep(0.01)
    return {"p50": percentile(lat, 50), "p99": percentile(lat, 99)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--jobs", type=int, default=1000, help="jobs for API and tsp throughput")
    parser.add_argument("--cli-jobs", type=int, default=200, help="jobs for CLI throughput")
    parser.add_argument("--slots", type=int, default=2)
    parser.add_argument("--samples", type=int, default=200, help="latency samples")
    parser.add_argument("--no-tsp", action="store_true", help="skip the task-spooler anchor")
    args = parser.parse_args()

    exe = None if args.no_tsp else find_tsp()
    result: dict[str, object] = {}
    with tempfile.TemporaryDirectory(prefix="det-local-bench-") as tmp_name:
        tmp = Path(tmp_name)
        home = str(tmp / "home")
        os.environ["DET_LOCAL_HOME"] = home  # for det_local.api in this process
        with Daemon(home, DET_LOCAL_CPU_SLOTS=str(args.slots)) as daemon:
            view = StoreView(home)
            lat = latency(args.samples, tmp, view)
            sync = api_sync(args.jobs, str(tmp), view)
            piped = api_pipelined(args.jobs, str(tmp), view)
            by_cli = cli(args.cli_jobs, str(tmp), daemon.env, view)
            view.conn.close()
        direct = direct_latency(args.samples, tmp)
        tsp_thr = tsp_lat = None
        if exe is not None:
            tsp_thr = tsp_throughput(exe, args.jobs, args.slots, tmp)
            tsp_lat = tsp_latency(exe, args.samples, args.slots, tmp)

    tsp_jobs_s = round(tsp_thr["jobs_s"], 1) if tsp_thr else None
    result = {
        "det_local_api_jobs_s": round(sync["jobs_s"], 1),
        "det_local_api_pipelined_jobs_s": round(piped["jobs_s"], 1),
        "det_local_cli_jobs_s": round(by_cli["jobs_s"], 1),
        "tsp_jobs_s": tsp_jobs_s,
        "api_vs_tsp": round(sync["jobs_s"] / tsp_thr["jobs_s"], 3) if tsp_thr else None,
        "latency_p50_ms": lat["p50"],
        "latency_p99_ms": lat["p99"],
        "latency_max_ms": lat["max"],
        "alloc_p50_ms": lat["alloc_p50"],
        "api_answer_p50_ms": lat["answer_p50"],
        "api_call_ms_first100": sync["call_ms_first"],
        "api_call_ms_last100": sync["call_ms_last"],
        "direct_start_p50_ms": direct["p50"],
        "direct_start_p99_ms": direct["p99"],
        "tsp_latency_p50_ms": tsp_lat["p50"] if tsp_lat else None,
        "tsp_latency_p99_ms": tsp_lat["p99"] if tsp_lat else None,
        "jobs": args.jobs,
        "cli_jobs": args.cli_jobs,
        "slots": args.slots,
        "latency_samples": args.samples,
        "api_ok": sync["ok"],
        "api_pipelined_ok": piped["ok"],
        "cli_ok": by_cli["ok"],
        "tsp_ok": tsp_thr["ok"] if tsp_thr else None,
        "tsp": exe
        or (
            "skipped (--no-tsp)" if args.no_tsp else "not available (apt-get install task-spooler)"
        ),
        "cpus": os.cpu_count(),
        "targets": {"api_vs_tsp": ">= 0.5", "latency_p50_ms": "<= 20", "latency_p99_ms": "<= 100"},
    }
    print(
        f"{args.jobs} `true` jobs on {args.slots} slots: det-local API "
        f"{result['det_local_api_jobs_s']} jobs/s (pipelined "
        f"{result['det_local_api_pipelined_jobs_s']}), CLI "
        f"{result['det_local_cli_jobs_s']} jobs/s ({args.cli_jobs} jobs), tsp {tsp_jobs_s} jobs/s"
    )
    print(
        f"start latency (idle, API): p50 {lat['p50']} ms, p99 {lat['p99']} ms; direct fork/exec "
        f"p50 {direct['p50']} ms; tsp p50 {result['tsp_latency_p50_ms']} ms"
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()

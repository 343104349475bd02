"""The dashboard under a flood of live streams: a real `det-local dashboard` process on a store
of 100 experiments (one trial each, ACTIVE, so a trial's stream never ends by itself), then
`--connections` (default 1,500) stream requests opened at once from 200 loopback addresses and
kept open. Measured, next to the quiet anchor in the same run: the experiments page's latency
(median of 9 GETs before; during the flood, GETs one after another until every stream request
was answered: their median and worst); how the streams were answered (200 kept open,
503 refused with one line, connection errors); the dashboard's open descriptors and SQLite
handles (database and WAL) before, during and after, and after 1,000 ordinary requests.

    python3 bench/dashboard_flood.py [--connections N]

Bounds it checks (issue 24): at most live.TOTAL streams served, the rest 503; no connection
error; the median page latency during the flood <= 1 s (the worst is reported: the one event
loop works through the burst's requests, ~1 ms each); SQLite handles <= pool.THREADS each.
The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from pathlib import Path

from _common import det_local_cmd  # bench/ is on sys.path when run as a script


def populate(home: Path, n: int) -> list[int]:
    from det_local.store.db import Store
    from det_local.store.paths import Paths

    store = Store(Paths(home).ensure().db)
    trials = []
    for i in range(n):
        exp = store.create_experiment(name=f"flood {i}", config={"searcher": {"name": "single"}})
        trials.append(int(store.create_trial(exp, hparams={"lr": 0.1}, seed=i)))
    store.close()
    return trials


def handles(pid: int, db: Path) -> dict[str, int]:
    out = {"fds": 0, "db": 0, "wal": 0}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        out["fds"] += 1
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        out["db"] += target == str(db)
        out["wal"] += target == f"{db}-wal"
    return out


def get_ms(base: str, token: str, path: str) -> float:
    req = urllib.request.Request(base + path, headers={"Authorization": f"Bearer {token}"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=120) as r:
        r.read()
    return (time.perf_counter() - t0) * 1000


async def open_stream(
    port: int, token: str, path: str, source: str, kept: list[asyncio.StreamWriter]
) -> str:
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))
        writer.write(
            f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
            f"Authorization: Bearer {token}\r\n\r\n".encode()
        )
        line = await asyncio.wait_for(reader.readline(), 120)
    except (OSError, asyncio.TimeoutError) as err:
        return f"error {type(err).__name__}"
    status = line.split(b" ")[1].decode() if line.count(b" ") >= 2 else "none"
    if status == "200":
        kept.append(writer)
    else:
        writer.close()
    return status


PROBE = """
import json, os, sys, time, urllib.request
base, token, stop = sys.argv[1:]
req = urllib.request.Request(base + "/", headers={"Authorization": "Bearer " + token})
seen = []
while not os.path.exists(stop) or len(seen) < 9:
    t0 = time.perf_counter()
    urllib.request.urlopen(req, timeout=120).read()
    seen.append((time.perf_counter() - t0) * 1000)
print(json.dumps(seen))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--connections", type=int, default=1500)
    args = ap.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 65536), hard))
    from det_local.web import live, pool

    with tempfile.TemporaryDirectory(prefix="det-local-flood-") as tmp:
        home = Path(tmp) / "home"
        trials = populate(home, 100)
        env = {**os.environ, "DET_LOCAL_HOME": str(home)}
        out = Path(tmp) / "dashboard.out"
        with open(out, "wb") as f:
            proc = subprocess.Popen(
                [*det_local_cmd(), "dashboard", "--port", "0"], env=env, stdout=f, stderr=f
            )
        try:
            deadline = time.monotonic() + 60
            while not (m := re.search(r"127\.0\.0\.1:(\d+)/\?token=(\S+)", out.read_text())):
                if proc.poll() is not None or time.monotonic() > deadline:
                    sys.exit(f"the dashboard did not start: {out.read_text()}")
                time.sleep(0.05)
            port, token = int(m.group(1)), m.group(2)
            base = f"http://127.0.0.1:{port}"
            db = (home / "det-local.db").resolve()
            quiet = statistics.median(get_ms(base, token, "/") for _ in range(9))
            before = handles(proc.pid, db)

            worst: list[float] = []

            async def flood() -> tuple[Counter[str], float, dict[str, int]]:
                kept: list[asyncio.StreamWriter] = []
                tasks = [
                    open_stream(
                        port,
                        token,
                        f"/api/trials/{trials[i % len(trials)]}/stream",
                        f"127.0.{i % 200 // 250 + 2}.{i % 200 + 1}",
                        kept,
                    )
                    for i in range(args.connections)
                ]
                # the page, again and again while the flood comes, from a process of its own
                stop = Path(tmp) / "stop"
                probing = subprocess.Popen(
                    [sys.executable, "-c", PROBE, base, token, str(stop)],
                    stdout=subprocess.PIPE,
                )
                answers = Counter(await asyncio.gather(*tasks))
                stop.touch()
                samples = json.loads(probing.communicate(timeout=300)[0])
                busy = statistics.median(samples)
                worst.append(max(samples))
                during = handles(proc.pid, db)
                for w in kept:
                    w.close()
                return answers, busy, during

            answers, busy, during = asyncio.run(flood())
            time.sleep(2)  # the closed streams notice (their next poll) and give their places back
            after = handles(proc.pid, db)
            for i in range(1000):
                get_ms(
                    base, token, ("/", "/api/experiments", f"/api/trials/{trials[i % 100]}")[i % 3]
                )
            after_requests = handles(proc.pid, db)
        finally:
            proc.terminate()
            proc.wait(10)

    checks = {
        "streams_served_le_total": answers.get("200", 0) <= live.TOTAL,
        "rest_refused_503": answers.get("200", 0) + answers.get("503", 0) == args.connections,
        "page_median_during_flood_le_1s": busy <= 1000,
        "sqlite_handles_le_pool": max(d["db"] for d in (during, after_requests)) <= pool.THREADS,
    }
    print(f"{os.cpu_count()} cpus; {args.connections} stream requests at once")
    print(f"answers: {dict(answers)} (at most {live.TOTAL} streams, {live.PER_CLIENT} a client)")
    print(
        f"experiments page: quiet {quiet:.1f} ms, during the flood {busy:.1f} ms "
        f"(median; worst {worst[0]:.1f} ms)"
    )
    print(f"descriptors before {before}, during {during}, after {after}")
    print(f"after 1,000 more requests {after_requests}")
    print(
        json.dumps(
            {
                "bench": "dashboard_flood",
                "connections": args.connections,
                "answers": dict(answers),
                "page_ms_quiet": round(quiet, 1),
                "page_ms_flood": round(busy, 1),
                "page_ms_flood_worst": round(worst[0], 1),
                "handles_before": before,
                "handles_during": during,
                "handles_after": after,
                "handles_after_1000_requests": after_requests,
                "checks": checks,
            }
        )
    )
    if not all(checks.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()

"""System metrics per run, idle reservations, `slots` (issue 30) against a real daemon with
fake GPUs whose utilisation and memory the test scripts (DET_LOCAL_FAKE_GPU_USAGE), and real
processes for CPU and memory."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest

from det_local.store.db import Store
from tests.support.world import Env, wait_for

FAST = {"system_metrics": {"interval": 0.25}}


def _gpus(dl: Env, devices: dict[int, dict[str, float]], procs: list[dict[str, Any]] = ()) -> None:
    """Script the fake NVML: rewritten atomically, as NVML would change its answers."""
    path = dl.tmp / "gpu-usage.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(
        json.dumps({"devices": {str(k): v for k, v in devices.items()}, "processes": list(procs)})
    )
    os.replace(tmp, path)
    dl.env["DET_LOCAL_FAKE_GPU_USAGE"] = str(path)


def _samples(dl: Env, job_id: int) -> list[tuple[int, float, float, dict[str, Any]]]:
    store = dl.store()
    try:
        return store.usage.samples(job_id=job_id)
    finally:
        store.close()


def _idle(dl: Env, job_id: int) -> Any:
    store = dl.store()
    try:
        return store.usage.idle_states([job_id]).get(job_id)
    finally:
        store.close()


def _proc_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_samples_at_the_rate_per_slot_and_per_process_and_bounded(dl: Env) -> None:
    _gpus(dl, {0: {"util": 80, "mem_mb": 4000}, 1: {"util": 10, "mem_mb": 999}})
    settings = {"system_metrics": {"interval": 0.25, "keep_full": 2, "max_rows_per_run": 100}}
    dl.daemon_start(settings, DET_LOCAL_FAKE_GPUS="2")
    job = dl.cmd("sleep", "300", slots=2)
    pid = dl.job_pid(job)
    wait_for(lambda: len(_samples(dl, job)) >= 4, timeout=60, what="4 samples")
    first = _samples(dl, job)
    m = first[-1][3]
    assert m["slot0_gpu_util_pct"] == 80 and m["slot1_gpu_util_pct"] == 10
    assert m["slot0_gpu_mem_used_mb"] == 4000 and m["gpu_mem_used_mb"] == 4999
    assert m["gpu_util_pct"] == 45
    assert {"cpu_util_pct", "rss_mb", "read_mb_s", "write_mb_s"} <= set(m)
    # per process where the driver says: the job's own process on slot 1 (its `sh` wrapper
    # or sleep: any pid of its tree counts)
    tree = [pid, *(int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split())]
    _gpus(
        dl,
        {0: {"util": 80, "mem_mb": 4000}, 1: {"util": 10, "mem_mb": 999}},
        [{"pid": tree[-1], "slot": 1, "mem_mb": 321, "util": 7}],
    )
    wait_for(
        lambda: _samples(dl, job)[-1][3].get("slot1_gpu_mem_used_mb") == 321,
        timeout=30,
        what="the per-process reading",
    )
    assert _samples(dl, job)[-1][3]["slot1_gpu_util_pct"] == 7
    # at the rate: 0.25 s apart (a loaded machine may be late, never early)
    times = [t for _, t, span, _ in _samples(dl, job) if span == 0]
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    assert gaps and min(gaps) >= 0.2, gaps
    # bounded: samples older than keep_full (2 s) are merged into 1-minute means
    wait_for(
        lambda: any(span == 60 for _, _, span, _ in _samples(dl, job)),
        timeout=60,
        what="old samples merged into a 1-minute mean",
    )
    merged_at = time.time()  # a few more seconds of sampling: the count stays bounded
    wait_for(lambda: _samples(dl, job)[-1][1] >= merged_at + 3, timeout=60, what="3 s more")
    rows = _samples(dl, job)
    raw = [r for r in rows if r[2] == 0]
    assert len(raw) <= 2.0 / 0.25 + 8, len(raw)  # the last keep_full seconds at full rate
    assert len(rows) <= len(raw) + 3, rows
    r = dl.det("cmd", "metrics", job, "--json")
    assert r.rc == 0, r
    assert json.loads(r.out)[-1]["group"] == "system"


def test_a_cpu_burning_command_shows_its_cpu_use(dl: Env) -> None:
    dl.daemon_start(FAST, DET_LOCAL_FAKE_GPUS="1")
    job = dl.cmd("python3", "-c", "while True: pass", slots=1)
    wrapper = dl.job_pid(job)
    burner = int(
        wait_for(
            lambda: Path(f"/proc/{wrapper}/task/{wrapper}/children").read_text().split(),
            what="the burner",
        )[0]
    )
    wait_for(lambda: len(_samples(dl, job)) >= 2, timeout=60, what="samples")
    t0, c0 = time.time(), _proc_cpu_s(burner)
    wait_for(lambda: time.time() - t0 >= 3, what="3 s of burning")
    t1, c1 = time.time(), _proc_cpu_s(burner)
    truth = (c1 - c0) / (t1 - t0) * 100  # the share of a core it got (a loaded CI box: < 100)
    got = [
        m["cpu_util_pct"]
        for _, t, _, m in _samples(dl, job)
        if t0 + 0.3 <= t <= t1 and "cpu_util_pct" in m
    ]
    assert got, "no samples while it burned"
    mean = sum(got) / len(got)
    assert abs(mean - truth) <= 20, (mean, truth, got)
    assert mean >= 15 and max(got) <= 110, got
    dl.det("cmd", "kill", job)


@pytest.mark.parametrize("policy", ["stop", "notify"])
def test_a_gpu_held_idle_is_flagged_then_stopped_or_left(dl: Env, policy: str) -> None:
    _gpus(dl, {0: {"util": 0, "mem_mb": 500}})
    settings = {"system_metrics": {"interval": 0.25}, "idle_policy": {"command": policy}}
    dl.daemon_start(settings, DET_LOCAL_FAKE_GPUS="1")
    r = dl.det("cmd", "run", "--config", "idle_timeout=2s", "--", "sleep", "600")
    assert r.rc == 0, r
    job = int(r.out.split()[2])
    wait_for(lambda: (st := _idle(dl, job)) is not None and st.flagged_at, timeout=60, what="flag")
    st = _idle(dl, job)
    assert st.flagged_at - st.idle_since >= 2.0
    if policy == "stop":
        done = dl.wait_job(job, "DONE", timeout=60)
        assert done.message.startswith(f"command {job} stopped: its slots [0] were idle for "), done
        assert "(idle_timeout 2s; idle_policy stop)" in done.message
        assert st.action == "stopped"
        listing = dl.det("cmd", "list")
        assert f"job {job}: slots idle since " in listing.out
        assert "flagged; stopped (idle_policy stop)" in listing.out
        return
    assert st.action == "notified"
    assert dl.job(job).state == "SCHEDULED"
    listing = dl.det("cmd", "list")
    assert "flagged; still holding its slots (idle_policy notify)" in listing.out, listing
    slots = dl.json("slots")
    assert slots[0]["job_id"] == job and slots[0]["idle_flagged"] is True
    assert slots[0]["idle_for_s"] >= 2 and slots[0]["held_for_s"] >= slots[0]["idle_for_s"]
    assert slots[0]["utilization_pct"] == 0 and slots[0]["memory_used_mb"] == 500
    table = dl.det("slots").out
    assert "IDLE " in table, table
    # the dashboard tells the owner too: the commands page and the command's page
    pytest.importorskip("starlette", reason="the dashboard needs the web extra")
    from tests.support.dashboard import asgi_get, token_app

    app = token_app()
    for path in ("/commands", f"/commands/{job}"):
        status, _, body = asgi_get(app, path, {"host": "127.0.0.1:8080"})
        assert status == 200 and b"flagged; still holding its slots" in body, (path, body)
    # busy again: the flag goes
    _gpus(dl, {0: {"util": 90, "mem_mb": 500}})
    wait_for(lambda: _idle(dl, job).flagged_at is None, timeout=60, what="the flag to clear")
    assert dl.job(job).state == "SCHEDULED"
    dl.det("cmd", "kill", job)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (
            "0",
            "error: --config idle_timeout: '0' is zero, which would end the job at once; give a "
            "time, e.g. 30m (leave it out to never time out)",
        ),
        (
            "-1m",
            "error: --config idle_timeout: '-1m' is negative; give a time after which to act, "
            "e.g. 30m",
        ),
        (
            "forever",
            "error: --config idle_timeout: 'forever' is not a duration; write a number with a "
            "unit, e.g. 30m, 2h, 90s (s, m, h, d; a bare number is seconds)",
        ),
    ],
)
def test_bad_idle_timeouts(dl: Env, value: str, message: str) -> None:
    r = dl.det("cmd", "run", "--config", f"idle_timeout={value}", "--", "true")
    assert r.rc != 0
    assert r.err.strip() == message


def test_a_sampling_rate_of_1ms_is_clamped_with_a_line(dl: Env) -> None:
    dl.daemon_start({"system_metrics": {"interval": "1ms"}}, DET_LOCAL_FAKE_GPUS="1")
    log = dl.paths.run_dir / "daemon.log"
    line = (
        f"det-local: system_metrics.interval in {dl.paths.settings} is '1ms': clamped to 0.1 s, "
        "the fastest det-local samples"
    )
    wait_for(lambda: line in log.read_text(), what="the clamp line")
    assert log.read_text().count("clamped") == 1


def test_system_metrics_off(dl: Env) -> None:
    dl.daemon_start({"system_metrics": {"enabled": False}}, DET_LOCAL_FAKE_GPUS="1")
    job = dl.cmd("sleep", "1")
    dl.wait_job(job)
    assert _samples(dl, job) == []
    r = dl.det("cmd", "metrics", job)
    assert r.rc == 1
    assert r.err.strip() == (
        f"error: job {job} (command) has no system metrics yet: the daemon samples running "
        "jobs every few seconds (daemon.yaml system_metrics)"
    )


def test_trial_metrics_group_system_at_the_profiling_rate(dl: Env) -> None:
    # every 5 s for other jobs; a trial whose config says profiling: {enabled: true} at 0.2 s
    settings = {"system_metrics": {"interval": 5, "profiling_interval": 0.2}}
    dl.daemon_start(settings, DET_LOCAL_FAKE_GPUS="1")
    cfg, ctx = dl.trainer({"batches": 400, "delay": 0.05}, {"profiling": {"enabled": True}})
    r = dl.det("run", "--detach", cfg, ctx)
    assert (r.rc, r.out.strip()) == (0, "Created experiment 1"), r
    exp = 1
    trial = wait_for(lambda: dl.trials(exp), what="the trial")[0].id
    store = dl.store()
    try:
        wait_for(
            lambda: len(store.usage.samples(trial_id=trial)) >= 6, timeout=25, what="6 samples"
        )
        times = [t for _, t, _, _ in store.usage.samples(trial_id=trial)]
    finally:
        store.close()
    assert max(b - a for a, b in zip(times, times[1:], strict=False)) < 2.5, times
    r = dl.det("trial", "metrics", trial, "--group", "system", "--csv")
    assert r.rc == 0, r
    head = r.out.splitlines()[0].split(",")
    assert head[:5] == ["trial_id", "run_id", "group", "steps_completed", "time"]
    assert "cpu_util_pct" in head and "slot0_gpu_util_pct" in head
    rows = dl.json("trial", "metrics", trial, "--group", "system")
    assert rows and all(x["group"] == "system" for x in rows)
    dl.det("experiment", "kill", exp)


def test_allocation_records_follow_a_real_command(dl: Env) -> None:
    dl.daemon_start(FAST, DET_LOCAL_FAKE_GPUS="2")
    job = dl.cmd("sleep", "1", slots=2)
    done = dl.wait_job(job)
    store = Store(dl.paths.db, readonly=True)
    try:
        (alloc,) = store.usage.list_allocations(job)
    finally:
        store.close()
    assert alloc.kind == "COMMAND" and alloc.slots == [0, 1] and alloc.ended == "ended"
    assert alloc.started_at == done.started_at
    assert abs(alloc.ended_at - done.ended_at) < 0.05
    rep = dl.json("usage", "--since", "1d")
    (row,) = rep["rows"]
    assert row["allocations"] == 1
    assert abs(row["slot_seconds"] - 2 * (alloc.ended_at - alloc.started_at)) < 0.01

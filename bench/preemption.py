"""Preemption: how long a priority-1 command waits while a priority-50 Core API trial holds the
machine's only slot.

    python3 bench/preemption.py [--runs 3] [--batch-s 0.2] [--checkpoint-s 0.5] [--ckpt-mb 8]

A daemon with DET_LOCAL_CPU_SLOTS=1 on a temporary home runs one experiment (priority 50): a
Core API trial whose batches each take batch_s (a sleep), that checks should_preempt() after
every batch and, when told to, writes a checkpoint of ckpt_mb MB (random bytes, fsync'd; padded
with a sleep to take checkpoint_s in all), reports it and exits. Once it has trained a few
batches, `cmd_run` of `sh -c 'date +%s.%N > FILE' ` at priority 1 is submitted through the Python
API; preempt_to_start_s is the time from just before that call to the timestamp the command's own
process writes. The command ends at once; the trial is requeued and resumes from its checkpoint,
and the next run starts once it trains again. The figures are medians over --runs preemptions.

The same run also times the anchor: a plain start of that command (fork/exec, no scheduler),
and splits the wait into: submission -> the trial sees should_preempt() True (signal_s), its
checkpoint (checkpoint_measured_s), and the trial's return -> the command starts (exit_to_start_s:
interpreter shutdown, the daemon reaping the trial, requeueing it and starting the command).

Target: preempt_to_start_s <= batch_s + checkpoint_s + 1. The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import Daemon, det_local_cmd  # noqa: E402

T = TypeVar("T")

TRIAL = '''\
"""A Core API trial for bench/preemption.py: timed batches, a checkpoint on preemption."""
import json
import os
import time

import determined as det
from determined import core

info = det.get_cluster_info()
hp = info.trial.hparams
out = hp["out"]


def note(kind, **fields):
    with open(os.path.join(out, "events.jsonl"), "a") as f:
        f.write(json.dumps({"t": time.time(), "kind": kind, **fields}) + "\\n")


with core.init() as ctx:
    batch = 0
    if info.latest_checkpoint is not None:
        with ctx.checkpoint.restore_path(info.latest_checkpoint) as path:
            batch = json.loads((path / "state.json").read_text())["batch"]
    note("start", batch=batch, resumed=info.latest_checkpoint is not None)
    for op in ctx.searcher.operations():
        while batch < op.length:
            time.sleep(hp["batch_s"])  # one batch of "training"
            batch += 1
            ctx.train.report_training_metrics(steps_completed=batch, metrics={"loss": 1 / batch})
            note("batch", batch=batch)
            if ctx.preempt.should_preempt():
                seen = time.time()
                with ctx.checkpoint.store_path({"steps_completed": batch}) as (path, _):
                    with open(path / "weights.bin", "wb") as f:
                        f.write(os.urandom(int(hp["ckpt_mb"] * 2**20)))
                        f.flush()
                        os.fsync(f.fileno())
                    (path / "state.json").write_text(json.dumps({"batch": batch}))
                    rest = hp["checkpoint_s"] - (time.time() - seen)
                    if rest > 0:
                        time.sleep(rest)  # the rest of a checkpoint that takes checkpoint_s
                note("preempted", batch=batch, seen=seen, checkpoint_s=time.time() - seen)
                raise SystemExit(0)  # exits; det-local requeues it to resume from the checkpoint
        op.report_completed(0.0)
'''

CONFIG = """\
name: preemption-bench
entrypoint: python3 train.py
resources: {{slots_per_trial: 1, priority: 50}}
hyperparameters:
  out: {out}
  batch_s: {batch_s}
  checkpoint_s: {checkpoint_s}
  ckpt_mb: {ckpt_mb}
searcher: {{name: single, metric: loss, max_length: {{batches: 1000000}}}}
max_restarts: 0
"""


def events(out: Path) -> list[dict[str, float]]:
    try:
        lines = (out / "events.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in lines if line.strip()]


def wait_for(
    what: str, check: Callable[[], T | None], timeout: float = 120.0, tick: float = 0.005
) -> T:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(tick)


def read_stamp(path: Path) -> float | None:
    try:
        text = path.read_text().strip()
        return float(text) if text else None
    except FileNotFoundError:
        return None


def training(out: Path, run: int, batches: int) -> bool:
    """The trial's process number run+1 (one per preemption) has trained `batches` batches."""
    evs = events(out)
    starts = [i for i, e in enumerate(evs) if e["kind"] == "start"]
    if len(starts) < run + 1:
        return False
    return sum(1 for e in evs[starts[run] :] if e["kind"] == "batch") >= batches


def one_preemption(out: Path, i: int, cwd: str) -> dict[str, float]:
    from det_local import api
    from det_local.store.db import Store

    stamp = out / f"started-{i}"
    n_before = len(events(out))
    t_sub = time.time()
    job_id = int(
        api.control_job(
            "cmd_run",
            {
                "argv": ["sh", "-c", f"date +%s.%N > {stamp}"],
                "cwd": cwd,
                "env": dict(os.environ),
                "slots": 1,
                "priority": 1,
                "name": f"urgent-{i}",
            },
        )
    )
    started = wait_for("the priority-1 command to start", lambda: read_stamp(stamp), 60, 0.002)
    pre = wait_for(
        "the trial's preemption record",
        lambda: next((e for e in events(out)[n_before:] if e["kind"] == "preempted"), None),
    )

    def done() -> bool:
        store = Store(Path(os.environ["DET_LOCAL_HOME"]) / "det-local.db", readonly=True)
        try:
            return store.jobs.get(job_id).state == "DONE"
        finally:
            store.close()

    wait_for("the command to end", done)
    trial_end = pre["t"]
    return {
        "preempt_to_start_s": started - t_sub,
        "signal_s": pre["seen"] - t_sub,
        "checkpoint_measured_s": pre["checkpoint_s"],
        "exit_to_start_s": started - trial_end,
    }


def direct_start(out: Path, runs: int) -> float:
    samples = []
    for i in range(runs):
        stamp = out / f"direct-{i}"
        t0 = time.time()
        subprocess.run(["sh", "-c", f"date +%s.%N > {stamp}"], check=True)
        samples.append(float(stamp.read_text()) - t0)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="preemptions to time (>= 3)")
    parser.add_argument("--batch-s", type=float, default=0.2)
    parser.add_argument("--checkpoint-s", type=float, default=0.5)
    parser.add_argument("--ckpt-mb", type=float, default=8.0, help="checkpoint size in MB")
    parser.add_argument("--warm-batches", type=int, default=3, help="batches before preempting")
    args = parser.parse_args()

    samples: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory(prefix="det-local-bench-") as tmp_name:
        tmp = Path(tmp_name)
        home, ctx, out = tmp / "home", tmp / "ctx", tmp / "out"
        ctx.mkdir()
        out.mkdir()
        (ctx / "train.py").write_text(TRIAL)
        (ctx / "config.yaml").write_text(
            CONFIG.format(
                out=out, batch_s=args.batch_s, checkpoint_s=args.checkpoint_s, ckpt_mb=args.ckpt_mb
            )
        )
        os.environ["DET_LOCAL_HOME"] = str(home)
        with Daemon(str(home), DET_LOCAL_CPU_SLOTS="1") as daemon:
            proc = subprocess.run(
                [*det_local_cmd(), "run", "--detach", "config.yaml", "."],
                cwd=ctx,
                env=daemon.env,
                capture_output=True,
                text=True,
            )
            if proc.returncode != 0:
                raise SystemExit(f"det-local run --detach failed: {proc.stderr.strip()[-2000:]}")
            exp_id = next(int(w) for w in proc.stdout.replace(":", " ").split() if w.isdigit())
            try:
                for i in range(args.runs):
                    wait_for(
                        "the trial to train",
                        functools.partial(training, out, i, args.warm_batches),
                        timeout=180,
                    )
                    samples.append(one_preemption(out, i, str(tmp)))
                resumed = wait_for(
                    "the trial to resume after the last preemption",
                    lambda: [e for e in events(out) if e["kind"] == "start" and e["resumed"]][
                        args.runs - 1 :
                    ],
                )
                evs = events(out)
                preempted = [e["batch"] for e in evs if e["kind"] == "preempted"]
                restarts = [e["batch"] for e in evs if e["kind"] == "start"][1:]
                resumed_ok = preempted == restarts  # each resume starts at its checkpoint's batch
            finally:
                subprocess.run(
                    [*det_local_cmd(), "experiment", "kill", str(exp_id)],
                    env=daemon.env,
                    capture_output=True,
                )
        direct = direct_start(out, 7)

    def med(key: str) -> float:
        return round(statistics.median(s[key] for s in samples), 3)

    result = {
        "preempt_to_start_s": med("preempt_to_start_s"),
        "batch_s": args.batch_s,
        "checkpoint_s": args.checkpoint_s,
        "target_s": round(args.batch_s + args.checkpoint_s + 1, 3),
        "signal_s": med("signal_s"),
        "checkpoint_measured_s": med("checkpoint_measured_s"),
        "exit_to_start_s": med("exit_to_start_s"),
        "preempt_to_start_all_s": [round(s["preempt_to_start_s"], 3) for s in samples],
        "direct_start_s": round(direct, 4),
        "ckpt_mb": args.ckpt_mb,
        "runs": args.runs,
        "resumes": args.runs if resumed else 0,
        "resumed_at_checkpoint": resumed_ok,
        "cpus": os.cpu_count(),
    }
    print(
        f"priority-1 command started {result['preempt_to_start_s']} s after submission "
        f"(target <= {result['target_s']} s): trial saw the request after {result['signal_s']} s, "
        f"checkpointed in {result['checkpoint_measured_s']} s, command started "
        f"{result['exit_to_start_s']} s after the trial returned; {result['resumes']} resume(s)"
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()

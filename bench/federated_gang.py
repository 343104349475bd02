"""Cross-machine gang figures, measured between real daemons in Linux network namespaces (root).

    python3 bench/federated_gang.py [--runs N] [--repeats R]

Every node is a `det-local daemon` in its own namespace (tests/support/fednet.py), joined by a
cluster key and a static peer, mDNS off. Times come from the daemons' own records where they can.

- placement_ms_p50/p99: a 2-slot trial on two 1-slot nodes (one rank each) whose script exits at
  once, N runs. From the owner's trial job `submitted_at` (the daemon queued the job) until the
  LAST share's `started_at` (set when a job's slots are committed; the owner commits its own
  share only after every member answered its commit), both written by the daemons with
  time.time() on one host clock. Also from the experiment's `created_at` (the CLI's submission
  reached the daemon): placement_from_submit_ms_p50. The first run ships the context (later
  runs find it cached by digest); it counts. Target p99 <= 50 ms.
- ddp_2node_vs_torchrun: the digits MLP (examples/digits_core's model and data, a DDP version:
  bench-local script, gloo, 1 thread per rank, batch 64 per rank) on 2 nodes x 1 slot under
  det-local (rank 0 reports its loss every 10 batches through the Core API, as the example does)
  over the same script started by hand with `torchrun --nnodes 2 --node_rank {0,1}
  --master_addr 10.77.0.1` in the same two namespaces; samples/s is rank 0's own count over its
  training loop (after 20 warm-up batches), median of R repeats each. Target >= 0.95.
- kill_ranks_gone_s, pause_ranks_gone_s: a long DDP run on 2 nodes x 1 slot; `det-local
  experiment kill` (then `pause`, on a second trial) at the owner: from the CLI's return (the
  engine applied the request) until every rank process on both machines has exited (a paused
  rank exits at its next 10-batch boundary, once it sees the preemption). Target: the control
  reaches every rank within 1 s. pause_reach_s: from the start of the `pause` CLI call (its
  Python start-up included) until the last rank saw the preemption (its own time stamp, one
  host clock). kill_cli_s/pause_cli_s: the CLI call itself.
- peer_loss_stop_s: a long DDP run; once it reports metrics, SIGKILL every pid in the member's
  namespace (`ip netns pids`: its daemon and its ranks), until every process the trial had in
  the owner's namespace (launcher and rank) is gone; the worst of --loss-runs, each on a fresh
  cluster. Target <= 15 s. peer_loss_trial_states: what the owner made of each trial half a
  second later (requeued: ACTIVE; or ERROR when the rank's own gloo failure won the race).
- relay_reports_per_s: a 2-slot trial on two 1-slot nodes whose rank 1 (the member's) reports
  M training metrics as fast as it can; the rate is M over the time from the rank's first
  report (the row's `time`, stamped by the rank) until the owner's metrics table holds all M
  (polled every 5 ms). Anchor: the same script as a 1-slot trial on the owner
  (local_reports_per_s). Target >= 10,000/s.

The machine may be loaded (2 shared cores): read the times as upper bounds. The last line
printed is one JSON object. Namespaces are prefixed dlf<pid> and removed at the end, even on
failure; every process started in them is killed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from det_local.federate import keys  # noqa: E402
from tests.support.fednet import Net, Node, cli, submitter_account, sweep  # noqa: E402

NO_MDNS = {"DET_LOCAL_MDNS": "0"}
ENTRY = "python3 -m determined.launch.torch_distributed python3 train.py"

QUICK_SCRIPT = 'print("placed", flush=True)\n'

DDP_SCRIPT = textwrap.dedent(
    """
    import os, sys, time
    import torch
    import torch.distributed as dist
    from sklearn.datasets import load_digits
    from torch import nn

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    steps = int(os.environ.get("BENCH_STEPS", "300"))
    warm = 20
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(
        nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    batch = 64
    per_epoch = len(x) // (batch * size)

    ctx = None
    try:
        import determined as det
        if det.get_cluster_info() is not None:
            from determined import core
            ctx = core.init(distributed=core.DistributedContext.from_torch_distributed())
            ctx.__enter__()
    except ImportError:
        pass

    losses = []
    t0 = None
    for step in range(steps):
        if step == warm:
            t0 = time.perf_counter()
        epoch, i = divmod(step, per_epoch)
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(epoch))
        idx = order[(i * size + rank) * batch : (i * size + rank + 1) * batch]
        loss = nn.functional.cross_entropy(model(x[idx]), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if (step + 1) % 10 == 0:
            if ctx is not None and os.environ.get("BENCH_PREEMPT") and ctx.preempt.should_preempt():
                print(f"PREEMPTED rank={rank} step={step + 1} t={time.time():.6f}", flush=True)
                sys.exit(0)
            if ctx is not None and rank == 0:
                ctx.train.report_training_metrics(
                    steps_completed=step + 1, metrics={"loss": sum(losses) / len(losses)}
                )
            losses = []
    dt = time.perf_counter() - t0
    if rank == 0:
        print(f"SAMPLES_PER_S {(steps - warm) * batch * size / dt:.1f}", flush=True)
    if ctx is not None:
        ctx.__exit__(None, None, None)
    dist.destroy_process_group()
    """
)

REPORT_SCRIPT = textwrap.dedent(
    """
    import os, time
    import torch.distributed as dist
    import determined as det
    from determined import core

    multi = "WORLD_SIZE" in os.environ
    if multi:
        dist.init_process_group("gloo")
        dc = core.DistributedContext.from_torch_distributed()
    else:
        dc = None
    n = int(os.environ.get("BENCH_REPORTS", "50000"))
    with core.init(distributed=dc) as ctx:
        if ctx.distributed.rank == int(os.environ.get("BENCH_REPORTER", "0")):
            t0 = time.perf_counter()
            for i in range(1, n + 1):
                ctx.train.report_training_metrics(steps_completed=i, metrics={"loss": 1.0 / i})
            dt = time.perf_counter() - t0
            print(f"REPORTED {n} in {dt:.3f}s", flush=True)
        if multi:
            ctx.distributed.allgather(None)
    """
)


# ---------------------------------------------------------------------------- helpers
def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


def wait(pred: Callable[[], Any], timeout: float, what: str, tick: float = 0.02) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(tick)


def query(node: Node, sql: str, args: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    conn = sqlite3.connect(f"file:{node.home / 'det-local.db'}?mode=ro", uri=True, timeout=10)
    try:
        return conn.execute(sql, args).fetchall()
    finally:
        conn.close()


def exp_state(node: Node, exp_id: int) -> str:
    rows = query(node, "SELECT state FROM experiments WHERE id=?", (exp_id,))
    return str(rows[0][0]) if rows else "?"


def trial_log(node: Node, exp_id: int) -> str:
    path = node.home / "experiments" / str(exp_id)
    return "\n".join(p.read_text(errors="replace") for p in sorted(path.rglob("*.log")))


def diagnose(nodes: list[Node], exp_id: int | None) -> str:
    out = []
    for n in nodes:
        out.append(f"--- daemon n{n.index} log\n{n.log_text()[-3000:]}")
        try:
            jobs = query(n, "SELECT id, kind, state, slots, exit_code FROM jobs")
            events = query(n, "SELECT message FROM events ORDER BY id DESC LIMIT 5")
            out.append(f"jobs {jobs}\nevents {[e[0] for e in events]}")
        except sqlite3.Error as err:
            out.append(f"(store: {err})")
    if exp_id is not None and nodes:
        out.append(f"--- trial log\n{trial_log(nodes[0], exp_id)[-3000:]}")
    return "\n".join(out)


class Bench:
    """One cluster: nodes in namespaces, experiments submitted to the owner (nodes[0])."""

    def __init__(self, net: Net, tmp: Path, slots: list[int]) -> None:
        key = keys.new_key()
        self.tmp = tmp
        tmp.mkdir(parents=True, exist_ok=True)
        self.nodes: list[Node] = []
        for i, s in enumerate(slots, start=1):
            env = {**NO_MDNS, "DET_LOCAL_CPU_SLOTS": str(s)}
            if i > 1:
                env["DET_LOCAL_PEERS"] = "10.77.0.1:47800"
            self.nodes.append(net.node(i, key).start(**env))
        names = [f"n{n.index}" for n in self.nodes]

        def alive() -> bool:
            for n in self.nodes:
                st = n.states()
                if any(st.get(p) != "alive" for p in names if p != f"n{n.index}"):
                    return False
            return True

        wait(alive, 60, f"a {len(slots)}-node cluster")
        self.count = 0

    @property
    def owner(self) -> Node:
        return self.nodes[0]

    def submit(self, script: str, slots: int, env: dict[str, str] | None = None) -> int:
        self.count += 1
        d = self.tmp / f"exp{self.count}"
        ctx = d / "ctx"
        ctx.mkdir(parents=True)
        (ctx / "train.py").write_text(script)
        shared = d / "shared"
        shared.mkdir()
        shared.chmod(0o777)
        cfg = {
            "name": f"bench{self.count}",
            "entrypoint": ENTRY,
            "resources": {"slots_per_trial": slots},
            "searcher": {"name": "single", "metric": "loss", "max_length": 1},
            "checkpoint_storage": {"type": "shared_fs", "host_path": str(shared)},
            "max_restarts": 0,
            "environment": {"environment_variables": [f"{k}={v}" for k, v in (env or {}).items()]},
        }
        path = d / "config.yaml"
        path.write_text(json.dumps(cfg))
        res = cli(self.owner.home, "run", "--detach", str(path), str(ctx), timeout=60)
        if res.returncode != 0:
            raise RuntimeError(f"det-local run failed: {(res.stdout + res.stderr).strip()}")
        return int(query(self.owner, "SELECT MAX(id) FROM experiments")[0][0])

    def wait_end(self, exp_id: int, timeout: float) -> str:
        try:
            wait(
                lambda: exp_state(self.owner, exp_id) in ("COMPLETED", "ERROR", "CANCELED"),
                timeout,
                f"experiment {exp_id} to end",
                tick=0.05,
            )
        except TimeoutError as err:
            raise RuntimeError(f"{err}\n{diagnose(self.nodes, exp_id)}") from None
        return exp_state(self.owner, exp_id)


def ns_pids(node: Node) -> set[int]:
    out = subprocess.run(
        ["ip", "netns", "pids", node.ns], capture_output=True, text=True, timeout=30
    ).stdout
    return {int(p) for p in out.split()}


def kill_ns(node: Node) -> None:
    for pid in ns_pids(node):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


# ---------------------------------------------------------------------------- figures
def placement(bench: Bench, runs: int) -> dict[str, Any]:
    commit, submit = [], []
    for _ in range(runs):
        exp_id = bench.submit(QUICK_SCRIPT, 2)
        state = bench.wait_end(exp_id, 60)
        if state != "COMPLETED":
            raise RuntimeError(f"placement trial ended {state}\n{diagnose(bench.nodes, exp_id)}")
        (created,) = query(bench.owner, "SELECT created_at FROM experiments WHERE id=?", (exp_id,))
        (job,) = query(
            bench.owner,
            "SELECT id, submitted_at, started_at FROM jobs WHERE experiment_id=?",
            (exp_id,),
        )
        # the member's share of this gang: its newest MEMBER job
        member = query(
            bench.nodes[1], "SELECT started_at FROM jobs WHERE kind='MEMBER' ORDER BY id DESC"
        )
        last = max(job[2], member[0][0])
        commit.append((last - job[1]) * 1000)
        submit.append((last - created[0]) * 1000)
    return {
        "placement_ms_p50": round(statistics.median(commit), 1),
        "placement_ms_p99": round(pct(commit, 0.99), 1),
        "placement_from_submit_ms_p50": round(statistics.median(submit), 1),
        "placement_ms_all": [round(v, 1) for v in commit],
    }


def samples_of(text: str) -> float:
    found = re.findall(r"SAMPLES_PER_S ([0-9.]+)", text)
    if not found:
        raise RuntimeError(f"no SAMPLES_PER_S line in:\n{text[-3000:]}")
    return float(found[-1])


def ddp_det_local(bench: Bench, steps: int) -> float:
    exp_id = bench.submit(DDP_SCRIPT, 2, {"BENCH_STEPS": str(steps)})
    state = bench.wait_end(exp_id, 300)
    log = trial_log(bench.owner, exp_id)
    if state != "COMPLETED":
        raise RuntimeError(f"DDP trial ended {state}\n{diagnose(bench.nodes, exp_id)}")
    return samples_of(log)


def ddp_torchrun(bench: Bench, steps: int, port: int) -> float:
    script = bench.tmp / "torchrun_train.py"
    script.write_text(DDP_SCRIPT)
    procs = []
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(bench.tmp),
        "BENCH_STEPS": str(steps),
        "PYTHONPATH": "",  # plain torch: no det-local, no determined shim in sight
        "GLOO_SOCKET_IFNAME": "eth0",  # what one sets by hand (det-local picks it itself)
    }
    for rank, node in enumerate(bench.nodes[:2]):
        argv = [
            "ip",
            "netns",
            "exec",
            node.ns,
            "env",
            *(f"{k}={v}" for k, v in env.items()),
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            "2",
            "--node_rank",
            str(rank),
            "--nproc_per_node",
            "1",
            "--master_addr",
            "10.77.0.1",
            "--master_port",
            str(port),
            str(script),
        ]
        procs.append(
            subprocess.Popen(
                argv,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
            )
        )
    outs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=120)
            outs.append(out)
            if p.returncode != 0:
                node = len(outs) - 1
                raise RuntimeError(f"torchrun node {node} failed ({p.returncode}):\n{out[-3000:]}")
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)
    return samples_of(outs[0])


def peer_loss(bench: Bench) -> dict[str, Any]:
    owner, member = bench.nodes[0], bench.nodes[1]
    daemon = owner.proc.pid if owner.proc is not None else -1
    before = ns_pids(owner)
    exp_id = bench.submit(DDP_SCRIPT, 2, {"BENCH_STEPS": "100000000"})
    trial_ids = lambda: query(owner, "SELECT id FROM trials WHERE experiment_id=?", (exp_id,))  # noqa: E731
    wait(
        lambda: (
            trial_ids()
            and query(owner, "SELECT COUNT(*) FROM metrics WHERE trial_id=?", (trial_ids()[0][0],))[
                0
            ][0]
            >= 2
        ),
        120,
        "the long DDP trial to report metrics",
        tick=0.1,
    )
    ranks_before = ns_pids(owner) - before - {daemon}
    if not ranks_before:
        raise RuntimeError("no rank of the trial in the owner's namespace")
    t0 = time.monotonic()
    kill_ns(member)
    try:
        wait(lambda: not (ns_pids(owner) & ranks_before), 60, "the owner's ranks to exit")
    except TimeoutError as err:
        raise RuntimeError(f"{err}\n{diagnose(bench.nodes, exp_id)}") from None
    stop = time.monotonic() - t0
    time.sleep(0.5)  # let the daemon record what it made of it (read once, not waited on)
    return {
        "peer_loss_stop_s": round(stop, 2),
        "peer_loss_trial_state": exp_state(owner, exp_id),
        "peer_loss_owner_ranks": len(ranks_before),
    }


def control(bench: Bench) -> dict[str, Any]:
    """`experiment kill` and `experiment pause` of a running 2-node DDP trial: from the CLI's
    return (the owner's engine has applied the request) until every rank process on both
    machines has exited (kill: SIGTERM everywhere; pause: the ranks see the preemption at their
    next 10-batch boundary and exit). Also the CLI call's own time."""
    out: dict[str, Any] = {}
    daemons = {n.proc.pid for n in bench.nodes if n.proc is not None}
    for action in ("kill", "pause"):
        before = {n.ns: ns_pids(n) for n in bench.nodes}
        exp_id = bench.submit(DDP_SCRIPT, 2, {"BENCH_STEPS": "100000000", "BENCH_PREEMPT": "1"})

        def reported(exp_id: int = exp_id) -> bool:
            sql = (
                "SELECT COUNT(*) FROM metrics m JOIN trials t ON t.id = m.trial_id"
                " WHERE t.experiment_id=?"
            )
            return bool(query(bench.owner, sql, (exp_id,))[0][0] >= 2)

        wait(reported, 120, "the DDP trial to report metrics", tick=0.1)
        ranks = {n.ns: ns_pids(n) - before[n.ns] - daemons for n in bench.nodes}
        if not all(ranks.values()):
            raise RuntimeError(f"{action}: no rank on some machine: {ranks}")
        t0, asked = time.monotonic(), time.time()
        res = bench.owner.cli("experiment", action, str(exp_id))
        t1 = time.monotonic()
        if res.returncode != 0:
            raise RuntimeError(f"experiment {action}: {res.stderr.strip()}")

        def gone(ranks: dict[str, set[int]] = ranks) -> bool:
            return not any(ns_pids(n) & ranks[n.ns] for n in bench.nodes)

        wait(gone, 60, f"every rank to exit after {action}", tick=0.01)
        out[f"{action}_ranks_gone_s"] = round(time.monotonic() - t1, 3)
        out[f"{action}_cli_s"] = round(t1 - t0, 3)
        if action == "pause":

            def paused(exp_id: int = exp_id) -> bool:
                return exp_state(bench.owner, exp_id) == "PAUSED"

            wait(paused, 60, "PAUSED")
            seen = [
                float(line.rsplit("t=", 1)[1])
                for line in trial_log(bench.owner, exp_id).splitlines()
                if "PREEMPTED rank=" in line
            ]
            if len(seen) != 2:
                raise RuntimeError(f"pause: {len(seen)} ranks saw the preemption, not 2")
            # every rank saw it (its own clock stamp: one host clock) this long after
            out["pause_reach_s"] = round(max(seen) - asked, 3)
            bench.owner.cli("experiment", "kill", str(exp_id))
        bench.wait_end(exp_id, 60)
    return out


def arrival_rate(bench: Bench, exp_id: int, reports: int) -> float:
    """Reports per second arriving in the owner's store: from the rank's first report (the
    row's `time`, stamped by the rank on the same host clock) until the owner holds all of
    them (polled every 5 ms, so it reads low by up to one tick)."""
    owner = bench.owner

    def arrived() -> float | None:
        try:
            trial = query(owner, "SELECT id FROM trials WHERE experiment_id=?", (exp_id,))
            if not trial:
                return None
            ((n,),) = query(
                owner,
                "SELECT COUNT(*) FROM metrics WHERE trial_id=? AND grp='training'",
                (trial[0][0],),
            )
        except sqlite3.Error:
            return None
        return time.time() if n >= reports else None

    done = wait(arrived, 120, f"{reports} reports at the owner", tick=0.005)
    ((first,),) = query(
        owner,
        "SELECT MIN(m.time) FROM metrics m JOIN trials t ON t.id = m.trial_id "
        "WHERE t.experiment_id=? AND m.grp='training'",
        (exp_id,),
    )
    return reports / (done - first)


def relay(bench: Bench, reports: int) -> dict[str, Any]:
    env = {"BENCH_REPORTS": str(reports)}
    local = bench.submit(REPORT_SCRIPT, 1, env)
    local_rate = arrival_rate(bench, local, reports)
    if bench.wait_end(local, 120) != "COMPLETED":
        raise RuntimeError(f"local report trial failed\n{diagnose(bench.nodes, local)}")
    # rank 1 is the member's: its reports reach the owner over the relay
    remote = bench.submit(REPORT_SCRIPT, 2, {**env, "BENCH_REPORTER": "1"})
    remote_rate = arrival_rate(bench, remote, reports)
    if bench.wait_end(remote, 120) != "COMPLETED":
        raise RuntimeError(f"relay trial failed\n{diagnose(bench.nodes, remote)}")
    log = trial_log(bench.owner, remote)
    return {
        "relay_reports_per_s": round(remote_rate),
        "local_reports_per_s": round(local_rate),
        "relay_reporter_line": next(
            (ln.strip() for ln in log.splitlines() if "REPORTED" in ln), "(none)"
        ),
        "relay_reports": reports,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=10, help="placement runs")
    parser.add_argument("--repeats", type=int, default=3, help="DDP runs of each kind")
    parser.add_argument("--steps", type=int, default=400, help="DDP batches per run")
    parser.add_argument("--reports", type=int, default=50000, help="metric reports (relay)")
    parser.add_argument("--loss-runs", type=int, default=3, help="peer-loss runs")
    parser.add_argument("--only", default="placement,ddp,control,loss,relay")
    args = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("bench/federated_gang.py creates network namespaces: run it as root")
    only = set(args.only.split(","))
    sweep()
    result: dict[str, Any] = {}
    errors: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as tmp, submitter_account():
        root = Path(tmp)
        root.chmod(0o755)

        def section(name: str, slots: list[int], fn: Callable[[Bench], dict[str, Any]]) -> None:
            if name not in only:
                return
            t = time.monotonic()
            try:
                with Net(root / name) as net:
                    try:
                        bench = Bench(net, root / name / "work", slots)
                        result.update(fn(bench))
                    finally:
                        for node in net.nodes:  # ranks outlive their daemon by design
                            kill_ns(node)
            except (RuntimeError, OSError, ValueError, subprocess.SubprocessError) as err:
                errors[name] = str(err).splitlines()[0]
                print(f"{name}: FAILED: {err}", file=sys.stderr)
            print(f"{name}: {time.monotonic() - t:.0f}s {json.dumps(result)}", file=sys.stderr)

        section("placement", [1, 1], lambda b: placement(b, args.runs))

        def ddp(b: Bench) -> dict[str, Any]:
            det, hand = [], []
            for i in range(args.repeats):
                try:
                    hand.append(ddp_torchrun(b, args.steps, 23456 + i))
                except RuntimeError as err:  # seen once: gloo aborts at start (SIGABRT)
                    print(f"torchrun retried once: {str(err)[-500:]}", file=sys.stderr)
                    hand.append(ddp_torchrun(b, args.steps, 24456 + i))
                det.append(ddp_det_local(b, args.steps))
            d, h = statistics.median(det), statistics.median(hand)
            return {
                "ddp_2node_vs_torchrun": round(d / h, 3),
                "ddp_det_local_samples_per_s": round(d, 1),
                "ddp_torchrun_samples_per_s": round(h, 1),
                "ddp_det_local_all": det,
                "ddp_torchrun_all": hand,
            }

        section("ddp", [1, 1], ddp)
        section("control", [1, 1], control)

        def losses(_: Bench) -> dict[str, Any]:
            runs = []
            for i in range(args.loss_runs):  # the member is dead after one: a cluster per run
                with Net(root / f"loss{i}") as net:
                    try:
                        runs.append(peer_loss(Bench(net, root / f"loss{i}" / "work", [1, 1])))
                    finally:
                        for node in net.nodes:
                            kill_ns(node)
            stops = [r["peer_loss_stop_s"] for r in runs]
            return {
                "peer_loss_stop_s": max(stops),
                "peer_loss_stop_s_all": stops,
                "peer_loss_trial_states": [r["peer_loss_trial_state"] for r in runs],
            }

        if "loss" in only:
            try:
                result.update(losses(None))  # type: ignore[arg-type]
            except (RuntimeError, OSError, ValueError, subprocess.SubprocessError) as err:
                errors["loss"] = str(err).splitlines()[0]
                print(f"loss: FAILED: {err}", file=sys.stderr)
        section("relay", [1, 1], lambda b: relay(b, args.reports))
    if errors:
        result["errors"] = errors
    result.update(runs=args.runs, repeats=args.repeats, steps=args.steps)
    print(json.dumps(result))


if __name__ == "__main__":
    main()

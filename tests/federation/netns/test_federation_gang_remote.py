"""A trial larger than its owner's machine that one peer holds whole: the owner runs none of
its ranks (it only coordinates: a run without a process), in network namespaces."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from pathlib import Path

from tests.support.fednet import Net, Node
from tests.support.gangnet import (
    alive,
    checkpoints,
    db,
    exp_state,
    experiment,
    job_row,
    ns_pids,
    pytestmark,  # noqa: F401  (root, iproute2; slow)
    rank_pids,
    run_anywhere,
    submit,
    trial_log,
    two_nodes,
    wait_end,
)
from tests.support.world import wait_for


def owner_and_big_peer(lan: Net) -> tuple[Node, Node]:
    """n1 with 1 CPU slot (the owner), n2 with 2."""
    return two_nodes(lan, DET_LOCAL_CPU_SLOTS="2")


def test_trial_runs_wholly_on_a_peer_and_its_owner_records_it(
    net: Net,
    tmp_path: Path,
) -> None:
    n1, n2 = owner_and_big_peer(net)
    cfg, ctx = experiment(tmp_path)
    exp_id = submit(n1, cfg, ctx)
    assert wait_end(n1, n2, exp_id, timeout=90) == "COMPLETED", n1.log_text()
    log = trial_log(n1, exp_id)
    # fewest nodes: both ranks on n2 (node rank 0 there), none on the owner
    assert "RESULT rank=0 size=2 cross=0 nodes=['0', '0'] word=from-chief sum=3.0" in log
    assert "RESULT rank=1 size=2 cross=0 nodes=['0', '0'] word=from-chief sum=3.0" in log
    assert "[rank=0]" in log and "[rank=1]" in log
    with db(n1) as conn:
        jobs = conn.execute("SELECT kind, state, slots_needed FROM jobs").fetchall()
        steps = [r[0] for r in conn.execute("SELECT steps_completed FROM metrics")]
        trial = conn.execute("SELECT state FROM trials").fetchone()[0]
    assert jobs == [("TRIAL", "DONE", 0)], jobs
    assert max(steps) == 3 and trial == "COMPLETED"
    assert checkpoints(n1, exp_id) == 3
    with db(n2) as conn:
        rows = conn.execute("SELECT kind, state, exit_code FROM jobs").fetchall()
    assert rows == [("MEMBER", "DONE", 0)], rows


def test_pause_activate_and_peer_loss_of_a_trial_its_owner_only_coordinates(
    net: Net,
    tmp_path: Path,
) -> None:
    n1, n2 = owner_and_big_peer(net)
    cfg, ctx = experiment(tmp_path, env={"STEPS": "40", "STEP_SLEEP": "0.3"})
    exp_id = submit(n1, cfg, ctx)
    wait_for(lambda: checkpoints(n1, exp_id) >= 1, timeout=90, what="a checkpoint")
    # pause reaches the ranks on n2 (the preemption frame goes down, their acks come back)
    assert n1.cli("experiment", "pause", str(exp_id)).returncode == 0
    wait_for(lambda: exp_state(n1, exp_id) == "PAUSED", timeout=40, what="paused")
    assert "preempted at" in trial_log(n1, exp_id)
    assert not rank_pids(n2)
    assert n1.cli("experiment", "activate", str(exp_id)).returncode == 0
    wait_for(lambda: len(rank_pids(n2)) >= 2, timeout=60, what="the ranks placed again")
    before = checkpoints(n1, exp_id)
    wait_for(lambda: checkpoints(n1, exp_id) > before, timeout=60, what="a new checkpoint")
    # the machine holding every rank dies: the owner requeues the trial (no max_restarts used)
    t0 = time.monotonic()
    for pid in ns_pids(n2):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    wait_for(
        lambda: "does not count toward max_restarts" in n1.log_text(),
        timeout=30,
        what="the requeue",
    )
    assert time.monotonic() - t0 <= 15.0
    assert exp_state(n1, exp_id) == "ACTIVE"
    n2.start()
    assert wait_end(n1, n2, exp_id, timeout=150) == "COMPLETED"
    with db(n1) as conn:
        steps = [r[0] for r in conn.execute("SELECT steps_completed FROM metrics")]
        restarts = conn.execute("SELECT restarts FROM trials").fetchone()[0]
    assert max(steps) == 40 and restarts == 0
    assert not any(alive(p) for p in rank_pids(n2))


def test_a_trial_that_may_run_anywhere_runs_on_an_idle_peer_when_its_machine_is_full(
    net: Net,
    tmp_path: Path,
) -> None:
    n1, n2 = two_nodes(net)
    # refused before anything starts: such a trial keeps its checkpoints where both machines do
    cfg, ctx = experiment(
        tmp_path,
        resources={"slots_per_trial": 1, "federate": True},
        checkpoint_storage={"type": "directory", "container_path": "/tmp"},
    )
    res = n1.cli("run", "--detach", str(cfg), str(ctx))
    assert res.returncode != 0, res.stdout
    assert res.stderr.strip().splitlines() == [
        "error: checkpoint_storage: a trial that may run on another machine "
        "(resources.federate: true) needs type shared_fs with the same host_path mounted on "
        "every machine"
    ], res.stderr
    # n1's only slot is taken: the trial runs on n2, which is idle; n1 records it
    res = n1.cli("cmd", "run", "--name", "busy", "--", "sleep", "120")
    assert res.returncode == 0, res.stderr
    cfg, ctx = experiment(tmp_path, resources={"slots_per_trial": 1})
    res = n1.cli("experiment", "create", "--anywhere", str(cfg), str(ctx), timeout=60)
    assert res.returncode == 0, res.stderr
    with db(n1) as conn:
        exp_id = int(conn.execute("SELECT MAX(id) FROM experiments").fetchone()[0])
    assert wait_end(n1, n2, exp_id, timeout=90) == "COMPLETED"
    assert "RESULT rank=0 size=1" in trial_log(n1, exp_id)
    assert "machine n2 has them free: it runs there (resources.federate)" in n1.log_text()
    with db(n1) as conn:
        steps = [r[0] for r in conn.execute("SELECT steps_completed FROM metrics")]
        trial_job = conn.execute(
            "SELECT state, slots_needed, gang FROM jobs WHERE kind='TRIAL'"
        ).fetchone()
    assert max(steps) == 3
    assert trial_job[0] == "DONE" and trial_job[1] == 0 and '"anywhere": "n2"' in trial_job[2]
    with db(n2) as conn:
        rows = conn.execute("SELECT kind, state, exit_code FROM jobs").fetchall()
    assert rows == [("MEMBER", "DONE", 0)], rows
    # without --anywhere, a trial waits for this machine's slot
    cfg, ctx = experiment(tmp_path, resources={"slots_per_trial": 1})
    exp2 = submit(n1, cfg, ctx)
    res = n1.cli("job", "list")
    assert res.returncode == 0
    with db(n1) as conn:
        state = conn.execute(
            "SELECT state FROM jobs WHERE experiment_id=? AND kind='TRIAL'", (exp2,)
        ).fetchone()[0]
    assert state == "QUEUED"
    assert n1.cli("experiment", "kill", str(exp2)).returncode == 0


def test_a_command_that_may_run_anywhere_runs_on_an_idle_peer_and_can_be_killed(
    net: Net,
    tmp_path: Path,
) -> None:
    n1, n2 = two_nodes(net)
    work = tmp_path / "work"
    work.mkdir()
    res = n1.cli("cmd", "run", "--name", "busy", "--", "sleep", "120")
    assert res.returncode == 0, res.stderr
    script = 'echo "ran in $(pwd) on $(ip -o -4 addr show | grep -o 10.77.0.[0-9]*)"; exit 3'
    job_id = run_anywhere(n1, work, "sh", "-c", script)

    wait_for(lambda: job_row(n1, job_id)[0] == "DONE", timeout=60, what="the command to end")
    state, code, message = job_row(n1, job_id)
    assert code == 3 and message is not None and "on n2" in message, (code, message)
    logs = n1.cli("cmd", "logs", str(job_id))
    assert f"ran in {work} on 10.77.0.2" in logs.stdout, logs.stdout + logs.stderr
    # its output and exit status came from n2, and the lists say so
    listed = n1.cli("cmd", "list", "--all").stdout
    assert "3 (from n2)" in listed, listed
    assert "DONE (on n2)" in n1.cli("job", "list", "--all").stdout
    rows = json.loads(n1.cli("cmd", "list", "--all", "--json").stdout)
    assert [r["ran_on"] for r in rows if r["id"] == job_id] == ["n2"]
    with db(n2) as conn:
        rows = conn.execute("SELECT kind, state, exit_code FROM jobs").fetchall()
    assert rows == [("MEMBER", "DONE", 3)], rows
    # a long one, killed from its machine: it stops on the peer
    job_id = run_anywhere(n1, work, "sleep", "300")
    wait_for(
        lambda: any(b"sleep\x00300" in cmdline(p) for p in ns_pids(n2)),
        timeout=30,
        what="the command to run on n2",
    )
    # where each job runs, as every node sees it
    res = n1.cli("job", "list", "--cluster", "--json")
    assert res.returncode == 0, res.stderr
    blocks = {b["node"]: b["value"] for b in json.loads(res.stdout)}
    mine = {j["id"]: j for j in blocks["n1"]}
    assert mine[job_id]["runs_on"] == "n2" and mine[job_id]["state"] == "SCHEDULED"
    assert [j["runs_on"] for j in blocks["n1"] if j["name"] == "busy"] == ["n1"]
    assert [(j["kind"], j["runs_on"]) for j in blocks["n2"]] == [("MEMBER", "n2")]
    table = n1.cli("job", "list", "--cluster").stdout
    assert "Runs on" in table and table.count(" n2") >= 2, table
    res = n1.cli("cmd", "kill", str(job_id))
    assert res.returncode == 0 and "being stopped" in res.stdout, res.stdout + res.stderr
    wait_for(lambda: job_row(n1, job_id)[0] == "DONE", timeout=30, what="the kill")
    assert job_row(n1, job_id)[2] == "killed on request"
    assert not any(b"sleep\x00300" in cmdline(p) for p in ns_pids(n2))


def cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def test_a_relayed_log_flood_is_cut_where_the_owner_says(
    net: Net,
    tmp_path: Path,
) -> None:
    """A peer writing 8 MB of output into a command's log (here an honest one running a loud
    command; a hostile one sends the same frames): the owner keeps federation.max_log_mb (1)
    and one line saying where it was cut."""
    from det_local.federate import keys

    key = keys.new_key()
    n1 = net.node(1, key)
    (n1.home / "daemon.yaml").write_text("federation:\n  max_log_mb: 1\n")
    n1.start(DET_LOCAL_MDNS="0")
    n2 = net.node(2, key).start(DET_LOCAL_MDNS="0", DET_LOCAL_PEERS="10.77.0.1:47800")
    wait_for(
        lambda: n1.states().get("n2") == "alive" and n2.states().get("n1") == "alive",
        timeout=30,
        what="a 2-node cluster",
    )
    assert n1.cli("cmd", "run", "--name", "busy", "--", "sleep", "120").returncode == 0
    work = tmp_path / "work"
    work.mkdir()
    # 8 MB over ~4 s (a member relays what its ranks write as they write it)
    flood = (
        "for i in $(seq 1 40); do head -c 200000 /dev/zero | tr '\\0' x | fold -w 999; "
        "sleep 0.1; done; echo done"
    )
    job_id = run_anywhere(n1, work, "sh", "-c", flood)

    def state() -> str:
        with db(n1) as conn:
            return str(conn.execute("SELECT state FROM jobs WHERE id=?", (job_id,)).fetchone()[0])

    wait_for(lambda: state() == "DONE", timeout=120, what="the loud command to end")
    logs = n1.cli("cmd", "logs", str(job_id)).stdout
    assert len(logs.encode()) <= 1024 * 1024 + 300, len(logs)
    assert logs.rstrip().endswith(
        "[det-local: the log relayed from n2 was cut here, after 1 MiB (federation.max_log_mb "
        "on n1); the rest of its output is not kept]"
    ), logs[-400:]
    assert f"federation: job {job_id}: the log relayed from n2 was cut at 1 MiB" in n1.log_text()


def test_roots_work_is_refused_by_the_lender_with_one_line_on_each_side(
    net: Net,
    tmp_path: Path,
) -> None:
    """root's `cmd run --anywhere` while this machine is full: the peer refuses it (root never
    runs a peer's work); the owner's line names the user, the machine and what would allow it,
    and the job waits here again; the lender logs one line however often it is asked."""
    n1, n2 = two_nodes(net)
    assert n1.cli("cmd", "run", "--name", "busy", "--", "sleep", "120", user="root").returncode == 0
    res = n1.cli("cmd", "run", "--anywhere", "--", "id", "-u", user="root")
    assert res.returncode == 0, res.stderr
    job_id = int(res.stdout.split()[-1])
    want = (
        "n2 does not run work of uid 0 (root, as 'root') from n1: root never runs work from "
        "other machines; submit as an ordinary user"
    )
    wait_for(lambda: want in n1.log_text(), timeout=60, what="the owner's line")
    line = next(x for x in n1.log_text().splitlines() if want in x)
    assert f"command {job_id}" in line or "waits here again" in line, line
    with db(n1) as conn:
        state = conn.execute("SELECT state FROM jobs WHERE id=?", (job_id,)).fetchone()[0]
    assert state == "QUEUED"  # waits here, in its place
    wait_for(
        lambda: (
            "federation: refused reserve from n1: n2 does not run work of uid 0" in n2.log_text()
        ),
        timeout=30,
        what="the lender's line",
    )
    with db(n2) as conn:
        assert conn.execute("SELECT COUNT(*) FROM jobs").fetchone()[0] == 0

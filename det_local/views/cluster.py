"""Read models of the machine and the cluster: the job queue, pools, slots, commands, peers,
system metrics and usage (what `job list`, `slots`, `cluster ...` and the dashboard show)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    pass
from det_local.api import open_store, paths
from det_local.store.states import JobKind, JobState


def queue(*, include_done: bool = False, limit: int | None = None) -> list[Any]:
    """The jobs in the order the scheduler goes by (JobRecords; `job list`'s # is the place)."""
    from det_local.client.queueview import in_queue_order

    jobs = in_queue_order(open_store().jobs.list(include_done=include_done), paths())
    return jobs if limit is None else jobs[: max(limit, 0)]


def jobs_json(*, include_done: bool = False, limit: int | None = None) -> list[dict[str, Any]]:
    """`job list --json`: each job with its place in the queue ("position", from 1)."""
    jobs = queue(include_done=include_done, limit=limit)
    where = job_pools(jobs)
    waits = pool_waits(jobs)
    return [
        {
            **j.to_json(),
            "position": i + 1,
            "pool": where[j.id],
            "ran_on": ran_on(j),
            # its run waits in its pool's own queue: "PENDING (Resources)" (Slurm's reason)
            "pool_state": waits.get(j.id),
        }
        for i, j in enumerate(jobs)
    ]


def pool_waits(jobs: list[Any]) -> dict[int, str]:
    """Scheduled jobs whose run still waits in its pool's own queue, and how: a Slurm job
    "PENDING (Resources)" (Slurm's reason, from the pool's squeue poller), or
    "SUBMITTING (sbatch)" before Slurm answered."""
    scheduled = {j.id for j in jobs if j.state == JobState.SCHEDULED}
    if not scheduled:
        return {}
    return {k: v for k, v in open_store().jobs.waiting().items() if k in scheduled}


def job_pools(jobs: list[Any]) -> dict[int, str]:
    """Each job's resource pool (its experiment's `resources.resource_pool`; `default`: this
    machine's slots)."""
    from det_local.errors import DetLocalError
    from det_local.pools import DEFAULT, is_default

    store = open_store()
    by_exp: dict[int, str] = {}
    out: dict[int, str] = {}
    for j in jobs:
        exp_id = j.experiment_id
        if exp_id is not None and exp_id not in by_exp:
            try:
                name = (store.get_experiment(exp_id).config.get("resources") or {}).get(
                    "resource_pool"
                )
            except DetLocalError:
                name = None
            by_exp[exp_id] = DEFAULT if is_default(name) else str(name)
        if exp_id is not None:
            out[j.id] = by_exp.get(exp_id, DEFAULT)
        else:  # a command: `cmd run --pool`
            row = store.job_pools.get(j.id)
            out[j.id] = DEFAULT if row is None else row[0]
    return out


def pools_rows() -> list[dict[str, str]]:
    """`slots`: the resource pools this home's daemon.yaml defines (the default one first)."""
    from det_local.pools import load_pools

    return load_pools(paths().settings).describe()


def slots_json() -> list[dict[str, Any]]:
    """`slots --json`: this machine's slots as the running engine sees them (discovered here
    when none runs), with who uses each."""
    from det_local.client.slotview import current

    return mark_disabled(current(paths()).rows())


def mark_disabled(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each slot row with `disabled` (`slot disable`: drained, kept across restarts); a
    disabled slot's "used by" says so."""
    disabled = open_store().drains.slots()
    for r in rows:
        r["disabled"] = r["index"] in disabled
        if r["disabled"]:
            r["used_by"] = f"{r['used_by']} (disabled)".strip()
    return rows


def commands_json(*, include_done: bool = False) -> list[dict[str, Any]]:
    """`cmd list --json`: commands, shells, notebooks and TensorBoards (every job but trials),
    oldest first, each with "link" (the address a notebook or TensorBoard serves on while it
    runs, without its token: that is printed only to its owner, by `notebook start`) and its
    argv with secret-looking option values hidden (client/taskview.py)."""
    from det_local.client.taskview import address, hide_secrets, hide_secrets_in_line

    out = []
    for j in open_store().jobs.list(include_done=include_done):
        if j.kind == JobKind.TRIAL:
            continue
        d = j.to_json()
        d["argv"] = hide_secrets(j.argv)
        d["name"] = hide_secrets_in_line(j.name)  # by default, its argv joined
        d["link"] = address(j.kind, j.argv) if j.state == JobState.SCHEDULED else None
        d["ran_on"] = ran_on(j)
        out.append(d)
    return out


def ended_commands() -> int:
    """How many commands (every job but trials) have ended: what `cmd list` leaves out
    without --all."""
    jobs = open_store().jobs
    return sum(1 for j in jobs.list(include_done=True) if j.kind != JobKind.TRIAL) - sum(
        1 for j in jobs.list() if j.kind != JobKind.TRIAL
    )


def ran_on(job: Any) -> str | None:
    """The peer a job was sent to whole (`--anywhere`, `resources.federate`): its output and
    exit status are what that machine reported. None for a job run here."""
    peer = (job.gang or {}).get("anywhere") if isinstance(job.gang, dict) else None
    return str(peer) if peer else None


def cluster_view() -> dict[str, Any]:
    """The running daemon's view of its cluster: {"federation": "on"|"off", "why" (when off),
    "node", "port", "cluster", "mdns", "live_peers" (when on), "peers": peers_rows}. A one-line
    NoDaemon error when no daemon runs (the cluster exists only in a daemon)."""
    from det_local.federate.client import request

    view = dict(request(paths(), {"t": "peers"}) or {})
    view["peers"] = peer_rows(view)
    return view


def peer_rows(view: dict[str, Any]) -> list[dict[str, Any]]:
    """Each node of the view (this one first, "state": "self"; then alive, suspect, dead or
    left peers) with "jobs": this node's running jobs whose processes are there ({"id",
    "kind", "name", "user", "slots"}; a share of a peer's gang shows on this node)."""
    from det_local.sched.extensions import runs_on

    rows = [dict(r) for r in view.get("peers") or []]
    if not rows:
        return rows
    me = str(view.get("node") or "local")
    where: dict[str, list[dict[str, Any]]] = {}
    for j in open_store().jobs.list(include_done=False):
        for node in filter(None, runs_on(j, me).split(",")):
            where.setdefault(node, []).append(
                {"id": j.id, "kind": j.kind, "name": j.name, "user": j.user, "slots": j.slots}
            )
    for r in rows:
        r["jobs"] = where.get(str(r["id"]), [])
    return rows


def peers_json() -> list[dict[str, Any]]:
    """`cluster peers --json`: every node of the cluster, this one included ([] when this
    daemon does not federate)."""
    rows: list[dict[str, Any]] = cluster_view()["peers"]
    return rows


# ---------------------------------------------------------------------- usage (issue 30)
def system_metrics(trial_id: int | None = None, job_id: int | None = None) -> list[Any]:
    """A trial's (or a command's, notebook's, shell's: job_id) system metrics as MetricRecords
    of group "system", oldest first (`det_local/usage/readers.py`)."""
    from det_local.usage.readers import command_metrics
    from det_local.usage.readers import system_metrics as read

    store = open_store()
    if job_id is not None:
        return command_metrics(store, job_id)
    assert trial_id is not None
    store.get_trial(trial_id)
    return read(store, trial_id=trial_id)


def usage(since: float, by: str = "user", until: float | None = None) -> dict[str, Any]:
    """`det-local usage --json`: slot-hours allocated and used (`det_local/usage/report.py`)."""
    from det_local.usage.readers import usage as read

    return read(open_store(), since=since, by=by, until=until)


def idle_notes(job_ids: list[int] | None = None) -> dict[int, str]:
    """Jobs flagged for holding idle slots: job id -> one line for their owner."""
    from det_local.usage.readers import idle_notes as read

    return read(open_store(), job_ids)

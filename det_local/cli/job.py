"""`det-local job list|update|update-batch`: the queue, as Determined shows it."""

from __future__ import annotations

import typer

from det_local.priority import HELP as PRIORITY_HELP

app = typer.Typer(no_args_is_help=True, rich_markup_mode=None, help="The job queue.")


@app.command("list")
def list_jobs(
    show_all: bool = typer.Option(False, "--all", "-a", help="Include ended jobs."),
    limit: int = typer.Option(None, "--limit", help="Show at most this many."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
    cluster: bool = typer.Option(
        False, "--cluster", help="Every node's jobs, read through the peers."
    ),
) -> None:
    """#, ID, type, name, priority, submitted, slots acquired/needed, state, user."""
    import time

    from det_local.cli.common import print_json, table
    from det_local.views import cluster as clusterviews

    if cluster:
        _cluster_jobs(show_all, as_json)
        return

    if as_json:
        print_json(clusterviews.jobs_json(include_done=show_all, limit=limit))
        return
    jobs = clusterviews.queue(include_done=show_all, limit=limit)
    pools = clusterviews.job_pools(jobs)
    pooled = any(p != "default" for p in pools.values())  # a Pool column only when it says much
    waits = clusterviews.pool_waits(jobs) if pooled else {}
    rows = []
    for i, j in enumerate(jobs):
        # a run still in its pool's queue: Slurm's state and reason, not SCHEDULED
        state = waits.get(j.id, j.state)
        submitted = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(j.submitted_at))
        rows.append(
            [
                i + 1,
                j.id,
                j.kind,
                j.name,
                j.priority,
                submitted,
                f"{len(j.slots)}/{j.slots_needed}",
                f"{state} (on {peer})" if (peer := clusterviews.ran_on(j)) else state,
                j.user,
            ]
            + ([_pool_cell(pools[j.id], j)] if pooled else [])
        )
    headers = ["#", "ID", "Type", "Name", "Priority", "Submitted", "Slots", "State", "User"]
    print(table(headers + (["Pool"] if pooled else []), rows, flex=("Name", "User")))


def _pool_cell(pool: str, job: object) -> str:
    """A job's pool; a run in a Slurm pool: its Slurm job (the job's pid column)."""
    pid = getattr(job, "pid", None)
    if pool == "default" or not pid:
        return pool
    return f"{pool} (Slurm job {pid})"


@app.command("update")
def update(
    job_id: int = typer.Argument(..., metavar="JOB_ID", help="The job to change."),
    priority: int = typer.Option(None, "--priority", help=PRIORITY_HELP),
    ahead_of: int = typer.Option(None, "--ahead-of", help="Move it just ahead of this job."),
    behind_of: int = typer.Option(None, "--behind-of", help="Move it just behind this job."),
) -> None:
    """Change a job's priority or its place in the queue (owner or admin only)."""
    from det_local import api

    print(
        api.control_job(
            "job_update",
            {"job_id": job_id, "priority": priority, "ahead_of": ahead_of, "behind_of": behind_of},
        )
    )


@app.command("update-batch")
def update_batch(
    updates: list[str] = typer.Argument(
        ...,
        metavar="UPDATE...",
        help="JOB_ID.priority=N, JOB_ID.ahead-of=J or JOB_ID.behind-of=J, several at once.",
    ),
) -> None:
    """Several updates, checked together before any is applied: `2.priority=10 5.ahead-of=3`."""
    from det_local import api
    from det_local.errors import DetLocalError

    parsed = []
    for item in updates:
        key, sep, value = item.partition("=")
        job, dot, field = key.partition(".")
        field = field.replace("-", "_")
        if not (sep and dot and job.isdigit() and value.lstrip("-").isdigit()) or field not in (
            "priority",
            "ahead_of",
            "behind_of",
        ):
            raise DetLocalError(
                f"update-batch: cannot read {item!r}; write JOB_ID.priority=N, "
                "JOB_ID.ahead-of=J or JOB_ID.behind-of=J"
            )
        parsed.append({"job_id": int(job), field: int(value)})
    for line in api.control_job("job_update_batch", {"updates": parsed}):
        print(line)


def _cluster_jobs(show_all: bool, as_json: bool) -> None:
    """`job list --cluster`: one block per node; a node that did not answer says why."""
    from det_local.cli.cluster import cluster_rows
    from det_local.cli.common import print_json, table

    nodes = cluster_rows("jobs", include_done=show_all)
    if as_json:
        print_json(nodes)
        return
    rows = []
    for node in nodes:
        if "error" in node:
            rows.append([node["node"], "-", "-", "-", "-", "-", f"({node['error']})", "-", "-"])
            continue
        for j in node.get("value") or []:  # type: ignore[attr-defined]
            rows.append(
                [
                    node["node"],
                    j["id"],
                    j["kind"],
                    j["name"],
                    j["priority"],
                    f"{len(j['slots'])}/{j['slots_needed']}",
                    j["state"],
                    j["user"],
                    j.get("runs_on") or "-",
                ]
            )
    headers = ["Node", "ID", "Type", "Name", "Priority", "Slots", "State", "User", "Runs on"]
    print(table(headers, rows, flex=("Node", "Name", "User", "Runs on")))

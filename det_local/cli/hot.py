"""The bodies of the commands typed all day, importable without typer: the typer commands
(`cli/cmd.py`, `cli/job.py`, `cli/trial.py`, `cli/daemon.py`) and their fast paths
(`cli/start/fast.py`) both call these, so what a command does is written once."""

from __future__ import annotations


def cmd_run(
    args: list[str],
    slots: int,
    priority: int,
    name: str | None,
    follow: bool,
    pool: str | None,
    anywhere: bool,
    config: list[str] | None,
) -> int | None:
    """`cmd run`: queue the command (args: the command line, maybe after a `--`); with
    follow, run it here when no daemon runs: its exit status."""
    import os

    from det_local import api
    from det_local.priority import check_priority, check_slots
    from det_local.sched.run.userfiles import current_umask
    from det_local.usage.settings import parse_task_config

    check_slots(slots)
    check_priority(priority)
    task_config = parse_task_config(config)
    argv = list(args)
    if argv and argv[0] == "--":
        argv = argv[1:]
    payload: dict[str, object] = {
        **task_config,
        "argv": argv,
        "cwd": os.getcwd(),
        "env": dict(os.environ),
        "slots": slots,
        "priority": priority,
        "name": name,
        "umask": current_umask(),  # it runs with this shell's umask, as if run here
        "anywhere": anywhere,
        **({"pool": pool} if pool else {}),
    }
    if follow:
        from det_local.client.embedded import run_command

        return run_command(api.paths(), payload)
    job_id = api.control_job("cmd_run", payload)
    print(f"Queued command {job_id}", flush=True)
    from det_local.sched.enginelock import lock_free

    p = api.paths()
    if lock_free(p):
        import sys

        print(
            f"det-local: no daemon is running for {p.home}; command {job_id} waits in the "
            "queue until one starts (`det-local daemon start`), or run it now in this "
            "terminal with `det-local cmd run -f`",
            file=sys.stderr,
            flush=True,
        )
    return None


def job_list(show_all: bool, limit: int | None, as_json: bool) -> None:
    """`job list` (not `--cluster`): #, ID, type, name, priority, submitted, slots, state, user."""
    import time

    from det_local.cli.common import print_json, table
    from det_local.views import cluster as clusterviews

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


def trial_logs(trial_id: int, follow: bool, rank: int | None, tail: int | None) -> None:
    """`trial logs`: a trial's output, every run and rank."""
    import os
    import sys

    from det_local.views import logs as logviews

    out = sys.stdout.buffer
    try:
        logviews.trial_logs(trial_id, out, follow=follow, rank=rank, tail=tail)
    except KeyboardInterrupt:
        pass  # Ctrl-C ends a follow quietly
    except BrokenPipeError:
        # The reader went away (`| head`): stop quietly, and keep Python's exit-time flush
        # from raising again on the closed pipe.
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        except (OSError, ValueError):
            pass


def daemon_status(as_json: bool) -> int | None:
    """`daemon status`: whether the daemon runs, its pid, uptime, memory, the queue's size;
    3 when none runs."""
    from det_local import api
    from det_local.client.daemonctl import status as daemon_status

    st = daemon_status(api.paths())
    if st["running"]:
        st["federation"] = _federation(api.paths())
    if as_json:
        from det_local.cli.common import print_json

        print_json(st)
        return None
    if st["running"]:
        print(
            f"det-local daemon {st['pid']} running for {st['home']}, up {st['uptime_s']:.0f}s, "
            f"{st.get('rss_mb', '?')} MB"
        )
        containment = st.get("containment")
        if isinstance(containment, dict) and containment.get("text"):
            print(f"containment: {containment['text']}")
        fed = st["federation"]
        if fed.get("federation") == "on":
            print(
                f"federation: on, node {fed['node']}, port {fed['port']}, "
                f"{fed['live_peers']} live peer(s)"
            )
            if fed.get("collision"):
                print(f"federation: {fed['collision']}")
        else:
            print(f"federation: off ({fed.get('why') or 'unknown'})")
    else:
        print(f"no det-local daemon is running for {st['home']}")
    print(
        f"jobs: {st['running_jobs']} running, {st['queued']} queued; "
        f"{st['pending_requests']} request(s) waiting in the spool"
    )
    return None if st["running"] else 3


def _federation(paths: object) -> dict[str, object]:
    """What the daemon's federation says of itself (its cluster socket), or why not."""
    from det_local.errors import DetLocalError
    from det_local.federate.client import request

    try:
        value = request(paths, {"t": "status"}, timeout=5.0)  # type: ignore[arg-type]
    except DetLocalError as err:
        return {"federation": "off", "why": str(err)}
    return dict(value) if isinstance(value, dict) else {"federation": "off", "why": "no answer"}


def _pool_cell(pool: str, job: object) -> str:
    """A job's pool; a run in a Slurm pool: its Slurm job (the job's pid column)."""
    pid = getattr(job, "pid", None)
    if pool == "default" or not pid:
        return pool
    return f"{pool} (Slurm job {pid})"

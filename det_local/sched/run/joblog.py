"""The daemon's log lines for jobs: one when a job's process starts, one when it has ended.

    job 7 started: trial 2 of experiment 1, user alice, slots [0], pid 4242
    job 7 ended: trial 2 of experiment 1, user alice, slots [0]; it exited with code 0; queued again

They go to the daemon's log only (not the store's events: a queue of short commands would
flood them); an embedded run (`det-local run`) prints neither. A command's name (its argv
joined, unless named) is shown with secret-looking option values hidden, as `cmd list` shows it.
"""

from __future__ import annotations

from det_local.masking import hide_secrets_in_line
from det_local.sched.life.outcome import describe_exit
from det_local.store.states import JobKind, JobState
from det_local.store.tables.jobs import JobRecord

NAME_MAX = 60


def what(job: JobRecord) -> str:
    """A job as a person names it, with its owner and slots."""
    if job.trial_id is not None:
        thing = f"trial {job.trial_id} of experiment {job.experiment_id}"
        if job.kind != JobKind.TRIAL:
            thing = f"{job.kind.lower()} ({thing})"
    else:
        # by default a command's argv joined: secret-looking values hidden as `cmd list` hides
        # them (det_local/masking.py), before it is cut
        name = hide_secrets_in_line(job.name)
        name = name if len(name) <= NAME_MAX else name[: NAME_MAX - 3] + "..."
        thing = f"{job.kind.lower()} {name!r}"
    return f"{thing}, user {job.user}, slots {list(job.slots)}"


def started(job: JobRecord, pid: int) -> str:
    return f"job {job.id} started: {what(job)}, pid {pid}"


def ended(job: JobRecord, code: int, after: JobRecord | None) -> str:
    """job: as it was when its process ended (its slots still held); after: as the engine
    left it (done, queued again, or still running while a gang's other ranks stop)."""
    said = describe_exit(code)  # "exited with code 0", "was killed by SIGTERM"...
    line = f"job {job.id} ended: {what(job)}; it {said}"
    if after is None:
        return line
    if after.state == JobState.QUEUED:
        line += "; queued again"
    elif after.state == JobState.SCHEDULED:
        line += "; its gang's other ranks are stopping"
    if after.message and not after.message.endswith(said):  # not the same words again
        line += f" ({after.message})"
    return line

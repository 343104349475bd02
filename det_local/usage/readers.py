"""What the CLI, the SDK and the dashboard read of system metrics, idle reservations and
usage (`det_local.api` re-exports these): one reader, one set of keys."""

from __future__ import annotations

import time
from typing import Any

from det_local.errors import NotFoundError
from det_local.store.db import Store
from det_local.store.records import MetricRecord
from det_local.usage.report import report

SYSTEM = "system"


def system_metrics(
    store: Store, *, trial_id: int | None = None, job_id: int | None = None
) -> list[MetricRecord]:
    """A trial's (or a command's) system samples as metric reports of group "system" (steps
    0: the sampler does not know the trial's steps; a downsampled row is the mean of its
    span's samples and says so in ``span_s``)."""
    rows = store.usage.samples(trial_id=trial_id, job_id=job_id)
    owner = trial_id if trial_id is not None else int(job_id or 0)
    out = []
    for run_id, t, span, metrics in rows:
        m = dict(metrics)
        if span:
            m["span_s"] = span
        out.append(MetricRecord(owner, run_id, SYSTEM, 0, t, m))
    return out


def command_metrics(store: Store, job_id: int) -> list[MetricRecord]:
    """A command's (notebook's, shell's) system metrics; NotFoundError for an unknown job or
    one without samples yet."""
    job = store.jobs.get(job_id)
    records = system_metrics(store, job_id=job_id)
    if not records:
        raise NotFoundError(
            f"job {job_id} ({job.kind.lower()}) has no system metrics yet: the daemon samples "
            "running jobs every few seconds (daemon.yaml system_metrics)"
        )
    return records


def idle_notes(store: Store, job_ids: list[int] | None = None) -> dict[int, str]:
    """One line per job flagged idle (its owner's notice): job id -> line."""
    out = {}
    for job_id, st in store.usage.idle_states(job_ids).items():
        if st.flagged_at is None or st.idle_since is None:
            continue
        idle_for = st.flagged_at - st.idle_since
        done = (
            "stopped (idle_policy stop)"
            if st.action == "stopped"
            else "still holding its slots (idle_policy notify)"
        )
        stamp = time.strftime("%H:%M:%S", time.localtime(st.idle_since))
        out[job_id] = f"job {job_id}: slots idle since {stamp} ({idle_for:.0f}s), flagged; {done}"
    return out


def usage(
    store: Store, *, since: float, by: str = "user", until: float | None = None
) -> dict[str, Any]:
    return report(store.usage, since=since, until=until, by=by)

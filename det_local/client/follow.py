"""Following an experiment: its trials' output as it is written, then a summary.

For a search (a searcher other than single, or more than one trial) the follower also prints a
compact progress line whenever the search's state changes (a trial starts, ends, is stopped by
the searcher, or a new best validation arrives), not on every poll:

    [search] 2 running, 9 queued, 1 completed, 4 stopped of 16; best loss 0.1167 (trial 3)

It is written between whole lines of trial output (trial output is only ever written up to its
last newline), so the two never share a line.
"""

from __future__ import annotations

import math
import os
import time
from typing import IO, Any

from det_local.store.db import Store
from det_local.store.logtail import LogTail, follow_async
from det_local.store.paths import Paths
from det_local.store.states import CheckpointState, JobState, State

POOL_CHECK_S = 0.5  # how often a follower looks for a pool's job ids (a search's many trials)


class Follower:
    """Tails every trial log of one experiment; prefixes lines with the trial id when there are
    several trials (always, with ``prefix_all``)."""

    def __init__(
        self,
        store: Store,
        paths: Paths,
        experiment_id: int,
        out: IO[str] | None,
        offsets: dict[int, int] | None = None,
        *,
        prefix_all: bool = False,
    ) -> None:
        """offsets: trial id -> where to start in its log (`log_ends`: what was shown
        before, e.g. by the run an `experiment activate` resumes); the start otherwise."""
        self.prefix_all = prefix_all
        self.store = store
        self.paths = paths
        self.experiment_id = experiment_id
        self.out = out
        self.offsets: dict[int, int] = dict(offsets or {})
        self.tails: dict[int, LogTail] = {}
        self._stop = False
        self._search: SearchProgress | None = None
        self._search_checked = False
        self._pooled: bool | None = None  # its trials run in a pool other than this machine's
        self._pool_jobs: dict[int, int] = {}  # trial id -> the pool's job announced for it
        self._pool_checked_at = 0.0

    def stop(self) -> None:
        self._stop = True

    def pump(self) -> bool:
        """Prints what is new; returns whether any trial output was read."""
        trials = self.store.list_trials(self.experiment_id)
        got = self._pump_logs(trials)
        self._pump_pool_jobs(trials)
        self._pump_progress(trials)
        return got

    def _pump_pool_jobs(self, trials: list[Any]) -> None:
        """A trial of a Slurm pool: `trial 1 -> Slurm job 4 (pool hpc)` once Slurm accepted
        each of its runs (looked at every POOL_CHECK_S, never for this machine's pool), between
        whole lines of output as the search's lines are."""
        if self.out is None or self._pooled is False:
            return
        now = time.monotonic()
        if now - self._pool_checked_at < POOL_CHECK_S:
            return
        self._pool_checked_at = now
        from det_local.pools import pool_job

        if self._pooled is None:
            rec = self.store.get_experiment(self.experiment_id)
            pool = (rec.config.get("resources") or {}).get("resource_pool")
            self._pooled = bool(pool) and pool != "default"
            if not self._pooled:
                return
        for t in trials:
            if t.state != State.ACTIVE:
                continue
            found = pool_job(self.store, self.experiment_id, t.id)
            if found is not None and self._pool_jobs.get(t.id) != found[1]:
                self._pool_jobs[t.id] = found[1]
                self.out.write(f"trial {t.id} -> Slurm job {found[1]} (pool {found[0]})\n")
                self.out.flush()

    def _pump_progress(self, trials: list[Any]) -> None:
        if self.out is None:
            return
        if self._search is None:
            if self._search_checked and len(trials) <= 1:
                return
            self._search_checked = True
            self._search = SearchProgress.for_experiment(self.store, self.experiment_id, trials)
            if self._search is None:
                return
        line = self._search.update(trials)
        if line is not None:
            self.out.write(line + "\n")
            self.out.flush()

    def _pump_logs(self, trials: list[Any]) -> bool:
        out = self.out
        if out is None:  # --quiet: nothing to read either
            return False
        many = self.prefix_all or len(trials) > 1
        got = False
        for t in trials:
            tail = self.tails.get(t.id)
            if tail is None:
                path = self.paths.trial_log(self.experiment_id, t.id)
                tail = self.tails[t.id] = LogTail(path, start=self.offsets.get(t.id, 0))

            def write(data: bytes, trial_id: int = t.id) -> None:
                text = data.decode("utf-8", "replace")
                if many:
                    text = "".join(f"[trial {trial_id}] {line}\n" for line in text.splitlines())
                out.write(text)

            if tail.pump(write):
                got = True
                out.flush()
        return got

    def _finished(self) -> bool:
        rec = self.store.get_experiment(self.experiment_id)
        if rec.state.terminal:
            return True
        if rec.state == State.PAUSED:
            return all(t.state != State.ACTIVE for t in self.store.list_trials(self.experiment_id))
        return False

    async def run(self, poll: float = 0.05, until_stopped: bool = False) -> None:
        """Prints until stop() (or, with until_stopped, until the experiment ends or pauses),
        then what is left, partial last lines included."""
        await follow_async(
            self.pump, lambda: self._stop or (until_stopped and self._finished()), poll=poll
        )
        self.write_rest()

    def write_rest(self) -> None:
        """The partial last lines the trials left (at the end of a follow)."""
        if self.out is None:
            return
        many = self.prefix_all or len(self.tails) > 1
        for trial_id, tail in self.tails.items():
            if rest := tail.rest():
                text = rest.decode("utf-8", "replace")
                self.out.write((f"[trial {trial_id}] " if many else "") + text + "\n")
        self.out.flush()


def log_ends(store: Store, paths: Paths, experiment_id: int) -> dict[int, int]:
    """trial id -> the size of its log now: a Follower given these shows only what comes next."""
    ends = {}
    for t in store.list_trials(experiment_id):
        try:
            ends[t.id] = os.path.getsize(paths.trial_log(experiment_id, t.id))
        except OSError:
            pass
    return ends


class SearchProgress:
    """The one-line state of a search: trials running, queued, paused, completed, stopped early
    by the searcher, failed; the number the searcher will create; the best validation so far.
    `update` returns a line only when that line changed."""

    def __init__(self, store: Store, search: dict[str, Any]) -> None:
        self.store = store
        self.search = search  # det_local.search.plan() of the experiment's config
        self.metric = search.get("metric")
        self.smaller = bool(search.get("smaller_is_better", True))
        self.total: int | None = search.get("trials")
        self.ended: dict[int, str] = {}  # trial id -> how it ended (never changes again)
        self.signature: tuple[Any, ...] | None = None
        self.recheck = False
        self.last: str | None = None

    @classmethod
    def for_experiment(
        cls, store: Store, experiment_id: int, trials: list[Any]
    ) -> SearchProgress | None:
        """A SearchProgress when the experiment is a search, else None."""
        config = store.get_experiment(experiment_id).config or {}
        searcher = config.get("searcher") or {}
        if searcher.get("name", "single") == "single" and len(trials) <= 1:
            return None
        try:
            from det_local.config import parse_config
            from det_local.search import plan

            search = plan(parse_config(config, source=f"experiment {experiment_id}"))
        except Exception:  # a config this version cannot plan: no total, no early stops
            search = {
                "metric": searcher.get("metric"),
                "smaller_is_better": searcher.get("smaller_is_better", True),
            }
        return cls(store, search)

    def kind(self, trial: Any) -> str:
        """How the trial stands or ended (the words of `_kind`)."""
        return self._kind(trial)

    def _kind(self, trial: Any) -> str:
        """running, queued, paused, completed, stopped, invalid, errored or canceled."""
        state = trial.state
        if state in (State.COMPLETED, State.ERROR, State.CANCELED):
            kind = self.ended.get(trial.id)
            if kind is None:
                kind = {State.ERROR: "errored", State.CANCELED: "canceled"}.get(state)
                kind = kind or self._how_completed(trial)
                self.ended[trial.id] = kind
            return kind
        if state == State.PAUSED:
            return "paused"
        if state == State.ACTIVE:
            job = self.store.jobs.for_trial(trial.id)
            return "running" if job is not None and job.state == JobState.SCHEDULED else "queued"
        return "running"  # STOPPING_*: its process is still there

    def _how_completed(self, trial: Any) -> str:
        """completed (trained its full length), stopped (early, by ASHA) or invalid."""
        job = self.store.jobs.for_trial(trial.id)
        why = job.message if job is not None else None
        if why == "invalid_hp":
            return "invalid"
        search = self.search
        if search.get("generation") == "stopping":
            # 0.38 ASHA stops every trial it is done with, those at the top rung included: a
            # stop is early when the trial's time metric had not reached max_time
            if why != "stopped":
                return "completed"
            val = self.store.latest_metrics(trial.id, "validation")
            time_metric = str(search.get("time_metric"))
            reached = val.metrics.get(time_metric) if val is not None else None
            if isinstance(reached, int | float) and reached >= search["max_time"]:
                return "completed"
            return "stopped"
        if (
            # <=0.37: trials not continued end (or are closed) short of max_length, which
            # counts in batches (or a bare number); records and epochs cannot be compared
            search.get("generation") in ("promotion", "stop_once")
            and search.get("time_metric") in ("batches", "unitless")
            and trial.steps_completed < search["max_time"]
        ):
            return "stopped"
        return "completed"

    def update(self, trials: list[Any]) -> str | None:
        # what the line depends on, but for the running/queued split: that changes with the
        # trial's run id (a new run when a queued trial is given its slots)
        # (another process's engine writes a trial's new run id and its job's SCHEDULED state
        # one after the other: the poll after a change looks once more)
        signature = tuple((t.id, t.state, t.run_id, t.best_validation) for t in trials)
        if signature == self.signature:
            if not self.recheck:
                return None
            self.recheck = False
        else:
            self.recheck = True
        self.signature = signature
        line = self.line(trials)
        if line == self.last:
            return None
        self.last = line
        return line

    def line(self, trials: list[Any]) -> str:
        counts: dict[str, int] = {}
        for t in trials:
            kind = self._kind(t)
            counts[kind] = counts.get(kind, 0) + 1
        parts = [f"{counts.get('running', 0)} running"]
        for kind in ("queued", "paused", "completed", "stopped", "invalid", "errored", "canceled"):
            if kind in ("completed", "stopped") or counts.get(kind):
                parts.append(f"{counts.get(kind, 0)} {kind}")
        text = "[search] " + ", ".join(parts)
        if self.total is not None:
            text += f" of {max(self.total, len(trials))}"
        scored = [t for t in trials if t.best_validation is not None]
        if scored:
            sign = 1.0 if self.smaller else -1.0
            best = min(scored, key=lambda t: (sign * t.best_validation, t.id))
            text += f"; best {self.metric} {_fmt(best.best_validation)} (trial {best.id})"
        return text


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:.6g}"
    return str(value)


def summary(store: Store, experiment_id: int, elapsed: float) -> str:
    from det_local.textsafe import visible

    rec = store.get_experiment(experiment_id)
    name = visible(rec.name)  # `experiment wait` and `logs -f` show other users' experiments
    lines = [f"Experiment {experiment_id} ({name}) {rec.state.value} after {elapsed:.1f}s"]
    trials = store.list_trials(experiment_id)
    if (
        rec.message
        and rec.state != State.COMPLETED
        and all(t.message != rec.message for t in trials)
    ):
        lines.append(f"  {visible(rec.message)}")
    if len(trials) > 1:  # a search: best first, a few rows, the best trial's checkpoint
        from det_local.client.searchsummary import search_lines

        lines += search_lines(store, experiment_id, trials, stopped_early(store, experiment_id))
        trials = []
    for t in trials:
        lines.append(
            f"  trial {t.id}: {t.state.value}, steps_completed={t.steps_completed}"
            + (f", restarts={t.restarts}" if t.restarts else "")
        )
        val = store.latest_metrics(t.id, "validation")
        if val is not None:
            shown = ", ".join(f"{k}={_fmt(v)}" for k, v in val.metrics.items())
            lines.append(f"    last validation (steps_completed={val.steps_completed}): {shown}")
        every = store.list_checkpoints(trial_id=t.id)
        ckpts = [c for c in every if c.state == CheckpointState.COMPLETED]
        if ckpts:
            last = ckpts[-1]
            lines.append(
                f"    checkpoints: {len(ckpts)}, latest {last.uuid} "
                f"(steps_completed={last.steps_completed})"
            )
        removed = sum(c.state == "DELETED" for c in every)
        if removed:
            lines.append(f"    {gc_note(removed, rec.config)}")
        if t.message:  # why it failed, or why it ended early (InvalidHP)
            lines.append(f"    {visible(t.message)}")
    if rec.state == State.PAUSED:
        lines.append(f"  resume with: det-local experiment activate {experiment_id}")
    return "\n".join(lines)


def stopped_early(store: Store, experiment_id: int) -> set[int]:
    """The trials the searcher stopped before their full length (ASHA), as the `[search]`
    line counts them: Determined records them as COMPLETED."""
    trials = store.list_trials(experiment_id)
    progress = SearchProgress.for_experiment(store, experiment_id, trials)
    if progress is None:
        return set()
    return {t.id for t in trials if progress.kind(t) == "stopped"}


def gc_note(removed: int, config: dict[str, Any]) -> str:
    """Why fewer checkpoints are left than were saved: checkpoint GC's rule as it applied (the
    config's values, Determined's defaults for those it leaves out: `ckpt_gc.GcPolicy`)."""
    from det_local.sched.life.ckpt_gc import GcPolicy

    policy = GcPolicy.from_config(config)
    keep = ", ".join(
        f"{k} {getattr(policy, k)}"
        for k in ("save_trial_latest", "save_trial_best", "save_experiment_best")
    )
    word = "checkpoint" if removed == 1 else "checkpoints"
    return f"{removed} older {word} removed by checkpoint GC (checkpoint_storage: {keep})"


# ---------------------------------------------------------------------------- commands
def command_exit_status(job: Any) -> int:
    """The exit status for an ended command's job, as a shell reports it (128+N for a signal;
    1, with its message on stderr, when it has none: it never started, or was canceled)."""
    import sys

    if job.message and job.exit_code is None:
        print(f"det-local: {job.message}", file=sys.stderr)
    code = job.exit_code
    return 1 if code is None else (code if 0 <= code < 256 else 128 + abs(code))


def follow_command(paths: Paths, job_id: int, poll: float = 0.05) -> int:
    """Stream a command's output to stdout until it ends (reading the store as a client);
    returns its exit status."""
    import codecs
    import sys

    from det_local.store.logtail import LogTail, follow
    from det_local.store.tables.jobs import ENDED

    tail = LogTail(paths.command_log(job_id), lines=False)  # partial lines too: prompts, progress
    text = codecs.getincrementaldecoder("utf-8")("replace")
    job = None

    def write(data: bytes) -> None:
        sys.stdout.write(text.decode(data))
        sys.stdout.flush()

    def done() -> bool:
        nonlocal job
        store = Store(paths.db, readonly=True)
        try:
            job = store.jobs.get(job_id)
        finally:
            store.close()
        return job.state in ENDED

    follow(lambda: tail.pump(write), done, poll=poll)
    write(b"")
    assert job is not None
    return command_exit_status(job)

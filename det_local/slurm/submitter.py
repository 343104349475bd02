"""A trial run's ``sbatch``, off the engine's loop, tried again while Slurm's controller is
unreachable.

``sbatch`` against a controller that does not answer takes Slurm's MessageTimeout (10 s by
default) to fail, so a submission never runs on the engine's event loop: each is a thread of
its own (:func:`submit`), and other runs and other pools submit meanwhile. The launcher reads
the outcome from the :class:`Submission` on its bounded tick.

* A transient failure (`client.TRANSIENT`: "Unable to contact slurm controller", "Socket timed
  out", "Resource temporarily unavailable", ...; or sbatch not answering in `client.TIMEOUT_S`)
  is tried again after 1, 2, 4, 8, 15, then every 30 s, for at most the pool's
  ``submit_retry`` seconds (120 by default). Slurm's commands exit 1 for every error, so the
  text decides, not the exit status.
* Any other failure (an invalid partition, a bad option) ends the submission at once, with
  sbatch's own line.
* After the budget, the last sbatch line, and how long and how often it was tried.
* ``scancel`` too runs in a thread (:func:`cancel`), tried again the same way while slurmctld
  is unreachable (for up to an hour), so a kill during an outage reaches the job once Slurm
  answers, and the engine's loop never waits for it.
* :func:`find`: a run whose sbatch was under way when the daemon stopped (no job id recorded),
  found again at a restart by asking Slurm (`launcher._submitted_unrecorded`) while slurmctld
  does not answer: tried again the same way (for up to an hour), never submitted meanwhile; the
  answer "no such job" is taken only when it is given twice ``CONFIRM_S`` apart (an sbatch the
  old daemon left may still be reaching a controller that just came back).
* :meth:`Submission.cancel` (a pause, a kill) stops the retries; a job that sbatch created while
  it was being cancelled is cancelled as soon as its id is known (under one lock, so neither
  side misses it).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from det_local.errors import TrialError
from det_local.slurm import client

RETRY_DELAYS_S = (1.0, 2.0, 4.0, 8.0, 15.0, 30.0)  # then 30 s apart
CANCEL_RETRY_S = 3600.0  # a kill or pause must reach its job once slurmctld answers again
FIND_RETRY_S = 3600.0  # how long a restart asks Slurm whether an unrecorded sbatch made a job
CONFIRM_S = 15.0  # "no such job" after an outage: asked again this much later before believed


class Submission:
    """One batch script on its way to Slurm: its job id once sbatch answered, or why not."""

    def __init__(self, budget_s: float) -> None:
        self.budget_s = budget_s
        self.job_id: int | None = None
        self.error: str | None = None  # sbatch refused it (or never answered within the budget)
        self.cancelled = False
        self.absent = False  # `find`: Slurm has no job of it (its sbatch never made one)
        self.attempts = 0
        self.done = threading.Event()
        self._lock = threading.Lock()
        self._wake = threading.Event()

    def cancel(self) -> int | None:
        """No more tries; the job id when sbatch already gave one (the caller cancels it)."""
        with self._lock:
            self.cancelled = True
            self._wake.set()
            return self.job_id

    def _submitted(self, job_id: int) -> bool:
        """Record the id; False when the submission was cancelled meanwhile."""
        with self._lock:
            self.job_id = job_id
            return not self.cancelled


def submit(
    script: str,
    uid: int | None,
    env: dict[str, str] | None,
    budget_s: float,
    on_job: Callable[[int], None],
) -> Submission:
    """Start submitting ``script`` (sbatch as ``uid``, in ``env``); ``on_job(id)`` is called
    from the submitting thread once Slurm gave the job id (the poller watches it)."""
    sub = Submission(budget_s)
    threading.Thread(
        target=_submit, args=(sub, script, uid, env, on_job), name="slurm-sbatch", daemon=True
    ).start()
    return sub


def _submit(
    sub: Submission,
    script: str,
    uid: int | None,
    env: dict[str, str] | None,
    on_job: Callable[[int], None],
) -> None:
    began = time.monotonic()
    try:
        while not sub.cancelled:
            sub.attempts += 1
            try:
                job_id = client.sbatch(script, uid, env)
            except client.Unreachable as err:
                waited = time.monotonic() - began
                delay = RETRY_DELAYS_S[min(sub.attempts, len(RETRY_DELAYS_S)) - 1]
                if waited + delay > sub.budget_s:
                    tries = f"{sub.attempts} tr{'ies' if sub.attempts > 1 else 'y'}"
                    sub.error = (
                        f"{err} (Slurm's controller did not answer for {waited:.0f}s, "
                        f"{tries}; the pool's submit_retry is {sub.budget_s:g}s)"
                    )
                    return
                sub._wake.wait(delay)
                continue
            except TrialError as err:
                sub.error = str(err)
                return
            keep = sub._submitted(job_id)
            on_job(job_id)  # watched either way: its end is the run's
            if not keep:
                _cancel(job_id, None, CANCEL_RETRY_S)  # cancelled while sbatch ran
            return
    except Exception as err:  # noqa: BLE001 - the run ends with it rather than waiting forever
        sub.error = f"sbatch could not be run: {err}"
    finally:
        sub.done.set()


def find(
    lookup: Callable[[], int], on_job: Callable[[int], None], budget_s: float = FIND_RETRY_S
) -> Submission:
    """Ask Slurm, from a thread, for the job an unrecorded sbatch may have made (``lookup``:
    its id, 0 when there is none; `client.Unreachable` while slurmctld does not answer), until
    it answers or ``budget_s`` has passed (``error`` then: whether it made one is unknown)."""
    sub = Submission(budget_s)
    threading.Thread(
        target=_find, args=(sub, lookup, on_job), name="slurm-find", daemon=True
    ).start()
    return sub


def _find(sub: Submission, lookup: Callable[[], int], on_job: Callable[[int], None]) -> None:
    began = time.monotonic()
    absent_at: float | None = None  # when Slurm first said it had no such job
    try:
        while not sub.cancelled:
            sub.attempts += 1
            try:
                job_id = lookup()
            except client.Unreachable as err:
                waited = time.monotonic() - began
                delay = RETRY_DELAYS_S[min(sub.attempts, len(RETRY_DELAYS_S)) - 1]
                if waited + delay > sub.budget_s:
                    sub.error = (
                        f"{err} (Slurm's controller did not answer for {waited:.0f}s): whether "
                        "the run's sbatch, under way when the daemon stopped, made a job is "
                        "unknown; the trial is not submitted again (scancel that job if squeue "
                        "shows it)"
                    )
                    return
                sub._wake.wait(delay)
                continue
            if job_id:
                keep = sub._submitted(job_id)
                on_job(job_id)
                if not keep:
                    _cancel(job_id, None, CANCEL_RETRY_S)
                return
            if absent_at is None:
                absent_at = time.monotonic()
                sub._wake.wait(CONFIRM_S)
                continue
            sub.absent = True
            return
    except Exception as err:  # noqa: BLE001 - the run ends with it rather than waiting forever
        sub.error = f"Slurm could not be asked for the run's job: {err}"
    finally:
        sub.done.set()


def cancel(job: int, signal: str | None = None, budget_s: float = CANCEL_RETRY_S) -> None:
    """``scancel [--signal=S] JOB`` from a thread of its own; tried again while slurmctld is
    unreachable, for at most ``budget_s``; any other failure means the job is gone."""
    threading.Thread(
        target=_cancel, args=(job, signal, budget_s), name="slurm-scancel", daemon=True
    ).start()


def _cancel(job: int, signal: str | None, budget_s: float) -> None:
    argv = ["scancel", *([f"--signal={signal}"] if signal else []), str(job)]
    began = time.monotonic()
    tries = 0
    while True:
        tries += 1
        try:
            client.run(argv)
            return
        except client.Unreachable:
            delay = RETRY_DELAYS_S[min(tries, len(RETRY_DELAYS_S)) - 1]
            if time.monotonic() - began + delay > budget_s:
                return
            time.sleep(delay)
        except TrialError:
            return  # already gone

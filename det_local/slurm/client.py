"""Slurm's commands, as det-local uses them: sbatch, squeue, scontrol, scancel.

Each runs with a bound (``TIMEOUT_S``) and its failure becomes one line. Job states come from
one batched ``squeue`` call for every job det-local watches (:class:`Poller`), at most every
``interval`` seconds, backing off while nothing changes; a job squeue no longer lists is read
once with ``scontrol show job`` (its state and exit code, kept by Slurm for MinJobAge).

Submission is as the experiment's submitter: a user-mode daemon submits as itself; a root
daemon runs ``runuser -u USER --`` (util-linux), keeping its own environment (SLURM_CONF).
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import time
from dataclasses import dataclass, field

from det_local.errors import TrialError

TIMEOUT_S = 30.0
POLL_MIN_S = 0.25  # looking at squeue again: at first, after a change
POLL_MAX_S = 2.0  # at most this long apart while jobs run
ENDED = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "PREEMPTED",
    "BOOT_FAIL",
    "DEADLINE",
    "OUT_OF_MEMORY",
}


def tool(name: str) -> str:
    """The command's path; TrialError (one line) when it is not installed."""
    path = shutil.which(name)
    if path is None:
        raise TrialError(
            f"{name} is not on the daemon's PATH ({os.environ.get('PATH', '')}): install "
            "Slurm's client commands (slurm-client) or start the daemon where they are"
        )
    return path


def _one_line(text: str) -> str:
    """A command's several lines of error as one (each kept, in order, "; " between)."""
    lines = [" ".join(line.split()) for line in text.splitlines()]
    return "; ".join(line for line in lines if line) or "no output"


def run(argv: list[str], *, stdin: str | None = None, uid: int | None = None) -> str:
    """Run a Slurm command (as ``uid`` when the daemon is root and it is another user); its
    stdout, or TrialError with its stderr in one line."""
    argv = [tool(argv[0]), *argv[1:]]
    if uid is not None and os.geteuid() == 0 and uid != 0:
        argv = [tool("runuser"), "-u", pwd.getpwuid(uid).pw_name, "--", *argv]
    try:
        done = subprocess.run(
            argv,
            input=stdin,
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
            stdin=None if stdin is not None else subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired:
        raise TrialError(f"{argv[0]} did not answer in {TIMEOUT_S:.0f}s") from None
    if done.returncode != 0:
        name = os.path.basename(argv[4] if argv[0].endswith("runuser") else argv[0])
        raise TrialError(f"{name} failed: {_one_line(done.stderr or done.stdout)}")
    return done.stdout


def sbatch(script: str, uid: int | None) -> int:
    """Submit a batch script (on stdin); the Slurm job id."""
    out = run(["sbatch", "--parsable"], stdin=script, uid=uid).strip()
    try:
        return int(out.split(";")[0])
    except ValueError:
        raise TrialError(f"sbatch answered {out!r}, not a job id") from None


def scancel(job: int, *, signal: str | None = None, batch: bool = False) -> None:
    argv = ["scancel"]
    if signal:
        argv.append(f"--signal={signal}")
    if batch:
        argv.append("--batch")
    try:
        run([*argv, str(job)])
    except TrialError:
        pass  # already gone


@dataclass
class JobState:
    state: str  # Slurm's JobState (PENDING, RUNNING, COMPLETED, ...)
    code: int | None = None  # exit status once ended: N, or -S for a signal
    reason: str = ""

    @property
    def ended(self) -> bool:
        return self.state in ENDED


def show_job(job: int) -> JobState | None:
    """``scontrol show job``: its state and exit code; None when Slurm has forgotten it."""
    try:
        out = run(["scontrol", "show", "job", "-o", str(job)])
    except TrialError:
        return None
    fields = dict(
        item.split("=", 1) for item in out.split() if "=" in item and not item.startswith("=")
    )
    state = fields.get("JobState", "UNKNOWN")
    code: int | None = None
    if "ExitCode" in fields:
        status, _, sig = fields["ExitCode"].partition(":")
        try:
            code = -int(sig) if sig and int(sig) else int(status)
        except ValueError:
            code = None
    return JobState(state, code, fields.get("Reason", ""))


@dataclass
class Poller:
    """The state of every watched job, from one squeue call per ``interval`` (bounded)."""

    states: dict[int, JobState] = field(default_factory=dict)
    interval: float = POLL_MIN_S
    next_at: float = 0.0

    def watch(self, job: int) -> None:
        self.states.setdefault(job, JobState("PENDING"))
        self.interval = POLL_MIN_S
        self.next_at = min(self.next_at, time.monotonic() + POLL_MIN_S)

    def forget(self, job: int) -> None:
        self.states.pop(job, None)

    def hurry(self) -> None:
        """Something happened (a signal sent): look again soon."""
        self.interval = POLL_MIN_S
        self.next_at = min(self.next_at, time.monotonic() + POLL_MIN_S)

    def refresh(self, *, force: bool = False) -> None:
        now = time.monotonic()
        live = [j for j, s in self.states.items() if not s.ended]
        if not live or (not force and now < self.next_at):
            return
        try:
            out = run(
                ["squeue", "-h", "-t", "all", "-j", ",".join(map(str, live)), "-o", "%i|%T|%r"]
            )
        except TrialError:
            out = ""  # every id unknown (squeue fails then): each is looked up below
        seen: dict[int, tuple[str, str]] = {}
        for line in out.splitlines():
            parts = line.strip().split("|")
            if len(parts) == 3 and parts[0].isdigit():
                seen[int(parts[0])] = (parts[1], parts[2])
        changed = False
        for job in live:
            state, reason = seen.get(job, ("", ""))
            old = self.states[job]
            if state and state not in ENDED:
                if state != old.state:
                    changed = True
                self.states[job] = JobState(state, None, reason)
                continue
            shown = show_job(job)  # ended, or forgotten: its exit code
            self.states[job] = shown or JobState("GONE", None, "Slurm no longer knows the job")
            if shown is not None and not shown.ended:
                self.states[job] = JobState(shown.state, None, shown.reason)
            changed = True
        self.interval = POLL_MIN_S if changed else min(self.interval * 2, POLL_MAX_S)
        self.next_at = time.monotonic() + self.interval

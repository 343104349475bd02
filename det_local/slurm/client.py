"""Slurm's commands, as det-local uses them: sbatch, squeue, scontrol, scancel.

Each runs with a bound (``TIMEOUT_S``) in a session of its own, and its failure becomes one
line; past the bound its whole process group is killed (:func:`bounded`: runuser, the command
and whatever it started; a hanging sbatch leaves nothing behind). None runs on the engine's
event loop: the poller and the submissions have threads of their own, and the check at
submission runs in one too (`slurm/submit.py`). Job states come from
one batched ``squeue`` call for every job det-local watches (:class:`Poller`), at most every
``interval`` seconds, backing off while nothing changes; a job squeue no longer lists is read
once with ``scontrol show job`` (its state and exit code, kept by Slurm for MinJobAge).

Submission is as the experiment's submitter: a user-mode daemon submits as itself; a root
daemon runs ``runuser -u USER --`` (util-linux). sbatch runs in the job's own environment
(its plan's, and SLURM_CONF), never the daemon's (:func:`job_env`).
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import subprocess
import threading
from dataclasses import dataclass

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
# what Slurm's commands say when its controller cannot be reached just now (restarting, a
# failover, overloaded): worth trying again. Every Slurm error exits 1, so the text decides.
TRANSIENT = (
    "Unable to contact slurm controller",
    "Socket timed out",
    "Resource temporarily unavailable",
    "temporarily unable to accept job",
    "Zero Bytes were transmitted or received",
    "Connection refused",
    "Connection reset by peer",
    "Communication connection failure",
    "Slurm backup controller in standby mode",
)


class Unreachable(TrialError):
    """Slurm's controller did not answer (one of TRANSIENT, or no answer in TIMEOUT_S)."""


def transient(text: str) -> bool:
    return any(t.lower() in text.lower() for t in TRANSIENT)


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


def run(
    argv: list[str],
    *,
    stdin: str | None = None,
    uid: int | None = None,
    env: dict[str, str] | None = None,
    timeout: float = TIMEOUT_S,
) -> str:
    """Run a Slurm command (as ``uid`` when the daemon is root and it is another user; in
    ``env`` when given, else the daemon's environment); its stdout, or TrialError with its
    stderr in one line (:class:`Unreachable` when the controller did not answer)."""
    argv = [tool(argv[0]), *argv[1:]]
    if uid is not None and os.geteuid() == 0 and uid != 0:
        argv = [tool("runuser"), "-u", pwd.getpwuid(uid).pw_name, "--", *argv]
    done = bounded(argv, stdin, env, timeout)
    if done.returncode != 0:
        name = os.path.basename(argv[4] if argv[0].endswith("runuser") else argv[0])
        said = _one_line(done.stderr or done.stdout)
        raise (Unreachable if transient(said) else TrialError)(f"{name} failed: {said}")
    return done.stdout


def bounded(
    argv: list[str], stdin: str | None, env: dict[str, str] | None, timeout: float
) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` in a session of its own; past ``timeout`` its whole process group is
    killed (runuser, the Slurm command, and whatever they started: nothing is left behind)
    and :class:`Unreachable` says so."""
    proc = subprocess.Popen(
        argv,
        stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(stdin, timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        raise Unreachable(f"{argv[0]} did not answer in {timeout:.0f}s") from None
    except BaseException:
        _kill_group(proc)
        raise
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def _kill_group(proc: subprocess.Popen[str]) -> None:
    """SIGKILL every process of ``proc``'s group (its leader's session), then reap the leader
    and close its pipes (a process that left the group and holds them is not waited for)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        proc.communicate(timeout=1.0)
    except subprocess.TimeoutExpired:
        for pipe in (proc.stdin, proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()
        proc.wait()


def job_env(plan_env: dict[str, str]) -> dict[str, str]:
    """The environment sbatch runs in, which the job gets (``--export=ALL``): the plan's, and
    of the daemon's own only where Slurm's configuration is (SLURM_CONF, which srun in the job
    needs too). Exporting the submission's environment starts a job faster than
    ``--export=NONE``, which has slurmd load the user's login environment first."""
    env = dict(plan_env)
    if os.environ.get("SLURM_CONF"):
        env["SLURM_CONF"] = os.environ["SLURM_CONF"]
    return env


def sbatch(script: str, uid: int | None, env: dict[str, str] | None = None) -> int:
    """Submit a batch script (on stdin), sbatch in ``env``; the Slurm job id."""
    out = run(["sbatch", "--parsable"], stdin=script, uid=uid, env=env).strip()
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
    """``scontrol show job``: its state and exit code; None when Slurm has forgotten it
    (:class:`Unreachable` when Slurm cannot say)."""
    try:
        out = run(["scontrol", "show", "job", "-o", str(job)])
    except Unreachable:
        raise
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


class Poller:
    """The state of every watched job, from one squeue call per ``interval`` (bounded: at most
    every POLL_MIN_S, backing off to POLL_MAX_S while nothing changes), made by a thread of its
    own (``start``), so the engine's event loop never waits for Slurm: ``state`` is a read."""

    def __init__(self) -> None:
        self.down: str | None = None  # why Slurm's controller did not answer, while it does not
        self.states: dict[int, JobState] = {}
        self.interval = POLL_MIN_S
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="slurm-poller", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=TIMEOUT_S)
            self._thread = None

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.interval if self._live() else POLL_MAX_S)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self.refresh()
            except Exception:  # noqa: BLE001 - never let the poller die; looked at again later
                self.interval = POLL_MAX_S

    def _live(self) -> list[int]:
        with self._lock:
            return [j for j, s in self.states.items() if not s.ended]

    def state(self, job: int) -> JobState | None:
        with self._lock:
            return self.states.get(job)

    def watch(self, job: int) -> None:
        with self._lock:
            self.states.setdefault(job, JobState("PENDING"))
        self.hurry()

    def forget(self, job: int) -> None:
        with self._lock:
            self.states.pop(job, None)

    def hurry(self) -> None:
        """Something happened (a job submitted, a signal sent): look again soon."""
        self.interval = POLL_MIN_S
        self._wake.set()

    def refresh(self) -> None:
        """One squeue call for every watched job that has not ended (and scontrol once for
        each that has)."""
        live = self._live()
        if not live:
            return
        try:
            out = run(
                ["squeue", "-h", "-t", "all", "-j", ",".join(map(str, live)), "-o", "%i|%T|%r"]
            )
        except Unreachable as err:  # nothing learnt: every job keeps its last known state
            self._unreachable(err)
            return
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
            if state and state not in ENDED:
                new = JobState(state, None, reason)
            else:
                try:
                    shown = show_job(job)  # ended, or forgotten: its exit code
                except Unreachable as err:
                    self._unreachable(err)
                    return
                if shown is None:
                    new = JobState("GONE", None, "Slurm no longer knows the job")
                elif not shown.ended:
                    new = JobState(shown.state, None, shown.reason)
                else:
                    new = shown
            with self._lock:
                if job not in self.states:
                    continue  # forgotten meanwhile
                changed = changed or self.states[job].state != new.state
                self.states[job] = new
        self.down = None
        self.interval = POLL_MIN_S if changed else min(self.interval * 2, POLL_MAX_S)

    def _unreachable(self, err: TrialError) -> None:
        """squeue or scontrol could not reach slurmctld: no job is taken for ended (Slurm
        still runs them), and Slurm is asked again after POLL_MAX_S (the launcher says so in
        the daemon's log, from the engine's loop)."""
        self.down = str(err)
        self.interval = POLL_MAX_S

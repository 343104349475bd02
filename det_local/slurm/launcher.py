"""A Slurm pool's launcher: each trial run is one batch job (`sched/run/launcher.py`'s rules).

* spawn: the plan's batch script (`script.py`) goes to ``sbatch`` as the run's user, from a
  thread of its own, tried again while Slurm's controller is unreachable (`submitter.py`); the
  Slurm job id is the run's "pid" (0 until sbatch answered; the supervisor records it in the
  job's pid column as soon as it is known), so a restarted daemon finds the job again. A
  submission Slurm refused ends the run as ``unstarted`` with sbatch's line (the trial ERRORs,
  no restart spent).
* queued: a run whose job has not started (being submitted, or PENDING in Slurm) has no process
  to ask for a checkpoint: a pause or preemption cancels it at once (the engine asks).
* poll: the job's state from the pool's batched poller (`client.Poller`); once it has ended,
  its exit status. A run that ended for the cluster's reasons (cancelled by someone else, its
  time limit reached before it checkpointed, a node failure, Slurm's preemption) carries
  ``lost``: the engine requeues it from its latest checkpoint without spending max_restarts.
* signal: SIGTERM/SIGKILL cancel the job (``scancel``, from a thread, retried while slurmctld
  is unreachable; Slurm signals every process of it, then kills them after KillWait); another
  signal goes to every process of the job.
* adopt: a job Slurm still runs is watched again; a finished one is settled from its state.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import signal as signals
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from det_local.errors import TrialError
from det_local.sched.run import userfiles
from det_local.sched.run.launcher import Lost, RunHandle
from det_local.sched.run.launchplan import LaunchPlan
from det_local.slurm import client, rankexit, stage, submitter
from det_local.slurm.config import SlurmPool
from det_local.slurm.script import Shape, batch_script
from det_local.store.paths import Paths
from det_local.store.private import PrivateFiles
from det_local.store.tables.jobs import JobRecord

# Slurm states that are the cluster's doing, not the trial's
_LOST = {
    "TIMEOUT": "reached its Slurm time limit before it checkpointed",
    "NODE_FAIL": "lost its node (NODE_FAIL)",
    "PREEMPTED": "was preempted by Slurm",
    "BOOT_FAIL": "could not start on its node (BOOT_FAIL)",
    "DEADLINE": "passed its Slurm deadline",
}


@dataclass
class SlurmRun:
    job_id: int
    pid: int  # the Slurm job id
    started: float | None
    info_dir: str
    code: int | None = None
    problem: str | None = None
    lost: str | None = None  # why the run ended that is not the trial's doing
    cancelled: bool = False  # det-local cancelled it (kill, or a preemption that timed out)
    submission: submitter.Submission | None = None  # its sbatch, until Slurm gave the job id
    queued: bool = True  # not started yet: being submitted, or PENDING in Slurm
    waiting: str | None = "SUBMITTING (sbatch)"  # `job list`'s state while not running
    unstarted: str | None = None  # Slurm refused it (sbatch's line): it never ran
    nodes: int = rankexit.MAX_NODES  # Slurm nodes it asked for (adopted: not known)
    failed: str | None = None  # over several nodes: which failed first (`rankexit.py`)


def slots_of(plan: LaunchPlan) -> int:
    try:
        config = json.loads(plan.env.get("DET_EXPERIMENT_CONFIG", "{}"))
        return int((config.get("resources") or {}).get("slots_per_trial") or 1)
    except (ValueError, TypeError):
        return 1


class SlurmLauncher:
    def __init__(
        self,
        pool: SlurmPool,
        paths: Paths,
        note: Callable[..., None],
        pool_slots: Callable[[JobRecord], int | None] = lambda job: None,
    ) -> None:
        self.pool = pool
        self.paths = paths
        self.note = note
        self.pool_slots = pool_slots  # a command's slots (a trial's are in its config)
        self.poller = client.Poller()
        self.pump = stage.LogPump()  # staged logs into the runs' own (slurm.stage_dir)
        self._down: str | None = None  # the poller's last "controller unreachable", said once
        self._stage_key: bytes | None = None

    @property
    def stage_key(self) -> bytes:
        """What the runs' staged directories are named with (`stage.name_key`)."""
        if self._stage_key is None:
            self._stage_key = stage.name_key(PrivateFiles(self.paths).key())
        return self._stage_key

    def start(self) -> None:
        self.poller.start()
        self.pump.start()

    def stop(self) -> None:
        self.poller.stop()  # its jobs run on; the next engine adopts them
        self.pump.stop()

    # ------------------------------------------------------------------ rules 1, 2
    def spawn(self, job: JobRecord, plan: LaunchPlan) -> SlurmRun:
        slots = self.pool_slots(job) or slots_of(plan)
        key = self.stage_key if self.pool.stage_dir is not None else None
        script = batch_script(plan, self.pool, slots, key)
        log = Path(plan.log_path)
        log.parent.mkdir(parents=True, exist_ok=True)
        # the job's output file, created as its user (slurmstepd appends to it as the user)
        os.close(userfiles.open_log(log, userfiles.owner_of(plan)))
        info = Path(plan.info_dir)
        info.mkdir(parents=True, exist_ok=True)
        _own_slot_ids(info, Shape.of(slots, self.pool).per_node)
        # what was submitted, for people (the run's token left out: the file is readable)
        token = plan.env.get("DET_LOCAL_TOKEN")
        shown = script.replace(token, "<per-run token>") if token else script
        _write_new(info / "slurm-batch.sh", shown)
        staged = stage.for_pool(plan, self.pool, key)
        if self.pool.stage_dir is not None:  # the compute node sees the shared FS only
            stage.stage_run(plan, staged, userfiles.owner_of(plan))
        env = {k: v for k, v in plan.env.items() if k != "CUDA_VISIBLE_DEVICES"}
        sub = submitter.submit(
            script, plan.uid, client.job_env(env), self.pool.submit_retry, self.poller.watch
        )
        if self.pool.stage_dir is not None:
            root = Path(staged.log_path).parent
            self.pump.add(job.id, root, log, plan.info_dir, userfiles.owner_of(plan))
        nodes = Shape.of(slots, self.pool).nodes
        return SlurmRun(job.id, 0, time.time(), staged.info_dir, submission=sub, nodes=nodes)

    # ------------------------------------------------------------------ rules 3, 4, 5
    def wait_fd(self, handle: RunHandle) -> int | None:
        return None  # the supervisor's bounded tick; the poller bounds Slurm's calls

    def poll(self, handle: RunHandle) -> int | None:
        assert isinstance(handle, SlurmRun)
        self._say_down()
        sub = handle.submission
        if not handle.pid and sub is not None:
            if not sub.done.is_set():
                return None  # sbatch runs (or waits to be tried again)
            if sub.job_id is None:  # never became a job
                self.pump.finish(handle.job_id)  # a staged directory goes too
                if sub.cancelled:
                    return -signals.SIGTERM
                if sub.absent:  # found at a restart: its sbatch never made a job
                    handle.lost = "was never made: its sbatch ended with the daemon"
                    self.note(f"job {handle.job_id}: its Slurm job {handle.lost}", level="WARNING")
                    return -signals.SIGKILL
                handle.unstarted = sub.error or "sbatch gave no job id"
                return 1
            handle.pid = sub.job_id  # the supervisor records it
        st = self.poller.state(handle.pid)
        handle.queued = st is None or st.state == "PENDING"
        # what `job list` shows: Slurm's PENDING and its reason (Resources, Priority, ...)
        if not handle.queued:
            handle.waiting = None
        elif st is not None:
            handle.waiting = f"PENDING ({st.reason})" if st.reason else "PENDING"
        if st is None or not (st.ended or st.state == "GONE"):
            return None
        code = self._settle(handle, st)
        self.pump.finish(handle.job_id)  # its log whole before its exit is handled
        return code

    def _say_down(self) -> None:
        """The daemon's log says once when squeue stops answering, and once when it is back
        (from the engine's loop; the poller's thread only records it)."""
        down = self.poller.down
        if (down is None) == (self._down is None):
            return
        self._down = down
        if down is not None:
            self.note(
                f"Slurm pool '{self.pool.name}': Slurm's controller is unreachable ({down}); "
                f"its jobs keep their last known state (none is taken for lost) and Slurm is "
                f"asked again every {client.POLL_MAX_S:.0f}s",
                level="WARNING",
            )
        else:
            self.note(f"Slurm pool '{self.pool.name}': Slurm's controller answers again")

    def _settle(self, run: SlurmRun, st: client.JobState) -> int:
        code = st.code
        if st.state == "GONE":  # Slurm forgot it: what its batch shell wrote
            code = _exit_file(run.info_dir, run.pid)
            if code is None:
                run.lost = "ended while Slurm was not watched, and left no exit status"
        elif st.state == "CANCELLED" and not run.cancelled:
            run.lost = "was cancelled outside det-local (scancel by someone else, or an admin)"
        elif st.state in _LOST:
            run.lost = _LOST[st.state]
        elif st.state == "CANCELLED":
            code = code if code else -signals.SIGTERM
        if run.lost is not None:
            code = code if code else -signals.SIGKILL
            self.note(f"job {run.job_id}: Slurm job {run.pid} {run.lost}", level="WARNING")
        elif code and st.state != "CANCELLED" and run.nodes > 1:
            # several nodes: the first failing node's own code, and which it was
            first = rankexit.first_failure(rankexit.read_all(run.info_dir, run.pid, run.nodes))
            if first is not None:
                code, run.failed = first.code, first.describe(run.pid)
        return 0 if code is None else code

    def signal(self, handle: RunHandle | None, pid: int | None, sig: int) -> None:
        if isinstance(handle, SlurmRun) and not handle.pid and handle.submission is not None:
            # still being submitted: no more tries; a job sbatch made meanwhile is cancelled
            if sig in (signals.SIGTERM, signals.SIGKILL):
                handle.cancelled = True
                made = handle.submission.cancel()
                if made:
                    submitter.cancel(made)
                    self.poller.hurry()
            return
        slurm_id = handle.pid if handle is not None else pid
        if not slurm_id:
            return
        if sig in (signals.SIGTERM, signals.SIGKILL):
            if isinstance(handle, SlurmRun):
                handle.cancelled = True
            submitter.cancel(slurm_id)  # off the loop; retried while slurmctld is down
        else:
            submitter.cancel(slurm_id, signals.Signals(sig).name.removeprefix("SIG"))
        self.poller.hurry()

    def drain(self, handle: RunHandle) -> bool:
        return True  # Slurm ends every process of a finished job

    def release(self, handle: RunHandle) -> None:
        self.poller.forget(handle.pid)

    def pids(self, handle: RunHandle) -> list[int]:
        return []  # none on this machine

    def where(self, handle: RunHandle) -> str:
        return f"Slurm job {handle.pid}" if handle.pid else "its Slurm submission"

    # ------------------------------------------------------------------ rule 6
    def run_key(self, job: JobRecord) -> str:
        return f"slurm-{job.id}-{job.run_id}"

    def adopt(self, job: JobRecord) -> SlurmRun | Lost:
        info = str(
            self.paths.job_dir(job.id)
            if job.trial_id is None
            else self.paths.trial_info_dir(job.experiment_id or 0, job.trial_id, job.run_id)
        )
        slurm_id = job.pid
        if not slurm_id:
            try:
                slurm_id = self._submitted_unrecorded(job, info)
            except client.Unreachable as err:  # cannot tell now: held, asked again
                return self._find_later(job, info, str(err))
        if not slurm_id:
            return Lost(None, False)  # allocated; never submitted
        self.poller.watch(slurm_id)
        self.poller.refresh()  # at a restart, before the loop runs: now
        st = self.poller.state(slurm_id) or client.JobState("PENDING")
        staged_info = self._pump_adopted(job, info)
        run = SlurmRun(job.id, slurm_id, job.pid_start, staged_info, queued=st.state == "PENDING")
        if not (st.ended or st.state == "GONE"):
            return run
        code = self._settle(run, st)
        self.pump.finish(job.id)
        self.poller.forget(slurm_id)
        # lost to the cluster while no engine watched: no exit status of the trial's own, so
        # the restart queues it again from its latest checkpoint (max_restarts untouched)
        return Lost(
            None if run.lost else code, True, run.lost and f"Slurm job {slurm_id} {run.lost}"
        )

    def _pump_adopted(self, job: JobRecord, info: str) -> str:
        """An adopted run's info directory as its job sees it; with stage_dir, its staged log
        copied on from where it was."""
        if self.pool.stage_dir is None:
            return info
        root = stage.adopted_root(self.pool, info, self.stage_key)
        log = (
            self.paths.command_log(job.id)
            if job.trial_id is None
            else self.paths.trial_log(job.experiment_id or 0, job.trial_id)
        )
        self.pump.add(job.id, root, log, info, stage.owner_of_job(job.uid, job.umask))
        return str(root / "info")

    def _find_later(self, job: JobRecord, info: str, why: str) -> SlurmRun:
        """A run whose sbatch was under way when the engine stopped, while Slurm's controller
        does not answer: held as a run being submitted (never submitted again meanwhile), Slurm
        asked again from a thread (`submitter.find`); the job it made is then followed, and when
        it made none the run ends as lost (queued again, no restart spent)."""
        self.note(
            f"job {job.id}: Slurm's controller does not answer ({why}); whether the sbatch "
            "under way when the daemon stopped made a job is asked again until it does (the "
            "run is not submitted again meanwhile)",
            level="WARNING",
        )
        sub = submitter.find(lambda: self._submitted_unrecorded(job, info), self.poller.watch)
        staged_info = self._pump_adopted(job, info)
        return SlurmRun(job.id, 0, job.pid_start, staged_info, submission=sub)

    def _submitted_unrecorded(self, job: JobRecord, info: str) -> int:
        """The engine stopped while the run's sbatch ran (or was being tried again): the job
        Slurm made of it, found by its name, its user and its output file in this home (so
        another det-local's job of the same name is never taken); 0 when there is none;
        `client.Unreachable` while Slurm's controller does not answer."""
        if job.trial_id is None:
            name = f"det-local_cmd{job.id}"
        else:
            name = f"det-local_e{job.experiment_id}_t{job.trial_id}_r{job.run_id}"
        # its output file: in this home, or in its staged directory (slurm.stage_dir)
        where = (
            f"{self.paths.home}/"
            if self.pool.stage_dir is None
            else f"{stage.root_of(self.pool, info, self.stage_key)}/"
        )
        try:  # every state: a job that ran and ended meanwhile is its run too
            ids = client.run(["squeue", "-h", "-t", "all", "-n", name, "-o", "%i"]).split()
        except client.Unreachable:
            raise
        except TrialError:
            return 0  # squeue refused (not the controller's absence): taken as none
        for text in ids:
            try:
                out = client.run(["scontrol", "show", "job", "-o", text])
            except client.Unreachable:
                raise
            except TrialError:
                continue  # gone meanwhile
            # the run's user's job (anyone can name a job so, and pass any --output)
            owner = re.search(r"\bUserId=\S*?\((\d+)\)", out)
            mine = owner is not None and int(owner.group(1)) == job.uid
            if mine and f"StdOut={where}" in out and text.isdigit():
                return int(text)
        return 0

    def cleanup(self, live: set[str]) -> None:
        pass

    def experiment_stopped(self, experiment_id: int) -> None:
        pass


def _exit_file(info_dir: str, slurm_id: int) -> int | None:
    try:
        return int(Path(info_dir, f"slurm-exit.{slurm_id}").read_text().strip())
    except (OSError, ValueError):
        return None


def _own_slot_ids(info: Path, per_node: int) -> None:
    """get_cluster_info().slot_ids: the job's own slots on its node (0..n-1, as Slurm numbers
    what it gives), not this machine's (the run holds none here). Rewritten in place (owner and
    mode kept), never through a link."""
    path = info / "cluster.json"
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return
    with os.fdopen(fd, "r+") as f:
        try:
            data = json.load(f)
        except ValueError:
            return
        data["slot_ids"] = list(range(per_node))
        f.seek(0)
        f.truncate()
        json.dump(data, f, indent=2)


def _write_new(path: Path, text: str) -> None:
    """Write a file in a directory that may be the job's user's (a root daemon): under a new
    name, never through a link put there, then renamed over the old one."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)

"""Commands: `cmd run`, `shell start`, `notebook start`, `tensorboard start` as jobs.

A command is queued like a trial (`sched/queue/jobqueue.py`) but never preempted; it runs once, as
its submitter, in its working directory, with the environment it was submitted with (kept in
a private file until it starts, never in the database) and det-local's slot variables.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
from collections.abc import Callable

from det_local.errors import DetLocalError, TrialError
from det_local.sched.life.outcome import describe_exit
from det_local.sched.queue import hardware as hardware
from det_local.sched.queue.jobqueue import check_priority
from det_local.sched.queue.policy import check_request
from det_local.sched.run import userfiles
from det_local.sched.run.launchplan import LaunchPlan, thread_env
from det_local.sched.run.runas import identity as identity_of
from det_local.sched.run.supervisor import Supervisor
from det_local.store.paths import Paths
from det_local.store.private import PrivateFiles
from det_local.store.states import TASK_KINDS, JobKind
from det_local.store.tables.jobs import QUEUED, SCHEDULED, JobRecord, JobTable


class Commands:
    def __init__(
        self,
        jobs: JobTable,
        paths: Paths,
        private: PrivateFiles,
        inventory: hardware.Inventory,
        supervisor: Supervisor,
        *,
        admin_group: str,
        note: Callable[..., None],
        schedule: Callable[[], None],
        slots_remedy: Callable[[int], str | None],
    ) -> None:
        self.jobs = jobs
        self.paths = paths
        self.private = private
        self.inventory = inventory
        self.supervisor = supervisor
        self.admin_group = admin_group
        self.note = note
        self.schedule = schedule
        self.slots_remedy = slots_remedy
        self.killing: set[int] = set()  # commands stopped on request
        # why a command being stopped is stopped, when not on request (an idle reservation)
        self.kill_reasons: dict[int, str] = {}

    def submit(
        self,
        *,
        argv: list[str],
        cwd: str,
        env: dict[str, str],
        slots: int,
        priority: int,
        user: str,
        uid: int,
        name: str | None = None,
        kind: JobKind | str = JobKind.COMMAND,
        umask: int | None = None,
        anywhere: bool = False,
    ) -> int:
        if kind not in TASK_KINDS:
            raise DetLocalError(
                f"unknown job type {kind!r}; expected one of {', '.join(TASK_KINDS)}"
            )
        kind = JobKind(kind)  # a request's string, checked above
        if not argv:
            raise DetLocalError(
                "cmd run: no command given; write it after --, e.g. -- python3 x.py"
            )
        check_request(
            slots,
            self.inventory.size(),
            "--slots",
            allow_zero=True,
            more=self.slots_remedy(slots),
        )
        check_priority(priority)
        prog = argv[0]
        if "/" in prog:
            target = prog if os.path.isabs(prog) else os.path.join(cwd, prog)
            if not os.access(target, os.X_OK):
                raise DetLocalError(
                    f"cmd run: {prog} does not exist or is not executable (from {cwd})"
                )
        elif shutil.which(prog, path=env.get("PATH")) is None:
            raise DetLocalError(f"cmd run: program '{prog}' was not found on PATH; check the name")
        job_id = self.jobs.create(
            kind=kind,
            name=name or " ".join(argv)[:80],
            user=user,
            uid=uid,
            priority=priority,
            slots_needed=slots,
            argv=argv,
            cwd=cwd,
            umask=userfiles.check_umask(umask),
            anywhere=anywhere and kind == JobKind.COMMAND,
        )
        # the environment may hold the submitter's secrets: a private file, never the database
        # (written before the request commits; always written: a rolled-back id is reused)
        self.private.save_job_env(job_id, env)
        self.schedule()
        return job_id

    def start(self, job: JobRecord) -> None:
        """The scheduler gave the command its slots (recorded in its job): start it."""
        assert job.argv is not None
        identity = identity_of(job.uid)
        owner = userfiles.owner_for(identity, job.umask, self.admin_group)
        if owner is not None:  # its directory (log, exit files) is the user's, as private
            try:
                userfiles.make_dir(self.paths.job_dir(job.id), owner)
            except (OSError, TrialError) as err:
                why = err.strerror if isinstance(err, OSError) else str(err)
                self.jobs.finish(job.id, None, f"command {job.id} could not start: {why}")
                return
        try:
            env = self.private.job_env(job.id) or {}  # as its submitter had it
        except DetLocalError as err:  # a damaged (or replaced) private file
            self.jobs.finish(job.id, None, f"command {job.id} could not start: {err}")
            self.note(f"command {job.id} could not start: {err}", level="ERROR")
            self.private.drop_job_env(job.id)
            return
        threads = self.slot_env(job, env)
        env["DET_LOCAL_JOB_ID"] = str(job.id)
        if job.kind != JobKind.COMMAND:  # `shell/notebook/tensorboard start` wait for it; a command
            self._write_allocation(job, env["CUDA_VISIBLE_DEVICES"], threads)  # has it in its env
        plan = LaunchPlan(
            argv=list(job.argv),
            env=env,
            cwd=job.cwd or "/",
            user=job.user,
            slots=list(job.slots),
            log_path=str(self.paths.command_log(job.id)),
            info_dir=str(self.paths.job_dir(job.id)),
            umask=job.umask,
            admin_gid=owner.admin_gid if owner is not None else None,
            **identity,
        )
        try:
            if not os.path.isdir(plan.cwd):
                raise TrialError(f"its directory {plan.cwd} no longer exists")
            self.supervisor.spawn(job, plan)
        except TrialError as err:
            self.jobs.finish(job.id, None, f"command {job.id} could not start: {err}")
        # started (its pid recorded: it is adopted or settled, never started again) or ended
        self.private.drop_job_env(job.id)

    def slot_env(self, job: JobRecord, env: dict[str, str]) -> dict[str, str]:
        """det-local's variables of a job on its slots, set in `env` (DET_LOCAL_HOME, the
        visible devices, the slot ids, and OMP_NUM_THREADS on CPU slots as a trial gets it,
        unless set); returns the thread variables it set."""
        env["DET_LOCAL_HOME"] = str(self.paths.home)
        env["CUDA_VISIBLE_DEVICES"] = self.inventory.visible_devices(job.slots)
        env["DET_SLOT_IDS"] = str(job.slots)
        threads: dict[str, str] = {}
        for item in thread_env(self.inventory.cpu_threads(len(job.slots)), env):
            name, _, value = item.partition("=")
            env[name] = threads[name] = value
        return threads

    def _write_allocation(self, job: JobRecord, visible: str, env: dict[str, str]) -> None:
        """jobs/<id>/allocation.json: the slots a job holds and the variables that come with
        them (an interactive shell, which runs in its user's terminal, reads it)."""
        d = self.paths.job_dir(job.id)
        d.mkdir(parents=True, exist_ok=True)
        # the directory may be the job's user's: a new name, never through a link put there
        tmp = d / f".allocation.json.{secrets.token_hex(8)}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        try:
            os.fchmod(fd, 0o644)
            alloc = {"slots": job.slots, "cuda_visible_devices": visible, "env": env}
            os.write(fd, json.dumps(alloc).encode())
        finally:
            os.close(fd)
        os.replace(tmp, d / "allocation.json")

    def on_exit(self, job: JobRecord, code: int, problem: str | None = None) -> None:
        killed = job.id in self.killing
        self.killing.discard(job.id)
        reason = self.kill_reasons.pop(job.id, None)
        status: int | None = code
        if killed:
            message = reason or "killed on request"
        elif problem is not None:
            message, status = f"command {job.id} ended; its exit status is unknown: {problem}", None
        else:
            message = f"command {job.id} {describe_exit(code)}"
        self.jobs.finish(job.id, status, message)

    def kill(self, job: JobRecord) -> str:
        """`cmd kill`: a queued command leaves the queue; a running one is stopped (SIGTERM,
        then SIGKILL after the grace period)."""
        if job.state == QUEUED:
            self.jobs.cancel(job.id, "removed from the queue on request")
            self.private.drop_job_env(job.id)
            self.schedule()
            return f"command {job.id} removed from the queue"
        if job.state == SCHEDULED:
            self.killing.add(job.id)
            self.supervisor.terminate(job.id, job.pid)
            return f"command {job.id} is being stopped"
        return f"command {job.id} already ended"

    def settle_lost(
        self, job: JobRecord, code: int | None, spawned: bool, problem: str | None
    ) -> None:
        """A command whose process ended while no engine watched it (spawned=False: it never
        started; it keeps its place in the queue)."""
        if not spawned:
            self.jobs.requeue(job.id)
            return
        if code is not None:
            message = f"command {job.id} ended while the daemon was down with exit code {code}"
        else:
            message = f"command {job.id} ended while the daemon was down; " + (
                f"its exit status is unknown: {problem}"
                if problem
                else "its exit status is unknown"
            )
        self.jobs.finish(job.id, code, message)

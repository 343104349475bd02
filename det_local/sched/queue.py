# mypy: disable-error-code="misc"
# (the mixin methods annotate `self: Engine`; mypy checks them against the whole engine)
"""The job queue inside the engine: slots, the scheduling pass, starting, preempting, reaping
and adopting job processes. The policy itself (who goes first, who is preempted) is
`sched/policy.py`; this module turns its decisions into allocations and processes.
"""

from __future__ import annotations

import asyncio
import secrets
import signal
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from det_local.errors import DetLocalError, StateError, TrialError
from det_local.sched import executor, unmanaged
from det_local.sched.plan import LaunchPlan, thread_env
from det_local.sched.policy import (
    JobView,
    PolicyConfig,
    RunningJob,
    SortedQueue,
    check_request,
    schedule,
)
from det_local.store.jobs import QUEUED, SCHEDULED, JobRecord

if TYPE_CHECKING:
    from det_local.sched.engine import Engine, ExperimentRun

TRIAL = "TRIAL"
COMMAND = "COMMAND"
# commands of these kinds are started by `shell start`, `notebook start`, `tensorboard start`
TASK_KINDS = (COMMAND, "SHELL", "NOTEBOOK", "TENSORBOARD")
PRIORITY_MIN, PRIORITY_MAX = 1, 99
FOREIGN_RECHECK_S = 2.0  # how often GPUs held by foreign processes are looked at while jobs wait
DRAIN_TICK_S = (0.005, 0.2)  # looking again at a job's cgroup after its leader ended: first, most
DRAIN_WARN_S = 10.0  # a cgroup not empty this long after SIGKILL is worth a line in the log
RECOVER_DRAIN_S = 2.0  # at a restart: how long to wait for a dead job's leftovers to die


def check_priority(priority: int) -> int:
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise DetLocalError(f"priority must be a whole number from 1 to 99, found {priority!r}")
    if not PRIORITY_MIN <= priority <= PRIORITY_MAX:
        raise DetLocalError(
            f"priority {priority} is outside 1-99 (1 is the most important, 42 the default)"
        )
    return priority


class QueueMixin:
    _foreign_timer: asyncio.TimerHandle | None  # a look at foreign-held GPUs, while jobs wait
    _foreign_held: bool

    # ------------------------------------------------------------------ views for the policy
    def _policy_config(self: Engine) -> PolicyConfig:
        groups: dict[str, int] = {}
        for exp in self.experiments.values():
            cap = exp.config.resources.max_slots
            if cap is not None:
                groups[f"exp:{exp.id}"] = int(cap)
        return PolicyConfig(
            mode=self.settings.mode,
            preemption=self.settings.preemption,
            group_max_slots=groups,
            user_quota=self.settings.user_quota,
            user_weight=self.settings.user_weight,
        )

    @staticmethod
    def _view(job: JobRecord) -> JobView:
        return JobView(
            id=job.id,
            user=job.user,
            priority=job.priority,
            position=job.position,
            slots=job.slots_needed,
            group=f"exp:{job.experiment_id}" if job.experiment_id is not None else None,
            preemptible=job.kind == TRIAL,
        )

    def _free_slots(self: Engine, running: Iterable[JobRecord]) -> list[int]:
        used = {s for j in running for s in j.slots}
        busy = self._foreign_busy()
        if busy - used:
            # nothing of ours tells when a foreign process lets go of its GPU: look again soon
            # while jobs wait (a bounded supervision tick, only then)
            self._foreign_held = True
        return [
            s.index for s in self.inventory.slots if s.index not in used and s.index not in busy
        ]

    def _recheck_foreign_later(self: Engine) -> None:
        if self._foreign_timer is not None or self.loop is None:
            return

        def again() -> None:
            self._foreign_timer = None
            self._schedule()

        self._foreign_timer = self.loop.call_later(FOREIGN_RECHECK_S, again)

    def _foreign_busy(self: Engine) -> set[int]:
        if not self.settings.foreign_gpus_busy or self.inventory.source == "cpu":
            return set()
        from det_local.sched import slots

        ours = [p.pid for p in self.procs.values()]
        for p in self.procs.values():  # with cgroups: those that left their session too
            if p.cgroup is not None:
                ours += p.cgroup.pids()
        inv = slots.detect_foreign(self.inventory, ours)
        return slots.busy_foreign(inv, True)

    # ------------------------------------------------------------------ the scheduling pass
    def _schedule(self: Engine) -> None:
        """Ask the policy what to start and whom to preempt; act on it. Re-entrant calls (a job
        that fails to start triggers another pass) are folded into one loop."""
        if self.offline:
            return
        if self._scheduling:
            self._schedule_again = True
            return
        self._scheduling = True
        try:
            while True:
                self._schedule_again = False
                self._schedule_once()
                if not self._schedule_again:
                    break
        finally:
            self._scheduling = False
        self._check_idle()

    def _schedule_once(self: Engine) -> None:
        # the writer's in-memory copy of the active jobs (no SQL), the queue in policy order:
        # the policy reads only as far into a long queue as can matter (policy rule 9)
        jobs = self.store.jobs.scheduling_view()
        if not jobs.queue:
            self.waiting = {}
            return
        running = [
            RunningJob(self._view(j), tuple(j.slots), preempting=j.id in self._preempting)
            for j in jobs.running.values()
        ]
        queued = SortedQueue(
            jobs=(self._view(j) for j in jobs.queued_in_order()), zero_slot=jobs.zero_slot
        )
        self._foreign_held = False
        decision = schedule(
            self.inventory.size(),
            self._free_slots(jobs.running.values()),
            running,
            queued,
            self._policy_config(),
        )
        # why the jobs read wait (those left unread wait too: decision.complete is False)
        self.waiting = dict(decision.waiting)
        if self._foreign_held and (self.waiting or not decision.complete):
            self._recheck_foreign_later()
        # the records as they were when the policy decided (starting one changes the copy)
        preempt = [jobs.jobs[job_id] for job_id in decision.preempt]
        start = [(jobs.jobs[job_id], slots) for job_id, slots in decision.start]
        for job in preempt:
            self._preempt_job(job)
        for job, slots in start:
            self._start_job(job, list(slots))

    def _start_job(self: Engine, job: JobRecord, slots: list[int]) -> None:
        if job.kind == TRIAL:
            assert job.experiment_id is not None and job.trial_id is not None
            exp = self._exp(job.experiment_id)
            run_id = self.store.next_trial_run(job.trial_id)
            self.store.jobs.allocate(job.id, slots, run_id)
            # derived from the daemon's key: stored nowhere, recomputed after a restart
            token = self.private.run_token(job.id, run_id)
            self._start_trial(exp, job.trial_id, job, slots, token, run_id)
        else:
            self.store.jobs.allocate(job.id, slots, job.run_id + 1)
            self._start_command(self.store.jobs.get(job.id))

    def _spawn(self: Engine, job: JobRecord, plan: LaunchPlan) -> executor.JobProc:
        """Spawn and watch a job's process; TrialError when it cannot start."""
        job = self.store.jobs.peek(job.id)  # as allocated: its run id
        exit_file = self.paths.job_exit_file(job.id, job.run_id)
        try:
            cgroup = self.containment.create(job.id, job.run_id, self._fenced_minors(plan.slots))
        except OSError as err:
            raise TrialError(
                f"could not create its cgroup under {self.containment.base}: {err.strerror}; "
                "`det-local daemon status` shows the containment mode (cgroups: false in "
                "daemon.yaml turns it off)"
            ) from None
        try:
            proc = executor.spawn(
                job.id,
                plan,
                exit_file,
                cgroup=cgroup,
                legacy_exit_file=self.paths.legacy_job_exit_file(job.id, job.run_id),
            )
        except BaseException:
            if cgroup is not None:
                cgroup.remove()
            raise
        self.store.jobs.set_process(job.id, proc.pid, executor.start_time(proc.pid) or time.time())
        self._watch(proc)
        return proc

    def _fenced_minors(self: Engine, slots: list[int]) -> list[int]:
        """The GPU device minors a job on these slots must not open (GPU fencing): every GPU
        of this machine that is not its own; none where a GPU's device node is unknown."""
        inv = self.inventory
        if self.containment.devices is None or inv.source == "cpu":
            return []
        minors = {s.minor for s in inv.slots}
        if None in minors:
            return []
        own = {inv.slots[i].minor for i in slots}
        every = {m for m in minors if m is not None} | set(self.containment.gpu_minors)
        return sorted(every - own)

    def _watch(self: Engine, proc: executor.JobProc) -> None:
        self.procs[proc.job_id] = proc
        assert self.loop is not None
        if proc.pidfd is not None:
            self.loop.add_reader(proc.pidfd, self._on_job_exit, proc.job_id)
        else:  # no pidfd (old kernel): a bounded supervision tick
            self.loop.call_later(0.05, self._tick, proc.job_id)

    def _tick(self: Engine, job_id: int) -> None:
        proc = self.procs.get(job_id)
        if proc is None:
            return
        if executor.exit_code(proc) is not None:
            self._on_job_exit(job_id)
        else:
            assert self.loop is not None
            self.loop.call_later(0.05, self._tick, job_id)

    def _on_job_exit(self: Engine, job_id: int) -> None:
        proc = self.procs.get(job_id)
        if proc is None or proc.code is not None:
            return  # gone, or its leader has ended and the rest of it is being killed
        code = executor.exit_code(proc)
        if code is None:
            return  # spurious wakeup
        proc.code = code
        assert self.loop is not None
        if proc.pidfd is not None:
            self.loop.remove_reader(proc.pidfd)
        executor.close(proc)
        self._reap(job_id, time.monotonic(), DRAIN_TICK_S[0])

    def _reap(self: Engine, job_id: int, since: float, delay: float) -> None:
        """The job's leader has ended: no orphans, the rest of it goes too (its whole cgroup,
        escaped processes included). Its slots stay held until its cgroup is empty."""
        proc = self.procs.get(job_id)
        if proc is None or proc.code is None:
            return
        if not executor.kill_rest(proc):
            assert self.loop is not None
            if since and time.monotonic() - since > DRAIN_WARN_S:
                self.note(
                    f"job {job_id}: processes of its cgroup {proc.cgroup and proc.cgroup.path} "
                    f"are still there {DRAIN_WARN_S:.0f}s after SIGKILL (uninterruptible?); "
                    "its slots stay held until they are gone",
                    level="WARNING",
                )
                since = 0.0
            self.loop.call_later(delay, self._reap, job_id, since, min(delay * 2, DRAIN_TICK_S[1]))
            return
        del self.procs[job_id]
        executor.release(proc)
        code = proc.code
        if proc.problem is not None:
            self.note(f"job {job_id}: {proc.problem}", level="WARNING")
        self._preempting.discard(job_id)
        job = self.store.jobs.peek(job_id)
        if job.kind == TRIAL:
            run = self.runs.get(job.trial_id or -1)
            if run is not None:
                self._on_trial_exit(run, code)
        else:
            self._on_command_exit(job, code, proc.problem)
        self._schedule()

    # ------------------------------------------------------------------ trials as jobs
    def _trial_priority(self: Engine, exp: ExperimentRun) -> int:
        override = self.store.get_experiment_priority(exp.id)
        if override is not None:
            return override
        return int(exp.config.resources.effective_priority)

    def _enqueue_trial(self: Engine, exp: ExperimentRun, trial_id: int) -> None:
        """Queue the trial (again) for slots; it starts when the policy says so."""
        job = self.store.jobs.for_trial(trial_id)
        if job is None:
            rec = self.store.get_experiment(exp.id)
            uid = self.user_ids.get(exp.id, _uid_of(rec.user))
            self.store.jobs.create(
                kind=TRIAL,
                name=f"{rec.name} (trial {trial_id})",
                user=rec.user,
                uid=uid,
                priority=self._trial_priority(exp),
                slots_needed=int(exp.config.resources.slots_per_trial),
                experiment_id=exp.id,
                trial_id=trial_id,
                umask=self.store.get_experiment_umask(exp.id),
            )
        elif job.state != QUEUED:
            self.store.jobs.requeue(job.id)

    def _dequeue_trial(self: Engine, trial_id: int, message: str, *, cancel: bool = False) -> None:
        """Take the trial's job out of the queue: DONE (it is queued again on activation), or
        CANCELED (cancel=True: the experiment was killed)."""
        job = self.store.jobs.for_trial(trial_id)
        if job is not None and job.state == QUEUED:
            if cancel:
                self.store.jobs.cancel(job.id, message)
            else:
                self.store.jobs.finish(job.id, None, message)

    def _finish_trial_job(self: Engine, trial_id: int, code: int | None, message: str) -> None:
        job = self.store.jobs.for_trial(trial_id)
        if job is not None:
            self.store.jobs.finish(job.id, code, message)

    def _preempt_job(self: Engine, job: JobRecord) -> None:
        if job.kind != TRIAL or job.trial_id is None:
            return
        run = self.runs.get(job.trial_id)
        if run is None:
            return
        self._preempting.add(job.id)
        run.requeue_requested = True
        self.note(
            f"trial {job.trial_id} (priority {job.priority}) is preempted for more important "
            "work: it checkpoints and waits in the queue",
            experiment_id=job.experiment_id,
            trial_id=job.trial_id,
        )
        self._preempt(run, self._exp(run.experiment_id))

    # ------------------------------------------------------------------ commands
    def submit_command(
        self: Engine,
        *,
        argv: list[str],
        cwd: str,
        env: dict[str, str],
        slots: int,
        priority: int,
        user: str,
        uid: int,
        name: str | None = None,
        kind: str = COMMAND,
        umask: int | None = None,
    ) -> int:
        import shutil

        from det_local.sched.userfiles import check_umask

        if kind not in TASK_KINDS:
            raise DetLocalError(
                f"unknown job type {kind!r}; expected one of {', '.join(TASK_KINDS)}"
            )
        if not argv:
            raise DetLocalError(
                "cmd run: no command given; write it after --, e.g. -- python3 x.py"
            )
        check_request(
            slots,
            self.inventory.size(),
            "--slots",
            allow_zero=True,
            more=self._cpu_slots_remedy(slots),
        )
        check_priority(priority)
        prog = argv[0]
        if "/" in prog:
            import os

            target = prog if os.path.isabs(prog) else os.path.join(cwd, prog)
            if not os.access(target, os.X_OK):
                raise DetLocalError(
                    f"cmd run: {prog} does not exist or is not executable (from {cwd})"
                )
        elif shutil.which(prog, path=env.get("PATH")) is None:
            raise DetLocalError(f"cmd run: program '{prog}' was not found on PATH; check the name")
        job_id = self.store.jobs.create(
            kind=kind,
            name=name or " ".join(argv)[:80],
            user=user,
            uid=uid,
            priority=priority,
            slots_needed=slots,
            argv=argv,
            cwd=cwd,
            umask=check_umask(umask),
        )
        # the environment may hold the submitter's secrets: a private file, never the database
        # (written before the request commits; always written: a rolled-back id is reused)
        self.private.save_job_env(job_id, env)
        self._schedule()
        return job_id

    def _start_command(self: Engine, job: JobRecord) -> None:
        import os

        from det_local.sched import userfiles

        assert job.argv is not None
        identity = _identity(job.uid)
        owner = userfiles.owner_for(identity, job.umask, self.settings.admin_group)
        if owner is not None:  # its directory (log, exit files) is the user's, as private
            try:
                userfiles.make_dir(self.paths.job_dir(job.id), owner)
            except (OSError, TrialError) as err:
                why = err.strerror if isinstance(err, OSError) else str(err)
                self.store.jobs.finish(job.id, None, f"command {job.id} could not start: {why}")
                return
        try:
            env = self.private.job_env(job.id) or {}  # as its submitter had it
        except DetLocalError as err:  # a damaged (or replaced) private file
            self.store.jobs.finish(job.id, None, f"command {job.id} could not start: {err}")
            self.note(f"command {job.id} could not start: {err}", level="ERROR")
            self.private.drop_job_env(job.id)
            return
        env["DET_LOCAL_HOME"] = str(self.paths.home)
        env["CUDA_VISIBLE_DEVICES"] = self.inventory.visible_devices(job.slots)
        env["DET_SLOT_IDS"] = str(job.slots)
        env["DET_LOCAL_JOB_ID"] = str(job.id)
        for item in thread_env(self.inventory.cpu_threads(len(job.slots)), env):
            name, _, value = item.partition("=")
            env[name] = value
        if job.kind != COMMAND:  # `shell/notebook/tensorboard start` wait for it; a command
            self._write_allocation(job, env["CUDA_VISIBLE_DEVICES"])  # has it in its env
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
            self._spawn(job, plan)
        except TrialError as err:
            self.store.jobs.finish(job.id, None, f"command {job.id} could not start: {err}")
        # started (its pid recorded: it is adopted or settled, never started again) or ended
        self.private.drop_job_env(job.id)

    def _write_allocation(self: Engine, job: JobRecord, visible: str) -> None:
        """jobs/<id>/allocation.json: the slots a job holds (an interactive shell reads it)."""
        import json
        import os

        d = self.paths.job_dir(job.id)
        d.mkdir(parents=True, exist_ok=True)
        # the directory may be the job's user's: a new name, never through a link put there
        tmp = d / f".allocation.json.{secrets.token_hex(8)}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        try:
            os.fchmod(fd, 0o644)
            os.write(fd, json.dumps({"slots": job.slots, "cuda_visible_devices": visible}).encode())
        finally:
            os.close(fd)
        os.replace(tmp, d / "allocation.json")

    def _on_command_exit(
        self: Engine, job: JobRecord, code: int, problem: str | None = None
    ) -> None:
        from det_local.sched.outcome import describe_exit

        killed = job.id in self._killing
        self._killing.discard(job.id)
        status: int | None = code
        if killed:
            message = "killed on request"
        elif problem is not None:
            message, status = f"command {job.id} ended; its exit status is unknown: {problem}", None
        else:
            message = f"command {job.id} {describe_exit(code)}"
        self.store.jobs.finish(job.id, status, message)

    def kill_job(self: Engine, job_id: int) -> str:
        job = self.store.jobs.get(job_id)
        if job.kind == TRIAL:
            assert job.experiment_id is not None
            return self.kill(job.experiment_id)
        if job.state == QUEUED:
            self.store.jobs.cancel(job.id, "removed from the queue on request")
            self.private.drop_job_env(job.id)
            self._schedule()
            return f"command {job_id} removed from the queue"
        if job.state == SCHEDULED:
            self._killing.add(job.id)
            self._terminate_pid(job.pid, job.id)
            return f"command {job_id} is being stopped"
        return f"command {job_id} already ended"

    def _terminate_pid(self: Engine, pid: int | None, job_id: int) -> None:
        """SIGTERM the job (its cgroup, else its group), then SIGKILL after the grace period
        if it is still there."""
        if pid is None:
            return
        executor.signal_job(self.procs.get(job_id), pid, signal.SIGTERM)
        assert self.loop is not None

        def finish() -> None:
            proc = self.procs.get(job_id)
            if proc is not None:
                executor.signal_job(proc, pid, signal.SIGKILL)

        self.loop.call_later(self.kill_grace, finish)

    # ------------------------------------------------------------------ queue order changes
    def update_job(
        self: Engine,
        job_id: int,
        *,
        priority: int | None = None,
        ahead_of: int | None = None,
        behind_of: int | None = None,
    ) -> str:
        job = self.store.jobs.get(job_id)
        if job.state not in (QUEUED, SCHEDULED):
            raise StateError(f"job {job_id} has ended; only queued or running jobs can be updated")
        if sum(x is not None for x in (priority, ahead_of, behind_of)) != 1:
            raise DetLocalError(
                "job update: give exactly one of --priority, --ahead-of, --behind-of"
            )
        if priority is not None:
            check_priority(priority)
            if job.experiment_id is not None:
                return self.set_experiment_priority(job.experiment_id, priority)
            self.store.jobs.set_priority(job_id, priority)
            what = f"priority {priority}"
        else:
            other = int(ahead_of if ahead_of is not None else behind_of)  # type: ignore[arg-type]
            if other == job_id:
                raise DetLocalError(f"job {job_id} cannot move relative to itself")
            target = self.store.jobs.get(other)
            if target.state not in (QUEUED, SCHEDULED):
                raise StateError(f"job {other} has ended; move relative to a queued job")
            pos = self.store.jobs.neighbour_position(other, ahead=ahead_of is not None)
            self.store.jobs.set_position(job_id, pos)
            # `ahead of` also means at least as important
            if ahead_of is not None and target.priority < job.priority:
                self.store.jobs.set_priority(job_id, target.priority)
            if behind_of is not None and target.priority > job.priority:
                self.store.jobs.set_priority(job_id, target.priority)
            what = f"{'ahead of' if ahead_of is not None else 'behind'} job {other}"
        self._schedule()
        return f"job {job_id}: {what}"

    def set_experiment_priority(self: Engine, experiment_id: int, priority: int) -> str:
        check_priority(priority)
        self._exp(experiment_id)
        self.store.set_experiment_priority(experiment_id, priority)
        for job in self.store.jobs.active():
            if job.experiment_id == experiment_id:
                self.store.jobs.set_priority(job.id, priority)
        self._schedule()
        return f"experiment {experiment_id}: priority {priority}"

    # ------------------------------------------------------------------ recovery
    def _private_start(self: Engine) -> None:
        """The private files at start: the directory and the daemon's key; the secrets an
        older det-local kept in the database moved out of it; the environments of jobs and
        experiments that have ended (or never committed) removed."""
        self.private.ensure()
        self.private.key()

        def keep(tokens: dict[int, tuple[int, str]], envs: dict[int, dict[str, str]]) -> None:
            if tokens:  # trials still running with them authenticate after the upgrade
                self.private.keep_legacy_tokens(tokens)
            for job_id, env in envs.items():
                self.private.save_job_env(job_id, env)

        if self.store.move_secrets_out(keep):
            self._out(
                "det-local: moved trial tokens and command environments that an older version "
                f"kept in the database to {self.paths.private}"
            )
        active = {j.id: j for j in self.store.jobs.active()}
        self.private.prune_legacy_tokens(
            {j.id: j.run_id for j in active.values() if j.state == SCHEDULED}
        )
        for job_id in self.private.saved_job_envs():
            job = active.get(job_id)
            # a command allocated but maybe not spawned may be queued again: it keeps its env
            if job is None or (job.state == SCHEDULED and job.pid is not None):
                self.private.drop_job_env(job_id)
        live = {r.id for r in self.store.list_experiments() if not r.state.terminal}
        for exp_id in self.private.saved_experiment_envs():
            if exp_id not in live:
                self.private.drop_experiment_env(exp_id)

    def _recover(self: Engine) -> None:
        """After a restart (even kill -9): adopt live processes, settle dead ones, keep the
        queue. Nothing queued is lost; nothing runs twice; no slot is booked twice."""
        from det_local.store.states import State

        for rec in self.store.list_experiments(states=[State.ACTIVE, State.STOPPING_CANCELED]):
            self._exp(rec.id)
        for rec in self.store.list_experiments(states=[State.PAUSED, State.STOPPING_PAUSED]):
            if rec.state == State.STOPPING_PAUSED or any(
                j.experiment_id == rec.id and j.state == SCHEDULED for j in self.store.jobs.active()
            ):
                exp = self._exp(rec.id)
                exp.stopping = "pause"  # PAUSED (STOPPING_PAUSED) once its trials have exited
        import os

        settled: list[tuple[JobRecord, int | None, bool, str | None]] = []
        live: set[str] = set()
        for job in self.store.jobs.active():
            if job.state != SCHEDULED:
                continue
            exit_file = self.paths.job_exit_file(job.id, job.run_id)
            legacy = self.paths.legacy_job_exit_file(job.id, job.run_id)
            spawned = job.pid is not None
            if not spawned:  # allocated; maybe spawned just before a crash, pid unrecorded
                pid = executor.find_wrapper(exit_file, legacy)
                started = executor.start_time(pid) if pid is not None else None
                if pid is not None and started is not None:
                    self.store.jobs.set_process(job.id, pid, started)
                    job = self.store.jobs.get(job.id)
                # the wrapper of this run (exit files are removed before a spawn) ran, or ran out
                spawned = (
                    job.pid is not None or os.path.lexists(exit_file) or os.path.lexists(legacy)
                )
            if job.pid is not None and executor.is_same_process(job.pid, job.pid_start):
                if self._adopt(job):
                    live.add(f"job-{job.id}-{job.run_id}")
                continue
            # its leader is gone: so goes whatever it left in its cgroup, before its slots do
            self._drain_now(self.containment.job(job.id, job.run_id))
            code, problem = (
                executor.exit_status(exit_file, legacy, job.uid) if spawned else (None, None)
            )
            settled.append((job, code, spawned, problem))
        for job, code, spawned, problem in settled:
            self._settle_lost(job, code, spawned=spawned, problem=problem)
        for cgroup in self.containment.leftovers(keep=live):  # runs that ended meanwhile
            self._drain_now(cgroup)
        for exp in list(self.experiments.values()):
            state = self.store.get_experiment(exp.id).state
            if state == State.STOPPING_CANCELED:
                exp.stopping = "kill"
            if state != State.ACTIVE:
                self._maybe_finish(exp)
                continue
            if unmanaged.settle_after_restart(self, exp.id):
                continue  # its process (not ours) lost the engine: nothing to start
            for t in self.store.list_trials(exp.id):  # a crash between a trial and its job
                if t.state == State.ACTIVE and self.store.jobs.for_trial(t.id) is None:
                    self._enqueue_trial(exp, t.id)

    def _drain_now(self: Engine, cgroup: Any) -> None:
        """At a restart: SIGKILL what is left in a cgroup whose job is over, wait (a bounded
        time) until it is empty, remove it."""
        if cgroup is None or not cgroup.exists():
            return
        deadline = time.monotonic() + RECOVER_DRAIN_S
        while cgroup.populated():
            cgroup.kill()
            if time.monotonic() > deadline:
                self.note(
                    f"cgroup {cgroup.path} still holds processes after SIGKILL "
                    "(uninterruptible?); left in place",
                    level="WARNING",
                )
                return
            time.sleep(0.01)
        cgroup.remove()

    def _adopt(self: Engine, job: JobRecord) -> bool:
        assert job.pid is not None
        cgroup = self.containment.job(job.id, job.run_id)
        proc = executor.adopt(
            job.id,
            job.pid,
            self.paths.job_exit_file(job.id, job.run_id),
            cgroup=cgroup if cgroup is not None and cgroup.exists() else None,
            legacy_exit_file=self.paths.legacy_job_exit_file(job.id, job.run_id),
            uid=job.uid,
        )
        if proc is None:
            self._drain_now(cgroup)
            self._settle_lost(job, None)
            return False
        if job.kind == TRIAL:
            assert job.experiment_id is not None and job.trial_id is not None
            exp = self._exp(job.experiment_id)
            self._adopt_trial(exp, job)
        self._watch(proc)
        self.note(f"adopted {job.kind.lower()} job {job.id} (pid {job.pid}) still running")
        if job.kind == TRIAL and job.experiment_id is not None:
            exp = self.experiments[job.experiment_id]
            run = self.runs.get(job.trial_id or -1)
            if run is not None and exp.stopping in ("pause", "kill"):
                if exp.stopping == "kill":
                    run.kill_requested = True
                    self._terminate(run)
                else:
                    self._preempt(run, exp)
        return True

    def _settle_lost(
        self: Engine,
        job: JobRecord,
        code: int | None,
        *,
        spawned: bool = True,
        problem: str | None = None,
    ) -> None:
        """A job whose process ended while no daemon watched it (spawned=False: whose process
        never started; problem: why its exit file was refused)."""
        if problem is not None:
            self.note(f"job {job.id}: {problem}", level="WARNING")
        if job.kind != TRIAL:
            if not spawned:
                self.store.jobs.requeue(job.id)  # never started: it keeps its place
                return
            if code is not None:
                message = f"command {job.id} ended while the daemon was down with exit code {code}"
            else:
                message = f"command {job.id} ended while the daemon was down; " + (
                    f"its exit status is unknown: {problem}"
                    if problem
                    else "its exit status is unknown"
                )
            self.store.jobs.finish(job.id, code, message)
            return
        assert job.experiment_id is not None and job.trial_id is not None
        exp = self._exp(job.experiment_id)
        if not spawned or code is None:
            # never started, or its status is lost: run it again from its latest checkpoint
            self.store.jobs.requeue(job.id)
            self.note(
                f"trial {job.trial_id} "
                + ("never started" if not spawned else "ended while the daemon was down")
                + "; queued again to resume from its latest checkpoint"
                + (f" (its exit status is unknown: {problem})" if problem else ""),
                experiment_id=exp.id,
                trial_id=job.trial_id,
                level="WARNING",
            )
            return
        run = self._adopt_trial(exp, job)
        self._on_trial_exit(run, code)


def _uid_of(user: str) -> int:
    import os
    import pwd

    try:
        return pwd.getpwnam(user).pw_uid
    except KeyError:
        return os.getuid()


def _identity(uid: int) -> dict[str, Any]:
    """uid/gid/groups for a LaunchPlan: the job's user when the daemon runs as root."""
    import os
    import pwd

    if os.geteuid() != 0 or uid == 0:
        return {}
    try:
        pw = pwd.getpwuid(uid)
    except KeyError:
        return {"uid": uid, "gid": uid, "groups": []}
    return {"uid": uid, "gid": pw.pw_gid, "groups": os.getgrouplist(pw.pw_name, pw.pw_gid)}

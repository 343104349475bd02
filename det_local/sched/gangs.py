"""A trial across machines, as this node's engine sees it (`federate/gangs/` is the cluster's
half: placement, the peer messages, faults).

* **Owner** (the node the experiment was submitted to): a trial whose `slots_per_trial` is more
  than this machine has is a *gang*. Its job asks this node for its share only (`GangFit.local`:
  the slots per node, or 0 when this node takes no part) and carries ``gang = {"size": n}``.
  When the policy starts that job its slots are RESERVED (nothing spawned) and the placer
  reserves the other shares on peers; once every share is ready the placer commits and this
  node spawns its ranks (:meth:`GangShares.launch_owner`).
* **Member** (a node lending slots): each share of another node's gang is a MEMBER job in this
  node's own queue, so local priorities, fair share and quotas apply to it. Started by the
  policy it is RESERVED; on commit its ranks are spawned here as the trial's user, from the
  experiment config the owner sent (never a command line), and their trial sessions are
  relayed to the owner (:meth:`GangShares.relay_run`).

The placer is the `Placer` protocol; without one (no federation) a trial larger than this
machine is refused at submission, as before.
"""

from __future__ import annotations

import os
import pwd
import time
from collections.abc import Iterator
from itertools import islice
from pathlib import Path
from typing import TYPE_CHECKING, Any

from det_local.errors import DetLocalError
from det_local.sched.gangseam import (
    REATTACH_S,
    GangFit,
    GangHost,
    GangSessions,
    GangTrials,
    Placer,
    gang_key,
)
from det_local.sched.life.experiments import TrialRun, checkpoint_dir_for
from det_local.sched.run.rendezvous import Rendezvous
from det_local.sched.run.trialplan import TrialFacts, build_trial_plan
from det_local.store.states import JobKind, State
from det_local.store.tables.jobs import QUEUED, RESERVED, SCHEDULED, JobRecord

if TYPE_CHECKING:
    from det_local.config.experiment import ExperimentConfig

OFFLOAD_BACKOFF_S = 10.0  # a trial a peer could not take is not offered to peers again before
OFFLOAD_BACKOFF_MAX_S = 300.0  # ... doubled at each time it comes back, up to this
OFFLOAD_SCAN = 1000  # how far into the queue a pass looks for jobs that may run anywhere
UNCLAIMED_S = REATTACH_S + 5.0


class GangShares:
    """The engine's operations on gang shares (owner and member sides)."""

    def __init__(self, engine: GangHost, trials: GangTrials, sessions: GangSessions) -> None:
        self.engine = engine
        self.trials = trials  # what a share does to its trial's job
        self.sessions = sessions  # relayed frames applied as a local run's
        self.placer: Placer | None = None
        self.relays: dict[int, TrialRun] = {}  # member job id -> its ranks' relay run
        self.stopping: dict[int, str] = {}  # member job id -> why its ranks are being stopped
        self.peer_lost: dict[int, str] = {}  # owner trial id -> why its gang lost a machine
        self.peer_requeues: dict[int, int] = {}  # owner trial id -> requeues for lost machines
        self.max_peer_requeues = 5  # federation.max_peer_requeues
        self.stay_until: dict[int, float] = {}  # job id -> not offered to peers before (monotonic)
        self.came_back: dict[int, int] = {}  # job id -> times it came back from a peer
        # shares found running after a restart, until the placer takes them back (job ids)
        self.adopted: set[int] = set()
        # MEMBER shares whose ranks died with this daemon (found gone at its restart): job id
        # -> its gang spec; the placer reports each lost to its owner at once
        self.died_with_daemon: dict[int, dict[str, Any]] = {}

    # ------------------------------------------------------------------ owner side
    def fit(self, slots: int) -> GangFit | None:
        """None when the trial fits this machine (no gang); else where it fits."""
        if slots <= self.engine.inventory.size():
            return None
        if self.placer is None:
            return None
        return self.placer.fit(slots)

    def _may_go(self) -> Iterator[JobRecord]:
        """Jobs that may run anywhere (`jobs.anywhere`), wait here for slots, and may be
        offered to peers now: among the first OFFLOAD_SCAN queued, in the queue's order (not
        only those the policy read: on a full machine it stops at the first that waits)."""
        engine = self.engine
        now = time.monotonic()
        queued = engine.store.jobs.scheduling_view().queued_in_order()
        for job in list(islice(queued, OFFLOAD_SCAN)):
            if job.id in engine.queue.hold_back or self.stay_until.get(job.id, 0.0) > now:
                continue
            if job.state == QUEUED and job.anywhere and job.gang is None and job.slots_needed:
                yield job

    def offloadable(self) -> bool:
        """Whether a job that may run anywhere waits here (a pass may send it to a peer)."""
        return next(self._may_go(), None) is not None

    def offload_waiting(self) -> None:
        """A job that may run anywhere (`resources.federate`, `--anywhere`) and waits here for
        slots runs wholly on a live peer that has them free now, as a gang of one peer whose
        owner (this node) only coordinates. Called after every scheduling pass."""
        engine = self.engine
        if self.placer is None:
            return
        moved = False
        for job in self._may_go():
            size = job.slots_needed
            node = self.placer.idle_peer(size, job.id)
            if node is None:
                continue
            self.stay_until.pop(job.id, None)
            spec = {"size": size, "per_node": size, "anywhere": node}
            engine.store.jobs.set_gang(job.id, spec, 0)
            engine.note(
                f"{_what(job)} waits here for {size} slot{'s' if size > 1 else ''}; "
                f"machine {node} has them free: it runs there "
                + ("(resources.federate)" if job.trial_id is not None else "(--anywhere)"),
                experiment_id=job.experiment_id,
                trial_id=job.trial_id,
            )
            moved = True
        if moved:
            engine.queue.schedule()

    def back_home(self, job_id: int, why: str) -> None:
        """A trial sent to run on a peer (`offload_waiting`) could not be placed there: it waits
        here again, in its place, offered again after a wait that doubles each time it does."""
        engine = self.engine
        job = engine.store.jobs.peek(job_id)
        if job.gang is None or job.state not in (QUEUED, RESERVED):
            return
        size = int(job.gang.get("size", job.slots_needed))
        if job.state == RESERVED:
            engine.store.jobs.requeue(job_id)
            engine.queue.preempting.discard(job_id)
        engine.store.jobs.set_gang(job_id, None, size)
        engine.queue.hold_back.pop(job_id, None)
        times = self.came_back[job_id] = self.came_back.get(job_id, 0) + 1
        wait = min(OFFLOAD_BACKOFF_S * 2 ** (times - 1), OFFLOAD_BACKOFF_MAX_S)
        self.stay_until[job_id] = time.monotonic() + wait
        engine.note(
            f"{_what(job)} waits here again: {why}",
            experiment_id=job.experiment_id,
            trial_id=job.trial_id,
        )
        if engine.loop is not None:  # offered again when the wait ends: no other event may come
            engine.loop.call_later(wait + 0.1, self._offer_again)

    def _offer_again(self) -> None:
        waits = {j.id for j in self.engine.store.jobs.active() if j.state in (QUEUED, RESERVED)}
        self.came_back = {j: n for j, n in self.came_back.items() if j in waits}  # ran: forgotten
        if self.offloadable():
            self.engine.queue.schedule()

    def check_storage(self, cfg: ExperimentConfig) -> None:
        """A trial across machines keeps its checkpoints where every machine reads them."""
        storage = cfg.checkpoint_storage
        if storage is None or storage.type != "shared_fs":
            why = (
                "a trial that may run on another machine (resources.federate: true)"
                if cfg.resources.federate
                and int(cfg.resources.slots_per_trial) <= self.engine.inventory.size()
                else "a trial across machines (resources.slots_per_trial "
                f"{cfg.resources.slots_per_trial} is more than this machine's "
                f"{self.engine.inventory.size()} slots)"
            )
            raise DetLocalError(
                f"checkpoint_storage: {why} needs type shared_fs with the same host_path "
                "mounted on every machine"
            )
        host = Path(str(storage.host_path or ""))
        if not host.is_dir():
            raise DetLocalError(
                f"checkpoint_storage.host_path {host} is not a directory on this machine: mount "
                "the shared file system at the same path on every machine"
            )

    def launch_owner(self, job_id: int, rendezvous: Rendezvous, ports: dict[str, int]) -> None:
        """Every share is ready: commit this node's share and spawn its ranks."""
        engine = self.engine
        job = engine.store.jobs.peek(job_id)
        if job.state != RESERVED:
            raise DetLocalError(f"job {job_id} is {job.state}, not reserved")
        engine.store.jobs.commit(job_id)
        job = engine.store.jobs.peek(job_id)
        if job.kind == JobKind.COMMAND:  # a command sent whole to a peer: it runs there
            engine.note(f"command {job_id} runs on {', '.join(rendezvous.addrs)}")
            return
        if job.slots_needed == 0:  # this node runs no ranks: its job only coordinates
            self._coordinate(job)
            return
        self.trials.start_trial(job, job.slots, job.run_id, rendezvous=rendezvous, ports=ports)

    def _coordinate(self, job: JobRecord) -> None:
        """The trial's run on an owner that runs none of its ranks: no process (pid 0: never
        signalled), but the run record every relayed frame is applied to; the placer ends it
        (`TrialJobs.gang_exited`) once the members' ranks have exited."""
        engine = self.engine
        assert job.trial_id is not None and job.experiment_id is not None
        exp = engine.experiment(job.experiment_id)
        if engine.store.get_trial(job.trial_id).state == State.PAUSED:
            engine.store.set_trial_state(job.trial_id, State.ACTIVE)
        os.close(self.open_trial_log(exp.id, job.trial_id))  # `trial logs` follows it from now
        self.trials.adopt_trial(exp, job)  # a run record as a restart makes (job.pid None: pid 0)

    def release(self, job_id: int, why: str) -> None:
        """A reserved share goes back to the queue, in its place (wounded, lease over)."""
        jobs = self.engine.store.jobs
        job = jobs.peek(job_id)
        if job.state == RESERVED:
            jobs.requeue(job_id)
            self.engine.queue.preempting.discard(job_id)
            self.engine.note(f"job {job_id} released its reserved slots: {why}")

    def end_owner_run(self, trial_id: int, run_id: int, why: str, *, lost: bool) -> None:
        """Stop this node's ranks of the gang (a member failed or a machine was lost)."""
        engine = self.engine
        run = self.sessions.managed_run(trial_id)
        if run is None or run.run_id != run_id:
            return
        if lost:
            self.peer_lost[trial_id] = why
        engine.note(why, experiment_id=run.experiment_id, trial_id=trial_id, level="WARNING")
        engine.supervisor.terminate(run.job_id, run.pid)

    def open_trial_log(self, experiment_id: int, trial_id: int) -> int:
        """The trial's log opened for appending, as its ranks' output is (the submitter's file
        in system mode; never through a link a user put in its place)."""
        from det_local.sched.run.runas import uid_of

        engine = self.engine
        uid = engine.owner_uid(experiment_id)
        if uid is None:
            uid = uid_of(engine.store.get_experiment(experiment_id).user)
        path = engine.paths.trial_log(experiment_id, trial_id)
        return self._open_log(path, uid, engine.store.get_experiment_umask(experiment_id))

    def _open_log(self, path: Path, uid: int, umask: int | None, *, own_dir: bool = False) -> int:
        """own_dir: the log's directory is the user's (a command's job directory), as
        `Commands.start` makes it."""
        from det_local.sched.run import userfiles
        from det_local.sched.run.runas import identity as identity_of

        owner = userfiles.owner_for(identity_of(uid), umask, self.engine.commands.admin_group)
        if own_dir and owner is not None:
            userfiles.make_dir(path.parent, owner)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
        return userfiles.open_log(path, owner)

    def append_command_log(self, job_id: int, data: bytes) -> None:
        """Output of a command this node sent whole to a peer (`cmd logs` shows it)."""
        job = self.engine.store.jobs.peek(job_id)
        path = self.engine.paths.command_log(job_id)
        with os.fdopen(self._open_log(path, job.uid, job.umask, own_dir=True), "ab") as f:
            f.write(data)

    def remote_command_ended(self, job_id: int, code: int, where: str, lost: str | None) -> None:
        """A command sent whole to a peer has ended there (or the peer was lost)."""
        from det_local.sched.life.outcome import describe_exit

        engine = self.engine
        job = engine.store.jobs.peek(job_id)
        if job.state != SCHEDULED:
            return
        killed = job_id in engine.commands.killing
        engine.commands.killing.discard(job_id)
        if killed:
            status, message = code, "killed on request"
        elif lost is not None:
            status, message = None, f"command {job_id} on {where}: {lost}; it is not run again"
        else:
            status, message = (
                code,
                f"command {job_id} {describe_exit(code)} on {where} (its output and exit status "
                f"as machine {where} reported them)",
            )
        engine.store.jobs.finish(job_id, status, message)
        engine.queue.schedule()

    def kill_remote(self, job: JobRecord) -> str | None:
        """`cmd kill` of a command sent whole to a peer; None when it is not one."""
        if job.gang is None or self.placer is None:
            return None
        if job.state == RESERVED:
            self.placer.yield_share(job, "killed on request")
            return None  # back in the queue: removed from it as any queued command
        if job.state == SCHEDULED:
            self.engine.commands.killing.add(job.id)
            self.placer.abort_job(job, "killed on request")
            return f"command {job.id} is being stopped"
        return None

    def append_trial_log(self, experiment_id: int, trial_id: int, data: bytes) -> None:
        """Output of the trial's ranks on another node (already `[rank=N]` prefixed)."""
        with os.fdopen(self.open_trial_log(experiment_id, trial_id), "ab") as f:
            f.write(data)

    def apply_relayed(self, trial_id: int, run_id: int, frame: dict[str, Any]) -> Any:
        """A frame of one of the trial's ranks on another node, applied as a local one."""
        run = self.sessions.managed_run(trial_id)
        if run is None or run.run_id != run_id:
            raise DetLocalError(f"run {run_id} of trial {trial_id} is not running here")
        return self.sessions.handle(run, frame, self.sessions.run_uid(run))

    # ------------------------------------------------------------------ member side
    def enqueue_member(
        self, *, name: str, user: str, priority: int, slots: int, gang: dict[str, Any]
    ) -> int:
        """A share of another node's gang, queued here as the same user name."""
        try:
            uid = pwd.getpwnam(user).pw_uid
        except KeyError:
            raise DetLocalError(
                f"user {user!r} does not exist on this machine: create the account (same name) "
                "to run a share of its trials here"
            ) from None
        jobs = self.engine.store.jobs
        job_id = jobs.create(
            kind=JobKind.MEMBER,
            name=name,
            user=user,
            uid=uid,
            priority=priority,
            slots_needed=slots,
            gang=gang,
        )
        # gangs keep one order on every machine (older first): ahead of younger queued gangs
        key = gang_key(gang)
        younger = [
            j
            for j in jobs.active()
            if j.state == QUEUED
            and j.gang is not None
            and j.id != job_id
            and gang_key(j.gang) > key
        ]
        if younger:
            first = min(younger, key=lambda j: j.position)
            jobs.set_position(job_id, jobs.neighbour_position(first.id, ahead=True))
        return job_id  # the caller runs a scheduling pass once it tracks the share

    def launch_member(
        self, job_id: int, commit: dict[str, Any], context: Path | None, rendezvous: Rendezvous
    ) -> int:
        """The owner committed: spawn this node's ranks of its trial; returns the pid."""
        engine = self.engine
        jobs = engine.store.jobs
        job = jobs.peek(job_id)
        spec = job.gang or {}
        if job.state != RESERVED:
            raise DetLocalError(f"member job {job_id} is {job.state}, not reserved")
        jobs.commit(job_id)
        # what a restarted daemon needs to take its running ranks back (relay_run_of)
        committed = {"run": int(commit["run"]), "ports": dict(commit["ports"])}
        jobs.set_gang(job_id, {**spec, "committed": committed}, job.slots_needed)
        try:
            if "command" in spec:
                return self._spawn_command(job_id, spec["command"])
            assert context is not None
            return self._spawn_member(job_id, spec, commit, context, rendezvous)
        except (DetLocalError, OSError) as err:  # it holds no process: end it, free its slots
            why = f"its ranks could not start: {err}"
            self.relays.pop(job_id, None)
            jobs.finish(job_id, None, why)
            engine.queue.schedule()
            raise DetLocalError(why) from None

    def _spawn_member(
        self,
        job_id: int,
        spec: dict[str, Any],
        commit: dict[str, Any],
        context: Path,
        rendezvous: Rendezvous,
    ) -> int:
        engine = self.engine
        job = engine.store.jobs.peek(job_id)
        run_dir = engine.paths.home / "fed" / "runs" / str(job_id)
        info_dir = run_dir / str(job.run_id)
        config = spec["config"]
        run = self.relay_run_of(engine.store.jobs.peek(job_id))
        assert run is not None
        token = run.token
        from det_local.sched.run import trialstart, userfiles
        from det_local.sched.run.runas import identity as identity_of

        identity = identity_of(job.uid)
        owner = userfiles.owner_for(identity, job.umask, engine.commands.admin_group)
        storage = checkpoint_dir_for(engine.paths, config)

        trial = trialstart.TrialIds(int(spec["trial_id"]), int(spec["seed"]), spec["hparams"])

        latest = commit.get("latest_checkpoint")
        steps = int(commit.get("steps_completed") or 0)
        info = trialstart.cluster_info(
            engine.paths,
            int(spec["experiment_id"]),
            trial,
            int(commit["run"]),
            config,
            list(job.slots),
            token,
            latest,
            steps,
            [],
            rendezvous=rendezvous,
        )
        run_dir.mkdir(parents=True, exist_ok=True)
        trialstart.write_info(info, info_dir, owner)
        facts = TrialFacts(
            experiment_id=int(spec["experiment_id"]),
            trial_id=int(spec["trial_id"]),
            run_id=int(commit["run"]),
            seed=int(spec["seed"]),
            hparams=spec["hparams"],
            config=config,
            context=context,
            steps_completed=steps,
            latest_checkpoint=latest,
            slots=list(job.slots),
            token=token,
            user=job.user,
            uid=job.uid,
            umask=job.umask,
            checkpoint_dir=storage,
            slots_per_trial=int(spec["size"]),
            ports=dict(commit["ports"]),
            identity=identity,
            rendezvous=rendezvous,
            info_dir=info_dir,
            log_path=run_dir / "trial.log",
        )
        plan = build_trial_plan(facts, engine.paths, engine.inventory)
        plan.env["DET_LOCAL_RELAY_JOB"] = str(job_id)
        self.relays[job_id] = run
        proc = engine.supervisor.spawn(job, plan)
        run.pid = proc.pid
        return proc.pid

    def _spawn_command(self, job_id: int, command: dict[str, Any]) -> int:
        """A command another node sent whole (`cmd run --anywhere`): run as its user in its
        working directory, with a clean environment (the submitter's stays on its machine)
        and this node's slot variables."""
        from det_local.errors import TrialError
        from det_local.sched.run import userfiles
        from det_local.sched.run.launchplan import LaunchPlan, base_env
        from det_local.sched.run.runas import identity as identity_of

        engine = self.engine
        job = engine.store.jobs.peek(job_id)
        identity = identity_of(job.uid)
        owner = userfiles.owner_for(identity, job.umask, engine.commands.admin_group)
        run_dir = engine.paths.home / "fed" / "runs" / str(job_id)
        run_dir.mkdir(parents=True, exist_ok=True)
        env = base_env(None, job.uid)
        engine.commands.slot_env(job, env)
        cwd = str(command["cwd"])
        if not os.path.isdir(cwd):
            raise DetLocalError(f"its working directory {cwd} is not on this machine")
        plan = LaunchPlan(
            argv=[str(a) for a in command["argv"]],
            env=env,
            cwd=cwd,
            user=job.user,
            slots=list(job.slots),
            log_path=str(self.member_log(job_id)),
            info_dir=str(run_dir),
            umask=job.umask,
            admin_gid=owner.admin_gid if owner is not None else None,
            **identity,
        )
        try:
            proc = engine.supervisor.spawn(job, plan)
        except TrialError as err:
            raise DetLocalError(str(err)) from None
        return int(proc.pid)

    def relay_run_of(self, job: JobRecord) -> TrialRun | None:
        """The relay run of a committed member share of a trial (None: a command)."""
        spec = job.gang or {}
        committed = spec.get("committed") or {}
        if "command" in spec or not committed:
            return None
        return TrialRun(
            int(spec["trial_id"]),
            int(spec["experiment_id"]),
            "relay",
            int(committed["run"]),
            self.engine.private.run_token(job.id, job.run_id),
            job.id,
            job.pid or 0,
            ports={str(k): int(v) for k, v in dict(committed.get("ports") or {}).items()},
        )

    # ------------------------------------------------------------------ daemon restarts
    def adopt_member(self, job: JobRecord) -> None:
        """A member share whose ranks outlived the daemon: their sessions may reconnect (its
        relay run again); the placer takes it back once its owner is heard, else it ends."""
        run = self.relay_run_of(job)
        if run is not None:
            self.relays[job.id] = run
        self._adopted(job, f"member job {job.id} (pid {job.pid}) outlived its daemon")

    def adopt_owner(self, job: JobRecord) -> None:
        """This node's job of a gang across machines, found running after a restart (its local
        ranks adopted, or none here): the placer takes the gang back."""
        if job.kind == JobKind.TRIAL and job.slots_needed == 0:
            self._coordinate(job)  # its run record again (it has no process)
        self._adopted(job, f"gang job {job.id} was running across machines")

    def _adopted(self, job: JobRecord, what: str) -> None:
        self.adopted.add(job.id)
        self.engine.note(f"{what}: the cluster has {REATTACH_S:.0f}s to take it back")
        loop = self.engine.loop
        if loop is not None:
            loop.call_later(UNCLAIMED_S, self._unclaimed, job.id)

    def claim(self, job_id: int) -> bool:
        """The placer takes an adopted share back; False when it was not adopted."""
        if job_id not in self.adopted:
            return False
        self.adopted.discard(job_id)
        return True

    def _unclaimed(self, job_id: int) -> None:
        """Nobody took an adopted share back (the cluster is off, or its nodes are gone)."""
        if job_id not in self.adopted:
            return
        self.adopted.discard(job_id)
        engine = self.engine
        job = engine.store.jobs.peek(job_id)
        if job.state != SCHEDULED:
            return
        why = "the cluster did not take it back after the daemon restarted"
        if job.kind == JobKind.MEMBER:
            self.drop_member(job_id, why)
        elif job.kind == JobKind.COMMAND:
            self.remote_command_ended(job_id, 1, "another machine", why)
        else:
            run = self.sessions.managed_run(job.trial_id or -1)
            if run is None:
                return
            self.peer_lost[run.trial_id] = why
            if run.pid:
                self.trials.terminate(run)
            else:
                self.trials.gang_exited(run, 1)

    def member_log(self, job_id: int) -> Path:
        return self.engine.paths.home / "fed" / "runs" / str(job_id) / "trial.log"

    def drop_member(self, job_id: int, why: str) -> None:
        """The owner aborted (or is gone): a waiting share leaves the queue, running ranks are
        stopped (SIGTERM, then SIGKILL after the grace period); the exit ends the job."""
        engine = self.engine
        jobs = engine.store.jobs
        job = jobs.peek(job_id)
        if job.state in (QUEUED, RESERVED):
            jobs.finish(job_id, None, why)
            engine.queue.preempting.discard(job_id)
            engine.queue.schedule()
        elif job.state == SCHEDULED:
            self.stopping.setdefault(job_id, why)
            run = self.relays.get(job_id)
            if job.pid is not None:
                engine.supervisor.terminate(job_id, job.pid)
            if run is not None:
                run.kill_requested = True

    def relay_down(self, job_id: int, frame: dict[str, Any]) -> None:
        from det_local.sched.sessions.trialserver import send

        run = self.relays.get(job_id)
        if run is None:
            return
        if frame.get("t") == "preempt":
            run.preempt_sent = True
        for w in run.writers:
            send(w, frame)

    def member_job_exited(self, job: JobRecord, code: int | None) -> None:
        self.relays.pop(job.id, None)
        what = "its command" if "command" in (job.gang or {}) else "its ranks"
        message = f"{what} exited" if code == 0 else f"{what} exited with {code}"
        why = self.stopping.pop(job.id, None)
        if why is not None:
            message = f"{message}: stopped, {why}"
        self.engine.store.jobs.finish(job.id, code, message)
        if self.placer is not None:
            self.placer.member_exited(job, code)


def _what(job: JobRecord) -> str:
    return f"trial {job.trial_id}" if job.trial_id is not None else f"command {job.id}"

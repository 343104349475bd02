"""A trial across machines, as this node's engine sees it (`federate/gangs.py` is the cluster's
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

import asyncio
import pwd
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, Protocol

from det_local.errors import DetLocalError
from det_local.sched.experiments import TrialRun, checkpoint_dir_for
from det_local.sched.rendezvous import Rendezvous
from det_local.sched.trialplan import TrialFacts, build_trial_plan
from det_local.store.jobs import QUEUED, RESERVED, SCHEDULED, JobRecord

if TYPE_CHECKING:
    from det_local.sched.engine import Engine

MEMBER = "MEMBER"


@dataclass(frozen=True)
class GangFit:
    """Where a gang of `size` slots fits: `per_node` slots on each of `nodes` (fit order; this
    node first when it takes part); `local` is this node's share (per_node or 0)."""

    size: int
    per_node: int
    nodes: tuple[str, ...]
    local: int


class Placer(Protocol):
    """The cluster's half (federate/gangs.py), as the engine calls it."""

    def fit(self, slots: int) -> GangFit:
        """Where a gang of this size fits now; DetLocalError (one line) when no set of live
        nodes could ever hold it."""

    def share_started(self, job: JobRecord) -> None:
        """The owner's share holds its slots (RESERVED): place the rest."""

    def member_started(self, job: JobRecord) -> None:
        """A member share holds its slots (RESERVED): tell its owner it is ready."""

    def yield_share(self, job: JobRecord, why: str) -> None:
        """More important local work needs a share's slots: release it (RESERVED) or have its
        owner preempt the whole gang by checkpoint (running)."""

    def owner_exited(self, run: TrialRun, code: int) -> bool:
        """The owner's ranks exited; True: the placer calls `Engine.gang_exited` once every
        member's ranks have stopped too."""

    def member_exited(self, job: JobRecord, code: int | None) -> None:
        """A member share's ranks exited."""

    def down(self, run: TrialRun, frame: dict[str, Any]) -> None:
        """A frame for every rank of the trial on other nodes (preempt)."""

    def stop(self, run: TrialRun) -> None:
        """Stop the trial's ranks on every other node (kill)."""

    def relay(self, run: TrialRun, msg: dict[str, Any]) -> asyncio.Future[Any] | None:
        """A member rank's trial frame, sent to the owner; its reply comes in the future."""


class GangShares:
    """The engine's operations on gang shares (owner and member sides)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.placer: Placer | None = None
        self.relays: dict[int, TrialRun] = {}  # member job id -> its ranks' relay run
        self.stopping: dict[int, str] = {}  # member job id -> why its ranks are being stopped
        self.peer_lost: dict[int, str] = {}  # owner trial id -> why its gang lost a machine
        self.peer_requeues: dict[int, int] = {}  # owner trial id -> requeues for lost machines
        self.max_peer_requeues = 5  # federation.max_peer_requeues

    # ------------------------------------------------------------------ owner side
    def fit(self, slots: int) -> GangFit | None:
        """None when the trial fits this machine (no gang); else where it fits."""
        if slots <= self.engine.inventory.size():
            return None
        if self.placer is None:
            return None
        return self.placer.fit(slots)

    def check_storage(self, cfg: Any) -> None:
        """A trial across machines keeps its checkpoints where every machine reads them."""
        storage = cfg.checkpoint_storage
        if storage is None or storage.type != "shared_fs":
            raise DetLocalError(
                "checkpoint_storage: a trial across machines (resources.slots_per_trial "
                f"{cfg.resources.slots_per_trial} is more than this machine's "
                f"{self.engine.inventory.size()} slots) needs type shared_fs with the same "
                "host_path mounted on every machine"
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
        if job.slots_needed == 0:  # this node takes no part: its job only coordinates
            return
        engine.start_trial(job, job.slots, job.run_id, rendezvous=rendezvous, ports=ports)

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
        run = engine.runs.get(trial_id)
        if run is None or run.run_id != run_id:
            return
        if lost:
            self.peer_lost[trial_id] = why
        engine.note(why, experiment_id=run.experiment_id, trial_id=trial_id, level="WARNING")
        engine.supervisor.terminate(run.job_id, run.pid)

    def apply_relayed(self, trial_id: int, run_id: int, frame: dict[str, Any]) -> Any:
        """A frame of one of the trial's ranks on another node, applied as a local one."""
        engine = self.engine
        run = engine.runs.get(trial_id)
        if run is None or run.run_id != run_id:
            raise DetLocalError(f"run {run_id} of trial {trial_id} is not running here")
        return engine.handle(run, frame, engine.run_uid(run))

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
            kind=MEMBER,
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
        self, job_id: int, commit: dict[str, Any], context: Path, rendezvous: Rendezvous
    ) -> int:
        """The owner committed: spawn this node's ranks of its trial; returns the pid."""
        engine = self.engine
        jobs = engine.store.jobs
        job = jobs.peek(job_id)
        spec = job.gang or {}
        if job.state != RESERVED:
            raise DetLocalError(f"member job {job_id} is {job.state}, not reserved")
        jobs.commit(job_id)
        try:
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
        token = engine.private.run_token(job.id, job.run_id)
        run = TrialRun(
            int(spec["trial_id"]),
            int(spec["experiment_id"]),
            "relay",
            int(commit["run"]),
            token,
            job.id,
            0,
            ports=dict(commit["ports"]),
        )
        from det_local.sched import trialstart, userfiles
        from det_local.sched.users import identity as identity_of

        identity = identity_of(job.uid)
        owner = userfiles.owner_for(identity, job.umask, engine.settings.admin_group)
        storage = checkpoint_dir_for(engine.paths, config)

        # what _cluster_info reads of a trial record
        trial = SimpleNamespace(
            id=int(spec["trial_id"]), seed=int(spec["seed"]), hparams=spec["hparams"]
        )

        latest = commit.get("latest_checkpoint")
        steps = int(commit.get("steps_completed") or 0)
        info = trialstart._cluster_info(
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
        from det_local.sched.trialserver import send

        run = self.relays.get(job_id)
        if run is None:
            return
        if frame.get("t") == "preempt":
            run.preempt_sent = True
        for w in run.writers:
            send(w, frame)

    def member_job_exited(self, job: JobRecord, code: int | None) -> None:
        self.relays.pop(job.id, None)
        message = "its ranks exited" if code == 0 else f"its ranks exited with {code}"
        why = self.stopping.pop(job.id, None)
        if why is not None:
            message = f"{message}: stopped, {why}"
        self.engine.store.jobs.finish(job.id, code, message)
        if self.placer is not None:
            self.placer.member_exited(job, code)


def gang_key(gang: dict[str, Any]) -> tuple[int, int, str, int]:
    """One order of gangs on every machine: (priority, submission time at the owner, owner,
    owner's job id); smaller is older (goes first)."""
    key = gang.get("key") or [0, 0, "", 0]
    return (int(key[0]), int(key[1]), str(key[2]), int(key[3]))


def share_key(job: JobRecord, node: str) -> tuple[int, int, str, int]:
    """A share's place in that order: a member's is its gang's; this node's own trial job's is
    made the way its owner (`node`) sends it in `reserve`."""
    if job.kind == MEMBER:
        return gang_key(job.gang or {})
    return owner_key(job, node)


def owner_key(job: JobRecord, node: str) -> tuple[int, int, str, int]:
    return (int(job.priority), int(job.submitted_at * 1e9), node, job.id)

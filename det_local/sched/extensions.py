"""Services that run on the daemon's event loop next to the engine (federation, later others).

`sched` imports none of them: the daemon's entry point (`det-local daemon`, in `cli/`) hands
`run_foreground` a list of factories, and each service gets an `EngineView`: its one door into
the engine, and the daemon's log. The view has two halves, marked in the class:

- reads: this node's home, slots, queue, jobs, runs and usage (nothing changes);
- changes: what the cluster (`federate/`) does to this node's engine to run a trial across
  machines: install its placer, hold back / release / reorder queued gang shares, record a
  share's slots, fail or preempt a gang, append relayed logs, stop an idle command, and the
  engine's gang-share operations (`gangs`: `sched/gangs.GangShares`: claim, release,
  launch_owner, enqueue_member, ...). Each change runs on the engine's loop, as the engine's own
  handlers do; a new kind of change comes as a new, named method here.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from det_local.store.paths import Paths
from det_local.store.states import JobKind, JobState

if TYPE_CHECKING:
    from det_local.sched.engine import Engine
    from det_local.sched.gangs import GangShares
    from det_local.sched.gangseam import Placer
    from det_local.sched.life.experiments import TrialRun
    from det_local.store.tables.jobs import JobRecord


class Extension(Protocol):
    async def start(self) -> None:
        """Called once the engine serves (jobs of an earlier daemon adopted)."""

    async def stop(self) -> None:
        """Called when the daemon stops, before the engine does; must not raise."""


ExtensionFactory = Callable[["EngineView"], Extension]

# what a job shows to other nodes (no argv, cwd, pid or message: those stay on this node)
JOB_FIELDS = (
    "id",
    "kind",
    "name",
    "user",
    "priority",
    "slots_needed",
    "state",
    "experiment_id",
    "trial_id",
    "slots",
    "submitted_at",
    "started_at",
)


class EngineView:
    """A service's door into the engine: reads, then (below "changes") the state-changing
    methods the cluster uses. Every method runs on the engine's loop."""

    def __init__(self, engine: Engine, log: Callable[[str], None]) -> None:
        self._engine = engine
        self._log = log
        self.node_id = ""  # this node's id in the cluster (set with the placer)

    @property
    def paths(self) -> Paths:
        return self._engine.paths

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return asyncio.get_running_loop()

    def log(self, line: str) -> None:
        """One line in the daemon's log (not an event in the store: a flood stays cheap)."""
        self._log(f"det-local: {line}")

    def slots(self) -> tuple[int, int, str]:
        """(free, total, kind): this node's slots now; kind is gpu or cpu."""
        total = self._engine.inventory.size()
        kind = "cpu" if self._engine.inventory.source == "cpu" else "gpu"
        if self.node_disabled():  # `cluster node disable`: nothing free for peers
            return 0, total, kind
        held = {
            i
            for j in self._engine.store.jobs.active()
            if j.state != JobState.QUEUED
            for i in j.slots
        }
        free = set(range(total)) - held - self._engine.slots.disabled  # drained slots too
        return len(free), total, kind

    def node_disabled(self) -> bool:
        """An admin disabled this node (`cluster node disable`): no new work from peers."""
        return self._engine.store.drains.node()

    def queue_digest(self, top: int = 5) -> dict[str, Any]:
        """Queued and running counts and the first `top` queued jobs as [priority, slots]."""
        jobs = self._engine.store.jobs.active()
        queued = sorted(
            (j for j in jobs if j.state == JobState.QUEUED), key=lambda j: (j.priority, j.id)
        )
        return {
            "queued": len(queued),
            "running": len(jobs) - len(queued),
            "top": [[int(j.priority), int(j.slots_needed)] for j in queued[:top]],
        }

    def jobs(self, include_done: bool = False, limit: int = 1000) -> list[dict[str, Any]]:
        """This node's jobs as `job list --json` gives them (running first, then queued)."""
        jobs = self._engine.store.jobs.list(include_done=include_done)
        order = {"SCHEDULED": 0, "QUEUED": 1}
        jobs.sort(key=lambda j: (order.get(str(j.state), 2), j.priority, j.id))
        return [
            {**{k: getattr(j, k) for k in JOB_FIELDS}, "runs_on": self.runs_on(j)}
            for j in jobs[:limit]
        ]

    def runs_on(self, job: JobRecord) -> str:
        """The nodes a running (or reserved) job's processes are on; "" while it waits or
        once it has ended."""
        return runs_on(job, self.node_id or "local")

    def slot_rows(self) -> list[dict[str, Any]]:
        """This node's slots as `slots --json` gives them (without foreign process lists)."""
        from det_local.sched.queue.hardware import describe, slot_holders

        rows = describe(self._engine.inventory, slot_holders(self._engine.store.jobs.active()))
        return [{k: v for k, v in row.items() if k != "foreign"} for row in rows]

    # ------------------------------------------------------------------ system metrics
    # (the seam `det_local/usage/sampler.py` samples running jobs and reclaims idle ones
    # through: it reads the hardware off the loop and writes only through these)
    @property
    def inventory(self) -> Any:
        return self._engine.inventory

    def cgroup_dir(self, job: JobRecord) -> str | None:
        """The tracking cgroup of the job's current run, where it has one."""
        cg = self._engine.containment.job(job.id, job.run_id)
        return None if cg is None else str(cg.path)

    def profiling(self, job: JobRecord) -> bool:
        """The job is a trial whose experiment config says profiling: {enabled: true}."""
        if job.experiment_id is None:
            return False
        config = self._engine.store.get_experiment(job.experiment_id).config
        return bool(((config or {}).get("profiling") or {}).get("enabled"))

    def record_system(
        self,
        samples: list[tuple[int, int, int | None, float, dict[str, float]]],
        utilisation: list[tuple[int, float]],
    ) -> None:
        """One sampler tick's rows and each job's utilisation, in one transaction."""
        usage = self._engine.store.usage
        with self._engine.store.transaction():
            usage.add_samples(samples)
            usage.add_utilisation(utilisation)

    @property
    def usage(self) -> Any:
        """The store's usage table (allocations, samples, idle states): the sampler's own."""
        return self._engine.store.usage

    # ------------------------------------------------------------------ changes
    # (each changes the engine's state; the usage sampler and the cluster call them)
    def stop_idle(self, job: JobRecord, why: str) -> str:
        """End an idle command, notebook or shell (never a trial): as `cmd kill`, with `why`
        as its end message."""
        if job.kind == JobKind.TRIAL:
            raise ValueError("trials are never stopped for idling")
        self._engine.commands.kill_reasons[job.id] = why
        return self._engine.kill_job(job.id)

    # ------------------------------------------------------------------ gangs across machines
    # (the seam `federate/gangs/` places trials through; see `sched/gangs.py`): changes,
    # except the reads job, active_jobs, member_jobs, held_back, gang_spec, command_spec,
    # context_of, resume_point, trial_run and the check_* methods
    @property
    def gangs(self) -> GangShares:
        """The engine's gang-share operations (state-changing: claim, release, launch_owner,
        enqueue_member, ...)."""
        return self._engine.gangs

    def install_placer(self, placer: Placer | None, node_id: str = "") -> None:
        """Plug the cluster's placer in (None: out); `node_id` is this node in gang keys."""
        self._engine.gangs.placer = placer
        self.node_id = node_id
        self._engine.node_name = node_id

    def schedule(self) -> None:
        self._engine.queue.schedule()

    def job(self, job_id: int) -> JobRecord | None:
        from det_local.errors import NotFoundError

        try:
            return self._engine.store.jobs.peek(job_id)
        except NotFoundError:
            return None

    def active_jobs(self) -> list[JobRecord]:
        return self._engine.store.jobs.active()

    def member_jobs(self, gang: str, run: int) -> list[JobRecord]:
        """This node's MEMBER jobs of one run of a gang, newest first (ended ones too)."""
        jobs = self._engine.store.jobs.list(include_done=True)
        found = [
            j
            for j in jobs
            if j.kind == JobKind.MEMBER
            and (j.gang or {}).get("gang") == gang
            and (j.gang or {}).get("run") == run
        ]
        return sorted(found, key=lambda j: -j.id)

    def hold_back(self, job_id: int, why: str) -> None:
        """Keep a queued gang share out of the passes (it waits for machines)."""
        self._engine.queue.hold_back[job_id] = why

    def held_back(self, job_id: int) -> bool:
        return job_id in self._engine.queue.hold_back

    def release_held_back(self, job_id: int | None = None) -> bool:
        """Let held-back shares (one, or all) be scheduled again; True if any was held."""
        held = self._engine.queue.hold_back
        if job_id is None:
            had = bool(held)
            held.clear()
            return had
        return held.pop(job_id, None) is not None

    def set_share(self, job_id: int, slots: int, gang: dict[str, Any]) -> None:
        self._engine.store.jobs.set_gang(job_id, gang, slots)

    def behind_older_gangs(self, job_id: int) -> None:
        """Move a queued gang share behind every queued share of an older gang."""
        from det_local.sched.gangseam import share_key

        jobs = self._engine.store.jobs
        me = jobs.peek(job_id)
        node = self.node_id

        def key(j: JobRecord) -> tuple[int, int, str, int]:
            return share_key(j, node)

        older = [
            j
            for j in jobs.active()
            if j.gang is not None
            and j.id != job_id
            and key(j) < key(me)
            and j.state == JobState.QUEUED
        ]
        if older:
            last = max(older, key=lambda j: j.position)
            if last.position > me.position:
                jobs.set_position(job_id, jobs.neighbour_position(last.id, ahead=False))

    def gang_spec(self, job: JobRecord) -> dict[str, Any]:
        """What a member needs to run its ranks of the job's trial (no command line: the
        member builds it from the config)."""
        engine = self._engine
        assert job.experiment_id is not None and job.trial_id is not None
        rec = engine.store.get_experiment(job.experiment_id)
        trial = engine.store.get_trial(job.trial_id)
        return {
            "experiment_id": job.experiment_id,
            "trial_id": job.trial_id,
            "seed": int(trial.seed),
            "hparams": trial.hparams,
            "config": rec.config,
            "size": int((job.gang or {}).get("size", job.slots_needed)),
        }

    def command_spec(self, job: JobRecord) -> dict[str, Any]:
        """What a peer needs to run a command sent to it whole (`cmd run --anywhere`): its
        argv and working directory (not its environment: the peer gives it a clean one)."""
        full = self._engine.store.jobs.get(job.id)  # the scheduler's copy leaves argv out
        return {
            "command": {"argv": list(full.argv or []), "cwd": str(full.cwd or "/")},
            "size": int((job.gang or {}).get("size", job.slots_needed)),
        }

    def check_gang_command(self, command: Any, user: str) -> None:
        """A member's check of a command another machine sends it whole: argv a list of
        strings, its working directory a directory here, the user present here."""
        import pwd

        from det_local.errors import DetLocalError

        argv = command.get("argv") if isinstance(command, dict) else None
        cwd = command.get("cwd") if isinstance(command, dict) else None
        if (
            not isinstance(argv, list)
            or not argv
            or not all(isinstance(a, str) and "\0" not in a for a in argv)
            or not isinstance(cwd, str)
            or not os.path.isabs(cwd)
        ):
            raise DetLocalError("a command needs argv (a list of strings) and an absolute cwd")
        try:
            pwd.getpwnam(user)
        except KeyError:
            raise DetLocalError(
                f"user {user!r} does not exist on this machine: create the account (same name) "
                "to run its commands here [permanent]"
            ) from None
        if not os.path.isdir(cwd):
            raise DetLocalError(
                f"the command's working directory {cwd} is not on this machine: run it from a "
                "directory every machine has (a shared file system) [permanent]"
            )
        if os.geteuid() != 0 and pwd.getpwuid(os.geteuid()).pw_name != user:
            raise DetLocalError(
                f"this machine's daemon is not root: it runs only its own user's jobs, not "
                f"{user!r}'s [permanent]"
            )

    def context_of(self, experiment_id: int) -> str:
        """The experiment's context snapshot directory."""
        return str(self._engine.store.get_experiment(experiment_id).context_dir)

    def allocate_ports(self) -> dict[str, int]:
        from det_local.launch.ports import allocate_ports

        in_use = [p for r in self._engine.runs.values() for p in r.ports.values()]
        return allocate_ports(in_use=in_use)

    def resume_point(self, trial_id: int) -> tuple[str | None, int]:
        return self._engine.trials.resume_point(trial_id)

    def trial_run(self, trial_id: int) -> TrialRun | None:
        return self._engine.runs.get(trial_id)

    def gang_exited(self, run: TrialRun, code: int) -> None:
        self._engine.trial_jobs.gang_exited(run, code)

    def gang_failed(self, job_id: int, why: str) -> None:
        """The gang can never be placed as configured (a member refused for good)."""
        engine = self._engine
        job = engine.store.jobs.peek(job_id)
        if job.state == JobState.RESERVED:
            engine.store.jobs.requeue(job_id)
        assert job.experiment_id is not None and job.trial_id is not None
        engine.trial_jobs.fail_trial_start(
            job.experiment_id, job.trial_id, f"trial {job.trial_id}: {why}"
        )
        engine.queue.schedule()

    def preempt_gang(self, job_id: int, why: str) -> None:
        engine = self._engine
        job = engine.store.jobs.peek(job_id)
        if job.state == JobState.SCHEDULED and engine.trial_jobs.preempt_trial(job):
            engine.queue.preempting.add(job_id)

    def append_trial_log(self, experiment_id: int, trial_id: int, data: bytes) -> None:
        self._engine.gangs.append_trial_log(experiment_id, trial_id, data)

    def append_command_log(self, job_id: int, data: bytes) -> None:
        self._engine.gangs.append_command_log(job_id, data)

    def check_gang_config(self, config: Any, user: str) -> None:
        """A member's check of the config it was sent (the owner's, hostile until checked):
        parsed as any experiment config, shared_fs checkpoints present here, the user
        present here. DetLocalError ending in [permanent]: it will never fit here."""
        import pwd

        from det_local.config import parse_config
        from det_local.errors import DetLocalError

        try:
            parse_config(config, source="a gang's experiment config")
        except DetLocalError as err:
            raise DetLocalError(f"{err} [permanent]") from None
        storage = config.get("checkpoint_storage") or {}
        if storage.get("type") != "shared_fs":
            raise DetLocalError(
                "a trial across machines needs checkpoint_storage of type shared_fs [permanent]"
            )
        host = str(storage.get("host_path") or "")
        if not os.path.isdir(host):
            raise DetLocalError(
                f"checkpoint_storage.host_path {host} is not a directory on this machine: "
                "mount the shared file system at the same path on every machine [permanent]"
            )
        try:
            pwd.getpwnam(user)
        except KeyError:
            raise DetLocalError(
                f"user {user!r} does not exist on this machine: create the account (same name) "
                "to run a share of its trials here [permanent]"
            ) from None
        if os.geteuid() != 0 and pwd.getpwuid(os.geteuid()).pw_name != user:
            raise DetLocalError(
                f"this machine's daemon is not root: it runs only its own user's ranks, not "
                f"{user!r}'s [permanent]"
            )


def runs_on(job: JobRecord, me: str) -> str:
    """The nodes a running (or reserved) job's processes are on, comma-separated (`me` is this
    node); "" while it waits or once it has ended. A share of another node's gang (MEMBER)
    runs here; a job sent to an idle peer runs there; a gang runs on its nodes."""
    if job.state not in (JobState.SCHEDULED, JobState.RESERVED):
        return ""
    gang = job.gang or {}
    if job.kind == JobKind.MEMBER:
        return me
    if gang.get("anywhere"):
        return str(gang["anywhere"])
    if gang.get("nodes"):
        return ",".join(str(n) for n in gang["nodes"])
    return me

"""Resource pools: where an experiment's trials run (`resources.resource_pool`).

The machine's own slots are the default pool (``""`` or ``default``; the LAN cluster extends
it). Other pools come from daemon.yaml's `resource_pools:`; each names a backend (today:
``slurm``, `det_local/slurm/`). A pool is a :class:`~det_local.sched.run.launcher.Launcher` behind
:class:`~det_local.pools.router.PoolLauncher`: the engine decides what runs and when, a pool's
launcher decides how and where. The engine knows pools only as names (``is_default``,
``check_experiment``); nothing in `sched/` knows Slurm.

A trial of a non-default pool holds no slot of this machine (its job asks for 0): the pool's own
scheduler (Slurm) queues it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from det_local.errors import ConfigError
from det_local.store.states import JobKind

if TYPE_CHECKING:
    from det_local.sched.run.launcher import Launcher
    from det_local.sched.run.launchplan import LaunchPlan
    from det_local.slurm.config import SlurmPool
    from det_local.store.paths import Paths
    from det_local.store.tables.jobs import JobRecord

DEFAULT = "default"
_BACKENDS = {"slurm"}


def is_default(name: str | None) -> bool:
    return not name or name == DEFAULT


def pool_job(store: Any, experiment_id: int, trial_id: int) -> tuple[str, int] | None:
    """(pool, Slurm job id) of the trial's latest run, for a trial of a pool other than this
    machine's whose job Slurm has accepted (the job's pid column holds the Slurm job id);
    None otherwise."""
    from det_local.errors import DetLocalError

    try:
        config = store.get_experiment(experiment_id).config
    except DetLocalError:
        return None
    name = (config.get("resources") or {}).get("resource_pool")
    if is_default(name) or not isinstance(name, str):
        return None
    job = store.jobs.for_trial(trial_id)
    if job is None or not job.pid:
        return None
    return name, int(job.pid)


@dataclass(frozen=True)
class Pools:
    """The pools this engine knows: the default one and daemon.yaml's."""

    slurm: dict[str, SlurmPool] = field(default_factory=dict)
    source: str = "daemon.yaml"

    @property
    def names(self) -> list[str]:
        return [DEFAULT, *sorted(self.slurm)]

    def describe(self) -> list[dict[str, str]]:
        """One row per pool (`det-local slots`)."""
        rows = [{"pool": DEFAULT, "kind": "local", "where": "this machine's slots"}]
        for name, pool in sorted(self.slurm.items()):
            rows.append({"pool": name, "kind": "slurm", "where": f"partition {pool.partition}"})
        return rows

    def listens(self) -> list[tuple[str, int]]:
        """Where the daemon listens for pools' trials over TCP (`slurm.channel.listen`)."""
        found = {(p.channel.host, p.channel.port) for p in self.slurm.values() if p.channel}
        return sorted(found)

    def check_pool(self, name: str | None, where: str = "resources.resource_pool") -> None:
        """ConfigError (one line) for a pool that does not exist."""
        if is_default(name) or name in self.slurm:
            return
        raise ConfigError(
            f"{where}: pool '{name}' does not exist; pools: {', '.join(self.names)} "
            f"(add it under resource_pools: in {self.source})"
        )

    def check_experiment(self, cfg: Any, home: Path, uid: int | None = None) -> None:
        """At submission: the pool exists, and its backend can run this experiment (for the
        submitter ``uid``; None: this process's user)."""
        name = cfg.resources.resource_pool
        self.check_pool(name)
        if is_default(name):
            return
        from det_local.slurm.stage import check_stage_dir
        from det_local.slurm.submit import check_experiment

        check_experiment(self.slurm[name], cfg, home)
        check_stage_dir(self.slurm[name], uid)

    def check_command(self, name: str | None, request: dict[str, Any]) -> int:
        """`cmd run --pool NAME` (``request``: the command's submission, its kind, slots and
        uid): the pool exists and can run it; the slots it asks of it."""
        kind, slots = str(request.get("kind", "COMMAND")), request["slots"]
        self.check_pool(name, "--pool")
        if kind != JobKind.COMMAND:
            raise ConfigError(
                f"--pool: only `cmd run` runs in a resource pool; {kind.lower()}s run on this "
                "machine's slots"
            )
        if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
            raise ConfigError(f"--slots {slots!r}: a command in a pool needs 1 slot or more")
        from det_local.slurm.stage import check_stage_dir
        from det_local.slurm.submit import check_slurm

        assert name is not None
        check_slurm(self.slurm[name], slots, "--pool")
        check_stage_dir(self.slurm[name], request.get("uid"))
        return slots

    def batch_script(self, name: str | None, plan: LaunchPlan, slots: int) -> str | None:
        """What a run of this plan is submitted as in pool ``name`` (`config check` shows it);
        None for this machine's pool."""
        if is_default(name) or name not in self.slurm:
            return None
        from det_local.slurm.script import batch_script

        return batch_script(plan, self.slurm[name], slots)

    def pool_of_config(self, config: dict[str, Any]) -> str:
        name = (config.get("resources") or {}).get("resource_pool") or ""
        return DEFAULT if is_default(name) else str(name)

    def launcher(
        self,
        local: Launcher,
        paths: Paths,
        pool_of: Callable[[JobRecord], str],
        pool_slots: Callable[[JobRecord], int | None],
        note: Callable[..., None],
    ) -> Launcher:
        """The launcher the supervisor uses: a router over this machine's and every pool's
        (always: a job of a pool removed from daemon.yaml is still routed, never taken for a
        local process)."""
        from det_local.pools.router import PoolLauncher
        from det_local.slurm.config import SlurmPool
        from det_local.slurm.launcher import SlurmLauncher

        backends: dict[str, Launcher] = {
            name: SlurmLauncher(pool, paths, note, pool_slots) for name, pool in self.slurm.items()
        }

        def removed(name: str) -> Launcher:
            """Follows the Slurm jobs of a pool no longer configured, by their ids (enough to
            watch and scancel them); it submits nothing (the router refuses first)."""
            return SlurmLauncher(SlurmPool(name, partition="(removed)"), paths, note, pool_slots)

        return PoolLauncher(local, backends, pool_of, removed, note, self.source)


def load_pools(path: Path) -> Pools:
    """daemon.yaml's `resource_pools:` (checked; ConfigError naming the field)."""
    source = str(path)
    if not path.exists():
        return Pools(source=source)
    import yaml

    from det_local.config.limits import read_settings_text

    try:
        raw = yaml.safe_load(read_settings_text(path)) or {}
    except yaml.YAMLError:
        return Pools(source=source)  # load_settings says what is wrong with it
    section = raw.get("resource_pools") if isinstance(raw, dict) else None
    if not section:
        return Pools(source=source)
    if not isinstance(section, dict):
        raise ConfigError(
            f"resource_pools in {source}: expected a mapping of pool names, found {section!r}"
        )
    from det_local.slurm.config import parse_slurm_pool
    from det_local.suggest import check_section_keys

    slurm: dict[str, SlurmPool] = {}
    for name, body in section.items():
        if not isinstance(name, str) or is_default(name):
            raise ConfigError(
                f"resource_pools.{name} in {source}: '{DEFAULT}' is this machine's own pool; "
                "give the pool another name"
            )
        if not isinstance(body, dict) or len(body) != 1:
            raise ConfigError(
                f"resource_pools.{name} in {source}: expected one backend, e.g. "
                "'slurm: {partition: debug}'"
            )
        check_section_keys(f"resource_pools.{name}.", body, _BACKENDS, source)
        slurm[name] = parse_slurm_pool(name, body["slurm"], source)
    return Pools(slurm=slurm, source=source)

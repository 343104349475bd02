"""One plan per trial run: :func:`build_trial_plan` turns the facts of a run into its
:class:`~det_local.sched.run.launchplan.LaunchPlan` (argv, env, cwd, user, slots, ports, rendezvous,
umask, log and info paths).

The engine builds every trial's plan here before it spawns it, and `det-local config check`
builds the first trial's plan with the same function (`client/preview.py`), so what the dry run
shows is what a launch does. Building a plan touches nothing: no file is written, no port is
bound (the ports are chosen by the caller), no process is started.

A trial whose ranks run on several machines gets one plan per node, each from facts with the
same ``ports`` (the chief's) and a :class:`~det_local.sched.run.rendezvous.Rendezvous` naming that
node's rank; without one (None) the plan is a single-node plan, as it always was.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from det_local.sched.queue import hardware as hardware
from det_local.sched.run.launchplan import (
    LaunchPlan,
    base_env,
    config_env_vars,
    entrypoint_argv,
    trial_env,
    trial_extra,
)
from det_local.sched.run.rendezvous import SHARED_PORTS, Rendezvous, RendezvousError
from det_local.store.paths import Paths


@dataclass(frozen=True)
class TrialFacts:
    """What one run of a trial is launched from."""

    experiment_id: int
    trial_id: int
    run_id: int
    seed: int
    hparams: dict[str, Any]
    config: dict[str, Any]  # the experiment's stored config
    context: Path  # the context snapshot it runs in
    steps_completed: int  # where it resumes
    latest_checkpoint: str | None  # what it resumes from
    slots: list[int]  # this node's slot indices it holds
    token: str  # the run's session token
    user: str
    uid: int | None  # the user it runs as (None: this process's own)
    umask: int | None
    checkpoint_dir: Path
    slots_per_trial: int = 1  # the config's resources.slots_per_trial (the entrypoint's form)
    captured_env: Mapping[str, str] | None = None  # the submitter's allow-listed variables
    test_mode: bool = False
    ports: Mapping[str, int] = field(default_factory=dict)  # rendezvous ports (chosen free)
    identity: Mapping[str, Any] = field(default_factory=dict)  # uid/gid/groups (system mode)
    admin_gid: int | None = None  # the admin group's ACL entry on its files (system mode)
    # a multi-node trial: where its nodes meet and which one this is (None: one machine)
    rendezvous: Rendezvous | None = None
    # where this node keeps the run's info files and output (None: the paths derived from the
    # experiment and trial ids; a node running another node's trial keeps them elsewhere)
    info_dir: Path | None = None
    log_path: Path | None = None


def build_trial_plan(
    facts: TrialFacts,
    paths: Paths,
    inventory: hardware.Inventory,
    *,
    shown: Mapping[str, str] | None = None,
) -> LaunchPlan:
    """The launch plan of one trial run. ``shown``: env values to show instead of the real
    ones (`config check`, for what only a launch decides: ports, devices, the token); the
    plan is otherwise the one a launch carries out."""
    config = facts.config
    info_dir = facts.info_dir or paths.trial_info_dir(
        facts.experiment_id, facts.trial_id, facts.run_id
    )
    log_path = facts.log_path or paths.trial_log(facts.experiment_id, facts.trial_id)
    # a clean environment: the submitter's allow-listed variables, never the daemon's
    base = base_env(facts.captured_env, facts.uid)
    extra = trial_extra(
        config,
        base=base,
        home=str(paths.home),
        threads=inventory.cpu_threads(len(facts.slots)),
        visible_devices=inventory.visible_devices(facts.slots),
        ports={name: str(port) for name, port in facts.ports.items()},
        test_mode=facts.test_mode,
        rendezvous=_rendezvous_env(facts),
    )
    if facts.admin_gid is not None:  # its checkpoints get the admin group's ACL entry
        extra.append(f"DET_LOCAL_ADMIN_GID={facts.admin_gid}")
    env = trial_env(
        base=base,
        experiment_id=facts.experiment_id,
        trial_id=facts.trial_id,
        run_id=facts.run_id,
        seed=facts.seed,
        hparams=facts.hparams,
        config=config,
        steps_completed=facts.steps_completed,
        latest_checkpoint=facts.latest_checkpoint,
        slots=list(facts.slots),
        socket_path=str(paths.socket),
        token=facts.token,
        info_dir=str(info_dir),
        checkpoint_dir=str(facts.checkpoint_dir),
        user=facts.user,
        extra=extra,
    )
    env.update(shown or {})
    return LaunchPlan(
        argv=entrypoint_argv(
            config.get("entrypoint") or "", facts.context, slots_per_trial=facts.slots_per_trial
        ),
        env=env,
        cwd=str(facts.context),
        user=facts.user,
        slots=list(facts.slots),
        log_path=str(log_path),
        info_dir=str(info_dir),
        ports=dict(facts.ports),
        umask=facts.umask,
        admin_gid=facts.admin_gid,
        **dict(facts.identity),
    )


def _rendezvous_env(facts: TrialFacts) -> dict[str, str]:
    """A multi-node trial's variables (``Rendezvous.to_env``); {} on one machine. Every node
    must be given the chief's ports: a node left to Determined's fixed defaults would wait for
    the others at a port nobody chose."""
    rdzv = facts.rendezvous
    if rdzv is None:
        return {}
    missing = [name for name in SHARED_PORTS if name not in facts.ports]
    if rdzv.nnodes > 1 and missing:
        raise RendezvousError(
            f"trial {facts.trial_id} (node {rdzv.node_rank} of {rdzv.nnodes}): the plan has no "
            f"{', '.join(missing)}; pass the chief's ports in TrialFacts.ports on every node"
        )
    configured = {item.partition("=")[0] for item in config_env_vars(facts.config)}
    return rdzv.to_env(configured)

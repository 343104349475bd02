"""Submitting an experiment: its checks, its context snapshot (taken with the submitter's
rights), its warm start, its record and its private environment, then its searcher started.

:func:`submit_experiment` is `Engine.submit`: the checks that need the engine (its pools, its
slots, a gang's storage), then :func:`record_experiment` (everything a submission commits),
then the experiment handed to the engine and its searcher's first actions applied.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from det_local.errors import ContextError, DetLocalError
from det_local.pools import is_default
from det_local.sched.life.experiments import ExperimentRun, checkpoint_dir_for
from det_local.sched.queue.policy import check_request
from det_local.sched.run import executor
from det_local.sched.run.launchplan import allowed_submitter_vars, check_entrypoint, entrypoint_argv
from det_local.sched.run.runas import identity as identity_of
from det_local.sched.run.runas import user_name
from det_local.search import Searcher, make_searcher
from det_local.store.db import Store
from det_local.store.paths import Paths
from det_local.store.private import PrivateFiles
from det_local.store.records import CHECKPOINT_DELETED

if TYPE_CHECKING:
    from det_local.config.experiment import ExperimentConfig
    from det_local.pools import Pools
    from det_local.sched.gangs import GangShares
    from det_local.sched.queue.hardware import Inventory
    from det_local.search.actions import Action


class Submitting(Protocol):
    """What a submission needs of the engine."""

    store: Store
    paths: Paths
    private: PrivateFiles
    pools: Pools
    gangs: GangShares
    inventory: Inventory
    user: str  # the engine's user: a local run's submitter

    def cpu_slots_remedy(self, slots: int) -> str | None: ...

    def add_experiment(self, exp: ExperimentRun, uid: int) -> None: ...

    def apply(self, exp: ExperimentRun, actions: list[Action]) -> None: ...

    def check_idle(self) -> None: ...


def submit_experiment(
    host: Submitting,
    cfg: ExperimentConfig,
    context_src: Path,
    source: str,
    *,
    test_mode: bool = False,
    user: str | None = None,
    uid: int | None = None,
    env: dict[str, str] | None = None,
    umask: int | None = None,
) -> int:
    """Validate, snapshot the context, record the experiment and start its searcher.

    ``env`` is the submitter's environment: its allow-listed variables (PATH, LANG...) are
    kept, in a private file, for the experiment's trials; the rest is dropped here.

    With test_mode the config is rewritten as Determined's `--test` does, and the trial runs
    twice: one batch + validation + checkpoint, then a fresh process that restores that
    checkpoint and trains one more batch."""
    from det_local.sched.run.userfiles import check_umask, current_umask

    # the submitter's umask: its trials run with it (a local run: this process's own)
    umask = current_umask() if umask is None and uid is None else check_umask(umask)
    if test_mode:
        from det_local.config import make_test_config

        cfg = make_test_config(cfg)
    slots = int(cfg.resources.slots_per_trial)
    host.pools.check_experiment(cfg, host.paths.home, uid)
    pooled = not is_default(cfg.resources.resource_pool)
    fit = None if pooled else host.gangs.fit(slots)
    if pooled:
        pass  # the pool's own scheduler has the slots (checked above)
    elif fit is not None or cfg.resources.federate:
        host.gangs.check_storage(cfg)
    else:  # not a gang across machines: this one must do
        check_request(
            slots,
            host.inventory.size(),
            "resources.slots_per_trial",
            more=host.cpu_slots_remedy(slots),
        )
    owner = os.getuid() if uid is None else uid
    exp_id, searcher, config = record_experiment(
        host.store,
        host.paths,
        host.private,
        cfg,
        context_src,
        source,
        user=user or host.user,
        uid=owner,
        env=env,
        umask=umask,
    )
    exp = ExperimentRun(exp_id, cfg, searcher, checkpoint_dir_for(host.paths, config))
    exp.test_mode = test_mode
    host.add_experiment(exp, owner)
    host.apply(exp, searcher.initial_actions())
    host.check_idle()
    return exp_id


def record_experiment(
    store: Store,
    paths: Paths,
    private: PrivateFiles,
    cfg: ExperimentConfig,
    context_src: Path,
    source: str,
    *,
    user: str,
    uid: int,
    env: dict[str, str] | None,
    umask: int | None,
) -> tuple[int, Searcher, dict[str, Any]]:
    """Snapshot the context (as the submitter), check the entrypoint, make the searcher (and
    its warm start), record the experiment and its environment: (id, searcher, config)."""
    staging = paths.staging_dir(uuid.uuid4().hex)
    identity = identity_of(uid)
    # the snapshot first: a missing, oversized or shadowing context is named as such
    snapshot_as(identity, context_src, staging)
    try:
        with executor.acting_as(**identity):
            check_entrypoint(cfg.entrypoint, context_src, source, snapshot=staging)
        assert cfg.entrypoint is not None  # check_entrypoint refuses a missing one
        # refuses forms this version cannot run (a multi-slot Trial class, launchers)
        entrypoint_argv(
            cfg.entrypoint,
            context_src,
            slots_per_trial=int(cfg.resources.slots_per_trial),
        )
        searcher = make_searcher(cfg)
        warm = warm_start(store, cfg)
        if warm is not None:
            searcher._warm = warm
        config = cfg.to_dict()
        exp_id = store.create_experiment(
            name=cfg.name,
            config=config,
            labels=cfg.labels,
            description=cfg.description,
            user=user,
            umask=umask,
        )
        # before the commit; always written: an id a rolled-back submission had is reused
        private.save_experiment_env(exp_id, allowed_submitter_vars(env or {}))
        dest = paths.context_dir(exp_id)
        dest.parent.mkdir(parents=True, exist_ok=True)
        if dest.exists():  # left by a submission whose record a crash rolled back
            shutil.rmtree(dest)
        os.replace(staging, dest)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    store.set_experiment_context(exp_id, str(dest))
    return exp_id, searcher, config


def snapshot_as(identity: dict[str, Any], src: Path, dest: Path) -> None:
    """Snapshot a context with its submitter's rights: a root daemon copies only what the
    submitter may read (in system mode the copy is built in a box of theirs)."""
    from det_local.store.context import snapshot_context

    if not identity:
        snapshot_context(src, dest)
        return
    box = dest.with_name(f"{dest.name}.box")
    box.mkdir(parents=True)
    try:
        os.chown(box, identity["uid"], identity["gid"])
        with executor.acting_as(**identity):
            try:
                snapshot_context(src, box / "context")
            except PermissionError as err:  # where the context's own checks do not look
                raise ContextError(
                    f"cannot read context {src} as {user_name(identity['uid'], '{uid}')}: "
                    f"permission denied ({err.filename or src})"
                ) from None
        os.replace(box / "context", dest)
    finally:
        shutil.rmtree(box, ignore_errors=True)


def warm_start(store: Store, cfg: ExperimentConfig) -> str | None:
    s = cfg.searcher
    if s.source_checkpoint_uuid:
        usable_checkpoint(store, str(s.source_checkpoint_uuid), "searcher.source_checkpoint_uuid")
        return str(s.source_checkpoint_uuid)
    if s.source_trial_id is not None:
        trial = store.get_trial(int(s.source_trial_id))
        if trial.latest_checkpoint is None:
            raise DetLocalError(
                f"searcher.source_trial_id: trial {trial.id} has no checkpoint to start from"
            )
        usable_checkpoint(store, trial.latest_checkpoint, "searcher.source_trial_id")
        return trial.latest_checkpoint
    return None


def usable_checkpoint(store: Store, uuid: str, field: str) -> None:
    """A warm start's checkpoint must still have its files (checkpoint GC may have removed
    them when its experiment ended)."""
    ckpt = store.get_checkpoint(uuid)
    if ckpt.state == CHECKPOINT_DELETED:
        raise DetLocalError(
            f"{field}: checkpoint {uuid} (trial {ckpt.trial_id}) was deleted by checkpoint "
            f"GC when experiment {ckpt.experiment_id} ended; start from another one "
            f"(`det-local checkpoint list {ckpt.experiment_id}`), or raise checkpoint_storage "
            "save_trial_best/save_trial_latest next time"
        )

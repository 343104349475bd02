"""Getting a trial run ready to start: where it resumes, its run directory, its checkpoint
storage, and its plan (`sched/run/trialplan.py`).

:meth:`TrialStarter.prepare` is called once the scheduler gave the trial its slots (recorded in
its job); it returns the plan and the engine's record of the run, or :class:`StartFailed` with
the one-line reason the trial cannot start. Spawning the plan is the supervisor's.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from det_local.errors import CheckpointError, DetLocalError, NotFoundError
from det_local.launch.ports import allocate_ports
from det_local.sched.life import ckpt_gc
from det_local.sched.life.experiments import ExperimentRun, TrialRun
from det_local.sched.queue import hardware as hardware
from det_local.sched.run import executor, userfiles
from det_local.sched.run.launchplan import LaunchPlan
from det_local.sched.run.rendezvous import Rendezvous, RendezvousError
from det_local.sched.run.runas import identity as identity_of
from det_local.sched.run.trialplan import TrialFacts, build_trial_plan
from det_local.store.db import Store
from det_local.store.paths import Paths
from det_local.store.private import PrivateFiles
from det_local.store.records import CHECKPOINT_DELETED, CheckpointRecord
from det_local.store.states import CheckpointState, State
from det_local.store.tables.jobs import JobRecord

INFO_SECRET = "cluster.json"  # holds the run's session token: its owner's eyes only


class StartFailed(DetLocalError):
    """The trial cannot start (the message says why); nothing of the run was started."""


class TrialStarter:
    def __init__(
        self,
        store: Store,
        paths: Paths,
        private: PrivateFiles,
        inventory: hardware.Inventory,
        *,
        admin_group: str,
        note: Callable[..., None],
    ) -> None:
        self.store = store
        self.paths = paths
        self.private = private
        self.inventory = inventory
        self.admin_group = admin_group
        self.note = note

    def prepare(
        self,
        exp: ExperimentRun,
        job: JobRecord,
        slots: list[int],
        token: str,
        run_id: int,
        ports_in_use: Collection[int],
        *,
        rendezvous: Rendezvous | None = None,
        ports: Mapping[str, int] | None = None,
    ) -> tuple[LaunchPlan, TrialRun]:
        """The plan of the trial's run on these slots, its run directory written and its
        checkpoint storage made; StartFailed when it cannot start.

        A multi-node trial: ``rendezvous`` is this node's, and ``ports`` the chief's (chosen
        once, e.g. with ``allocate_ports``, and the same on every node); without ``ports`` this
        node chooses them (a single-node trial, or the chief before it tells the others)."""
        assert job.trial_id is not None
        trial_id = job.trial_id
        try:
            latest, steps = self._test_mode_point(exp, trial_id, run_id) or self.resume_point(
                trial_id
            )
            # its submitter's allow-listed variables (a private file; None: none were sent)
            captured = self.private.experiment_env(exp.id)
        except CheckpointError as err:
            raise StartFailed(str(err)) from None
        except DetLocalError as err:  # a damaged (or replaced) private file
            raise StartFailed(f"trial {trial_id} cannot start: {err}") from None
        trial = self.store.get_trial(trial_id)
        if trial.state == State.PAUSED:
            self.store.set_trial_state(trial_id, State.ACTIVE)
        gpu_uuids = [
            s.uuid for s in self.inventory.slots if s.index in slots and s.uuid is not None
        ]
        rec = self.store.get_experiment(exp.id)
        info_dir = self.paths.trial_info_dir(exp.id, trial_id, run_id)
        config = rec.config
        info = cluster_info(
            self.paths,
            exp.id,
            TrialIds(trial.id, trial.seed, trial.hparams),
            run_id,
            config,
            slots,
            token,
            latest,
            steps,
            gpu_uuids,
            rendezvous=rendezvous,
        )
        identity = identity_of(job.uid)
        self._remove_incomplete(exp, trial_id, identity)
        owner = userfiles.owner_for(identity, job.umask, self.admin_group)
        try:
            write_info(info, info_dir, owner)
        except (OSError, DetLocalError) as err:
            why = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
            raise StartFailed(
                f"trial {trial_id}: cannot write its run directory {info_dir}: {why}"
            ) from None
        if latest is not None:  # before the run's own output, whichever pool runs it
            self._log_resume(exp.id, trial, run_id, latest, steps, owner)
        # unique rendezvous ports per running trial, so two multi-slot trials never collide
        ports = dict(ports) if ports is not None else allocate_ports(in_use=ports_in_use)
        try:
            plan = build_trial_plan(
                TrialFacts(
                    experiment_id=exp.id,
                    trial_id=trial_id,
                    run_id=run_id,
                    seed=trial.seed,
                    hparams=trial.hparams,
                    config=config,
                    context=Path(rec.context_dir),
                    steps_completed=steps,
                    latest_checkpoint=latest,
                    slots=list(slots),
                    token=token,
                    user=job.user,
                    uid=job.uid,
                    umask=job.umask,
                    checkpoint_dir=exp.checkpoint_dir,
                    slots_per_trial=int(exp.config.resources.slots_per_trial),
                    captured_env=captured,
                    test_mode=exp.test_mode,
                    ports=ports,
                    identity=identity,
                    admin_gid=owner.admin_gid if owner is not None else None,
                    rendezvous=rendezvous,
                ),
                self.paths,
                self.inventory,
            )
        except RendezvousError as err:  # a rendezvous without the chief's ports
            raise StartFailed(str(err)) from None
        try:  # a storage path of the user's choosing is created with the user's rights
            with executor.acting_as(**identity):
                if owner is None:
                    exp.checkpoint_dir.mkdir(parents=True, exist_ok=True)
                else:  # and their umask
                    userfiles.makedirs_as_user(exp.checkpoint_dir, owner)
        except OSError as err:
            raise StartFailed(
                f"trial {trial_id}: cannot create checkpoint storage {exp.checkpoint_dir}"
                f" as {job.user}: {err.strerror}; fix checkpoint_storage"
            ) from None
        if identity and exp.checkpoint_dir == self.paths.checkpoints:
            share_with(exp.checkpoint_dir)
        run = TrialRun(
            trial_id, exp.id, exp.request_of[trial_id], run_id, token, job.id, 0, ports=ports
        )
        return plan, run

    # ------------------------------------------------------------------ where it resumes
    def resume_point(self, trial_id: int) -> tuple[str | None, int]:
        """(checkpoint uuid, steps_completed) a new run starts from."""
        trial = self.store.get_trial(trial_id)
        if trial.latest_checkpoint is None:
            warm = trial.warm_start_checkpoint
            return warm, 0
        ckpts = [
            c
            for c in self.store.list_checkpoints(trial_id=trial_id)
            if c.state == CheckpointState.COMPLETED
        ]
        missing: set[str] = set()  # found gone from disk just now
        for ckpt in sorted(ckpts, key=lambda c: (c.steps_completed, c.created_at), reverse=True):
            if Path(ckpt.path).is_dir():
                if ckpt.uuid != trial.latest_checkpoint:
                    message, level = self._not_latest(
                        trial_id, trial.latest_checkpoint, ckpt, missing
                    )
                    self.note(
                        message,
                        experiment_id=trial.experiment_id,
                        trial_id=trial_id,
                        level=level,
                    )
                return ckpt.uuid, ckpt.steps_completed
            missing.add(ckpt.uuid)
            self.store.mark_checkpoint_deleted(ckpt.uuid)
        raise CheckpointError(
            f"trial {trial_id}: its checkpoints (latest {trial.latest_checkpoint}) are gone from "
            f"disk, so it cannot resume where it stopped; restore the checkpoint directory or "
            f"kill the experiment and start it again"
        )

    def _log_resume(
        self,
        experiment_id: int,
        trial: Any,
        run_id: int,
        uuid: str,
        steps: int,
        owner: userfiles.Owner | None,
    ) -> None:
        """The trial's log says where this run starts (Determined's trial logs do too): from
        its own checkpoint ("resuming"), or a warm start from another trial's. Written by the
        daemon ahead of the run's output, so every entrypoint and pool has it (a Slurm job's
        output is appended to the same file). Best effort: a log that cannot be opened is the
        spawn's to report."""
        if trial.latest_checkpoint is None:
            what = f"starting from checkpoint {uuid} (a warm start) at batch {steps}"
        else:
            what = f"resuming from checkpoint {uuid} at batch {steps}"
        line = f"det-local: trial {trial.id} run {run_id}: {what}\n"
        log = self.paths.trial_log(experiment_id, trial.id)
        try:
            log.parent.mkdir(parents=True, exist_ok=True)
            fd = userfiles.open_log(log, owner)
        except (OSError, DetLocalError):
            return
        try:
            os.write(fd, line.encode())
        except OSError:
            pass
        finally:
            os.close(fd)

    def _test_mode_point(
        self, exp: ExperimentRun, trial_id: int, run_id: int
    ) -> tuple[str, int] | None:
        """Test mode's restore run starts from the checkpoint step 3 judged, not the latest."""
        if not exp.test_mode or run_id < 2:
            return None
        ckpt = restore_checkpoint(self.store, trial_id)
        return None if ckpt is None else (ckpt.uuid, ckpt.steps_completed)

    def _not_latest(
        self, trial_id: int, latest: str, chosen: Any, missing: set[str]
    ) -> tuple[str, str]:
        """(message, level) when resume_point picked `chosen` (the checkpoint with the most
        steps still on disk), not `latest` (the trial's most recently recorded one): why."""
        resuming = f"resuming from {chosen.uuid} (steps_completed={chosen.steps_completed})"
        if latest in missing:
            return f"trial {trial_id}: checkpoint {latest} is gone from disk; {resuming}", "WARNING"
        try:
            rec = self.store.get_checkpoint(latest)
        except NotFoundError:
            return f"trial {trial_id}: checkpoint {latest} is not recorded; {resuming}", "WARNING"
        if rec.state == CHECKPOINT_DELETED:
            return f"trial {trial_id}: checkpoint {latest} was deleted; {resuming}", "WARNING"
        return (
            f"trial {trial_id}: {resuming}, which has more steps than its latest checkpoint "
            f"{latest} (steps_completed={rec.steps_completed})",
            "INFO",
        )

    def _remove_incomplete(
        self, exp: ExperimentRun, trial_id: int, identity: dict[str, Any]
    ) -> None:
        """Before a trial starts again: the directories of checkpoints an earlier run began
        and never completed (it died while writing them) are removed, with the owner's rights
        (links are removed, never followed)."""
        targets = self.store.list_incomplete_checkpoints(trial_id=trial_id)
        if not targets:
            return
        removed, failed = ckpt_gc.remove_files(targets, identity)
        self.store.drop_incomplete_checkpoints(ckpt_gc.settled(targets, failed))
        for uuid_ in removed:
            self.note(
                f"trial {trial_id}: removed incomplete checkpoint {uuid_} (an earlier run "
                "stopped while writing it)",
                experiment_id=exp.id,
                trial_id=trial_id,
            )
        for failure in failed:
            self.note(
                f"trial {trial_id}: could not remove incomplete checkpoint {failure}; "
                "checkpoint GC tries again when the experiment ends",
                experiment_id=exp.id,
                trial_id=trial_id,
                level="WARNING",
            )


@dataclass(frozen=True)
class TrialIds:
    """What a run's info files say of its trial: its id, seed and hyperparameters."""

    id: int
    seed: int
    hparams: dict[str, Any]


def cluster_info(
    paths: Paths,
    exp_id: int,
    trial: TrialIds,
    run_id: int,
    config: dict[str, Any],
    slots: list[int],
    token: str,
    latest: str | None,
    steps: int,
    gpu_uuids: list[str],
    *,
    rendezvous: Rendezvous | None = None,
) -> Any:
    """The run's ClusterInfo (what ``det.get_cluster_info()`` reads back inside the trial).
    Its RendezvousInfo is the
    rendezvous's addrs, node rank and slot counts; on one machine (None)
    ``(["127.0.0.1"], 0, [len(slots)])``."""
    from det_local.wire.trialinfo import ClusterInfo, RendezvousInfo, ResourcesInfo, TrialInfo

    if rendezvous is None:
        rdzv = RendezvousInfo(["127.0.0.1"], 0, [len(slots)])
    else:
        rdzv = RendezvousInfo(
            list(rendezvous.addrs), rendezvous.node_rank, list(rendezvous.slot_counts)
        )
    return ClusterInfo(
        master_url="unix://" + str(paths.socket),
        cluster_id="det-local",
        agent_id=os.uname().nodename,
        slot_ids=list(slots),
        task_id=f"{exp_id}.{trial.id}",
        allocation_id=f"{exp_id}.{trial.id}.{run_id}",
        session_token=token,
        task_type="TRIAL",
        latest_checkpoint=latest,
        trial_info=TrialInfo(
            trial_id=trial.id,
            experiment_id=exp_id,
            trial_seed=trial.seed,
            hparams=trial.hparams,
            config=config,
            steps_completed=steps,
            trial_run_id=run_id,
            debug=bool(config.get("debug")),
            inter_node_network_interface=rendezvous.ifname if rendezvous else None,
        ),
        user_data=config.get("data") or {},
        rendezvous_info=rdzv,
        resources_info=ResourcesInfo(gpu_uuids),
    )


def write_info(info: Any, info_dir: Path, owner: userfiles.Owner | None) -> None:
    """The run's info files. System mode: written while the directory is root's and private,
    then the files and the directory are given to the trial's user (mode from their umask,
    readable by admins; cluster.json, which holds the session token, 0600)."""
    if owner is None:
        info._to_files(info_dir)
        return
    info_dir.parent.mkdir(parents=True, exist_ok=True)
    if os.path.lexists(info_dir):  # left by a daemon that crashed while starting this run
        shutil.rmtree(info_dir)  # (links in it are removed, never followed)
    info_dir.mkdir(mode=0o700)
    info._to_files(info_dir)
    for path in sorted(info_dir.iterdir()):
        userfiles.give_file(path, owner, secret=path.name == INFO_SECRET)
    userfiles.make_dir(info_dir, owner)  # the trial writes in it (TensorBoard files)


def share_with(storage: Path) -> None:
    """System mode: the trial runs as its submitter, who must create new checkpoints in the
    shared storage directory (det-local's own default storage only; never a directory a user
    named)."""
    try:
        st = storage.stat()
        if st.st_uid == 0 and st.st_mode & 0o1777 != 0o1777:
            os.chmod(storage, 0o1777)  # anyone creates, only owners delete (like /tmp)
    except OSError:
        pass


def restore_checkpoint(store: Store, trial_id: int) -> CheckpointRecord | None:
    """The checkpoint step 3 judges and step 4 restores: the first one the trial recorded (the
    first run's first), or None."""
    for ckpt in store.list_checkpoints(trial_id=trial_id):  # in the order they were recorded
        if ckpt.state == CheckpointState.COMPLETED:
            return ckpt
    return None

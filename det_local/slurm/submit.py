"""What a Slurm pool checks when an experiment is submitted to it, so that a trial that cannot
run there is refused in one line at once, not after it waited in Slurm's queue:

* Slurm's commands are on the daemon's PATH;
* the checkpoint storage is shared_fs (det-local's default storage is a shared_fs directory in
  DET_LOCAL_HOME), and it, and DET_LOCAL_HOME, are on a path the compute nodes share
  (``shared_paths``; unset: every path);
* Slurm would accept the job: ``sbatch --test-only`` with the pool's partition, account, qos,
  gres and sbatch_args (a partition Slurm does not have is Slurm's own error, in one line).
  When Slurm's controller does not answer just then (within CHECK_TIMEOUT_S), the check is
  skipped: the trial's own submission is tried again (`submitter.py`) and says what Slurm
  refused, if anything.

The check never runs on the engine's event loop (`slurm/offloop.py`): it runs in a thread of its
own, and a submission the daemon's loop applies (``errors.DEFER``) that would wait for it raises
``errors.Pending`` instead: the spool server answers that request (and its owner's later ones)
when the check has ended, and serves everyone else meanwhile. A check's answer serves every
submission of the same shape (the same ``sbatch --test-only`` line) for ``offloop.FRESH_S``, so a
burst of submissions while slurmctld is down costs one check, not one each. An offline or
embedded engine's one request waits for it (bounded by CHECK_TIMEOUT_S).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from det_local.errors import ConfigError, TrialError
from det_local.slurm import client, offloop
from det_local.slurm.config import SlurmPool
from det_local.slurm.script import Shape

CHECK_TIMEOUT_S = 3.0  # `sbatch --test-only` at submission: a live controller answers in ms


def _sbatch_test(argv: list[str]) -> Callable[[], str | None]:
    """The work of one ``sbatch --test-only`` line: Slurm's refusal (its line), or None
    (accepted, or the controller did not answer: the trial's own sbatch is tried again)."""

    def work() -> str | None:
        try:
            client.run(argv, timeout=CHECK_TIMEOUT_S)
        except client.Unreachable:
            return None
        except TrialError as err:
            return str(err)
        return None

    return work


def _under(path: Path, roots: tuple[str, ...]) -> bool:
    text = str(path)
    return any(text == r or text.startswith(r.rstrip("/") + "/") for r in roots)


def check_experiment(pool: SlurmPool, cfg: Any, home: Path) -> None:
    where = f"Slurm pool '{pool.name}'"
    try:
        client.tool("sbatch")
    except TrialError as err:
        raise ConfigError(f"resources.resource_pool: {where}: {err}") from None
    storage = cfg.checkpoint_storage
    kind = None if storage is None else storage.type
    if kind not in (None, "shared_fs"):
        raise ConfigError(
            f"checkpoint_storage.type {kind}: {where} needs shared_fs storage (a directory the "
            "compute nodes and this host share); set checkpoint_storage.type: shared_fs"
        )
    if kind == "shared_fs":
        host = Path(storage.host_path or "")
        ckpt = host / storage.storage_path if storage.storage_path else host
        field = "checkpoint_storage.host_path"
    else:
        ckpt = home / "checkpoints"
        field = "DET_LOCAL_HOME"
    if pool.shared_paths:
        shared = ", ".join(pool.shared_paths)
        # with stage_dir the compute nodes need it, not DET_LOCAL_HOME (slurm/stage.py)
        ours = (
            ("DET_LOCAL_HOME", home)
            if pool.stage_dir is None
            else ("stage_dir", Path(pool.stage_dir))
        )
        for name, path in ((field, ckpt), ours):
            if not _under(path.resolve(), pool.shared_paths):
                raise ConfigError(
                    f"{name} {path} is not on a filesystem the compute nodes of {where} share "
                    f"(resource_pools.{pool.name}.slurm.shared_paths: {shared}); put it under "
                    "one of them"
                )
    check_slurm(pool, int(cfg.resources.slots_per_trial))


def check_slurm(pool: SlurmPool, slots: int, field: str = "resources.resource_pool") -> None:
    """Slurm would take a job of this many slots in the pool (`sbatch --test-only`)."""
    where = f"Slurm pool '{pool.name}'"
    try:
        client.tool("sbatch")
    except TrialError as err:
        raise ConfigError(f"{field}: {where}: {err}") from None
    shape = Shape.of(slots, pool)
    argv = [
        "sbatch",
        "--test-only",
        f"--partition={pool.partition}",
        f"--nodes={shape.nodes}",
        "--ntasks-per-node=1",
        "--output=/dev/null",
        *([f"--gres={pool.gres}:{shape.per_node}"] if pool.gres else []),
        *([f"--account={pool.account}"] if pool.account else []),
        *([f"--qos={pool.qos}"] if pool.qos else []),
        *pool.sbatch_args,
        "--wrap=true",
    ]
    # off the loop, shared by the submissions of the same shape (slurm/offloop.py)
    refused = offloop.refusal(tuple(argv), _sbatch_test(argv), f"{where}: sbatch --test-only")
    if refused is not None:
        raise ConfigError(
            f"{field}: {where} (partition {pool.partition}): Slurm refuses its "
            f"jobs: {refused}; check resource_pools.{pool.name}.slurm in daemon.yaml"
        )

"""What an engine does with its private files when it starts (`store/private.py`)."""

from __future__ import annotations

from collections.abc import Callable

from det_local.store.db import Store
from det_local.store.paths import Paths
from det_local.store.private import PrivateFiles
from det_local.store.tables.jobs import SCHEDULED


def prepare_private(
    store: Store, private: PrivateFiles, paths: Paths, out: Callable[[str], None]
) -> None:
    """The private files at start: the directory and the daemon's key; the secrets an
    older det-local kept in the database moved out of it; the environments of jobs and
    experiments that have ended (or never committed) removed."""
    private.ensure()
    private.key()

    def keep(tokens: dict[int, tuple[int, str]], envs: dict[int, dict[str, str]]) -> None:
        if tokens:  # trials still running with them authenticate after the upgrade
            private.keep_legacy_tokens(tokens)
        for job_id, env in envs.items():
            private.save_job_env(job_id, env)

    if store.move_secrets_out(keep):
        out(
            "det-local: moved trial tokens and command environments that an older version "
            f"kept in the database to {paths.private}"
        )
    active = {j.id: j for j in store.jobs.active()}
    private.prune_legacy_tokens({j.id: j.run_id for j in active.values() if j.state == SCHEDULED})
    for job_id in private.saved_job_envs():
        job = active.get(job_id)
        # a command allocated but maybe not spawned may be queued again: it keeps its env
        if job is None or (job.state == SCHEDULED and job.pid is not None):
            private.drop_job_env(job_id)
    live = {r.id for r in store.list_experiments() if not r.state.terminal}
    for exp_id in private.saved_experiment_envs():
        if exp_id not in live:
            private.drop_experiment_env(exp_id)

"""A root daemon with a Slurm pool: each user's trials are submitted to Slurm as that user
(`runuser -u USER -- sbatch`), and run as that user."""

from __future__ import annotations

import os
import pwd
import shutil

import pytest

from det_local import api
from det_local.store.states import State
from tests.support import slurmkit
from tests.support.users import A, Shared
from tests.support.world import wait_for

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        os.geteuid() != 0 or shutil.which("useradd") is None or shutil.which("runuser") is None,
        reason="real users: needs root, useradd and runuser",
    ),
]


@pytest.fixture
def shared(pool_daemon: Shared) -> Shared:
    """The folder's root daemon with a Slurm pool (tests/slurm/conftest.py)."""
    return pool_daemon


def test_a_users_trial_is_their_slurm_job(shared: Shared, slurm: slurmkit.Slurm) -> None:
    ctx = shared.out / "ctx"
    ctx.mkdir()
    who = shared.out / "who.txt"
    (ctx / "config.yaml").write_text(
        f"name: a-exp\nentrypoint: id -un > {who}; echo $SLURM_JOB_ID >> {who}\n"
        "max_restarts: 0\nresources: {resource_pool: hpc}\n"
        "searcher: {name: single, metric: loss, max_length: 1}\n"
    )
    os.chmod(ctx, 0o755)

    def submit() -> int:
        return api.run(ctx / "config.yaml", ctx, follow=False)

    shared.as_user(A, submit)
    wait_for(lambda: shared.job(1).state == "DONE", timeout=60, what="A's trial to end")
    job = shared.job(1)
    store = api.open_store(shared.paths)
    try:
        events = [e[3] for e in store.list_events(1)]
        trial = store.get_trial(1)
    finally:
        store.close()
    assert (job.user, job.exit_code) == (A, 0), (job, trial, events)
    user, slurm_id = who.read_text().split()
    assert user == A and int(slurm_id) == job.pid
    shown = slurm.run("scontrol", "show", "job", slurm_id).stdout
    assert f"UserId={A}({pwd.getpwnam(A).pw_uid})" in shown  # submitted as A, not root
    store = api.open_store(shared.paths)
    try:
        assert store.get_experiment(1).state == State.COMPLETED
    finally:
        store.close()

"""A root daemon's Slurm pool with stage_dir, for a real user, on a node that cannot see the
daemon's home (tests/slurmkit.py ``hide``): the staged directory is the user's, the job's output
reaches `trial logs`, and the staged copy goes when the run ends. (The users of these tests
cannot start the test venv's Python, which lives under /root: the trial is a shell command.)"""

from __future__ import annotations

import os
import pwd
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from det_local import api
from det_local.store.states import State
from tests.support import slurmkit
from tests.support.users import A, Shared
from tests.support.world import Env, kill_home_processes, wait_for

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        os.geteuid() != 0 or shutil.which("useradd") is None or shutil.which("runuser") is None,
        reason="real users: needs root, useradd and runuser",
    ),
]


@pytest.fixture(scope="module")
def hidden() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="det-local-slurmnet-hid-", dir="/tmp"))
    os.chmod(path, 0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory, hidden: Path) -> Iterator[slurmkit.Slurm]:
    yield from slurmkit.slurm_fixture(tmp_path_factory, hide=(hidden,))


@pytest.fixture
def shared(dl: Env, accounts: None, slurm: slurmkit.Slurm, hidden: Path) -> Iterator[Shared]:
    """A root daemon whose home the compute node cannot see; stage_dir and out are shared."""
    home = Path(tempfile.mkdtemp(prefix="home-", dir=hidden))
    os.chmod(home, 0o755)
    outer = Path(tempfile.mkdtemp(prefix="det-local-slurmnet-", dir="/tmp"))
    os.chmod(outer, 0o755)
    for sub in ("out", "stage"):
        (outer / sub).mkdir()
        os.chmod(outer / sub, 0o1777)
    dl.home = home
    dl.env["DET_LOCAL_HOME"] = str(home)
    (port,) = slurmkit._free_ports(1)
    pool = {
        "partition": "debug",
        "channel": {"listen": f"127.0.0.1:{port}"},
        "stage_dir": str(outer / "stage"),
    }
    try:
        dl.daemon_start({"resource_pools": {"hpc": {"slurm": pool}}}, SLURM_CONF=str(slurm.conf))
        yield Shared(dl, home, outer / "out")
    finally:
        kill_home_processes(home)
        shutil.rmtree(home, ignore_errors=True)
        shutil.rmtree(outer, ignore_errors=True)


def test_a_users_staged_trial(shared: Shared, slurm: slurmkit.Slurm) -> None:
    ctx = shared.out / "ctx"
    ctx.mkdir()
    (ctx / "config.yaml").write_text(
        "name: a-exp\n"
        'entrypoint: echo "who $(id -un) owns $(stat -c %U .) sees '
        f'$(test -e {shared.home} && echo home || echo nothing) at $PWD"\n'
        "max_restarts: 0\nresources: {resource_pool: hpc}\n"
        "searcher: {name: single, metric: loss, max_length: 1}\n"
    )
    os.chmod(ctx, 0o755)
    stage = shared.out.parent / "stage"

    def submit() -> int:
        return api.run(ctx / "config.yaml", ctx, follow=False)

    shared.as_user(A, submit)
    wait_for(lambda: shared.job(1).state == "DONE", timeout=90, what="A's trial to end")
    job = shared.job(1)
    assert (job.user, job.exit_code) == (A, 0), job
    log = shared.paths.trial_log(1, 1).read_text()
    line = next(x for x in log.splitlines() if x.startswith("who "))
    words = line.split()
    # run as A, in A's staged copy of the context, not seeing the daemon's home
    assert words[:6] == ["who", A, "owns", A, "sees", "nothing"], line
    assert words[7].startswith(str(stage) + "/det-local-") and words[7].endswith("/context")
    assert os.stat(shared.paths.trial_log(1, 1)).st_uid == pwd.getpwnam(A).pw_uid
    store = api.open_store(shared.paths)
    try:
        assert store.get_experiment(1).state == State.COMPLETED
    finally:
        store.close()
    wait_for(lambda: list(stage.iterdir()) == [], timeout=30, what="stage cleanup")

"""What only the Slurm tests need: a private single-host Slurm (tests/support/slurmkit.py), started
once for the modules that share it (a start and a stop cost ~2.5 s, 5-6 s on a loaded machine)
and stopped after the folder's last test (package scope).
Modules whose Slurm is another (two nodes in network namespaces, a node hiding other paths, one
whose controller a test stops and starts) keep a module-scoped one of their own."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import slurmkit
from tests.support.users import Shared
from tests.support.world import Env, kill_home_processes


@pytest.fixture(scope="package")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[slurmkit.Slurm]:
    """A plain Slurm: one node `n1` on this host, partition `debug`."""
    yield from slurmkit.slurm_fixture(tmp_path_factory)


@pytest.fixture(scope="package")
def slurm_hiding_tests(tmp_path_factory: pytest.TempPathFactory) -> Iterator[slurmkit.Slurm]:
    """A Slurm whose node does not see pytest's temporary directory (every test's own files,
    the daemon's state directory and socket among them): a compute node that is not this host."""
    yield from slurmkit.slurm_fixture(tmp_path_factory, hide=(tmp_path_factory.getbasetemp(),))


@pytest.fixture
def pool_daemon(dl: Env, accounts: None, slurm: slurmkit.Slurm) -> Iterator[Shared]:
    """A root daemon on a home every user can reach, with a Slurm pool `hpc` on the package's
    Slurm (the modules whose users submit to it name it as their `shared`)."""
    base = Path(tempfile.mkdtemp(prefix="det-local-slurm-", dir="/tmp"))
    os.chmod(base, 0o755)
    out = base / "out"
    out.mkdir()
    os.chmod(out, 0o1777)
    home = base / "home"
    dl.home = home
    dl.env["DET_LOCAL_HOME"] = str(home)
    try:
        dl.daemon_start(
            {"resource_pools": {"hpc": {"slurm": {"partition": "debug"}}}},
            SLURM_CONF=str(slurm.conf),
        )
        yield Shared(dl, home, out)
    finally:
        kill_home_processes(home)
        shutil.rmtree(base, ignore_errors=True)

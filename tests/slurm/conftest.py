"""What only the Slurm tests need: a private single-host Slurm (tests/support/slurmkit.py), started
once for the modules that share it (a start and a stop cost ~2.5 s, 5-6 s on a loaded machine)
and stopped after the folder's last test (package scope).
Modules whose Slurm is another (two nodes in network namespaces, a node hiding other paths, one
whose controller a test stops and starts) keep a module-scoped one of their own."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support import slurmkit


@pytest.fixture(scope="package")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[slurmkit.Slurm]:
    """A plain Slurm: one node `n1` on this host, partition `debug`."""
    yield from slurmkit.slurm_fixture(tmp_path_factory)


@pytest.fixture(scope="package")
def slurm_hiding_tests(tmp_path_factory: pytest.TempPathFactory) -> Iterator[slurmkit.Slurm]:
    """A Slurm whose node does not see pytest's temporary directory (every test's own files,
    the daemon's state directory and socket among them): a compute node that is not this host."""
    yield from slurmkit.slurm_fixture(tmp_path_factory, hide=(tmp_path_factory.getbasetemp(),))

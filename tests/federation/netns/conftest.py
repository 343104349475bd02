"""What only the namespaced federation tests need: `net`, the namespaced machines, and each
test's directory (`tmp_path`) where the test accounts can reach it."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.fednet import Net, namespaces, sweep
from tests.support.reach import python_reachable


@pytest.fixture
def tmp_path() -> Iterator[Path]:
    """The test's directory (its machines' homes, contexts, shared storage), outside pytest's
    /tmp/pytest-of-root: every root pytest session that starts on this machine makes that 0700
    again (pytest's rule), and the ranks, running as a test account, would lose their way into
    their context and checkpoints mid-trial. Removed after the test."""
    base = Path(tempfile.mkdtemp(prefix="det-local-netns-", dir="/tmp"))
    base.chmod(0o755)
    try:
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def net(tmp_path: Path, accounts: None) -> Iterator[Net]:
    """Namespaced machines; work is submitted as an ordinary account (`fednet.submitter`),
    which runs this checkout's Python (`reach.python_reachable`: skipped, saying which
    directory blocks it, where it cannot)."""
    sweep()
    with Net(tmp_path) as n, python_reachable(on_blocked=pytest.skip):
        yield n
    assert not [ns for ns in namespaces() if ns.startswith(n.prefix)]

"""What only the namespaced federation tests need: `net`, the namespaced machines."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.fednet import Net, namespaces, sweep
from tests.support.reach import python_reachable


@pytest.fixture
def net(tmp_path: Path, accounts: None) -> Iterator[Net]:
    """Namespaced machines; work is submitted as an ordinary account (`fednet.submitter`),
    which runs this checkout's Python (`reach.python_reachable`: skipped, saying which
    directory blocks it, where it cannot)."""
    sweep()
    with Net(tmp_path) as n, python_reachable(on_blocked=pytest.skip):
        yield n
    assert not [ns for ns in namespaces() if ns.startswith(n.prefix)]

"""What only the namespaced federation tests need: `net`, the namespaced machines."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.fednet import Net, interpreter_reachable, namespaces, sweep


@pytest.fixture
def net(tmp_path: Path, accounts: None) -> Iterator[Net]:
    """Namespaced machines; work is submitted as an ordinary account (`fednet.submitter`)."""
    sweep()
    with Net(tmp_path) as n, interpreter_reachable():
        yield n
    assert not [ns for ns in namespaces() if ns.startswith(n.prefix)]

"""What only tests/sdk/ needs: `client`, Determined's SDK module as a notebook imports it."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support.paths import COMPAT
from tests.support.world import Env


@pytest.fixture
def client(dl: Env, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Any:
    """`from determined.experimental import client`, as a notebook imports it."""
    monkeypatch.syspath_prepend(str(COMPAT))
    monkeypatch.chdir(tmp_path)
    for name in [m for m in sys.modules if m == "determined" or m.startswith("determined.")]:
        monkeypatch.delitem(sys.modules, name)
    import det_local.sdk.client

    monkeypatch.setattr(det_local.sdk.client, "_determined", None)  # login() of another test
    from determined.experimental import client as c

    return c

"""What only tests/federation/ needs: `victim` (a federated daemon on 127.0.0.1 holding a
cluster key) and `member` (one per module: a victim with one CPU slot that the test, as a gang's
owner, ships a context to). Their classes are in tests/support/peerlink.py."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from det_local.federate import keys
from det_local.federate.blobs import pack_context
from tests.support.fednet import reachable
from tests.support.peerlink import TRAIN, Member, Victim
from tests.support.world import wait_for


@pytest.fixture
def victim(tmp_path: Path) -> Iterator[Victim]:
    v = Victim(tmp_path / "victim", keys.new_key())
    wait_for(lambda: "listening on 127.0.0.1" in v.text(), timeout=30, what="federation on")
    try:
        yield v
    finally:
        v.stop()


@pytest.fixture(scope="module")
def member(tmp_path_factory: pytest.TempPathFactory, accounts: None) -> Iterator[Member]:
    tmp = tmp_path_factory.mktemp("gangproto")
    reachable(tmp)  # the ranks run as the submitter: they reach their context and directory
    ctx = tmp / "ctx"
    ctx.mkdir()
    (ctx / "train.py").write_text(TRAIN)
    shared = tmp / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    packed = pack_context(ctx, tmp / "outgoing")
    v = Victim(tmp / "member", keys.new_key(), DET_LOCAL_CPU_SLOTS="1")
    try:
        v.logged("listening on 127.0.0.1", timeout=30)
        yield Member(v, packed, shared)
    finally:
        v.stop()

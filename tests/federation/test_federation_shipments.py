"""Nothing a peer ships is unbounded (issue 25, item 2): a context is accepted only against a
pending reserve from that very peer; a peer over its quota is refused with one line; the least
recently used contexts no job refers to make room, so fed/contexts stays under its cap while
100 different contexts are shipped; a relayed log flood is cut with a line saying where."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from det_local.federate.blobs import MAX_CHUNK, ContextCache, pack_context
from det_local.federate.shipments import Shipments
from det_local.federate.untar import BlobError
from tests.support.peerlink import NODE, Member, Owner, talk

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="runs a root daemon")


def blob(digest: str, data: bytes, off: int = 0, last: bool = True) -> dict[str, object]:
    return {"t": "blob", "digest": digest, "off": off, "total": len(data), "data": data} | {
        "last": last
    }


def test_a_context_nobody_reserved_is_refused(member: Member) -> None:
    data = os.urandom(4096)
    digest = hashlib.sha256(data).hexdigest()

    async def scenario(o: Owner) -> None:
        line = await o.error(blob(digest, data))
        assert line == (
            f"blob {digest[:12]} from {NODE}: no pending reserve from {NODE} asked for this "
            "context (a context is accepted only for a reserve that needs it)"
        ), line
        for _ in range(50):  # a flood of unasked chunks: refused, logged once a minute
            await o.session.send(blob(digest, data, last=False) | {"total": 10**6})
        assert not (await o.ask({"t": "has", "digest": digest}))["value"]
        answer = await o.ask(blob("../../etc/passwd" + "0" * 48, data))  # a path for a digest
        assert answer["t"] == "error" and "invalid 'digest'" in answer["error"], answer

    talk(member, scenario)
    text = member.daemon.text()
    assert text.count(f"federation: refused blob from {NODE}: blob {digest[:12]}") <= 1
    assert not list((member.daemon.home / "fed" / "contexts" / ".incoming").iterdir())


def ship_one(s: Shipments, peer: str, root: Path, i: int, size: int = 20_000) -> str:
    src = root / f"src{i}"
    src.mkdir()
    (src / "train.py").write_bytes(os.urandom(size))
    packed = pack_context(src, root / "out")
    s.expect(peer, packed.digest)
    data = packed.path.read_bytes()
    for off in range(0, len(data), MAX_CHUNK):
        chunk = data[off : off + MAX_CHUNK]
        s.receive(peer, packed.digest, off, len(data), chunk, off + len(chunk) == len(data))
    return packed.digest


def disk(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file() and p.parent != root)


def test_100_contexts_stay_under_the_cap_and_in_use_ones_stay(tmp_path: Path) -> None:
    cache = ContextCache(tmp_path / "contexts")
    busy: set[str] = set()
    logged: list[str] = []
    cap = 400_000
    s = Shipments(cache, cap, cap, lambda: busy, logged.append)
    first = ship_one(s, "n2", tmp_path, 0)
    busy.add(first)  # a job here still refers to it
    peak = 0
    for i in range(1, 100):
        ship_one(s, "n2", tmp_path, i)
        peak = max(peak, disk(cache.root))
    assert peak <= cap, peak
    assert cache.has(first) is not None  # in use: never evicted
    assert len(list(cache.root.iterdir())) < 30
    assert any("least recently used, no job refers to it" in line for line in logged)
    # a restarted daemon reads who shipped what
    again = Shipments(cache, cap, cap, lambda: busy, logged.append)
    assert again.used_bytes("n2") == s.used_bytes("n2") <= cap


def test_a_peer_over_its_quota_and_another_peer_shipping(tmp_path: Path) -> None:
    cache = ContextCache(tmp_path / "contexts")
    busy: set[str] = set()
    s = Shipments(cache, 1_000_000, 100_000, lambda: busy, lambda _line: None)
    busy.add(ship_one(s, "n2", tmp_path, 0, size=60_000))
    with pytest.raises(BlobError) as err:
        ship_one(s, "n2", tmp_path, 1, size=60_000)
    assert "more would pass this machine's 97.7 KiB of contexts per peer" in str(err.value)
    assert "(federation.contexts_peer_mb), and every context held is in use" in str(err.value)
    ship_one(s, "n3", tmp_path, 2, size=60_000)  # another peer's quota is its own
    with pytest.raises(BlobError, match="is over this machine's 97.7 KiB per peer"):
        ship_one(s, "n3", tmp_path, 3, size=200_000)
    # a reserve lets only its own peer ship
    src = tmp_path / "src9"
    src.mkdir()
    (src / "a").write_text("x")
    packed = pack_context(src, tmp_path / "out")
    s.expect("n2", packed.digest)
    data = packed.path.read_bytes()
    with pytest.raises(BlobError, match="no pending reserve from n4"):
        s.receive("n4", packed.digest, 0, len(data), data, True)

"""The peer link under attack: a real federated daemon listening on 127.0.0.1 only (mDNS off),
and a hostile client in this process speaking raw frames. Each attack must be refused with
one line in the daemon's log and leave the daemon's cluster view unchanged.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import struct
import time
from pathlib import Path
from typing import Any

import msgpack
import psutil
import pytest

from det_local.federate import keys, transport
from det_local.federate.transport import Me
from tests.support.fednet import cli
from tests.support.peerlink import Victim
from tests.support.world import wait_for

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="runs a root daemon")


def frame(msg: Any) -> bytes:
    body = msgpack.packb(msg, use_bin_type=True)
    return struct.pack(">I", len(body)) + body


def connect(v: Victim) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", v.port), timeout=10)
    return s


def read_plain(s: socket.socket) -> dict[str, Any] | None:
    head = b""
    while len(head) < 4:
        chunk = s.recv(4 - len(head))
        if not chunk:
            return None
        head += chunk
    (n,) = struct.unpack(">I", head)
    body = b""
    while len(body) < n:
        chunk = s.recv(n - len(body))
        if not chunk:
            return None
        body += chunk
    return dict(msgpack.unpackb(body, raw=False))


def hello(key: bytes, node: str = "mallory", **over: Any) -> dict[str, Any]:
    msg = transport.hello_msg(Me(node, key, "e" * 16, 47800), os.urandom(32))
    msg.update(over)
    return msg


def only_self(v: Victim) -> None:
    assert [p["id"] for p in v.peers()] == ["victim"]


def test_wrong_key_refused_at_the_challenge(victim: Victim) -> None:
    other = keys.new_key()
    s = connect(victim)
    s.sendall(frame(hello(other, cluster=keys.cluster_id(victim.key or b""))))
    challenge = read_plain(s)
    assert challenge is not None and challenge["t"] == "challenge"
    s.sendall(frame({"t": "auth", "mac": os.urandom(32)}))
    answer = read_plain(s)
    assert answer is not None and answer["t"] == "error" and answer["code"] == "key"
    line = victim.logged("failed the challenge")
    assert "mallory" in line and "does not hold this cluster's key" in line
    only_self(victim)


def test_client_refuses_a_server_with_another_key(victim: Victim) -> None:
    me = Me("mallory", keys.new_key(), "f" * 16, 47800)

    async def dial() -> None:
        r, w = await asyncio.open_connection("127.0.0.1", victim.port)
        try:
            await transport.client_handshake(r, w, me, "victim")
        finally:
            w.close()

    with pytest.raises(transport.Refused) as err:
        asyncio.run(dial())
    # the server refuses first (another cluster id): the client says so in one line
    assert err.value.code == "cluster" and "another cluster" in str(err.value)
    only_self(victim)


def test_version_mismatch_names_both_versions(victim: Victim) -> None:
    s = connect(victim)
    s.sendall(frame(hello(victim.key or b"", v=2)))
    answer = read_plain(s)
    assert answer is not None and answer["code"] == "version"
    line = victim.logged("speaks federation protocol")
    assert "v2, this is v1" in line
    only_self(victim)


def test_reflected_challenge_mac_and_nonce(victim: Victim) -> None:
    key = victim.key or b""
    s = connect(victim)
    s.sendall(frame(hello(key)))
    challenge = read_plain(s)
    assert challenge is not None
    s.sendall(frame({"t": "auth", "mac": challenge["mac"]}))  # its own MAC sent back
    answer = read_plain(s)
    assert answer is not None and answer["code"] == "reflect"
    victim.logged("reflected this node's challenge MAC")
    # the server's nonce echoed back as our nonce on a second connection
    s2 = connect(victim)
    s2.sendall(frame(hello(key, nc=challenge["ns"])))
    c2 = read_plain(s2)
    assert c2 is not None and c2["t"] == "challenge" and c2["ns"] != challenge["ns"]
    only_self(victim)


@pytest.mark.parametrize(
    "raw, needle",
    [
        (struct.pack(">I", 5000) + b"x" * 100, "frame of 5000 bytes (limit 4096)"),
        (struct.pack(">I", 0), "frame of 0 bytes"),
        (frame([1, 2, 3]), "frame over its budget: an array of 3 items is over the limit of 0"),
        (frame("hello"), "not a message map"),
        (struct.pack(">I", 3) + b"\xc1\xc1\xc1", "frame over its budget: message is not msgpack"),
        (
            frame({"t": "hello", "x": msgpack.ExtType(1, b"pwn")}),
            "frame over its budget: an extension value of 3 bytes is over the limit of 0",
        ),
        (
            struct.pack(">I", 5) + b"\xdd\xff\xff\xff\xff",
            "frame over its budget: an array of 4,294,967,295 items is over the limit of 0",
        ),
        (
            frame({"t": "hello", "n": {"a": {}}}),
            "frame over its budget: message nests deeper than 1 levels",
        ),
        (frame({"t": "hb", "free": 1}), "sent 'hb' before its hello"),
        (frame(hello(b"k" * 32, node="../../etc")), "no valid node id"),
    ],
)
def test_malformed_frames_before_auth(victim: Victim, raw: bytes, needle: str) -> None:
    s = connect(victim)
    s.sendall(raw)
    read_plain(s)
    line = victim.logged(needle)
    assert line.count("refused") == 1
    only_self(victim)


def test_slow_loris_is_cut_after_1s(victim: Victim) -> None:
    s = connect(victim)
    s.sendall(struct.pack(">I", 100) + b"\x82")  # a frame that never finishes
    t0 = time.monotonic()
    victim.logged("no hello within 1s", timeout=15)
    assert 0.9 <= time.monotonic() - t0 <= 5
    s.settimeout(10)
    got = b""
    while chunk := s.recv(4096):  # the refusal, then the daemon closes it
        got += chunk
    assert b"no hello within 1s" in got, got
    only_self(victim)


async def _session(v: Victim, node: str = "mallory") -> tuple[transport.Session, Any]:
    r, w = await asyncio.open_connection("127.0.0.1", v.port)
    me = Me(node, v.key or b"", os.urandom(8).hex(), 47800)
    return await transport.client_handshake(r, w, me, "victim")


def test_replayed_tampered_and_oversized_frames_close_the_link(victim: Victim) -> None:
    hb = {
        "t": "hb",
        "free": 1,
        "total": 1,
        "kind": "cpu",
        "digest": {"queued": 0, "running": 0, "top": []},
    }

    async def attack(kind: str) -> None:
        session, _ = await _session(victim, f"mallory-{kind}")
        sealed = session.seal(hb)
        session.writer.write(sealed)
        if kind == "replay":
            session.writer.write(sealed)
        elif kind == "tamper":
            bad = bytearray(session.seal(hb))
            bad[12] ^= 1
            session.writer.write(bytes(bad))
        elif kind == "reorder":
            first, second = session.seal(hb), session.seal(hb)
            session.writer.write(second + first)
        elif kind == "oversized":
            session.writer.write(struct.pack(">I", 2 * 1024 * 1024) + b"\0" * 64)
        elif kind == "garbage":  # a valid MAC over bytes that are not msgpack
            body = b"\xc1\xc1"
            seq = struct.pack(">Q", 2)
            mac = transport._h(session._key, session._out, seq, body)
            session.writer.write(struct.pack(">I", len(seq + body + mac)) + seq + body + mac)
        await session.writer.drain()
        assert await asyncio.wait_for(session.reader.read(), 10) is not None
        session.close()

    needles = {
        "replay": "replayed or reordered",
        "tamper": "MAC does not verify",
        "reorder": "replayed or reordered",
        "oversized": "frame of 2097152 bytes (limit 1048576)",
        "garbage": "frame over its budget: ",
    }
    for kind, needle in needles.items():
        asyncio.run(attack(kind))
        line = victim.logged(f"closed the link to mallory-{kind}: ")
        assert needle in line, line


def test_frame_replayed_onto_a_new_link_is_refused(victim: Victim) -> None:
    async def attack() -> None:
        first, _ = await _session(victim, "mallory-x")
        captured = first.seal({"t": "leave"})
        first.close()
        second, _ = await _session(victim, "mallory-x")
        second.writer.write(captured)
        await second.writer.drain()
        await asyncio.wait_for(second.reader.read(), 10)

    asyncio.run(attack())
    victim.logged("closed the link to mallory-x: frame MAC does not verify")


def test_unknown_and_invalid_messages_get_an_error(victim: Victim) -> None:
    async def attack() -> list[dict[str, Any]]:
        session, _ = await _session(victim, "mallory-u")
        await session.send({"t": "exec", "argv": ["rm", "-rf", "/"]})
        await session.send({"t": "hb", "free": -1, "total": 1, "kind": "cpu", "digest": {}})
        await session.send({"t": "query", "id": 7, "what": "secrets"})
        answers = []
        while len(answers) < 3:
            msg = await asyncio.wait_for(session.recv(), 10)
            if msg["t"] == "error":
                answers.append(msg)
        session.close()
        return answers

    answers = asyncio.run(attack())
    assert "unknown message type 'exec'" in answers[0]["error"]
    assert "invalid 'free'" in answers[1]["error"]
    assert answers[2]["id"] == 7 and "invalid 'what'" in answers[2]["error"]
    victim.logged("refused a message from mallory-u: unknown message type 'exec'")


def test_a_thousand_unauthenticated_connects(victim: Victim, tmp_path: Path) -> None:
    rss0 = psutil.Process(victim.proc.pid).memory_info().rss
    before = victim.text().count("federation: refused 127.0.0.1")
    before += victim.text().count("federation: refused a connection from")
    sent = 0
    for _batch in range(10):
        socks = []
        for _ in range(100):
            s = socket.create_connection(("127.0.0.1", victim.port), timeout=10)
            s.sendall(struct.pack(">I", 99999))
            socks.append(s)
            sent += 1
        for s in socks:
            s.settimeout(10)
            try:
                s.recv(64)
            except OSError:
                pass
            s.close()

    def count() -> int:
        text = victim.text()
        return (
            text.count("federation: refused 127.0.0.1")
            + text.count("federation: refused a connection from")
            - before
        )

    # refused, and logged once per source and kind a minute (the next line counts the rest)
    wait_for(lambda: count() >= 1, timeout=30, what="a refusal line")
    rss1 = psutil.Process(victim.proc.pid).memory_info().rss
    assert rss1 - rss0 < 30 * 2**20, (rss0, rss1)
    # its local queue is still served
    res = cli(victim.home, "cmd", "run", "--", "true")
    assert res.returncode == 0, res.stderr
    job = int(res.stdout.split()[2])

    def done() -> bool:
        out = cli(victim.home, "job", "list", "--all", "--json").stdout
        return any(j["id"] == job and j["state"] == "DONE" for j in json.loads(out))

    wait_for(done, timeout=30, what="the local job to finish")
    assert 1 <= count() <= 3, victim.text()[-3000:]  # by then every refusal was decided
    only_self(victim)


def test_no_key_nothing_listens_and_loose_key_refused(tmp_path: Path) -> None:
    v = Victim(tmp_path / "nokey", None)
    try:
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", v.port), timeout=5)
        status = cli(v.home, "daemon", "status").stdout
        assert "federation: off (no cluster key" in status
    finally:
        v.stop()
    home = tmp_path / "loose"
    home.mkdir()
    keys.write_key(home / "cluster.key", keys.new_key())
    os.chmod(home / "cluster.key", 0o644)
    v = Victim(home, None)
    try:
        line = v.logged("has mode 0644")
        assert "chmod 600" in line and "federation is off" in line
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", v.port), timeout=5)
    finally:
        v.stop()


def test_cluster_commands(tmp_path: Path) -> None:
    home = tmp_path / "h"
    res = cli(home, "cluster", "init", "--json")
    assert res.returncode == 0, res.stderr
    token = json.loads(res.stdout)["token"]
    key_path = home / "cluster.key"
    assert (key_path.stat().st_mode & 0o777) == 0o600 and len(key_path.read_bytes()) == 32
    res = cli(home, "cluster", "init")
    assert res.returncode != 0 and res.stderr.count("\n") == 1 and "exists" in res.stderr
    other = tmp_path / "o"
    res = cli(other, "cluster", "join", token)
    assert res.returncode == 0, res.stderr
    assert (other / "cluster.key").read_bytes() == key_path.read_bytes()
    res = cli(other, "cluster", "join", token[:-3])
    assert res.returncode != 0 and res.stderr.startswith("error: the join token")
    res = cli(other, "cluster", "leave", "--forget")
    assert res.returncode == 0 and not (other / "cluster.key").exists()
    os.chmod(key_path, 0o640)
    res = cli(home, "cluster", "token")
    assert res.returncode != 0 and res.stderr.count("\n") == 1 and "mode 0640" in res.stderr


def test_a_node_advertises_only_the_address_it_listens_on(victim: Victim) -> None:
    """Issue 34, item 9: with `federation.listen: 127.0.0.1` the node advertised its eth0
    address, where nothing of it answers."""
    from det_local.federate.client import request
    from det_local.store.paths import Paths

    rows = request(Paths(victim.home), {"t": "peers"}, timeout=10)["peers"]
    me = next(r for r in rows if r["state"] == "self")
    assert me["address"] == f"127.0.0.1:{victim.port}"
    from det_local.federate.discovery import advertised

    # a wildcard listen advertises the interfaces' addresses, a specific one only itself
    assert advertised("0.0.0.0", ["10.0.0.5", "192.168.1.2"]) == ["10.0.0.5", "192.168.1.2"]
    assert advertised("10.0.0.5", ["10.0.0.5", "192.168.1.2"]) == ["10.0.0.5"]

"""The peer link: msgpack over TCP, authenticated with the cluster key.

Framing is `rpc`'s (a 4-byte big-endian length, then the body). Before authentication a
body is one plain msgpack map of at most PRE_AUTH_MAX bytes, and only these are read:

    C -> S  hello      {v, node, cluster, nc, epoch, port, dl}
    S -> C  challenge  {v, node, ns, mac = H(K, "srv" | nc | ns | idc | ids), epoch, port, dl}
    C -> S  auth       {mac = H(K, "cli" | ns | nc | idc | ids)}
    S -> C  ok {} | error {error, code}

H is HMAC-SHA256, K the cluster key, nc/ns 32-byte nonces, idc/ids the client's and the
server's node ids. Distinct labels per direction stop reflection; both ids are bound in. The
whole handshake has HANDSHAKE_TIMEOUT seconds. Then each side derives the session key
Ks = H(K, "session" | nc | ns | idc | ids), and every frame's body is

    seq (u64, big-endian) | msgpack map | H(Ks, direction | seq | msgpack map)

with `seq` exactly one more than the last frame's in that direction: a replayed, reordered,
reflected or altered frame, or one from another link (other nonces), is refused and the link
closed. Nothing is ever unpickled: msgpack with ext types refused, maps with a str `t`, and
each message type's fields checked by `schema`. Integrity only, no encryption.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import os
import struct
from dataclasses import dataclass
from typing import Any

import msgpack

from det_local import __version__
from det_local.federate.keys import cluster_id, valid_node_id
from det_local.wire.budget import Budget
from det_local.wire.budget import Refused as BudgetRefused
from det_local.wire.budget import decode as budget_decode
from det_local.wire.rpc import HEADER

PROTOCOL_VERSION = 1
PRE_AUTH_MAX = 4 * 1024
SESSION_MAX = 1024 * 1024
HANDSHAKE_TIMEOUT = 5.0
NONCE_BYTES = 32
MAC_BYTES = 32
SEQ = struct.Struct(">Q")
DRAIN_ABOVE = 1024 * 1024
_C2S = b"c2s"
_S2C = b"s2c"


class Refused(Exception):
    """A peer or a frame refused; str() is the one line for the log. `code` names the kind."""

    def __init__(self, message: str, code: str = "refused") -> None:
        super().__init__(message)
        self.code = code


# What one frame may hold, checked before msgpack builds anything (det_local/wire/budget.py).
# Before authentication: a hello, challenge, auth or answer (a few short fields).
PRE_AUTH_BUDGET = Budget(
    max_bytes=PRE_AUTH_MAX,
    max_str=1024,
    max_bin=64,
    max_array=0,
    max_map=16,
    max_ext=0,
    max_depth=1,
    max_objects=64,
)
# An authenticated frame (SESSION_MAX bytes): a blob chunk, a reserve with its experiment
# config (at most 64 levels: config/limits.py, under 3 of envelope), a job or slot list.
SESSION_BUDGET = Budget(
    max_bytes=SESSION_MAX,
    max_str=SESSION_MAX,
    max_bin=SESSION_MAX,
    max_array=20_000,
    max_map=20_000,
    max_ext=0,
    max_depth=72,
    max_objects=250_000,
)


def decode(body: bytes, budget: Budget = SESSION_BUDGET) -> dict[str, Any]:
    """One msgpack map with a str `t`, within `budget`: no ext types, valid UTF-8."""
    try:
        msg = budget_decode(body, budget)
    except BudgetRefused as err:
        raise Refused(f"frame over its budget: {err}", "frame") from None
    if not isinstance(msg, dict) or not isinstance(msg.get("t"), str):
        raise Refused("frame is not a message map with a string 't'", "frame")
    return msg


def plain(msg: dict[str, Any]) -> bytes:
    body = msgpack.packb(msg, use_bin_type=True)
    return HEADER.pack(len(body)) + body


async def read_frame(reader: asyncio.StreamReader, limit: int) -> bytes:
    head = await reader.readexactly(HEADER.size)
    (size,) = HEADER.unpack(head)
    if size == 0 or size > limit:
        raise Refused(f"frame of {size} bytes (limit {limit})", "frame")
    return await reader.readexactly(size)


def _h(key: bytes, *parts: bytes) -> bytes:
    mac = hmac.new(key, digestmod=hashlib.sha256)
    for part in parts:
        mac.update(SEQ.pack(len(part)))  # length-prefixed: no two part lists collide
        mac.update(part)
    return mac.digest()


@dataclass(frozen=True)
class Me:
    """This node as the handshake presents it."""

    node: str
    key: bytes
    epoch: str  # a random id of this daemon start: tells a restart, and a dial to ourselves
    port: int

    @property
    def cluster(self) -> str:
        return cluster_id(self.key)


@dataclass(frozen=True)
class PeerHello:
    node: str
    epoch: str
    port: int
    version: str


def _version_refusal(peer: str, theirs: object) -> Refused:
    return Refused(
        f"peer {peer} speaks federation protocol v{theirs}, this is v{PROTOCOL_VERSION}: "
        "run the same det-local version on every node",
        "version",
    )


def _field(msg: dict[str, Any], name: str, kind: type, what: str) -> Any:
    value = msg.get(name)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise Refused(f"{what} has no valid '{name}'", "frame")
    return value


def _nonce(msg: dict[str, Any], name: str, what: str) -> bytes:
    value = _field(msg, name, bytes, what)
    if len(value) != NONCE_BYTES:
        raise Refused(f"{what} has a '{name}' of {len(value)} bytes, not {NONCE_BYTES}", "frame")
    return bytes(value)


def _peer_fields(msg: dict[str, Any], what: str) -> PeerHello:
    node = msg.get("node")
    if not valid_node_id(node):
        raise Refused(f"{what} has no valid node id", "frame")
    epoch = _field(msg, "epoch", str, what)
    port = _field(msg, "port", int, what)
    if not 0 < port < 65536 or not 0 < len(epoch) <= 64:
        raise Refused(f"{what} has an invalid port or epoch", "frame")
    version = msg.get("dl")
    return PeerHello(str(node), epoch, port, version[:32] if isinstance(version, str) else "?")


class Session:
    """An authenticated link: MAC'd, sequenced frames both ways."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        key: bytes,
        out_label: bytes,
        in_label: bytes,
        max_frame: int = SESSION_MAX,
    ) -> None:
        self.reader = reader
        self.writer = writer
        self._key = key
        self._out = out_label
        self._in = in_label
        self._send_seq = 0
        self._recv_seq = 0
        self.max_frame = max_frame

    def seal(self, msg: dict[str, Any]) -> bytes:
        body = msgpack.packb(msg, use_bin_type=True)
        self._send_seq += 1
        seq = SEQ.pack(self._send_seq)
        frame = seq + body + _h(self._key, self._out, seq, body)
        if len(frame) > self.max_frame:
            raise ValueError(f"message of {len(frame)} bytes is over {self.max_frame}")
        return HEADER.pack(len(frame)) + frame

    def open(self, frame: bytes) -> dict[str, Any]:
        if len(frame) < SEQ.size + 1 + MAC_BYTES:
            raise Refused(f"session frame of {len(frame)} bytes is too short", "frame")
        seq_b, body, mac = frame[: SEQ.size], frame[SEQ.size : -MAC_BYTES], frame[-MAC_BYTES:]
        if not hmac.compare_digest(mac, _h(self._key, self._in, seq_b, body)):
            raise Refused("frame MAC does not verify (altered, or not from this session)", "mac")
        (seq,) = SEQ.unpack(seq_b)
        if seq != self._recv_seq + 1:
            raise Refused(
                f"frame sequence {seq} where {self._recv_seq + 1} was due (replayed or reordered)",
                "seq",
            )
        self._recv_seq = seq
        return decode(body)

    def send_now(self, msg: dict[str, Any]) -> None:
        """Queue a message at once, in order with every other (no wait for the buffer)."""
        if self.writer.transport.is_closing():
            raise ConnectionError("the link is closed")
        self.writer.write(self.seal(msg))

    async def send(self, msg: dict[str, Any]) -> None:
        self.writer.write(self.seal(msg))
        if self.writer.transport.get_write_buffer_size() > DRAIN_ABOVE:
            await self.writer.drain()

    async def recv(self) -> dict[str, Any]:
        """The next message; Refused for a bad frame, IncompleteReadError at EOF."""
        return self.open(await read_frame(self.reader, self.max_frame))

    def close(self) -> None:
        try:
            self.writer.close()
        except Exception:
            pass


def _session_key(key: bytes, nc: bytes, ns: bytes, idc: str, ids: str) -> bytes:
    return _h(key, b"session", nc, ns, idc.encode(), ids.encode())


def hello_msg(me: Me, nc: bytes) -> dict[str, Any]:
    return {
        "t": "hello",
        "v": PROTOCOL_VERSION,
        "node": me.node,
        "cluster": me.cluster,
        "nc": nc,
        "epoch": me.epoch,
        "port": me.port,
        "dl": __version__,
    }


async def client_handshake(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    me: Me,
    where: str,
    own_nonces: set[bytes] | None = None,
) -> tuple[Session, PeerHello]:
    """Dial side. Refused (one line) when the server is not of this cluster, or refuses us.
    `own_nonces` holds this node's outstanding nonces while the handshake runs, so that a
    hello that echoes one of them to this node's listener is refused."""
    nc = os.urandom(NONCE_BYTES)
    if own_nonces is not None:
        own_nonces.add(nc)
    try:
        return await asyncio.wait_for(
            _client_handshake(reader, writer, me, where, nc), HANDSHAKE_TIMEOUT
        )
    finally:
        if own_nonces is not None:
            own_nonces.discard(nc)


async def _client_handshake(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, me: Me, where: str, nc: bytes
) -> tuple[Session, PeerHello]:
    if True:  # the body of client_handshake, under its deadline
        writer.write(plain(hello_msg(me, nc)))
        msg = decode(await read_frame(reader, PRE_AUTH_MAX), PRE_AUTH_BUDGET)
        if msg["t"] == "error":
            text = msg.get("error")
            code = msg.get("code")
            raise Refused(
                f"{where} refused this node: {str(text)[:300]}",
                str(code)[:20] if isinstance(code, str) else "refused",
            )
        if msg["t"] != "challenge":
            raise Refused(f"{where} answered the hello with '{str(msg['t'])[:40]}'", "frame")
        if msg.get("v") != PROTOCOL_VERSION:
            raise _version_refusal(f"{msg.get('node')!s:.64} at {where}", msg.get("v"))
        peer = _peer_fields(msg, f"the challenge from {where}")
        if peer.epoch == me.epoch:
            raise Refused(f"{where} is this daemon itself", "self")
        ns = _nonce(msg, "ns", f"the challenge from {where}")
        mac = _field(msg, "mac", bytes, f"the challenge from {where}")
        if ns == nc:
            raise Refused(f"{where} reflected this node's nonce", "reflect")
        ids = (me.node.encode(), peer.node.encode())
        if not hmac.compare_digest(mac, _h(me.key, b"srv", nc, ns, *ids)):
            raise Refused(
                f"{where} ({peer.node}) does not hold this cluster's key (wrong key, or "
                "another cluster): `det-local cluster join TOKEN` with this cluster's token",
                "key",
            )
        writer.write(plain({"t": "auth", "mac": _h(me.key, b"cli", ns, nc, *ids)}))
        answer = decode(await read_frame(reader, PRE_AUTH_MAX), PRE_AUTH_BUDGET)
        if answer["t"] == "error":
            text = answer.get("error")
            code = answer.get("code")
            raise Refused(
                f"{where} refused this node: {str(text)[:300]}",
                str(code)[:20] if isinstance(code, str) else "refused",
            )
        if answer["t"] != "ok":
            raise Refused(f"{where} answered the auth with '{str(answer['t'])[:40]}'", "frame")
    ks = _session_key(me.key, nc, ns, me.node, peer.node)
    return Session(reader, writer, ks, _C2S, _S2C), peer


class Pending:
    """A handshake the server has half done: admit() or refuse() it."""

    def __init__(
        self, writer: asyncio.StreamWriter, reader: asyncio.StreamReader, peer: PeerHello, ks: bytes
    ) -> None:
        self.writer = writer
        self.reader = reader
        self.peer = peer
        self._ks = ks

    def admit(self) -> Session:
        self.writer.write(plain({"t": "ok"}))
        return Session(self.reader, self.writer, self._ks, _S2C, _C2S)

    def refuse(self, message: str, code: str) -> None:
        self.writer.write(plain({"t": "error", "error": message, "code": code}))


async def server_handshake(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    me: Me,
    where: str,
    own_nonces: set[bytes],
    first_frame_s: float = HANDSHAKE_TIMEOUT,
) -> Pending:
    """Accept side, under the caller's deadline (the hello within `first_frame_s`). Refused
    (and the refusal sent) for anything but a hello and an auth from a holder of this
    cluster's key."""
    try:
        try:
            first = await asyncio.wait_for(read_frame(reader, PRE_AUTH_MAX), first_frame_s)
        except asyncio.TimeoutError:
            raise Refused(f"no hello within {first_frame_s:g}s", "slow") from None
        msg = decode(first, PRE_AUTH_BUDGET)
        if msg["t"] != "hello":
            raise Refused(f"{where} sent '{str(msg['t'])[:40]}' before its hello", "frame")
        if msg.get("v") != PROTOCOL_VERSION:
            raise _version_refusal(f"{msg.get('node')!s:.64} at {where}", msg.get("v"))
        peer = _peer_fields(msg, f"the hello from {where}")
        nc = _nonce(msg, "nc", f"the hello from {where}")
        if msg.get("cluster") != me.cluster:
            raise Refused(
                f"{where} ({peer.node}) belongs to another cluster "
                f"(id {str(msg.get('cluster'))[:16]}, this is {me.cluster})",
                "cluster",
            )
        if peer.epoch == me.epoch:
            raise Refused(f"{where} is this daemon itself", "self")
        if peer.node == me.node:
            raise Refused(duplicate_message(me.node, where), "duplicate")
        if nc in own_nonces:
            raise Refused(f"{where} reflected this node's nonce in its hello", "reflect")
        ns = os.urandom(NONCE_BYTES)
        ids = (peer.node.encode(), me.node.encode())
        srv_mac = _h(me.key, b"srv", nc, ns, *ids)
        writer.write(
            plain(
                {
                    "t": "challenge",
                    "v": PROTOCOL_VERSION,
                    "node": me.node,
                    "ns": ns,
                    "mac": srv_mac,
                    "epoch": me.epoch,
                    "port": me.port,
                    "dl": __version__,
                }
            )
        )
        auth = decode(await read_frame(reader, PRE_AUTH_MAX), PRE_AUTH_BUDGET)
        if auth["t"] != "auth":
            raise Refused(f"{where} sent '{str(auth['t'])[:40]}' instead of auth", "frame")
        mac = _field(auth, "mac", bytes, f"the auth from {where}")
        if hmac.compare_digest(mac, srv_mac):
            raise Refused(f"{where} reflected this node's challenge MAC", "reflect")
        if not hmac.compare_digest(mac, _h(me.key, b"cli", ns, nc, *ids)):
            raise Refused(
                f"{where} ({peer.node}) failed the challenge: it does not hold this "
                "cluster's key (`det-local cluster join TOKEN` there)",
                "key",
            )
    except Refused as err:
        try:
            writer.write(plain({"t": "error", "error": str(err), "code": err.code}))
        except Exception:
            pass
        raise
    return Pending(writer, reader, peer, _session_key(me.key, nc, ns, peer.node, me.node))


def duplicate_message(node: str, where: str) -> str:
    return (
        f"two hosts claim node id '{node}' ({where} and another): a cloned machine? give each "
        "its own id (federation.node_id in daemon.yaml or DET_LOCAL_NODE_ID), or regenerate "
        "/etc/machine-id (systemd-machine-id-setup)"
    )

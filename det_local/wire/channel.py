"""The trial channel over TCP: a trial on another host reports to the daemon with its run's
token, which never crosses the wire.

Framing is `rpc`'s (a 4-byte big-endian length, then the body). The handshake, in plain
msgpack frames (each at most ``rpc.HELLO_MAX_FRAME`` bytes, within ``rpc.HELLO_TIMEOUT``)::

    S -> C  challenge  {t: challenge, v, ns}
    C -> S  hello      {t: hello, v, trial_id, run_id, rank, pid, nc,
                        mac = H(T, "det-local trial cli" | ns | nc | ids)}
    S -> C  hello      {t: hello, preempt, [started],
                        mac = H(T, "det-local trial srv" | ns | nc | ids)}
                     | {t: hello, error, [retry]}

H is HMAC-SHA256, T the run's token (its per-run secret, as on the unix socket), ns/nc 32-byte
nonces of the server and the client, ``ids`` ``"<trial_id>.<run_id>.<rank>"``. The server's
nonce is new for every connection, so a recorded hello is worth nothing on another one; the
server's answer proves it knows T too (a trial does not report to an impostor). Distinct labels
per direction stop a reflected MAC.

Then each side derives Ks = H(T, "det-local trial session" | ns | nc | ids) and every frame's
body is ``seq (u64) | msgpack map | H(Ks, direction | seq | msgpack map)``, ``seq`` one more than
the last in that direction: a frame altered, replayed, reordered, reflected or injected into the
connection is refused and the connection closed. Integrity, not confidentiality: metrics and
checkpoint paths are readable by whoever can watch the network between the compute nodes and
the daemon (docs/system-mode.md says why).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import struct
import threading
from typing import Any

from det_local.wire import rpc
from det_local.wire.budget import DAEMON_TO_TRIAL, TRIAL_HELLO

VERSION = 1
NONCE_BYTES = 32
MAC_BYTES = 32
SEQ = struct.Struct(">Q")
OVERHEAD = SEQ.size + MAC_BYTES  # what sealing adds to a frame's body
SCHEME = "tcp://"
CONNECT_TIMEOUT = 10.0
_CLI = b"det-local trial cli"
_SRV = b"det-local trial srv"
_SESSION = b"det-local trial session"
C2S = b"c2s"
S2C = b"s2c"


class ChannelError(Exception):
    """A frame or handshake that does not verify: the connection is closed."""


def h(key: bytes, *parts: bytes) -> bytes:
    mac = hmac.new(key, digestmod=hashlib.sha256)
    for part in parts:
        mac.update(SEQ.pack(len(part)))  # lengths bound in: no two splits give one input
        mac.update(part)
    return mac.digest()


def ids(trial_id: int, run_id: int, rank: int) -> bytes:
    return f"{trial_id}.{run_id}.{rank}".encode()


def client_mac(token: str, ns: bytes, nc: bytes, who: bytes) -> bytes:
    return h(token.encode(), _CLI, ns, nc, who)


def server_mac(token: str, ns: bytes, nc: bytes, who: bytes) -> bytes:
    return h(token.encode(), _SRV, ns, nc, who)


def session_key(token: str, ns: bytes, nc: bytes, who: bytes) -> bytes:
    return h(token.encode(), _SESSION, ns, nc, who)


def parse_url(url: str) -> tuple[str, int]:
    """``tcp://host:port`` -> (host, port); ValueError naming what is wrong."""
    if not url.startswith(SCHEME):
        raise ValueError(f"{url!r} is not a tcp://host:port address")
    host, sep, port = url[len(SCHEME) :].rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{url!r} is not a tcp://host:port address")
    return host.strip("[]"), int(port)


class Sealer:
    """One direction's sequence and key: seals frames going out, opens frames coming in."""

    def __init__(self, key: bytes, direction: bytes) -> None:
        self.key = key
        self.direction = direction
        self.seq = 0

    def seal(self, packed: bytes) -> bytes:
        """An `rpc.pack` frame (header + body) -> the sealed frame (header + seq|body|mac)."""
        self.seq += 1
        seq = SEQ.pack(self.seq)
        body = packed[rpc.HEADER.size :]
        mac = hmac.new(self.key, self.direction + seq + body, hashlib.sha256).digest()
        return rpc.HEADER.pack(len(body) + OVERHEAD) + seq + body + mac

    def open(self, sealed: bytes | bytearray) -> bytes:
        """A sealed frame's body (without its header) -> the msgpack map's bytes."""
        if len(sealed) < OVERHEAD:
            raise ChannelError("a frame too short to be sealed")
        seq, body, mac = sealed[: SEQ.size], sealed[SEQ.size : -MAC_BYTES], sealed[-MAC_BYTES:]
        want = hmac.new(self.key, self.direction + bytes(seq) + bytes(body), hashlib.sha256)
        if not hmac.compare_digest(want.digest(), bytes(mac)):
            raise ChannelError("a frame whose MAC does not verify (altered, or not this session's)")
        (n,) = SEQ.unpack(seq)
        if n != self.seq + 1:
            raise ChannelError(f"frame {n} out of sequence (expected {self.seq + 1}): replayed?")
        self.seq = n
        return bytes(body)


class Link:
    """A trial's connection to its daemon: plain on the unix socket, sealed over TCP."""

    def __init__(self, sock: socket.socket, out: Sealer | None = None, inn: Sealer | None = None):
        self.sock = sock
        self.out = out
        self.inn = inn
        self._lock = threading.Lock()

    def send_packed(self, data: bytes) -> None:
        if self.out is None:
            self.sock.sendall(data)
            return
        with self._lock:  # sequence numbers leave in order
            self.sock.sendall(self.out.seal(data))

    def recv(self) -> dict[str, Any] | None:
        if self.inn is None:
            return rpc.recv(self.sock)
        head = rpc.recv_exact(self.sock, rpc.HEADER.size)
        if head is None:
            return None
        (size,) = rpc.HEADER.unpack(head)
        if size > rpc.MAX_FRAME + OVERHEAD:
            raise rpc.FrameError(f"frame of {size} bytes is over the {rpc.MAX_FRAME} byte limit")
        sealed = rpc.recv_exact(self.sock, size)
        if sealed is None:
            return None
        try:
            body = self.inn.open(sealed)
        except ChannelError as err:
            raise rpc.FrameError(str(err)) from None
        return rpc.unpack(body, DAEMON_TO_TRIAL)


def _recv_plain(sock: socket.socket) -> dict[str, Any] | None:
    head = rpc.recv_exact(sock, rpc.HEADER.size)
    if head is None:
        return None
    (size,) = rpc.HEADER.unpack(head)
    if size > rpc.HELLO_MAX_FRAME:
        raise rpc.FrameError(
            f"handshake frame of {size} bytes (the limit is {rpc.HELLO_MAX_FRAME})"
        )
    body = rpc.recv_exact(sock, size)
    return None if body is None else rpc.unpack(body, TRIAL_HELLO)


def connect(
    url: str, token: str, hello: dict[str, Any]
) -> tuple[socket.socket, dict[str, Any] | None, Link]:
    """Connect to ``tcp://host:port`` and authenticate as ``hello``'s run (trial_id, run_id,
    rank): (socket, the daemon's answer to hello, the sealed link). OSError when the daemon
    cannot be reached; ChannelError when it does not prove it knows the token."""
    host, port = parse_url(url)
    sock = socket.create_connection((host, port), timeout=CONNECT_TIMEOUT)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        challenge = _recv_plain(sock)
        if challenge is None:
            raise ConnectionResetError("the daemon closed the connection")
        ns = challenge.get("ns")
        if challenge.get("t") != "challenge" or not isinstance(ns, bytes) or len(ns) != NONCE_BYTES:
            raise ChannelError(f"{url} did not answer as a det-local daemon's trial channel")
        nc = os.urandom(NONCE_BYTES)
        who = ids(int(hello["trial_id"]), int(hello["run_id"]), int(hello.get("rank", 0)))
        fields = {k: v for k, v in hello.items() if k != "token"}
        msg = {
            **fields,
            "t": "hello",
            "v": VERSION,
            "nc": nc,
            "mac": client_mac(token, ns, nc, who),
        }
        sock.sendall(rpc.pack(msg))
        answer = _recv_plain(sock)
        if answer is not None and not answer.get("error"):
            proof = answer.get("mac")
            if not isinstance(proof, bytes) or not hmac.compare_digest(
                proof, server_mac(token, ns, nc, who)
            ):
                raise ChannelError(
                    f"{url} did not prove it knows this run's token: not this run's daemon"
                )
        sock.settimeout(None)
    except BaseException:
        sock.close()
        raise
    key = session_key(token, ns, nc, who)
    return sock, answer, Link(sock, Sealer(key, C2S), Sealer(key, S2C))

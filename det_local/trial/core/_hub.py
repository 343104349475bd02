"""The sockets under DistributedContext's collectives: one star-shaped hub per group of ranks.

A group's chief (its member 0) listens; every other member opens one stream connection to it
(TCP for the trial-wide group, a unix socket in a private directory for the ranks of one
machine). A collective is one frame from each member to the chief and/or one frame back:

    gather     members -> chief ("gather"), chief -> members ("gather_ack": a barrier)
    allgather  members -> chief ("allgather"), chief -> members ("allgather": the whole list)
    broadcast  chief -> members ("broadcast")

A frame is an 8-byte big-endian length and a pickle (collectives carry arbitrary Python
objects, as Determined's do). Before the first pickle is read, each end proves it knows the
trial's secret with an HMAC over the other end's nonce, so another process on the machine
cannot feed pickles to a trial (det-local sets DET_LOCAL_TOKEN per allocation; off det-local
the secret is empty, as good as Determined's unauthenticated ZMQ).

A member that dies closes its connection: the chief's collective raises at once, naming the
rank, and the chief's own exit closes every other member's connection in turn. So a dead peer
never leaves a collective hanging; the launcher's supervision then ends the whole group.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import pickle
import selectors
import socket
import struct
import threading
import time
from typing import Any

from det_local.errors import DetLocalError

MAGIC = b"DLH1"
NONCE = 16
DIGEST = 32
HEADER = struct.Struct("!Q")
INDEX = struct.Struct("!I")
HANDSHAKE_TIMEOUT = 10.0
TIMEOUT_ENV = "DET_LOCAL_DIST_TIMEOUT"
SECRET_ENV = "DET_LOCAL_DIST_SECRET"
DEFAULT_TIMEOUT = 600.0
_SMALL = 64 * 1024

Address = tuple[Any, ...]  # ("tcp", host, port) or ("unix", path)


class DistributedError(DetLocalError):
    """A collective could not complete: a peer died, or the ranks disagree."""


def connect_timeout() -> float:
    try:
        return float(os.environ.get(TIMEOUT_ENV) or DEFAULT_TIMEOUT)
    except ValueError:
        return DEFAULT_TIMEOUT


def secret() -> bytes:
    """The trial's shared secret: DET_LOCAL_DIST_SECRET, else the allocation's token."""
    return (os.environ.get(SECRET_ENV) or os.environ.get("DET_LOCAL_TOKEN") or "").encode()


def _mac(key: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, b"".join(parts), hashlib.sha256).digest()


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise EOFError
        got += k
    return bytes(buf)


def _frame(kind: str, payload: Any) -> bytes:
    data = pickle.dumps((kind, payload), protocol=pickle.HIGHEST_PROTOCOL)
    return HEADER.pack(len(data)) + data if len(data) < _SMALL else data


def _send_frame(sock: socket.socket, frame: bytes) -> None:
    if len(frame) >= _SMALL:  # big pickles: header then body, no concatenated copy
        sock.sendall(HEADER.pack(len(frame)))
    sock.sendall(frame)


def _recv_frame(sock: socket.socket) -> tuple[str, Any]:
    (n,) = HEADER.unpack(_recv_exactly(sock, HEADER.size))
    kind, payload = pickle.loads(_recv_exactly(sock, n))
    return kind, payload


def _describe(addr: Address) -> str:
    return f"{addr[1]}:{addr[2]}" if addr[0] == "tcp" else str(addr[1])


def listen(addr: Address, backlog: int) -> tuple[socket.socket, Address]:
    """A listening socket at addr (a TCP port 0 or a unix path); returns it and its address."""
    if addr[0] == "unix":
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(addr[1])
        sock.listen(backlog)
        return sock, addr
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((addr[1], addr[2]))
    sock.listen(backlog)
    return sock, ("tcp", addr[1], sock.getsockname()[1])


class Hub:
    """The chief's end of a group: accepts members 1..size-1, then runs collectives."""

    def __init__(
        self, listener: socket.socket, size: int, key: bytes, what: str, names: str = "rank"
    ) -> None:
        self._listener = listener
        self._size = size
        self._key = key
        self._what = what  # e.g. "the chief (rank 0)"
        self._names = names  # "rank" or "local rank"
        self._peers: dict[int, socket.socket] = {}
        self._sel = selectors.DefaultSelector()
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ set-up
    def accept_all(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        try:
            while len(self._peers) < self._size - 1:
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = sorted(set(range(1, self._size)) - set(self._peers))
                    raise DistributedError(
                        f"{self._what}: {self._names}s {missing} did not connect within "
                        f"{timeout:.0f}s ({TIMEOUT_ENV}); did every worker construct its "
                        "DistributedContext?"
                    )
                self._listener.settimeout(left)
                try:
                    conn, _ = self._listener.accept()
                except TimeoutError:
                    continue
                index = self._handshake(conn)
                if index is None:
                    continue
                conn.setblocking(True)
                self._peers[index] = conn
                self._sel.register(conn, selectors.EVENT_READ, index)
        finally:
            self._listener.close()

    def _handshake(self, conn: socket.socket) -> int | None:
        """Mutual HMAC proof; the member's index, or None for a stranger (closed)."""
        try:
            conn.settimeout(HANDSHAKE_TIMEOUT)
            if conn.family == socket.AF_INET:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            mine = os.urandom(NONCE)
            conn.sendall(MAGIC + mine)
            head = _recv_exactly(conn, INDEX.size + NONCE + DIGEST)
            raw_index, theirs, proof = head[:4], head[4 : 4 + NONCE], head[4 + NONCE :]
            if not hmac.compare_digest(proof, _mac(self._key, b"member", mine, raw_index)):
                conn.close()
                return None
            (index,) = INDEX.unpack(raw_index)
            if not 0 < index < self._size:
                conn.close()
                raise DistributedError(
                    f"{self._what}: a worker says it is {self._names} {index}, outside the "
                    f"group's size {self._size}; every rank must agree on the sizes"
                )
            if index in self._peers:
                conn.close()
                raise DistributedError(
                    f"{self._what}: two workers say they are {self._names} {index}; give "
                    "each process its own rank"
                )
            conn.sendall(_mac(self._key, b"chief", theirs))
            conn.settimeout(None)
            return index
        except (OSError, EOFError):
            conn.close()
            return None

    # ------------------------------------------------------------------ collectives
    def collect(self, kind: str) -> list[Any]:
        """One ``kind`` frame from every member, in member order."""
        with self._lock:
            pending = set(self._peers)
            got: dict[int, Any] = {}
            while pending:
                for key, _ in self._sel.select():
                    index: int = key.data
                    sock = self._peers[index]
                    if index not in pending:
                        early = self._peek(sock)
                        raise DistributedError(
                            f"{self._what}: {self._names} {index} "
                            + (
                                f"exited during {kind}(); see its log ([rank=...] lines)"
                                if not early
                                else f"called another collective during {kind}(); every rank "
                                "must call the same collectives in the same order"
                            )
                        )
                    try:
                        their_kind, payload = _recv_frame(sock)
                    except (OSError, EOFError):
                        raise DistributedError(
                            f"{self._what}: {self._names} {index} exited during {kind}(); see "
                            "its log for why"
                        ) from None
                    if their_kind != kind:
                        raise DistributedError(
                            f"{self._what} called {kind}() while {self._names} {index} called "
                            f"{their_kind}(); every rank must call the same collectives in the "
                            "same order"
                        )
                    got[index] = payload
                    pending.discard(index)
            return [got[i] for i in sorted(got)]

    @staticmethod
    def _peek(sock: socket.socket) -> bool:
        try:
            return bool(sock.recv(1, socket.MSG_PEEK))
        except OSError:
            return False

    def send_all(self, kind: str, payload: Any) -> None:
        frame = _frame(kind, payload)
        with self._lock:
            for index, sock in sorted(self._peers.items()):
                try:
                    _send_frame(sock, frame)
                except OSError:
                    raise DistributedError(
                        f"{self._what}: {self._names} {index} exited before {kind}() reached it; "
                        "see its log for why"
                    ) from None

    def close(self) -> None:
        for sock in self._peers.values():
            try:
                sock.close()
            except OSError:
                pass
        self._peers.clear()
        self._sel.close()
        try:
            self._listener.close()
        except OSError:
            pass


class Link:
    """A member's end of a group: one connection to the group's chief."""

    def __init__(self, addr: Address, index: int, key: bytes, what: str, timeout: float) -> None:
        self._what = what  # e.g. "rank 2"
        self._addr = addr
        self._lock = threading.Lock()
        self._sock = self._connect(addr, timeout)
        self._handshake(index, key)

    def _connect(self, addr: Address, timeout: float) -> socket.socket:
        deadline = time.monotonic() + timeout
        pause = 0.005
        while True:
            if addr[0] == "unix":
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                target: Any = addr[1]
            else:
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                target = (addr[1], addr[2])
            try:
                sock.connect(target)
                if addr[0] == "tcp":
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                return sock
            except OSError as err:
                sock.close()
                if time.monotonic() > deadline:
                    raise DistributedError(
                        f"{self._what} could not reach its chief at {_describe(addr)} within "
                        f"{timeout:.0f}s ({err.strerror or err}); did the chief (rank 0) start, "
                        "and do all ranks use the same INTER_TRAIN_PROCESS_COMM_PORT_1?"
                    ) from None
                time.sleep(pause)
                pause = min(pause * 2, 0.1)

    def _handshake(self, index: int, key: bytes) -> None:
        sock = self._sock
        try:
            sock.settimeout(HANDSHAKE_TIMEOUT)
            head = _recv_exactly(sock, len(MAGIC) + NONCE)
            if head[: len(MAGIC)] != MAGIC:
                raise EOFError
            theirs = head[len(MAGIC) :]
            mine = os.urandom(NONCE)
            raw_index = INDEX.pack(index)
            sock.sendall(raw_index + mine + _mac(key, b"member", theirs, raw_index))
            proof = _recv_exactly(sock, DIGEST)
            if not hmac.compare_digest(proof, _mac(key, b"chief", mine)):
                raise EOFError
            sock.settimeout(None)
        except (OSError, EOFError):
            sock.close()
            raise DistributedError(
                f"{self._what}: the process listening at {_describe(self._addr)} is not this "
                "trial's chief (the handshake failed); another program may use that port: set "
                "INTER_TRAIN_PROCESS_COMM_PORT_1 to a free port on every rank"
            ) from None

    def send(self, kind: str, payload: Any) -> None:
        with self._lock:
            try:
                _send_frame(self._sock, _frame(kind, payload))
            except OSError:
                raise DistributedError(
                    f"{self._what} lost its connection to the chief during {kind}(): the chief "
                    "exited; see the [rank=0] log lines for why"
                ) from None

    def recv(self, kind: str) -> Any:
        with self._lock:
            try:
                their_kind, payload = _recv_frame(self._sock)
            except (OSError, EOFError):
                raise DistributedError(
                    f"{self._what} lost its connection to the chief during {kind}(): the chief "
                    "(or another worker) exited; see the other ranks' logs for why"
                ) from None
        if their_kind != kind:
            chief_called = their_kind.replace("_ack", "")
            raise DistributedError(
                f"{self._what} called {kind}() while the chief called {chief_called}(); every "
                "rank must call the same collectives in the same order"
            )
        return payload

    def close(self) -> None:
        try:
            self._sock.close()
        except OSError:
            pass

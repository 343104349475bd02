"""The trial's side of the daemon socket: non-blocking metric reports, requests, preemption.

A trial process launched by det-local finds DET_LOCAL_SOCKET and DET_LOCAL_TOKEN in its
environment. ``Session`` connects once, then:

* ``report()`` appends to an in-memory queue and returns (a few hundred nanoseconds); a sender
  thread ships the queue in batched frames every ``FLUSH_INTERVAL`` seconds;
* ``request()`` flushes what is queued, sends one request and waits for its reply (checkpoint
  reports, searcher operations, best validation): the daemon has committed it on return;
* a receiver thread turns the daemon's ``preempt`` message into a flag that ``preempted`` reads
  (an attribute read: cheap enough for every batch).

If the socket breaks (the daemon restarted), the sender reconnects and resends what was not
acknowledged, so nothing reported is lost while the daemon comes back.
"""

from __future__ import annotations

import atexit
import collections
import itertools
import os
import socket
import sys
import threading
import time
from typing import Any

from det_local.errors import DetLocalError
from det_local.wire import channel, rpc
from det_local.wire.budget import TRIAL_SESSION, Refused, scan

FLUSH_INTERVAL = 0.05
MAX_BATCH = 20_000
RECONNECT_TIMEOUT = 120.0


class SessionError(DetLocalError):
    pass


class Session:
    def __init__(
        self,
        socket_path: str,
        token: str,
        trial_id: int,
        run_id: int,
        rank: int = 0,
        *,
        hello: dict[str, Any] | None = None,
    ) -> None:
        self.socket_path = socket_path
        self._hello_extra = dict(hello or {})  # e.g. {"unmanaged": True} (core_v2)
        self.token = token
        self.trial_id = trial_id
        self.run_id = run_id
        self.rank = rank
        self.preempted = False
        self._queue: collections.deque[tuple[Any, ...]] = collections.deque()
        self._send_lock = threading.RLock()
        self._replies: dict[int, tuple[threading.Event, list[Any]]] = {}
        self._ids = itertools.count(1)
        self._wake = threading.Event()
        self._closed = False
        self._sock: socket.socket | None = None
        self._link: channel.Link | None = None
        self._connected = threading.Event()
        self._connect()
        self._sender = threading.Thread(
            target=self._send_loop, name="det-local-sender", daemon=True
        )
        self._sender.start()
        atexit.register(self.close)

    # ------------------------------------------------------------------ connection
    def _connect(self) -> None:
        deadline = time.monotonic() + RECONNECT_TIMEOUT
        hello = {
            "t": "hello",
            "trial_id": self.trial_id,
            "run_id": self.run_id,
            "rank": self.rank,
            "pid": os.getpid(),
            **self._hello_extra,
        }
        while True:
            try:
                if self.socket_path.startswith(channel.SCHEME):  # a compute node of a pool
                    try:
                        sock, answer, link = channel.connect(self.socket_path, self.token, hello)
                    except (channel.ChannelError, rpc.FrameError, ValueError) as err:
                        raise SessionError(
                            f"det-local trial channel {self.socket_path}: {err}"
                        ) from None
                else:
                    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                    sock.connect(self.socket_path)
                    rpc.send(sock, {**hello, "token": self.token})
                    answer = rpc.recv(sock)
                    link = channel.Link(sock)
                if answer is not None and answer.get("retry"):  # busy: many connecting at once
                    sock.close()
                    raise _Busy
                if answer is None or answer.get("error"):
                    reason = answer.get("error") if answer else "connection closed"
                    raise SessionError(f"det-local daemon refused trial {self.trial_id}: {reason}")
                break
            except (OSError, _Busy):
                if time.monotonic() > deadline or self._closed:
                    raise SessionError(
                        f"cannot reach the det-local daemon at {self.socket_path}; "
                        "is `det-local daemon status` running?"
                    ) from None
                time.sleep(0.2)
        if answer.get("preempt"):
            self.preempted = True
        _say_started(self.trial_id, self.rank, answer.get("started"))
        self._sock = sock
        self._link = link
        self._connected.set()
        threading.Thread(
            target=self._recv_loop, args=(link,), name="det-local-receiver", daemon=True
        ).start()

    def _recv_loop(self, link: channel.Link) -> None:
        sock = link.sock
        while True:
            try:
                msg = link.recv()
            except (OSError, rpc.FrameError):
                msg = None
            if msg is None:
                if self._sock is sock:
                    self._connected.clear()
                    self._wake.set()
                return
            kind = msg.get("t")
            if kind == "preempt":
                self.preempted = True
            elif kind == "refused":  # a frame of ours over the daemon's budget: said once
                print(f"det-local: the daemon refused a frame: {msg.get('error')}", file=sys.stderr)
            elif kind == "reply":
                waiter = self._replies.pop(int(msg.get("id", -1)), None)
                if waiter is not None:
                    waiter[1].append(msg)
                    waiter[0].set()

    def _send_frame(self, msg: dict[str, Any]) -> None:
        data = rpc.pack(msg)
        if len(data) - rpc.HEADER.size > rpc.SESSION_MAX_FRAME:
            raise SessionError(
                f"'{msg.get('t')}' message of {len(data)} bytes is over the det-local daemon's "
                f"{rpc.SESSION_MAX_FRAME} byte limit (a checkpoint of too many files, or "
                "metadata too large?)"
            )
        over = over_budget(data)
        if over is not None:
            raise SessionError(
                f"'{msg.get('t')}' message is over the det-local daemon's budget: {over} (a "
                "checkpoint of too many files, or metadata too large?)"
            )
        self._send_packed(data)

    def _send_packed(self, data: bytes) -> None:
        """Send, reconnecting once if the daemon went away meanwhile."""
        with self._send_lock:
            for attempt in range(2):
                if not self._connected.is_set() or self._link is None:
                    self._connect()
                assert self._link is not None
                try:
                    self._link.send_packed(data)
                    return
                except OSError:
                    self._connected.clear()
                    if attempt:
                        raise

    # ------------------------------------------------------------------ reporting
    def report(
        self,
        group: str,
        steps_completed: int,
        metrics: dict[str, Any],
        batch_metrics: list[dict[str, Any]] | None = None,
    ) -> None:
        self._queue.append((group, steps_completed, metrics, time.time(), batch_metrics))

    def _drain(self) -> None:
        with self._send_lock:  # frames leave in report order
            while self._queue:
                n = min(len(self._queue), MAX_BATCH)
                batch = [self._queue.popleft() for _ in range(n)]
                frames = _metric_frames(batch)
                for i, (_part, data) in enumerate(frames):
                    try:
                        self._send_packed(data)
                    except BaseException:
                        unsent = [r for p, _ in frames[i:] for r in p]
                        self._queue.extendleft(reversed(unsent))  # keep them for the next try
                        raise

    def _send_loop(self) -> None:
        while not self._closed:
            self._wake.wait(FLUSH_INTERVAL)
            self._wake.clear()
            try:
                self._drain()
            except Exception:  # daemon gone for good: keep the queue, retry next tick
                time.sleep(FLUSH_INTERVAL)

    def send(self, kind: str, **fields: Any) -> None:
        """Fire-and-forget message, ordered after every queued report."""
        with self._send_lock:
            self._drain()
            self._send_frame({"t": kind, **fields})

    def request(self, kind: str, timeout: float | None = None, **fields: Any) -> Any:
        """Send a request after every queued report; wait for the daemon's answer."""
        req_id = next(self._ids)
        done = threading.Event()
        box: list[Any] = []
        self._replies[req_id] = (done, box)
        with self._send_lock:
            self._drain()
            self._send_frame({"t": kind, "id": req_id, **fields})
        deadline = None if timeout is None else time.monotonic() + timeout
        while not done.wait(0.5):
            if not self._connected.is_set():
                # the daemon went away before answering: ask again once it is back
                self._send_frame({"t": kind, "id": req_id, **fields})
            if deadline is not None and time.monotonic() > deadline:
                self._replies.pop(req_id, None)
                raise SessionError(f"the det-local daemon did not answer '{kind}' in {timeout}s")
        reply = box[0]
        if reply.get("error"):
            raise DetLocalError(str(reply["error"]))
        return reply.get("value")

    def flush(self) -> None:
        self._drain()

    def close(self) -> None:
        if self._closed:
            return
        try:
            self._drain()
            self.request("bye", timeout=30)
        except Exception:
            pass
        self._closed = True
        self._wake.set()
        if self._sock is not None:
            try:
                # the receiver thread blocks in recv(): close() alone would leave the connection
                # open until the process exits; shutdown ends it now (the daemon sees EOF)
                self._sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            try:
                self._sock.close()
            except OSError:
                pass


class _Busy(Exception):
    """The daemon answered hello with 'busy, retry'."""


def _metric_frames(batch: list[tuple[Any, ...]]) -> list[tuple[list[tuple[Any, ...]], bytes]]:
    """(reports, packed frame) pairs within the daemon's frame limit: a batch too large is
    split in halves; a single report too large for any frame is dropped with a warning."""
    data = rpc.pack({"t": "metrics", "reports": batch})
    if len(data) - rpc.HEADER.size <= rpc.SESSION_MAX_FRAME and over_budget(data) is None:
        return [(batch, data)]
    if len(batch) == 1:
        group, steps = batch[0][0], batch[0][1]
        over = over_budget(data) or f"{len(data)} bytes"
        print(
            f"det-local: warning: {group} metrics at steps_completed={steps} are over the "
            f"daemon's limit for one frame ({rpc.SESSION_MAX_FRAME} bytes: {over}); not "
            "recorded (report fewer or smaller batch_metrics)",
            file=sys.stderr,
            flush=True,
        )
        return []
    mid = len(batch) // 2
    return _metric_frames(batch[:mid]) + _metric_frames(batch[mid:])


def over_budget(data: bytes) -> str | None:
    """Why a packed frame (header and body) is over the daemon's TRIAL_SESSION budget (its
    values, maps and arrays: wire/budget.py), or None. A body no longer than the container
    limit cannot hold more values or containers than it has bytes: not scanned."""
    body = data[rpc.HEADER.size :]
    if len(body) <= min(TRIAL_SESSION.max_containers, TRIAL_SESSION.max_objects):
        return None
    try:
        scan(body, TRIAL_SESSION)
    except Refused as err:
        return str(err)
    return None


_session: Session | None = None
_session_lock = threading.Lock()


def get_session() -> Session | None:
    """The process's session when launched by det-local, else None (off-cluster)."""
    global _session
    if _session is not None:
        return _session
    path = os.environ.get("DET_LOCAL_SOCKET")
    if not path:
        return None
    with _session_lock:
        if _session is None:
            _session = Session(
                path,
                os.environ.get("DET_LOCAL_TOKEN", ""),
                int(os.environ["DET_TRIAL_ID"]),
                int(os.environ.get("DET_TRIAL_RUN_ID", "1")),
                int(os.environ.get("RANK", "0") or 0),
                # a rank of another machine's trial: this daemon relays it (federate/)
                hello=_relay_hello(),
            )
    return _session


def _say_started(trial_id: int, rank: int, started: Any) -> None:
    """The chief's line in the trial's log: how long the run took to start, cold or warm (the
    daemon measured it: from its spawn to this hello). Off with DET_LOCAL_METRIC_LINES=0."""
    from det_local.trial.core import _metric_lines

    if rank != 0 or not isinstance(started, dict) or not _metric_lines.enabled():
        return
    seconds = started.get("seconds")
    if not isinstance(seconds, (int, float)):
        return
    kind = "warm" if started.get("warm") else "cold"
    try:
        print(f"det-local: trial {trial_id} started {kind} in {seconds:.3f}s", flush=True)
    except (OSError, ValueError):  # stdout closed by the trial
        pass


def _relay_hello() -> dict[str, Any] | None:
    raw = os.environ.get("DET_LOCAL_RELAY_JOB")
    return {"relay": int(raw)} if raw and raw.isdigit() else None

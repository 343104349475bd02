"""msgpack framing and the message types spoken between trials and the daemon.

A frame is a 4-byte big-endian length followed by one msgpack map. Every map has a ``t`` key
naming its type. Requests that expect an answer carry ``id``; the answer is a ``reply`` frame
with the same ``id`` and either ``value`` or ``error`` (a one-line message).

Trial -> daemon (one handler each in ``sched/sessions/trialmessages.py``'s ``MESSAGES``)
    hello         {token, trial_id, run_id, rank, pid, [unmanaged]}  (request) first frame
    metrics       {reports: [[group, steps_completed, metrics, time, batch_metrics], ...]}
    progress      {progress}
    status        {status}
    ckpt_begin    {uuid}                                 (request) before its directory exists
    checkpoint    {uuid, path, steps_completed, metadata, resources}  (request) durable on reply
    ckpt_delete   {uuid}                                            (request)
    ckpt_get      {uuid}                                            (request) -> record | None
    early_exit    {reason}                                          (request)
    best_val      {}                                                (request) -> float | None
    last_val      {}                                                (request) -> steps | None
    op_next       {}                                                (request) -> length | None
    op_done       {length, metric}                                  (request)
    out_of_ops    {}                                                (request)
    preempt_ack   {}                                                (request)
    bye           {}                                                (request) reporting is done
    unmanaged_end {state: COMPLETED | ERROR, message}  (request) a core_v2 process ends its trial
    time_limit    {}       (request) the run's pool ends it soon (a Slurm job's batch shell)

Daemon -> trial
    hello         {preempt, [started]} | {error, [retry]}           the answer to hello
                  (started: {warm, seconds}, how long the run took to start; first hello only)
    reply         {id, value | error}
    preempt       {}                                                should_preempt() turns True
    refused       {error}              a frame over its budget (wire/budget.py); then closed

Clients (the CLI, the Python API) never use the socket: they submit and control through spool
files (``sched/intake/spool.py``).

A trial's session is an allocation's authority, not a pipe (``sched/sessions/trialserver.py``):
hello must
come first, within HELLO_TIMEOUT, in a frame of at most HELLO_MAX_FRAME bytes, and binds the
connection to one run of one trial (its token and its process's uid); every later frame is at
most SESSION_MAX_FRAME bytes (the trial side splits metric batches to fit) and acts on that run
only. A refused hello answers ``{t: hello, error}``, with ``retry: true`` when it is only busy.

A trial on another host (a Slurm pool's ``channel``) speaks the same messages over TCP, after
a challenge-response handshake and with every frame sealed (``det_local/wire/channel.py``).

Every frame is decoded with a budget (``det_local/wire/budget.py``): hello with TRIAL_HELLO,
session frames with TRIAL_SESSION, what a trial reads with DAEMON_TO_TRIAL; a frame over it is a
FrameError naming the limit, found before anything is built. A frame over its budget, or one
that is not a message its handler can read (a field of the wrong type), is refused with one line
(``refused``) and its session closed.
"""

from __future__ import annotations

import socket
import struct
from typing import Any

import msgpack

from det_local.wire.budget import DAEMON_TO_TRIAL, Budget, Refused, decode

HEADER = struct.Struct(">I")
MAX_FRAME = 64 * 1024 * 1024  # what a trial accepts from the daemon
HELLO_MAX_FRAME = 4 * 1024  # what the daemon reads from a connection that has not said hello
# what the daemon reads from a session (budget.TRIAL_SESSION): a single metric report, a
# checkpoint's file list (about 45,000 files of 80-byte paths) or a request fits; the trial side
# splits its metric batches below it
SESSION_MAX_FRAME = 4 * 1024 * 1024
HELLO_TIMEOUT = 5.0


class FrameError(Exception):
    """A peer sent something that is not a det-local frame."""


def pack(msg: dict[str, Any]) -> bytes:
    body = msgpack.packb(msg, use_bin_type=True)
    return HEADER.pack(len(body)) + body


def unpack(body: bytes | bytearray, budget: Budget = DAEMON_TO_TRIAL) -> dict[str, Any]:
    try:
        msg = decode(body, budget)
    except Refused as err:  # over budget, or not msgpack: one line naming which
        raise FrameError(f"frame refused: {err}") from None
    if not isinstance(msg, dict) or "t" not in msg:
        raise FrameError("frame is not a message map with a 't' key")
    return msg


def recv_exact(sock: socket.socket, n: int) -> bytes | None:
    """n bytes from a blocking socket; None when the peer closed it first."""
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def recv(sock: socket.socket, budget: Budget = DAEMON_TO_TRIAL) -> dict[str, Any] | None:
    """Blocking read of one frame; None when the peer closed the connection."""
    head = recv_exact(sock, HEADER.size)
    if head is None:
        return None
    (size,) = HEADER.unpack(head)
    limit = min(MAX_FRAME, budget.max_bytes)
    if size > limit:
        raise FrameError(f"frame of {size} bytes is over the {limit} byte limit")
    body = recv_exact(sock, size)
    if body is None:
        return None
    return unpack(body, budget)


def send(sock: socket.socket, msg: dict[str, Any]) -> None:
    sock.sendall(pack(msg))

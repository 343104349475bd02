"""The trial server: the engine's unix socket, its connections, sessions and frames.

What each message does once a session is established is `sched/sessions/trialmessages.py` (one
handler
per message type); this module authenticates sessions and keeps memory bounded.

The socket is an authority, not a pipe. A root daemon opens it to every user (mode 0666), so:

* **a session is bound to its allocation**: hello names a live trial, and both its token and the
  connecting process's uid (SO_PEERCRED) must be that run's (the job's user for a root daemon,
  the daemon's own uid otherwise); a token alone, leaked or stolen, is useless from another uid;
* **a session acts on its own run only**: it records checkpoints of its own trial, whose
  directory is ``<its experiment's storage>/<uuid>`` (a real directory owned by the trial's user,
  with a well-formed uuid no other trial recorded); it reads (``ckpt_get``) the records of its
  own trial's checkpoints and of the checkpoint its trial was warm-started from; it deletes only
  its own trial's checkpoints; no field of a message may name another trial or run; a run that
  ended has no session any more. Anything else is refused: a one-line error in the reply and one
  line in the daemon's log (rate-limited per uid), and nobody else's records change;
* **memory stays bounded whatever a client sends**: before hello a frame is at most
  ``rpc.HELLO_MAX_FRAME`` bytes and hello must arrive within ``rpc.HELLO_TIMEOUT`` seconds; a
  uid has at most ``PENDING_PER_UID`` connections waiting for hello and ``SESSIONS_PER_UID``
  sessions; a session frame is at most ``rpc.SESSION_MAX_FRAME`` bytes, and a uid reads at most
  ``LARGE_READS_PER_UID`` frames over ``LARGE_FRAME`` bytes at a time (the others wait, unread, in
  their sockets); every frame is decoded within its budget (``wire/budget.py``: TRIAL_HELLO,
  TRIAL_SESSION: bytes, values, maps and arrays, nesting), found over it before anything is built
  (one line back to the sender, one rate-limited line in the log, the session closed); a frame
  over ``DECODE_ON_LOOP_MAX`` is decoded off the event loop, one such frame at a time for the whole
  daemon (a frame within TRIAL_SESSION decodes to at most ~7 MB, so three users' frames in
  flight cost their bytes and one decode); a frame whose fields its handler cannot read
  (malformed) is refused the same way and closes its session;
  replies wait for the client to read (drain) and a client whose unread replies pile up past
  ``WRITE_MAX`` is dropped.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import socket as _socket
import struct
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from det_local.errors import DetLocalError
from det_local.sched.run.runas import user_name
from det_local.wire import budget as wire
from det_local.wire import rpc
from det_local.wire.budget import TRIAL_HELLO, TRIAL_SESSION, Budget

if TYPE_CHECKING:
    from det_local.sched.life.experiments import TrialRun

PENDING_PER_UID = 16  # connections of one uid that have not said hello yet
SESSIONS_PER_UID = 512  # authenticated connections of one uid (16-rank trials, many of them)
# frames over this many bytes are decoded by the decoder thread, not on the event loop (the
# scan and the decode of 16 KiB cost a few ms at most; of 256 KiB of small values, ~30 ms)
DECODE_ON_LOOP_MAX = 16 * 1024
LARGE_FRAME = 256 * 1024  # frames over this many bytes ...
LARGE_READS_PER_UID = 2  # ... are read this many at a time per uid
PEEK_BYTES = 64 * 1024  # of a large frame, checked against its budget before the rest is read
WRITE_HIGH_WATER = 256 * 1024  # unread reply bytes after which a session waits for its client
WRITE_MAX = 8 * 1024 * 1024  # unread reply bytes after which a client is dropped
NOTES_PER_MINUTE = 20  # refusals logged per uid, kind and minute (the rest are counted)


# what a session may send (wire/rpc.py); anything else is named "request" in the log
KINDS = frozenset(
    [
        "metrics",
        "progress",
        "status",
        "checkpoint",
        "ckpt_delete",
        "ckpt_get",
        "early_exit",
        "best_val",
        "last_val",
        "op_next",
        "op_done",
        "out_of_ops",
        "preempt_ack",
        "bye",
    ]
)


def kind_of(msg: dict[str, Any]) -> str:
    kind = msg.get("t")
    return kind if isinstance(kind, str) and kind in KINDS else "request"


class Refused(DetLocalError):
    """A session asked for something that is not its own: refused and logged."""


@dataclass
class SocketState:
    """The socket's bookkeeping: connections per uid, large reads, the refusal log's budget."""

    pending: Counter[int] = field(default_factory=Counter)
    sessions: Counter[int] = field(default_factory=Counter)
    large_reads: dict[int, asyncio.Semaphore] = field(default_factory=dict)
    decoder: Executor | None = None  # one thread decodes the large frames, one at a time
    # ... and one frame decoded at a time, handed to its session before the next is decoded
    decode_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    # (uid, what) -> (minute's start, lines logged, lines left out)
    notes: dict[tuple[int, str], tuple[float, int, int]] = field(default_factory=dict)
    warned: set[tuple[int, str]] = field(default_factory=set)  # (trial, metric) non-finite

    def decoding(self) -> tuple[Executor, asyncio.Lock]:
        if self.decoder is None:
            self.decoder = ThreadPoolExecutor(1, thread_name_prefix="det-local-frames")
        return self.decoder, self.decode_lock

    def large(self, uid: int) -> asyncio.Semaphore:
        sem = self.large_reads.get(uid)
        if sem is None:
            sem = self.large_reads[uid] = asyncio.Semaphore(LARGE_READS_PER_UID)
        return sem


class FrameTooLarge(Exception):
    def __init__(self, size: int, limit: int) -> None:
        super().__init__(size, limit)
        self.size = size
        self.limit = limit


async def _read_frame(
    reader: asyncio.StreamReader,
    limit: int,
    large: asyncio.Semaphore | None,
    budget: Budget,
    decoder: tuple[Executor, asyncio.Lock] | None = None,
) -> dict[str, Any]:
    """One frame, decoded within `budget` (rpc.FrameError naming the limit otherwise). A large
    frame is read while holding one of its uid's large-read slots (into one buffer, a chunk at
    a time: its bytes are held once) and decoded off the event loop, by ``decoder`` when given
    (the daemon's one thread for them: one decode at a time, and one thread's malloc arena
    holding what they leave; a refused one costs its bytes and the scan up to the limit:
    wire/budget.py stops there)."""
    (size,) = rpc.HEADER.unpack(await reader.readexactly(rpc.HEADER.size))
    if size > limit:
        raise FrameTooLarge(size, limit)
    if large is not None and size > LARGE_FRAME:
        async with large:
            # its first bytes first: a bomb shows itself there, and the rest is never read
            body = bytearray(await reader.readexactly(PEEK_BYTES))
            try:
                wire.scan(body, budget, total=size)
            except wire.Refused as err:
                raise rpc.FrameError(f"frame refused: {err}") from None
            while len(body) < size:
                body += await reader.readexactly(min(PEEK_BYTES, size - len(body)))
            loop = asyncio.get_running_loop()
            if decoder is None:
                return await loop.run_in_executor(None, rpc.unpack, body, budget)
            async with decoder[1]:
                return await loop.run_in_executor(decoder[0], rpc.unpack, body, budget)
    body_bytes = await reader.readexactly(size)
    if decoder is not None and size > DECODE_ON_LOOP_MAX:  # up to ~20 ms to decode: not here
        async with decoder[1]:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(decoder[0], rpc.unpack, body_bytes, budget)
    return rpc.unpack(body_bytes, budget)


class Sessions(Protocol):
    """What the trial server asks of the engine: which run a hello names, whether it is still
    running, whose it is; what a message does (`trialmessages.handle`)."""

    def managed_run(self, trial_id: int) -> TrialRun | None: ...

    def relay_run(self, job_id: int) -> TrialRun | None: ...

    def is_live(self, run: TrialRun) -> bool: ...

    def run_uid(self, run: TrialRun) -> int: ...

    def unmanaged_hello(
        self, msg: dict[str, Any], writer: asyncio.StreamWriter
    ) -> TrialRun | None: ...

    def session_opened(self, run: TrialRun) -> dict[str, Any] | None: ...

    def session_closed(self, run: TrialRun) -> None: ...

    def handle(self, run: TrialRun, msg: dict[str, Any], uid: int) -> Any: ...


class TrialServer:
    """The unix socket trials report on: connections, hello, sessions, frames, refusals."""

    def __init__(self, path: Any, sessions: Sessions, note: Callable[..., None]) -> None:
        self.path = path
        self.sessions = sessions
        self.note = note
        self.state = SocketState()  # the socket's limits and refusal log
        self.server: asyncio.AbstractServer | None = None
        self.channel: Any = None  # the pools' TCP listeners (sessions/netchannel.py), if any

    async def start(self) -> None:
        sock = self.path
        if sock.exists():
            sock.unlink()
        self.server = await asyncio.start_unix_server(self._on_connection, path=str(sock))
        # trials of every user connect (a per-run token authenticates them); the daemon alone
        # serves other users, so only a root daemon opens the socket to them
        os.chmod(sock, 0o666 if os.geteuid() == 0 else 0o600)

    async def stop(self) -> None:
        if self.state.decoder is not None:
            self.state.decoder.shutdown(wait=False)
        if self.channel is not None:
            await self.channel.stop()
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass

    async def _on_connection(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        st = self.state
        uid = peer_uid(writer.get_extra_info("socket"))
        run: TrialRun | None = None
        if uid is None:
            writer.close()
            return
        if st.pending[uid] >= PENDING_PER_UID:
            self.refuse(
                uid,
                None,
                "connection",
                f"{PENDING_PER_UID} connections of this user are already waiting to say hello",
            )
            send(writer, {"t": "hello", "error": "the daemon is busy; retry", "retry": True})
            writer.close()
            return
        st.pending[uid] += 1
        try:
            try:
                msg = await asyncio.wait_for(
                    _read_frame(reader, rpc.HELLO_MAX_FRAME, None, TRIAL_HELLO),
                    rpc.HELLO_TIMEOUT,
                )
            except asyncio.TimeoutError:
                self.refuse(
                    uid, None, "connection", f"no hello within {rpc.HELLO_TIMEOUT:g}s; closed"
                )
                return
            except FrameTooLarge as err:
                why = f"a frame of {err.size} bytes before hello (the limit is {err.limit}); closed"
                self.refuse(uid, None, "connection", why)
                send(writer, {"t": "hello", "error": why})
                return
            finally:
                st.pending[uid] -= 1
                if st.pending[uid] <= 0:
                    del st.pending[uid]
            if msg.get("t") != "hello":
                why = f"the first frame must be hello, not {str(msg.get('t'))[:40]!r}; closed"
                self.refuse(uid, None, "connection", why)
                send(writer, {"t": "hello", "error": why})
                return
            run = self._hello(msg, writer, uid)
            if run is None:
                return
            await self.serve_session(run, reader, writer, uid)
        except FrameTooLarge:
            pass  # before hello: answered above
        except rpc.FrameError as err:
            why = f"{err}; closed"
            self.refuse(uid, None, "frame", why)
            # one line to the sender (a trial prints it), before the connection closes
            send(writer, {"t": "hello", "error": why})
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def serve_session(
        self,
        run: TrialRun,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        uid: int,
    ) -> None:
        """An admitted connection's frames until it closes: the unix socket's after hello, the
        TCP channel's (`sessions/netchannel.py`) after its handshake, through its sealing."""
        st = self.state
        st.sessions[uid] += 1
        try:
            large = st.large(uid)
            while True:
                msg = await _read_frame(
                    reader, rpc.SESSION_MAX_FRAME, large, TRIAL_SESSION, st.decoding()
                )
                if not self.sessions.is_live(run):
                    if msg.get("t") == "bye":  # a goodbye after its run ended (core_v2's
                        # close: `end`, then bye): nothing refused, nothing to log
                        if "id" in msg:
                            send(writer, {"t": "reply", "id": msg["id"], "value": None})
                        return
                    why = f"run {run.run_id} of trial {run.trial_id} has ended; closed"
                    self.refuse(uid, run, kind_of(msg), why)
                    if "id" in msg:
                        send(writer, {"t": "reply", "id": msg["id"], "error": why})
                    return
                if not self._handle(run, msg, writer, uid):
                    return  # malformed: refused (told and logged), closed
                del msg  # not kept while the next frame is awaited (a large one's ~7 MB)
                if writer.transport.get_write_buffer_size() > WRITE_HIGH_WATER:
                    await writer.drain()  # not read further until the client reads its replies
        except FrameTooLarge as err:
            why = f"a frame of {err.size} bytes (the limit is {err.limit}); closed"
            self.refuse(uid, run, "frame", why)
            send(writer, {"t": "refused", "error": why})
        except rpc.FrameError as err:
            why = f"{err}; closed"
            self.refuse(uid, run, "frame", why)
            send(writer, {"t": "refused", "error": why})  # one line the trial prints
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            st.sessions[uid] -= 1
            if st.sessions[uid] <= 0:
                del st.sessions[uid]
            if writer in run.writers:
                run.writers.remove(writer)
                self.sessions.session_closed(run)
            writer.close()

    def _hello(
        self, msg: dict[str, Any], writer: asyncio.StreamWriter, uid: int
    ) -> TrialRun | None:
        """The run this connection speaks for, or None (refused: answered and logged)."""
        if msg.get("unmanaged"):  # a core_v2 process det-local did not start
            return self.sessions.unmanaged_hello(msg, writer)
        trial_id = msg.get("trial_id")
        relay = msg.get("relay")
        if type(relay) is int:  # a rank of another machine's trial, run here as a gang member
            run = self.sessions.relay_run(relay)
            if run is not None and run.trial_id != trial_id:
                run = None
        else:
            run = self.sessions.managed_run(trial_id) if type(trial_id) is int else None
        token = msg.get("token")
        if (
            run is None
            or not isinstance(token, str)
            or not secrets.compare_digest(token.encode(), run.token.encode())
        ):
            unknown = "unknown trial or wrong token"
            self.refuse(uid, None, "hello", f"{unknown} (trial {str(trial_id)[:20]})")
            send(writer, {"t": "hello", "error": unknown})
            return None
        return self.admit(run, msg, writer, uid, writer)

    def admit(
        self,
        run: TrialRun,
        msg: dict[str, Any],
        writer: asyncio.StreamWriter,
        uid: int,
        answer_to: asyncio.StreamWriter,
        proof: dict[str, Any] | None = None,
    ) -> TrialRun | None:
        """A connection authenticated for ``run`` (its token checked) becomes its session, or is
        refused (answered on ``answer_to`` and logged). ``writer`` is what the session's frames go
        through (the TCP channel's is sealed); ``proof`` goes into the answer."""
        why: str | None = None
        owner = self.sessions.run_uid(run)
        run_id = msg.get("run_id", run.run_id)
        if uid != owner:
            why = (
                f"trial {run.trial_id} runs as {user_name(owner)}; this connection is from "
                f"{user_name(uid)} (uid {uid}): a trial's token is valid only in its own "
                "processes"
            )
        elif run_id != run.run_id:
            why = (
                f"run {str(run_id)[:20]} of trial {run.trial_id} is not running (run "
                f"{run.run_id} is)"
            )
        elif self.state.sessions[uid] >= SESSIONS_PER_UID:
            why = f"this user already has {SESSIONS_PER_UID} trial sessions open"
        if why is not None:
            self.refuse(uid, run, "hello", why)
            send(answer_to, {"t": "hello", "error": why})
            return None
        run.writers.append(writer)
        started = self.sessions.session_opened(run)  # how long it took to start, the first time
        answer: dict[str, Any] = {"t": "hello", "preempt": run.preempt_sent, **(proof or {})}
        if started is not None:
            answer["started"] = started
        send(answer_to, answer)
        return run

    def refuse(self, uid: int, run: TrialRun | None, what: str, why: str) -> None:
        """One line in the daemon's log for a refused request (at most NOTES_PER_MINUTE per
        uid, kind of request and minute; the next line logged says how many were left out)."""
        st = self.state
        now = time.monotonic()
        key = (uid, what)
        start, logged, dropped = st.notes.get(key, (now, 0, 0))
        if now - start >= 60.0:
            start, logged = now, 0
        if logged >= NOTES_PER_MINUTE:
            st.notes[key] = (start, logged, dropped + 1)
            return
        st.notes[key] = (start, logged + 1, 0)
        who = f"{user_name(uid)} (uid {uid})"
        if run is not None:
            who += f", trial {run.trial_id} run {run.run_id}"
        more = f" [{dropped} more such refusals of this user were not logged]" if dropped else ""
        self.note(
            f"trial socket: refused {what} from {who}: {why}{more}",
            experiment_id=None if run is None else run.experiment_id,
            trial_id=None if run is None else run.trial_id,
            level="WARNING",
        )

    def _handle(
        self, run: TrialRun, msg: dict[str, Any], writer: asyncio.StreamWriter, uid: int
    ) -> bool:
        """One frame of a session: its handler's value or one-line error as the reply (when
        the frame asks for one); refusals are logged. False for a malformed frame (a field its
        handler cannot read): refused in one line (logged, and sent as ``refused``), and the
        session is to be closed, as for a frame over its budget."""
        kind = msg.get("t")
        value: Any = None
        error: str | None = None
        try:
            value = self.sessions.handle(run, msg, uid)
            if isinstance(value, asyncio.Future):  # relayed to the trial's owner: answered later
                if "id" in msg:
                    value.add_done_callback(lambda f: _reply_later(f, msg["id"], writer))
                return True
        except Refused as err:
            error = str(err)
            self.refuse(uid, run, kind_of(msg), error)
        except DetLocalError as err:
            error = str(err)
        except (KeyError, TypeError, ValueError, IndexError, AttributeError) as err:
            error = f"malformed {str(kind)[:40]!r} message ({type(err).__name__}: {err})"[:300]
            why = f"frame refused: {error}; closed"
            self.refuse(uid, run, "frame", why)
            send(writer, {"t": "refused", "error": why})
            return False
        if "id" in msg:
            reply: dict[str, Any] = {"t": "reply", "id": msg["id"]}
            if error is not None:
                reply["error"] = error
            else:
                reply["value"] = value
            send(writer, reply)
        return True


def _reply_later(fut: asyncio.Future[Any], msg_id: Any, writer: asyncio.StreamWriter) -> None:
    reply: dict[str, Any] = {"t": "reply", "id": msg_id}
    if fut.cancelled():
        reply["error"] = "the trial's owner did not answer"
    elif fut.exception() is not None:
        reply["error"] = str(fut.exception())[:300]
    else:
        reply["value"] = fut.result()
    send(writer, reply)


def send(writer: asyncio.StreamWriter, msg: dict[str, Any]) -> None:
    """Queue a frame for a client; a client that leaves WRITE_MAX bytes unread is dropped."""
    try:
        transport = writer.transport
        if transport.is_closing():
            return
        if transport.get_write_buffer_size() > WRITE_MAX:
            transport.abort()  # it does not read its replies: memory is not its to hold
            return
        writer.write(rpc.pack(msg))
    except (ConnectionError, RuntimeError):
        pass


def peer_creds(sock: Any) -> tuple[int | None, int | None]:
    """(pid, uid) of a unix socket's peer, from the kernel (SO_PEERCRED)."""
    if sock is None:
        return None, None
    try:
        creds = sock.getsockopt(_socket.SOL_SOCKET, _socket.SO_PEERCRED, struct.calcsize("3i"))
    except (AttributeError, OSError):
        return None, None
    pid, uid, _gid = struct.unpack("3i", creds)
    return int(pid), int(uid)


def peer_uid(sock: Any) -> int | None:
    return peer_creds(sock)[1]

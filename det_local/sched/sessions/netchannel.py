"""The trial channel over TCP: the trial server's sessions for trials on other hosts (a Slurm
pool's compute nodes, `resource_pools.NAME.slurm.channel`).

The protocol is `det_local/wire/channel.py`'s: the daemon's nonce, the trial's HMAC of it with
its run's token (the token itself never crosses the wire), the daemon's HMAC back, then every
frame sealed (sequence number and HMAC under a per-connection key). After that a connection is
a session like one on the unix socket (`trialserver.TrialServer.serve_session`: the same
budgets, limits, handlers and refusals), bound to its run; its uid is its run's (the token
proved it).

Nothing is served before the handshake: a connection gets the challenge, at most
``rpc.HELLO_MAX_FRAME`` bytes read within ``rpc.HELLO_TIMEOUT`` seconds, and either a session
or one line back and the connection closed. A host has at most ``PENDING_PER_HOST`` connections
in the handshake (``PENDING_MAX`` in all); refusals are logged, at most ``NOTES_PER_MINUTE`` a
host and minute.
"""

from __future__ import annotations

import asyncio
import hmac
import os
import time
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

from det_local.errors import ConfigError
from det_local.sched.sessions.trialserver import (
    LARGE_FRAME,
    NOTES_PER_MINUTE,
    FrameTooLarge,
    TrialServer,
    _read_frame,
    send,
)
from det_local.wire import channel, rpc
from det_local.wire.budget import TRIAL_HELLO

if TYPE_CHECKING:
    from det_local.sched.life.experiments import TrialRun

PENDING_PER_HOST = 16
PENDING_MAX = 256
UNKNOWN = "unknown trial or wrong token"


class SealedReader:
    """What the trial server reads a session from (``readexactly``), over sealed frames: each
    frame is read whole (its size checked first), verified, then handed out as a plain one."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        sealer: channel.Sealer,
        limit: int,
        large: asyncio.Semaphore,
    ) -> None:
        self.reader = reader
        self.sealer = sealer
        self.limit = limit
        self.large = large  # its uid's large reads (trialserver.LARGE_READS_PER_UID at a time)
        self.buf = b""
        self.pos = 0

    async def readexactly(self, n: int) -> bytes:
        if self.pos >= len(self.buf):
            (size,) = rpc.HEADER.unpack(await self.reader.readexactly(rpc.HEADER.size))
            if size > self.limit + channel.OVERHEAD:
                raise FrameTooLarge(max(size - channel.OVERHEAD, 0), self.limit)
            if size > LARGE_FRAME:
                async with self.large:  # read and verified whole: memory bounded per uid
                    sealed = await self.reader.readexactly(size)
                    loop = asyncio.get_running_loop()
                    body = await loop.run_in_executor(None, self._open, sealed)
            else:
                body = self._open(await self.reader.readexactly(size))
            self.buf, self.pos = rpc.HEADER.pack(len(body)) + body, 0
        if self.pos + n > len(self.buf):
            raise rpc.FrameError("frame refused: a read across sealed frames")
        out = self.buf[self.pos : self.pos + n]
        self.pos += n
        return out

    def _open(self, sealed: bytes) -> bytes:
        try:
            return self.sealer.open(sealed)
        except channel.ChannelError as err:
            raise rpc.FrameError(f"frame refused: {err}") from None


class SealedWriter:
    """What the engine writes a session's frames to (a run's ``writers``): each `rpc.pack`
    frame sealed on its way out."""

    def __init__(self, raw: asyncio.StreamWriter, sealer: channel.Sealer) -> None:
        self.raw = raw
        self.sealer = sealer

    @property
    def transport(self) -> asyncio.WriteTransport:
        return cast(asyncio.WriteTransport, self.raw.transport)

    def write(self, data: bytes) -> None:
        self.raw.write(self.sealer.seal(bytes(data)))

    async def drain(self) -> None:
        await self.raw.drain()

    def close(self) -> None:
        self.raw.close()

    def is_closing(self) -> bool:
        return self.raw.is_closing()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self.raw.get_extra_info(name, default)


class TcpChannel:
    """The TCP listeners of the pools' channels, each serving any run's trial (its token
    decides which run it is)."""

    def __init__(self, server: TrialServer, note: Callable[..., None]) -> None:
        self.server = server
        self.note = note
        self.servers: list[asyncio.AbstractServer] = []
        self.pending: Counter[str] = Counter()
        self.notes: dict[str, tuple[float, int, int]] = {}

    async def listen(self, addresses: list[tuple[str, int]]) -> None:
        for host, port in addresses:
            try:
                srv = await asyncio.start_server(
                    self._on_connection, host or None, port, reuse_address=True
                )
            except OSError as err:
                raise ConfigError(
                    f"resource_pools: cannot listen for trials on {host}:{port} "
                    f"(slurm.channel.listen): {err.strerror or err}; choose a free port"
                ) from None
            self.servers.append(srv)

    async def stop(self) -> None:
        for srv in self.servers:
            srv.close()
        for srv in self.servers:
            await srv.wait_closed()
        self.servers.clear()

    def refuse(self, who: tuple[str, str], why: str, run: TrialRun | None = None) -> None:
        """One line in the daemon's log (at most NOTES_PER_MINUTE per host and minute).
        ``who``: (host, host:port)."""
        host, peer = who
        now = time.monotonic()
        if len(self.notes) > 1024:  # hosts not heard from for a minute are forgotten
            self.notes = {h: n for h, n in self.notes.items() if now - n[0] < 60.0}
        start, logged, dropped = self.notes.get(host, (now, 0, 0))
        if now - start >= 60.0:
            start, logged = now, 0
        if logged >= NOTES_PER_MINUTE:
            self.notes[host] = (start, logged, dropped + 1)
            return
        self.notes[host] = (start, logged + 1, 0)
        more = f" [{dropped} more refusals from this host were not logged]" if dropped else ""
        self.note(
            f"trial channel: refused a connection from {peer}: {why}{more}",
            experiment_id=None if run is None else run.experiment_id,
            trial_id=None if run is None else run.trial_id,
            level="WARNING",
        )

    async def _on_connection(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        addr = writer.get_extra_info("peername")
        host = str(addr[0]) if isinstance(addr, tuple) and addr else "?"
        peer = f"{host}:{addr[1]}" if isinstance(addr, tuple) and len(addr) > 1 else host
        who = (host, peer)
        try:
            if self.pending[host] >= PENDING_PER_HOST or sum(self.pending.values()) >= PENDING_MAX:
                self.refuse(who, "too many connections in the handshake; closed")
                send(writer, {"t": "hello", "error": "the daemon is busy; retry", "retry": True})
                return
            self.pending[host] += 1
            try:
                ns = os.urandom(channel.NONCE_BYTES)
                send(writer, {"t": "challenge", "v": channel.VERSION, "ns": ns})
                msg = await asyncio.wait_for(
                    _read_frame(reader, rpc.HELLO_MAX_FRAME, None, TRIAL_HELLO),
                    rpc.HELLO_TIMEOUT,
                )
            finally:
                self.pending[host] -= 1
                if self.pending[host] <= 0:
                    del self.pending[host]
            await self._session(msg, ns, who, reader, writer)
        except asyncio.TimeoutError:
            self.refuse(who, f"no hello within {rpc.HELLO_TIMEOUT:g}s; closed")
        except FrameTooLarge as err:
            why = f"a frame of {err.size} bytes before hello (the limit is {err.limit}); closed"
            self.refuse(who, why)
            send(writer, {"t": "hello", "error": why})
        except rpc.FrameError as err:
            self.refuse(who, f"{err}; closed")
            send(writer, {"t": "hello", "error": f"{err}; closed"})
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def _session(
        self,
        msg: dict[str, Any],
        ns: bytes,
        who: tuple[str, str],
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> None:
        fields = [msg.get(k) for k in ("trial_id", "run_id", "rank")]
        nc, mac = msg.get("nc"), msg.get("mac")
        if (
            msg.get("t") != "hello"
            or msg.get("v") != channel.VERSION
            or not all(type(f) is int for f in fields)
            or not isinstance(nc, bytes)
            or len(nc) != channel.NONCE_BYTES
            or not isinstance(mac, bytes)
        ):
            why = "the first frame must be a version-1 channel hello; closed"
            self.refuse(who, why)
            send(writer, {"t": "hello", "error": why})
            return
        trial_id, run_id, rank = (cast(int, f) for f in fields)
        ids = channel.ids(trial_id, run_id, rank)
        sessions = self.server.sessions
        run = sessions.managed_run(trial_id)
        if run is None or not hmac.compare_digest(mac, channel.client_mac(run.token, ns, nc, ids)):
            self.refuse(who, f"{UNKNOWN} (trial {trial_id})")
            send(writer, {"t": "hello", "error": UNKNOWN})
            return
        key = channel.session_key(run.token, ns, nc, ids)
        sealed_out = SealedWriter(writer, channel.Sealer(key, channel.S2C))
        out = cast(asyncio.StreamWriter, sealed_out)
        uid = sessions.run_uid(run)
        proof = {"mac": channel.server_mac(run.token, ns, nc, ids)}
        if self.server.admit(run, msg, out, uid, writer, proof) is None:
            return
        large = self.server.state.large(uid)
        sealed_in = SealedReader(
            reader, channel.Sealer(key, channel.C2S), rpc.SESSION_MAX_FRAME, large
        )
        await self.server.serve_session(run, cast(asyncio.StreamReader, sealed_in), out, uid)


async def start(server: TrialServer, addresses: list[tuple[str, int]]) -> None:
    """The trial server's unix socket, then the pools' TCP listeners (`Pools.listens`), which
    stop with it."""
    await server.start()
    if not addresses:
        return
    tcp = TcpChannel(server, server.note)
    await tcp.listen(addresses)
    server.channel = tcp

"""The cluster socket (`run/cluster.sock`): the local CLI's questions to its daemon's federation
(`cluster peers`, `slots --cluster`, `job list --cluster`) and its `reload`/`leave` requests,
which only the daemon's user or root may make (SO_PEERCRED). One small request per connection,
at most MAX_LOCAL_CONNECTIONS at once."""

from __future__ import annotations

import asyncio
import contextlib
import os
from typing import Any, Protocol

from det_local.federate.report import Report
from det_local.federate.transport import (
    HANDSHAKE_TIMEOUT,
    PRE_AUTH_MAX,
    Refused,
    decode,
    plain,
    read_frame,
)
from det_local.sched.sessions.trialserver import peer_uid

MAX_LOCAL_CONNECTIONS = 32


class SocketHost(Protocol):
    """What the local cluster socket uses of the federation (`federate/service.py`): its
    state and the commands `det-local cluster ...` sends."""

    on: bool
    why_off: str

    async def begin(self) -> None: ...

    async def end(self, goodbye: bool) -> None: ...

    @property
    def report(self) -> Report: ...


class ClusterSocket:
    def __init__(self, fed: SocketHost) -> None:
        self.fed = fed
        self.conns = 0

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.conns >= MAX_LOCAL_CONNECTIONS:
            writer.transport.abort()
            return
        self.conns += 1
        try:
            frame = await asyncio.wait_for(read_frame(reader, PRE_AUTH_MAX), HANDSHAKE_TIMEOUT)
            msg = decode(frame)
            answer = await self.request(msg, peer_uid(writer.get_extra_info("socket")))
        except (Refused, asyncio.TimeoutError, asyncio.IncompleteReadError, ConnectionError) as err:
            answer = {"t": "reply", "error": f"bad request: {err}"}
        except Exception as err:
            answer = {"t": "reply", "error": f"{type(err).__name__}: {err}"}
        finally:
            self.conns -= 1
        with contextlib.suppress(Exception):
            writer.write(plain(answer))
            await writer.drain()
            writer.close()

    async def request(self, msg: dict[str, Any], uid: int | None) -> dict[str, Any]:
        kind = msg["t"]
        if kind == "status":
            return {"t": "reply", "value": self.fed.report.status()}
        if kind == "peers":
            return {
                "t": "reply",
                "value": {**self.fed.report.status(), "peers": self.fed.report.peer_rows()},
            }
        if kind in ("jobs", "slots"):
            if not self.fed.on:
                return {"t": "reply", "error": f"federation is off: {self.fed.why_off}"}
            rows = await self.fed.report.gather(kind, bool(msg.get("all", False)))
            return {"t": "reply", "value": rows}
        if kind in ("reload", "leave"):
            if uid not in (0, os.geteuid()):
                return {"t": "reply", "error": "only the daemon's user (or root) may do that"}
            if kind == "leave":
                was = self.fed.on
                await self.fed.end(goodbye=True)
                self.fed.why_off = "left the cluster (`det-local cluster join TOKEN` to join again)"
                return {"t": "reply", "value": {"was_on": was}}
            await self.fed.begin()
            return {"t": "reply", "value": self.fed.report.status()}
        return {"t": "reply", "error": f"unknown request '{str(kind)[:40]}'"}

"""One real federated daemon on 127.0.0.1 (mDNS off) and this test speaking the peer protocol
to it: `Victim` (the daemon, its log and its cluster view), `Member` (a victim holding one CPU
slot, with a context packed for it), `Owner` and `talk` (this test as a gang's owner, "n9"), and
the messages an owner sends (reserve, commit, abort, command_reserve). tests/federation/'s
conftest.py makes the `victim` and `member` fixtures out of them."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from det_local.federate import keys, transport
from det_local.federate.blobs import Packed, send_context
from det_local.federate.transport import Me
from tests.support.fednet import cli, cli_env
from tests.support.users import A
from tests.support.world import wait_for


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Victim:
    def __init__(self, home: Path, key: bytes | None, **env: str) -> None:
        self.home = home
        self.key = key
        home.mkdir(parents=True, exist_ok=True)
        if key is not None:
            keys.write_key(home / "cluster.key", key)
        self.log = home / "daemon-test.log"
        # a port free when chosen may be taken (another process's connection) before the
        # daemon binds it: federation is then off, saying so; started again on another port
        for _attempt in range(5):
            self._start(free_port(), env)
            if f"cannot listen on 127.0.0.1:{self.port}" not in self.text():
                break
            self.stop()
            (home / "run" / "daemon.pid").unlink(missing_ok=True)

    def _start(self, port: int, env: dict[str, str]) -> None:
        self.port = port
        self.env = cli_env(
            self.home,
            DET_LOCAL_NODE_ID="victim",
            DET_LOCAL_FED_PORT=str(self.port),
            DET_LOCAL_FED_LISTEN="127.0.0.1",
            DET_LOCAL_MDNS="0",
            **env,
        )
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "det_local.cli.main", "daemon"],
                env=self.env,
                stdout=log,
                stderr=log,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        # written once the daemon serves, its federation started (listening, or saying why not)
        pid_file = self.home / "run" / "daemon.pid"
        wait_for(
            lambda: pid_file.exists() or self.proc.poll() is not None,
            timeout=60,
            what="daemon up",
        )
        assert self.proc.poll() is None, self.text()

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def logged(self, needle: str, timeout: float = 15.0) -> str:
        def find() -> str | None:
            lines = [line for line in self.text().splitlines() if needle in line]
            return lines[-1] if lines else None

        return wait_for(find, timeout=timeout, what=f"log line with {needle!r}")

    def peers(self) -> list[dict[str, Any]]:
        res = cli(self.home, "cluster", "peers", "--json")
        assert res.returncode == 0, res.stderr
        return list(json.loads(res.stdout))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


NODE = "n9"
TRAIN = "import time\ntime.sleep(30)\n"


@dataclass
class Member:
    daemon: Victim
    packed: Packed
    shared: Path

    def db(self) -> sqlite3.Connection:
        return sqlite3.connect(f"file:{self.daemon.home / 'det-local.db'}?mode=ro", uri=True)

    def jobs(self) -> list[dict[str, Any]]:
        """The MEMBER jobs of the member's queue, oldest first."""
        with self.db() as conn:
            rows = conn.execute(
                "SELECT id, state, pid, message, gang FROM jobs WHERE kind='MEMBER' ORDER BY id"
            ).fetchall()
        return [
            {"id": i, "state": s, "pid": p, "message": m, **json.loads(g or "{}")}
            for i, s, p, m, g in rows
        ]

    def job(self, gang: str) -> dict[str, Any] | None:
        found = [j for j in self.jobs() if j["gang"] == gang]
        return found[-1] if found else None


def submitter() -> tuple[str, int]:
    """The ordinary account the hand-made owner's work runs as (root never runs a peer's)."""
    import pwd

    return A, pwd.getpwnam(A).pw_uid


@dataclass
class Owner:
    """This test as a gang's owner: requests get their reply (or error) by id; the member's
    `ready` requests are answered; `wounded` messages are kept."""

    session: transport.Session
    next_id: int = 1000
    pending: dict[int, asyncio.Future[dict[str, Any]]] = field(default_factory=dict)
    ready: list[dict[str, Any]] = field(default_factory=list)
    wounded: list[dict[str, Any]] = field(default_factory=list)
    errors: list[dict[str, Any]] = field(default_factory=list)

    async def read(self) -> None:
        while True:
            msg = await self.session.recv()
            kind = msg.get("t")
            fut = self.pending.pop(msg["id"], None) if kind in ("reply", "error") else None
            if fut is not None and "id" in msg:
                fut.set_result(msg)
            elif kind == "error":
                self.errors.append(msg)
            elif kind == "ready":
                self.ready.append(msg)
                await self.session.send({"t": "reply", "id": msg["id"], "value": None})
            elif kind == "wounded":
                self.wounded.append(msg)

    async def beat(self) -> None:
        hb = {
            "t": "hb",
            "free": 0,
            "total": 1,
            "kind": "cpu",
            "digest": {"queued": 0, "running": 0, "top": []},
        }
        while True:
            await self.session.send(hb)
            await asyncio.sleep(0.5)

    async def ask(self, msg: dict[str, Any], timeout: float = 15.0) -> dict[str, Any]:
        """Send a request; its reply (or error) message."""
        self.next_id += 1
        rid = self.next_id
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self.pending[rid] = fut
        await self.session.send({**msg, "id": rid})
        return await asyncio.wait_for(fut, timeout)

    async def error(self, msg: dict[str, Any]) -> str:
        """The one-line error a request gets (it must get one)."""
        answer = await self.ask(msg)
        assert answer.get("error"), answer
        line = str(answer["error"])
        assert "\n" not in line and "Traceback" not in line, line
        return line

    async def ship(self, packed: Packed, asked_by: dict[str, Any] | None = None) -> None:
        """Ship the context, as an owner does after a reserve the member answered "context"
        (a member accepts a context only for such a reserve); `asked_by`: that reserve."""
        if (await self.ask({"t": "has", "digest": packed.digest}))["value"]:
            return
        if asked_by is not None:
            answer = await self.ask(asked_by)
            assert answer.get("value") == "context", answer
        answers: list[dict[str, Any]] = []

        async def send(m: dict[str, Any]) -> None:
            if m["last"]:
                answers.append(await self.ask(m, timeout=60))
            else:
                await self.session.send(m)

        await send_context(send, packed)
        assert answers and answers[0].get("value") is True, answers


def talk(member: Member, scenario: Callable[[Owner], Awaitable[None]]) -> None:
    """Connect as NODE, ship the context, run the scenario, hang up."""

    async def main() -> None:
        r, w = await asyncio.open_connection("127.0.0.1", member.daemon.port)
        assert member.daemon.key is not None
        me = Me(NODE, member.daemon.key, os.urandom(8).hex(), free_port())
        session, _ = await transport.client_handshake(r, w, me, "member")
        owner = Owner(session)
        tasks = [asyncio.create_task(owner.read()), asyncio.create_task(owner.beat())]
        try:
            await owner.ship(member.packed, reserve(member, 999))
            await scenario(owner)
        finally:
            for t in tasks:
                t.cancel()
            session.close()

    asyncio.run(main())


async def until(pred: Callable[[], Any], timeout: float = 15.0, what: str = "") -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.02)


def config(member: Member, **over: Any) -> dict[str, Any]:
    return {
        "name": "gang",
        "entrypoint": "python3 train.py",
        "resources": {"slots_per_trial": 2},
        "searcher": {"name": "single", "metric": "loss", "max_length": 3},
        "checkpoint_storage": {"type": "shared_fs", "host_path": str(member.shared)},
        "max_restarts": 0,
        **over,
    }


def reserve(member: Member, job: int, run: int = 1, **over: Any) -> dict[str, Any]:
    spec = {
        "experiment_id": 1,
        "trial_id": job,
        "seed": 7,
        "hparams": {},
        "config": config(member),
        "digest": member.packed.digest,
        "size": 2,
    }
    spec.update(over.pop("spec", {}))
    return {
        "t": "reserve",
        "gang": f"{NODE}:{job}",
        "run": run,
        "key": [50, time.time_ns(), NODE, job],
        "slots": 1,
        "user": submitter()[0],
        "uid": submitter()[1],
        "priority": 50,
        "name": f"trial {job}",
        "hold_s": 30.0,
        "spec": spec,
        **over,
    }


def commit(job: int, run: int = 1) -> dict[str, Any]:
    return {
        "t": "commit",
        "gang": f"{NODE}:{job}",
        "run": run,
        "node_rank": 1,
        "addrs": ["127.0.0.1", "127.0.0.1"],
        "slot_counts": [1, 1],
        "ports": {
            "C10D_PORT": free_port(),
            "INTER_TRAIN_PROCESS_COMM_PORT_1": free_port(),
            "INTER_TRAIN_PROCESS_COMM_PORT_2": free_port(),
        },
    }


def abort(job: int, run: int = 1) -> dict[str, Any]:
    return {"t": "abort", "gang": f"{NODE}:{job}", "run": run, "why": "test"}


def no_new_member_jobs(member: Member, before: list[dict[str, Any]]) -> None:
    assert member.jobs() == before


def command_reserve(job: int, command: Any, **over: Any) -> dict[str, Any]:
    return {
        "t": "reserve",
        "gang": f"{NODE}:{job}",
        "run": 1,
        "key": [50, time.time_ns(), NODE, job],
        "slots": 1,
        "user": submitter()[0],
        "uid": submitter()[1],
        "priority": 50,
        "name": f"command {job}",
        "hold_s": 30.0,
        "spec": {"command": command, "size": 1},
        **over,
    }

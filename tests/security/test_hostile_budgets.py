"""Budgets that bound cost, not only memory (issue 34, item 4).

Real users against a real root daemon (the `shared` fixture): three users at once send trial
session frames of the costliest shape within the session budget (wire/budget.py: TRIAL_SESSION),
and the issue's bomb (1 MB of empty maps, within the old budget of a million values); three users
drop 60 spool requests that cost the most to read (within SPOOL_REQUEST, and over it only at
their last values). The daemon's memory and its event loop's lag (its own probe,
run/looplag.json) stay within the issue's bounds, and a malformed frame closes its session.
"""

from __future__ import annotations

import json
import os
import re
import socket
import struct
import threading
import time
from pathlib import Path
from typing import Any

import msgpack
import psutil
import pytest

from det_local import api
from det_local.errors import DetLocalError
from det_local.sched.intake import spool
from det_local.wire import rpc
from tests.support.users import ADMIN, A, B, Shared, start_sleeping_trial

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0, reason="multi-user tests create real users: they need root"
)

MIB = 1024 * 1024


def _array(items: bytes, n: int) -> bytes:
    return b"\xdd" + struct.pack(">I", n) + items


# the bomb: {"t": "best_val", "id": 1, "pad": [[{} x 99,990] x 10]}, ~1 MB and a
# million values: within the old session budget, ~100 MB decoded
BOMB = b"\x83\xa1t\xa8best_val\xa2id\x01\xa3pad\x9a" + _array(b"\x80" * 99_990, 99_990) * 10
BOMB_REFUSED = "frame refused: message holds more than 10,000 maps and arrays (at byte 26); closed"
# the costliest frame within TRIAL_SESSION: 9,990 maps and 89,990 two-byte strings (~0.28 MB:
# a large frame, decoded off the loop), answered as best_val is
WORST = b"\x83\xa1t\xa8best_val\xa2id\x01\xa3pad" + _array(
    b"\x80" * 9_990 + b"\xa2ab" * 89_990, 9_990 + 89_990
)
# ... and under the large-read size (256 KiB): 80,000 two-byte strings (~25 ms to scan and
# decode, which must not happen on the event loop)
UNDER = b"\x83\xa1t\xa8best_val\xa2id\x01\xa3pad" + _array(b"\xa2ab" * 80_000, 80_000)


BODIES = (WORST, UNDER)


def _hello(env: dict[str, str]) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX)
    sock.connect(env["DET_LOCAL_SOCKET"])
    sock.settimeout(60)
    rpc.send(
        sock,
        {
            "t": "hello",
            "token": env["DET_LOCAL_TOKEN"],
            "trial_id": int(env["DET_TRIAL_ID"]),
            "run_id": int(env["DET_TRIAL_RUN_ID"]),
        },
    )
    answer = rpc.recv(sock)
    assert answer is not None and answer["t"] == "hello" and "error" not in answer, answer
    return sock


def _frame(body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + body


def _until_closed(sock: socket.socket) -> list[Any]:
    frames = []
    try:
        while (msg := rpc.recv(sock)) is not None:
            frames.append(msg)
    except OSError:
        pass
    sock.close()
    return frames


# ---------------------------------------------------------------------------- as each user
def flood_frames(env: dict[str, str], rounds: int) -> list[Any]:
    """Two sessions at once (a user's large reads in flight), each sending WORST and UNDER
    `rounds` times (each answered), then the bomb (refused, closed); what each session got."""
    out: list[Any] = [None, None]

    def session(i: int) -> None:
        try:
            run(i)
        except Exception as err:  # noqa: BLE001 - reported to the test
            out[i] = f"{type(err).__name__}: {err}"

    def run(i: int) -> None:
        sock = _hello(env)
        answers = []
        for _ in range(rounds):
            for body in BODIES:
                sock.sendall(_frame(body))
                answers.append(rpc.recv(sock))
        sock.close()
        bomb = _hello(env)
        try:
            bomb.sendall(_frame(BOMB))
        except OSError:
            pass
        out[i] = [answers, _until_closed(bomb)]

    threads = [threading.Thread(target=session, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def _hostile_request(user: str, strings: int) -> bytes:
    """A request of `user` whose payload is 19,990 [nil] (arrays: the scan's slow path) and
    twice `strings` two-byte strings."""
    head = msgpack.packb({"op": "no_such_op", "user": user})[1:]  # the map's two entries
    pad = b"\x93" + _array(b"\x91\xc0" * 19_990, 19_990) + _array(b"\xa2ab" * strings, strings) * 2
    return b"\x83" + head + b"\xa7payload\x81\xa3pad" + pad


def drop_hostile_requests(user: str, n: int) -> list[str]:
    """`n` requests written at once, half within SPOOL_REQUEST (99,900 values) and half over
    it only at their end; each one's answer."""
    paths = api.paths()
    ids = []
    for i in range(n):
        body = _hostile_request(user, 29_950 if i % 2 else 30_100)
        req_id = f"{time.time_ns():020d}-{os.getpid()}-hostile{i}"
        tmp = paths.queue / f".{req_id}.tmp"
        tmp.write_bytes(body)
        os.rename(tmp, paths.queue / f"{req_id}{spool.SUFFIX}")
        ids.append(req_id)
    answers = []
    for req_id in ids:
        try:
            answers.append(str(spool.wait_response(paths, req_id, timeout=120)))
        except DetLocalError as err:
            answers.append(str(err))
    return answers


def malformed(env: dict[str, str]) -> list[Any]:
    """A metrics frame whose reports are not a list: what the daemon sends, until it closes."""
    sock = _hello(env)
    rpc.send(sock, {"t": "metrics", "reports": 5})
    return _until_closed(sock)


# ---------------------------------------------------------------------------- measuring
class Peak:
    """The daemon's RSS, sampled every 10 ms from now until `stop`: its growth at the peak."""

    def __init__(self, shared: Shared) -> None:
        pid = shared.dl.daemon_pid()
        assert pid is not None
        self.proc = psutil.Process(pid)
        self.rss0 = self.peak = self.proc.memory_info().rss
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.done.is_set():
            self.peak = max(self.peak, self.proc.memory_info().rss)
            time.sleep(0.01)

    def stop(self) -> float:
        self.done.set()
        self.thread.join()
        return (self.peak - self.rss0) / MIB


class Lag:
    """The worst second of the daemon's loop lag (its probe's max_1s in run/looplag.json)
    written from now until `stop`."""

    def __init__(self, shared: Shared) -> None:
        self.path = shared.paths.run_dir / "looplag.json"
        self.start = time.time()
        self.worst = 0.0
        self.seconds = 0
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        seen = None
        while not self.done.is_set():
            try:
                data = json.loads(self.path.read_text())
                if data["at"] != seen and data["at"] >= self.start:
                    seen = data["at"]
                    self.seconds += 1
                    self.worst = max(self.worst, float(data["max_1s"]))
            except (OSError, ValueError, KeyError):
                pass
            time.sleep(0.05)

    def stop(self) -> tuple[float, int]:
        time.sleep(1.2)  # the probe's figures for the last second
        self.done.set()
        self.thread.join()
        return self.worst, self.seconds


def _at_once(shared: Shared, calls: list[tuple[str, Any, tuple[Any, ...]]]) -> list[Any]:
    """shared.as_user(user, fn, *args) for each call, all at once; their values in order."""
    out: list[Any] = [None] * len(calls)

    def one(i: int) -> None:
        user, fn, args = calls[i]
        out[i] = shared.as_user(user, fn, *args)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


# ---------------------------------------------------------------------------- the tests
@pytest.mark.cpu_slots(3)
def test_three_users_frames_within_budget_cost_the_daemon_little(shared: Shared) -> None:
    users = (A, B, ADMIN)
    envs = {
        u: start_sleeping_trial(shared, u, f"frames-{i}", {"metric": "loss"})["env"]
        for i, u in enumerate(users)
    }
    peak, lag = Peak(shared), Lag(shared)
    seen = _at_once(shared, [(u, flood_frames, (envs[u], 3)) for u in users])
    grown = peak.stop()
    worst, seconds = lag.stop()
    for user, sessions in zip(users, seen, strict=True):
        assert all(isinstance(x, list) for x in sessions), (user, sessions)
        for answers, bomb in sessions:
            assert answers == [{"t": "reply", "id": 1, "value": None}] * 3 * len(BODIES), user
            assert bomb == [{"t": "refused", "error": BOMB_REFUSED}], user
    assert grown <= 50, f"the daemon grew by {grown:.1f} MB"
    assert seconds >= 1 and worst <= 100, f"the event loop lagged {worst:.1f} ms"
    log = (shared.paths.run_dir / "daemon.log").read_text()
    assert f"trial socket: refused frame from {B}" in log and BOMB_REFUSED in log


def test_sixty_costly_spool_requests_from_three_users_keep_the_loop_free(
    shared: Shared,
) -> None:
    users = (A, B, ADMIN)
    lag = Lag(shared)
    answers = _at_once(shared, [(u, drop_hostile_requests, (u, 20)) for u in users])
    worst, seconds = lag.stop()
    for user, said in zip(users, answers, strict=True):
        for i, answer in enumerate(said):
            if i % 2:
                assert "unknown request 'no_such_op' in " in answer, (user, answer)
            else:
                assert re.fullmatch(
                    r"request \S+\.req refused: message holds more than 100,000 values \(at "
                    r"byte 220,\d{3}\); submit it with the det-local CLI",
                    answer,
                ), (user, answer)
    assert seconds >= 1, "the loop-lag probe wrote nothing meanwhile"
    assert worst <= 100, f"the event loop lagged {worst:.1f} ms"


def test_a_malformed_frame_is_refused_in_one_line_and_closes_its_session(
    shared: Shared,
) -> None:
    bob = start_sleeping_trial(shared, B, "malformed", {"metric": "loss"})
    frames = shared.as_user(B, malformed, bob["env"])
    why = "frame refused: malformed 'metrics' message (TypeError: reports must be a list); closed"
    assert frames == [{"t": "refused", "error": why}]
    log = Path(shared.paths.run_dir / "daemon.log").read_text()
    assert f"trial socket: refused frame from {B} (uid" in log and why in log

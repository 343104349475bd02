"""The dashboard's bounds, against a real `det-local dashboard` process: live streams per client
and in all (503 and one line beyond them, pages still answered quickly), SQLite handles (one
pool: a bounded number however many requests come; counted in /proc/PID/fd), and ids no row
can have (404, not 500)."""

from __future__ import annotations

import json
import os
import socket
import statistics
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("uvicorn", reason="the dashboard needs the web extra")

from det_local.store.db import Store  # noqa: E402
from det_local.store.paths import Paths  # noqa: E402
from det_local.web import live, pool  # noqa: E402
from tests.support.dashboard import Server, World, make_world, serve  # noqa: E402
from tests.support.world import wait_for  # noqa: E402


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> World:
    return make_world(tmp_path_factory.mktemp("dash-limits"), dict(os.environ))


@pytest.fixture(scope="module")
def trial(world: World) -> int:
    """A trial that stays ACTIVE (nothing runs it: its stream never ends by itself)."""
    store = Store(Paths(world.home).db)
    try:
        exp = store.create_experiment(name="open", config={"searcher": {"name": "single"}})
        return int(store.create_trial(exp, hparams={"lr": 0.1}, seed=0))
    finally:
        store.close()


@pytest.fixture(scope="module")
def server(world: World, trial: int) -> Iterator[Server]:
    yield from serve(world)


def open_stream(server: Server, path: str, source: str) -> tuple[socket.socket, int, bytes]:
    """A GET of a stream from the loopback address `source`: (the socket, left open, its
    status, what came after the headers so far, or the whole body of a refusal)."""
    host, port = server.base.removeprefix("http://").rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=30, source_address=(source, 0))
    request = (
        f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\n"
        f"Authorization: Bearer {server.token}\r\n\r\n"
    )
    sock.sendall(request.encode())
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(4096)
        assert chunk, data
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    if status != 200:
        length = int(
            next(
                ln for ln in head.split(b"\r\n") if ln.lower().startswith(b"content-length")
            ).split(b":")[1]
        )
        while len(rest) < length:
            rest += sock.recv(4096)
        sock.close()
    return sock, status, rest


def page_ms(server: Server, path: str = "/") -> float:
    t0 = time.perf_counter()
    status, _, _ = server.get(path)
    assert status == 200
    return (time.perf_counter() - t0) * 1000


def test_streams_are_capped_per_client_and_in_all(server: Server, trial: int) -> None:
    path = f"/api/trials/{trial}/stream"
    quiet = statistics.median(page_ms(server) for _ in range(5))
    held: list[socket.socket] = []
    try:
        for _ in range(live.PER_CLIENT):
            sock, status, _ = open_stream(server, path, "127.0.0.1")
            assert status == 200
            held.append(sock)
        _, status, body = open_stream(server, path, "127.0.0.1")
        assert status == 503 and b"\n" not in body, body
        assert json.loads(body)["error"] == (
            f"too many live streams from 127.0.0.1: {live.PER_CLIENT} are open (the most one "
            "client may hold); close some dashboard pages and reload"
        )
        clients = [f"127.0.0.{i}" for i in range(2, 2 + live.TOTAL // live.PER_CLIENT)]
        for source in clients[:-1]:
            for _ in range(live.PER_CLIENT):
                sock, status, _ = open_stream(server, path, source)
                assert status == 200, source
                held.append(sock)
        assert len(held) == live.TOTAL
        _, status, body = open_stream(server, path, clients[-1])  # a client with none open
        assert status == 503 and json.loads(body)["error"] == (
            f"too many live streams: {live.TOTAL} are open (the most this dashboard serves); "
            "reload later"
        )

        # a flood beyond the caps: each refused at once, and pages are answered meanwhile
        def refused(i: int) -> int:
            return open_stream(server, path, f"127.0.1.{i % 200 + 1}")[1]

        with ThreadPoolExecutor(16) as ex:
            flood = list(ex.map(refused, range(400)))
        assert set(flood) == {503}, flood
        busy = statistics.median(page_ms(server) for _ in range(5))
        assert busy < max(1000.0, 10 * quiet), (busy, quiet)
    finally:
        for sock in held:
            sock.close()

    # the places are given back when the clients go
    def accepted() -> bool:
        sock, status, _ = open_stream(server, path, "127.0.0.1")
        sock.close()
        return status == 200

    wait_for(accepted, timeout=30, what="a stream to be accepted again")


def db_handles(pid: int, db: Path) -> dict[str, int]:
    """Open descriptors of `pid` on the database and its WAL."""
    out = {"db": 0, "wal": 0, "all": 0}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        out["all"] += 1
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target == str(db):
            out["db"] += 1
        elif target == f"{db}-wal":
            out["wal"] += 1
    return out


def test_sqlite_handles_are_pooled(world: World, server: Server, trial: int) -> None:
    paths = [
        "/",
        "/api/experiments",
        "/api/experiments/1",
        f"/api/trials/{trial}",
        f"/api/trials/{trial}/logs",
        f"/api/trials/{trial}/metrics",
        "/api/experiments/1/metrics",
        f"/trials/{trial}",
        "/experiments/1",
    ]

    def hit(i: int) -> int:
        req = urllib.request.Request(
            server.base + paths[i % len(paths)],
            headers={"Authorization": f"Bearer {server.token}"},
        )
        with urllib.request.urlopen(req, timeout=60) as r:
            r.read()
            return int(r.status)

    db = Paths(world.home).db.resolve()
    rounds = []
    for _ in range(3):
        with ThreadPoolExecutor(24) as ex:
            assert set(ex.map(hit, range(300))) == {200}
        rounds.append(db_handles(server.proc.pid, db))
    for r in rounds:
        assert 1 <= r["db"] <= pool.THREADS and r["wal"] <= pool.THREADS, rounds
    assert rounds[-1]["all"] <= rounds[0]["all"] + 5, rounds  # nothing piles up


@pytest.mark.parametrize(
    ("path", "status", "fragment"),
    [
        ("/api/trials/99999999999999999999999", 404, "no trial id is that large"),
        ("/api/trials/9223372036854775808", 404, "no trial id is that large"),
        ("/api/trials/9223372036854775807", 404, "trial 9223372036854775807 not found"),
        ("/api/experiments/18446744073709551616/metrics", 404, "no experiment id is that large"),
        ("/api/experiments/99999999999999999999/stream", 404, "no experiment id is that large"),
        ("/api/trials/99999999999999999999/stream", 404, "no trial id is that large"),
        ("/api/trials/99999999999999999999/logs/raw", 404, "no trial id is that large"),
        ("/api/trials/\u00b2", 404, "trial ids are whole numbers"),
        ("/api/trials/1/logs?offset=99999999999999999999999", 400, "is too large"),
        ("/api/trials/1/stream?metrics=9223372036854775808", 400, "is too large"),
        ("/api/trials/1/logs?tail=-1", 400, "must be 0 or more"),
    ],
)
def test_ids_out_of_range(server: Server, path: str, status: int, fragment: str) -> None:
    got, body, headers = server.get(urllib.request.quote(path, safe="/?=&"))
    assert got == status, body
    error = json.loads(body)["error"]
    assert fragment in error and "\n" not in error, error


@pytest.mark.parametrize(
    "path",
    [
        "/experiments/99999999999999999999999",
        "/trials/99999999999999999999999",
        "/experiments/99999999999999999999999/hparams",
        "/compare?ids=99999999999999999999999",
    ],
)
def test_pages_of_ids_out_of_range(server: Server, path: str) -> None:
    got, body, _ = server.get(path)
    assert got == 404, body
    assert b"is that large" in body


def test_pool_reopens_when_the_database_appears(tmp_path: Path) -> None:
    """One Store per thread, reused; an empty home's Store is replaced once the database has
    its tables; the Stores of threads that ended are closed."""
    import threading

    paths = Paths(tmp_path / "home")
    stores = pool.StorePool(paths)
    empty = stores.get()
    assert empty.list_experiments() == [] and stores.get().list_experiments() == []
    writer = Store(paths.db)
    try:
        writer.create_experiment(name="x", config={})
        found = stores.get()
        assert found is not empty and len(found.list_experiments()) == 1
        assert stores.get() is found  # reused
        writer.create_experiment(name="y", config={})
        assert len(stores.get().list_experiments()) == 2  # a long-lived reader sees new rows
        other = threading.Thread(target=stores.get)
        other.start()
        other.join()
        assert stores.size() == 2
        stores.swept -= pool.SWEEP_S
        stores.get()  # the ended thread's Store is closed (looked for once a second)
        assert stores.size() == 1
    finally:
        stores.close()
        writer.close()

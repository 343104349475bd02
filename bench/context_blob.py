"""Shipping a context snapshot to a peer (federate/blobs.py), over loopback TCP.

A 50 MiB context (5 random 8 MiB files and 2,000 random 5 KiB files: 10 MiB of source) is
packed, sent as blob messages over an authenticated link (mutual HMAC handshake, MAC'd and
sequenced frames) to a peer in another process, which checks each message's schema,
receives, verifies the sha256 and extracts into its ContextCache, then replies.

- pack_s: pack_context (deterministic tar + sha256) of the tree.
- ship_s / ship_mib_s: from the first blob sent to the peer's reply after its extraction;
  MiB/s of the tar's size.
- verify_extract_s: of ship_s, the peer's sha256 check and extraction after the last chunk.
- wire_mib_s: MiB/s of ship_s less verify_extract_s (the link, MACs, schema, chunk writes).
- raw_tcp_mib_s (anchor, same run): the same tar bytes over a plain loopback socket into a
  file in the peer process (no MAC, no msgpack, no check, no extraction).
- gnu_tar_x_s (anchor, same run): `tar -xf` of the same tar into a fresh directory.

Both processes share this machine's cores with whatever else runs: read times as upper
bounds. Each figure is the median of --runs rounds. The last line printed is one JSON object.

Usage: python3 bench/context_blob.py [--runs 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from det_local.federate import keys, schema, transport  # noqa: E402
from det_local.federate.blobs import ContextCache, pack_context, send_context  # noqa: E402
from det_local.federate.transport import Me  # noqa: E402

MiB = 1024 * 1024


def make_context(root: Path) -> None:
    root.mkdir(parents=True)
    for i in range(5):
        (root / f"weights{i}.bin").write_bytes(os.urandom(8 * MiB))
    for i in range(2000):
        sub = root / "src" / f"m{i // 100:02d}"
        sub.mkdir(parents=True, exist_ok=True)
        (sub / f"f{i}.py").write_bytes(os.urandom(5 * 1024))


def peer(key: bytes, cache_root: str, conn: mp.connection.Connection) -> None:
    """The receiving daemon's side: accept one authenticated link, receive, reply."""

    async def main() -> None:
        cache = ContextCache(Path(cache_root))
        me = Me("peer", key, os.urandom(8).hex(), 47800)
        done = asyncio.get_running_loop().create_future()

        async def on_connect(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            session = (await transport.server_handshake(r, w, me, "owner", set())).admit()
            while True:
                msg = await session.recv()
                problem = schema.check(msg)
                if problem:
                    raise SystemExit(problem)
                t0 = time.perf_counter()
                got = cache.receive(
                    msg["digest"], msg["off"], msg["total"], msg["data"], msg["last"]
                )
                if msg["last"]:
                    value = [str(got), time.perf_counter() - t0]
                    await session.send({"t": "reply", "id": 1, "value": value})
                    await session.writer.drain()
                    done.set_result(None)
                    return

        server = await asyncio.start_server(on_connect, "127.0.0.1", 0)
        conn.send(server.sockets[0].getsockname()[1])
        await done
        server.close()

    asyncio.run(main())


def raw_peer(path: str, conn: mp.connection.Connection) -> None:
    with socket.create_server(("127.0.0.1", 0)) as srv:
        conn.send(srv.getsockname()[1])
        s, _ = srv.accept()
        with s, open(path, "wb") as out:
            while data := s.recv(MiB):
                out.write(data)
        conn.send("done")


def ship_once(packed_path: Path, digest: str, size: int, work: Path) -> tuple[float, float]:
    from det_local.federate.blobs import Packed

    key = keys.new_key()
    cache_root = work / "cache"
    shutil.rmtree(cache_root, ignore_errors=True)
    parent, child = mp.Pipe()
    proc = mp.get_context("fork").Process(target=peer, args=(key, str(cache_root), child))
    proc.start()
    port = parent.recv()

    async def main() -> tuple[float, float]:
        r, w = await asyncio.open_connection("127.0.0.1", port)
        session, _ = await transport.client_handshake(
            r, w, Me("owner", key, os.urandom(8).hex(), 47801), "peer"
        )
        t0 = time.perf_counter()
        await send_context(session.send, Packed(digest, packed_path, size))
        await session.writer.drain()
        reply = await session.recv()
        elapsed = time.perf_counter() - t0
        assert reply["t"] == "reply" and Path(reply["value"][0]).is_dir(), reply
        session.close()
        return elapsed, float(reply["value"][1])

    elapsed = asyncio.run(main())
    proc.join(30)
    return elapsed


def raw_once(packed_path: Path, work: Path) -> float:
    parent, child = mp.Pipe()
    target = work / "raw.tar"
    proc = mp.get_context("fork").Process(target=raw_peer, args=(str(target), child))
    proc.start()
    port = parent.recv()
    with socket.create_connection(("127.0.0.1", port)) as s:
        t0 = time.perf_counter()
        with open(packed_path, "rb") as f:
            s.sendfile(f)
        s.shutdown(socket.SHUT_WR)
        assert parent.recv() == "done"
        elapsed = time.perf_counter() - t0
    proc.join(30)
    target.unlink()
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="dl-blob-bench-") as tmp:
        work = Path(tmp)
        make_context(work / "ctx")
        packs, ships, extracts, raws, untars = [], [], [], [], []
        packed = None
        for _ in range(args.runs):
            shutil.rmtree(work / "out", ignore_errors=True)
            t0 = time.perf_counter()
            packed = pack_context(work / "ctx", work / "out")
            packs.append(time.perf_counter() - t0)
            ship, extract = ship_once(packed.path, packed.digest, packed.size, work)
            ships.append(ship)
            extracts.append(extract)
            raws.append(raw_once(packed.path, work))
            dest = work / "untar"
            shutil.rmtree(dest, ignore_errors=True)
            dest.mkdir()
            t0 = time.perf_counter()
            subprocess.run(["tar", "-xf", str(packed.path), "-C", str(dest)], check=True)
            untars.append(time.perf_counter() - t0)
        assert packed is not None
        mib = packed.size / MiB
        ship = statistics.median(ships)
        wires = [s - e for s, e in zip(ships, extracts, strict=True)]
        result = {
            "context_mib": round(mib, 1),
            "pack_s": round(statistics.median(packs), 3),
            "ship_s": round(ship, 3),
            "ship_mib_s": round(mib / ship, 1),
            "verify_extract_s": round(statistics.median(extracts), 3),
            "wire_mib_s": round(mib / statistics.median(wires), 1),
            "raw_tcp_mib_s": round(mib / statistics.median(raws), 1),
            "gnu_tar_x_s": round(statistics.median(untars), 3),
            "runs": args.runs,
        }
        print(json.dumps(result))


if __name__ == "__main__":
    main()

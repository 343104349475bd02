"""Context snapshots shipped to a peer by digest (federate/blobs.py): packed deterministically,
sent over a real authenticated link on loopback TCP, received, checked and extracted. Every
hostile input is refused in one line and leaves no file behind."""

from __future__ import annotations

import asyncio
import hashlib
import io
import os
import shutil
import socket
import stat
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest

from det_local.errors import ContextError, DetLocalError
from det_local.federate import keys, schema, transport
from det_local.federate.blobs import (
    MAX_CHUNK,
    ContextCache,
    Packed,
    pack_context,
    send_context,
    tar_cap,
)
from det_local.federate.transport import Me, Session
from det_local.federate.untar import BlobError
from det_local.store.context import MAX_CONTEXT_BYTES

MiB = 1024 * 1024


def make_tree(root: Path, big: int = 0) -> Path:
    (root / "pkg" / "sub").mkdir(parents=True)
    (root / "empty").mkdir()
    (root / "train.py").write_text("print('hello')\n")
    (root / "pkg" / "__init__.py").write_text("")
    (root / "pkg" / "sub" / "model.py").write_text("X = 1\n" * 100)
    (root / "startup-hook.sh").write_text("#!/bin/sh\necho hook\n")
    os.chmod(root / "startup-hook.sh", 0o700)
    (root / "data.bin").write_bytes(os.urandom(big or 3 * MAX_CHUNK + 12345))
    return root


def tree(root: Path) -> dict[str, tuple[str, int, bytes]]:
    """name -> (kind, permission bits, content) for everything under root."""
    out: dict[str, tuple[str, int, bytes]] = {}
    for path in sorted(root.rglob("*")):
        st = path.lstat()
        rel = str(path.relative_to(root))
        if stat.S_ISDIR(st.st_mode):
            out[rel] = ("dir", stat.S_IMODE(st.st_mode), b"")
        else:
            out[rel] = ("file", stat.S_IMODE(st.st_mode), path.read_bytes())
    return out


def leftovers(cache: ContextCache) -> list[str]:
    """Everything under the cache root but its empty .incoming directory."""
    return sorted(str(p.relative_to(cache.root)) for p in cache.root.rglob("*"))[1:] + [
        f"incoming:{p.name}" for p in cache.incoming.iterdir()
    ]


def chunks(data: bytes, size: int = MAX_CHUNK) -> Iterator[tuple[int, bytes, bool]]:
    for off in range(0, len(data), size):
        part = data[off : off + size]
        yield off, part, off + len(part) == len(data)


def feed(cache: ContextCache, data: bytes, digest: str | None = None) -> Path | None:
    digest = digest or hashlib.sha256(data).hexdigest()
    result = None
    for off, part, last in chunks(data):
        result = cache.receive(digest, off, len(data), part, last)
    return result


def refused(err: pytest.ExceptionInfo[BlobError], *fragments: str) -> str:
    text = str(err.value)
    assert "\n" not in text and isinstance(err.value, DetLocalError)
    for f in fragments:
        assert f in text, (f, text)
    return text


# -- a real authenticated link on loopback --------------------------------------------------


async def link(key: bytes) -> tuple[Session, Session, asyncio.Server]:
    """(owner side, peer side, the peer's server), after the mutual HMAC handshake."""
    accepted: asyncio.Future[Session] = asyncio.get_running_loop().create_future()
    peer = Me("peer", key, os.urandom(8).hex(), 47800)

    async def on_connect(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        pending = await transport.server_handshake(r, w, peer, "owner", set())
        accepted.set_result(pending.admit())

    server = await asyncio.start_server(on_connect, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    r, w = await asyncio.open_connection("127.0.0.1", port)
    owner = Me("owner", key, os.urandom(8).hex(), 47801)
    client, hello = await transport.client_handshake(r, w, owner, "peer")
    assert hello.node == "peer"
    return client, await asyncio.wait_for(accepted, 10), server


async def ship(packed: Packed, cache: ContextCache) -> tuple[Path, int]:
    """Send `packed` over a fresh link; the peer checks each message's schema and receives
    it. The extracted directory, and how many messages it took."""
    owner, peer, server = await link(keys.new_key())

    async def serve() -> tuple[Path, int]:
        count = 0
        while True:
            msg = await peer.recv()
            assert schema.check(msg) is None, schema.check(msg)
            count += 1
            got = cache.receive(msg["digest"], msg["off"], msg["total"], msg["data"], msg["last"])
            if msg["last"]:
                assert got is not None
                return got, count

    receiving = asyncio.create_task(serve())
    await send_context(owner.send, packed)
    await owner.writer.drain()
    try:
        return await asyncio.wait_for(receiving, 60)
    finally:
        owner.close()
        peer.close()
        server.close()


def test_round_trip_over_an_authenticated_link(tmp_path: Path) -> None:
    src = make_tree(tmp_path / "src")
    packed = pack_context(src, tmp_path / "out")
    assert packed.path == tmp_path / "out" / f"{packed.digest}.tar"
    assert packed.size == packed.path.stat().st_size
    assert hashlib.sha256(packed.path.read_bytes()).hexdigest() == packed.digest
    assert [p.name for p in (tmp_path / "out").iterdir()] == [packed.path.name]  # no temp
    cache = ContextCache(tmp_path / "cache")
    assert cache.has(packed.digest) is None

    got, messages = asyncio.run(ship(packed, cache))

    assert got == cache.root / packed.digest
    assert messages == -(-packed.size // MAX_CHUNK) >= 4
    want, have = tree(src), tree(got)
    assert sorted(have) == sorted(want)
    for name, (kind, _, content) in want.items():
        assert have[name][0] == kind and have[name][2] == content, name
    # exec bits kept, modes normalised for every user, owned by the daemon's user
    assert have["startup-hook.sh"][1] == 0o755
    assert have["train.py"][1] == 0o644 and have["pkg"][1] == have["empty"][1] == 0o755
    assert stat.S_IMODE(got.stat().st_mode) == 0o755
    assert stat.S_IMODE(cache.root.stat().st_mode) == 0o755
    assert {p.stat().st_uid for p in [got, *got.rglob("*")]} == {os.geteuid()}
    assert leftovers(cache) == [packed.digest] + [
        str(p.relative_to(cache.root)) for p in sorted(got.rglob("*"))
    ]
    # the cache hit: the next trial needs no transfer
    assert cache.has(packed.digest) == got
    assert ContextCache(cache.root).has(packed.digest) == got  # and after a daemon restart


def test_pack_is_deterministic(tmp_path: Path) -> None:
    a = make_tree(tmp_path / "a")
    first = pack_context(a, tmp_path / "out")
    again = pack_context(a, tmp_path / "out")
    assert again == first
    # the same tree elsewhere, other times, another owner, other mode bits (same exec bit)
    b = tmp_path / "b"
    shutil.copytree(a, b)
    os.utime(b / "train.py", (1, 1))
    os.chown(b / "train.py", 1234, 5678)
    os.chmod(b / "train.py", 0o600)
    os.chmod(b / "startup-hook.sh", 0o751)
    assert pack_context(b, tmp_path / "out2").digest == first.digest
    with tarfile.open(first.path) as tar:
        members = tar.getmembers()
    assert [m.name for m in members] == sorted(m.name for m in members)
    assert {(m.mtime, m.uid, m.gid, m.uname, m.gname) for m in members} == {(0, 0, 0, "", "")}
    # a changed byte or a lost exec bit is another context
    (b / "pkg" / "sub" / "model.py").write_text("X = 2\n" * 100)
    changed = pack_context(b, tmp_path / "out2").digest
    assert changed != first.digest
    os.chmod(b / "startup-hook.sh", 0o644)
    assert pack_context(b, tmp_path / "out2").digest not in (first.digest, changed)


def test_pack_reads_through_links_inside_the_tree(tmp_path: Path) -> None:
    src = make_tree(tmp_path / "src")
    os.symlink("train.py", src / "alias.py")
    os.symlink("pkg", src / "pkg_link")
    packed = pack_context(src, tmp_path / "out")
    with tarfile.open(packed.path) as tar:
        kinds = {m.name: m.type for m in tar.getmembers()}
    assert kinds["alias.py"] == tarfile.REGTYPE and kinds["pkg_link"] == tarfile.DIRTYPE
    assert kinds["pkg_link/sub/model.py"] == tarfile.REGTYPE


def test_pack_refusals(tmp_path: Path) -> None:
    def refusal(src: Path, *fragments: str, **kw: Any) -> None:
        out = tmp_path / "out"
        with pytest.raises(ContextError) as err:
            pack_context(src, out, **kw)
        text = str(err.value)
        assert "\n" not in text and str(src) in text
        for f in fragments:
            assert f in text, (f, text)
        assert not out.exists() or list(out.iterdir()) == []  # no temp tar left

    src = make_tree(tmp_path / "big", big=3 * MiB)
    refusal(src, "is 3.0 MiB, over the 2.0 MiB limit", max_bytes=2 * MiB)
    refusal(src, "over 3 files and directories", max_files=3)
    outside = make_tree(tmp_path / "outside")
    os.symlink("/etc/passwd", outside / "passwd")
    refusal(outside, "passwd is a symbolic link to /etc/passwd, outside the tree")
    dangling = make_tree(tmp_path / "dangling")
    os.symlink("missing.py", dangling / "gone.py")
    refusal(dangling, "gone.py is a symbolic link to missing.py")
    loop = make_tree(tmp_path / "loop")
    os.symlink("..", loop / "pkg" / "up")
    refusal(loop, "pkg/up is a symbolic link to its own directory or a parent")
    fifo = make_tree(tmp_path / "fifo")
    os.mkfifo(fifo / "pipe")
    refusal(fifo, "pipe is a FIFO; a context holds regular files and directories only")
    sock_dir = make_tree(tmp_path / "sock")
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(sock_dir / "s.sock"))
        refusal(sock_dir, "s.sock is a socket")
    if os.geteuid() == 0:
        dev = make_tree(tmp_path / "dev")
        os.mknod(dev / "null", 0o600 | stat.S_IFCHR, os.makedev(1, 3))
        refusal(dev, "null is a device file")


# -- the receiving side under attack ------------------------------------------------------


def test_flipped_byte_is_refused_and_nothing_is_left(tmp_path: Path) -> None:
    packed = pack_context(make_tree(tmp_path / "src"), tmp_path / "out")
    data = bytearray(packed.path.read_bytes())
    data[len(data) // 2] ^= 1
    cache = ContextCache(tmp_path / "cache")
    with pytest.raises(BlobError) as err:
        feed(cache, bytes(data), packed.digest)
    refused(err, f"blob {packed.digest[:12]}: the ", "not " + packed.digest[:12], "send it again")
    assert err.value.code == "digest"
    assert leftovers(cache) == [] and cache.has(packed.digest) is None and cache.active() == []


def test_chunks_out_of_order_are_refused(tmp_path: Path) -> None:
    data = pack_context(make_tree(tmp_path / "src"), tmp_path / "out").path.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    cache = ContextCache(tmp_path / "cache")
    parts = list(chunks(data))
    cache.receive(digest, 0, len(data), parts[0][1], False)
    assert (cache.incoming / f"{digest}.part").exists() and cache.active() == [digest]
    with pytest.raises(BlobError) as err:
        cache.receive(digest, parts[2][0], len(data), parts[2][1], False)  # chunk 1 skipped
    due = f"at offset {parts[2][0]} where {MAX_CHUNK} was due (out of order)"
    refused(err, due, "send it again from offset 0")
    assert leftovers(cache) == [] and cache.active() == []
    # the transfer is gone: a later chunk is not taken either
    with pytest.raises(BlobError) as err:
        cache.receive(digest, parts[1][0], len(data), parts[1][1], False)
    refused(err, "a transfer that is not under way; send it again from offset 0")
    assert err.value.code == "order"


@pytest.mark.parametrize(
    "total, size, last, needle",
    [
        (MAX_CHUNK + 101, 50, False, "the total changed from 1047652 to 1047653 bytes"),
        (MAX_CHUNK + 100, 200, True, "a chunk ending at 1047752, past the total of 1047652"),
        (MAX_CHUNK + 100, 50, True, "a chunk ending at 1047602 of 1047652 bytes marked last"),
        (MAX_CHUNK + 100, 100, False, "ending at 1047652 of 1047652 bytes not marked last"),
        (MAX_CHUNK + 100, 0, False, "an empty chunk"),
    ],
)
def test_inconsistent_chunks_are_refused(
    tmp_path: Path, total: int, size: int, last: bool, needle: str
) -> None:
    data = os.urandom(MAX_CHUNK + 100)
    digest = hashlib.sha256(data).hexdigest()
    cache = ContextCache(tmp_path / "cache")
    cache.receive(digest, 0, len(data), data[:MAX_CHUNK], False)
    with pytest.raises(BlobError) as err:
        cache.receive(digest, MAX_CHUNK, total, os.urandom(size), last)
    refused(err, needle, "send it again from offset 0")
    assert leftovers(cache) == [] and cache.active() == []


def test_sizes_and_digests_out_of_range(tmp_path: Path) -> None:
    cache = ContextCache(tmp_path / "cache", max_bytes=MiB)
    digest = "ab" * 32
    with pytest.raises(BlobError) as err:
        cache.receive(digest, 0, 2 * MiB + 1, b"x", False)
    refused(err, f"blob {digest[:12]}: a context of 2.0 MiB is over the 2.0 MiB limit")
    assert err.value.code == "size"
    with pytest.raises(BlobError) as err:
        cache.receive(digest, 0, MiB, b"x" * (MiB + 1), False)
    refused(err, "a chunk must be at most 1048576 bytes")
    for bad in ["AB" * 32, "ab" * 31, "../../etc/passwd" + "a" * 48, 7]:
        with pytest.raises(BlobError) as err:
            cache.receive(bad, 0, 10, b"x", False)  # type: ignore[arg-type]
        refused(err, "is not 64 lowercase hex characters")
        with pytest.raises(BlobError):
            cache.has(bad)  # type: ignore[arg-type]
    with pytest.raises(BlobError) as err:
        cache.receive(digest, True, 10, b"x", False)
    refused(err, "of the wrong type")
    assert leftovers(cache) == []


def hostile_tar(add: Any) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        ok = tarfile.TarInfo("ok.py")
        ok.size = 3
        tar.addfile(ok, io.BytesIO(b"ok\n"))
        add(tar)
    return buf.getvalue()


def member(name: str, kind: bytes = tarfile.REGTYPE, data: bytes = b"", **kw: Any) -> Any:
    def add(tar: tarfile.TarFile) -> None:
        info = tarfile.TarInfo(name)
        info.type = kind
        info.size = len(data)
        for k, v in kw.items():
            setattr(info, k, v)
        tar.addfile(info, io.BytesIO(data) if data else None)

    return add


def twice(name: str) -> Any:
    def add(tar: tarfile.TarFile) -> None:
        member(name, data=b"1")(tar)
        member(name, data=b"2")(tar)

    return add


@pytest.mark.parametrize(
    "add, needle",
    [
        (member("../x", data=b"x"), "member '../x' climbs out with '..'"),
        (member("a/../../x", data=b"x"), "member 'a/../../x' climbs out"),
        (member("/etc/cron.d/x", data=b"x"), "member '/etc/cron.d/x' has an absolute path"),
        (member("link", tarfile.SYMTYPE, linkname="/etc/passwd"), "'link' is a symbolic link"),
        (member("hard", tarfile.LNKTYPE, linkname="ok.py"), "'hard' is a hard link"),
        (member("null", tarfile.CHRTYPE, devmajor=1, devminor=3), "'null' is a device file"),
        (member("sda", tarfile.BLKTYPE, devmajor=8), "'sda' is a device file"),
        (member("pipe", tarfile.FIFOTYPE), "'pipe' is a FIFO"),
        (member("./x", data=b"x"), "has an empty, '.' or NUL path component"),
        (member("a" * 256, data=b"x"), "has a name over 255 bytes"),
        (twice("dup.py"), "member 'dup.py' appears twice"),
        (member("ok.py/inner", data=b"x"), "lies under the file 'ok.py'"),
        (member("big", data=b"x" * (64 * 1024 + 1)), "its files total over 64.0 KiB"),
    ],
)
def test_hostile_tars_are_refused(tmp_path: Path, add: Any, needle: str) -> None:
    data = hostile_tar(add)
    cache = ContextCache(tmp_path / "cache", max_bytes=64 * 1024)
    with pytest.raises(BlobError) as err:
        feed(cache, data)
    digest = hashlib.sha256(data).hexdigest()
    refused(err, f"blob {digest[:12]}: ", needle, "the context is refused")
    assert leftovers(cache) == [] and cache.has(digest) is None
    assert not (tmp_path / "x").exists() and not (tmp_path / "cache" / "x").exists()


def test_many_files_and_not_a_tar(tmp_path: Path) -> None:
    def many(tar: tarfile.TarFile) -> None:
        for i in range(5):
            member(f"f{i}", data=b"x")(tar)

    cache = ContextCache(tmp_path / "cache", max_files=4)
    with pytest.raises(BlobError) as err:
        feed(cache, hostile_tar(many))
    refused(err, "over 4 files and directories")
    with pytest.raises(BlobError) as err:
        feed(cache, b"\x01" * 2048)
    refused(err, "not a valid tar")
    assert err.value.code == "tar" and leftovers(cache) == []


def test_more_than_max_transfers_is_refused(tmp_path: Path) -> None:
    cache = ContextCache(tmp_path / "cache", max_transfers=2)
    blobs = [hostile_tar(member(f"f{i}", data=os.urandom(MAX_CHUNK))) for i in range(3)]
    assert all(MAX_CHUNK < len(b) < 2 * MAX_CHUNK for b in blobs)
    digests = [hashlib.sha256(b).hexdigest() for b in blobs]
    for blob, digest in zip(blobs[:2], digests[:2], strict=True):
        cache.receive(digest, 0, len(blob), blob[:MAX_CHUNK], False)
    with pytest.raises(BlobError) as err:
        cache.receive(digests[2], 0, len(blobs[2]), blobs[2][:MAX_CHUNK], False)
    refused(err, f"blob {digests[2][:12]}: 2 context transfers already under way (at most 2)")
    assert err.value.code == "busy" and cache.active() == sorted(digests[:2])
    assert not (cache.incoming / f"{digests[2]}.part").exists()
    # a restart of one of them takes its own place, not a new one
    cache.receive(digests[0], 0, len(blobs[0]), blobs[0][:MAX_CHUNK], False)
    assert cache.active() == sorted(digests[:2])
    # one finishing frees a place
    done = cache.receive(digests[1], MAX_CHUNK, len(blobs[1]), blobs[1][MAX_CHUNK:], True)
    assert done is not None and (done / "f1").stat().st_size == MAX_CHUNK
    cache.receive(digests[2], 0, len(blobs[2]), blobs[2][:MAX_CHUNK], False)
    assert cache.active() == sorted([digests[0], digests[2]])


def test_a_silent_transfer_gives_its_place(tmp_path: Path) -> None:
    cache = ContextCache(tmp_path / "cache", max_transfers=1, idle_s=0.0)
    a, b = os.urandom(2 * MAX_CHUNK), os.urandom(2 * MAX_CHUNK)
    da, db = hashlib.sha256(a).hexdigest(), hashlib.sha256(b).hexdigest()
    cache.receive(da, 0, len(a), a[:MAX_CHUNK], False)
    cache.receive(db, 0, len(b), b[:MAX_CHUNK], False)
    assert cache.active() == [db] and not (cache.incoming / f"{da}.part").exists()


def test_abandon_and_restart_clean_up(tmp_path: Path) -> None:
    data = pack_context(make_tree(tmp_path / "src"), tmp_path / "out").path.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    cache = ContextCache(tmp_path / "cache")
    part = cache.incoming / f"{digest}.part"
    cache.receive(digest, 0, len(data), data[:MAX_CHUNK], False)
    assert part.stat().st_size == MAX_CHUNK and stat.S_IMODE(part.stat().st_mode) == 0o600
    assert cache.abandon(digest) is True and cache.abandon(digest) is False
    assert leftovers(cache) == [] and cache.active() == []
    # the link dropped midway and the owner starts again: offset 0 starts afresh
    cache.receive(digest, 0, len(data), data[:MAX_CHUNK], False)
    cache.receive(digest, MAX_CHUNK, len(data), data[MAX_CHUNK : 2 * MAX_CHUNK], False)
    got = feed(cache, data)
    assert got == cache.has(digest) and (got / "train.py").read_text() == "print('hello')\n"
    assert list(cache.incoming.iterdir()) == []
    # a daemon restart drops the partial files of its predecessor
    cache.receive("cd" * 32, 0, 10, b"12345", False)
    assert ContextCache(cache.root).has(digest) == got and list(cache.incoming.iterdir()) == []


# -- the wire -----------------------------------------------------------------------------


def test_blob_schema_and_frame_size() -> None:
    assert tar_cap(MAX_CONTEXT_BYTES) == schema.BLOB_TOTAL_MAX  # the wire's bound is the cache's
    good = {"t": "blob", "digest": "0f" * 32, "off": 0, "total": 10, "data": b"x", "last": False}
    assert schema.check(good) is None
    bad = {
        "digest": ["0F" * 32, "0f" * 31, 5, None],
        "off": [-1, True, 2 * 95 * MiB + 1, "0"],
        "total": [0, 2 * 95 * MiB + 1, 1.5],
        "data": ["x", b"x" * (MiB + 1), [1]],
        "last": [0, "yes", None],
    }
    for field, values in bad.items():
        for value in values:
            msg = dict(good, **{field: value})
            assert schema.check(msg) == (
                f"'blob' message with an invalid '{field}' ({str(value)[:40]!r})"
            )
        assert schema.check({k: v for k, v in good.items() if k != field}) == (
            f"'blob' message without '{field}'"
        )
    # the largest chunk at the largest offset fits a session frame, and arrives as bytes
    session = Session(None, None, os.urandom(32), b"a", b"b")  # type: ignore[arg-type]
    biggest = dict(good, off=2 * 95 * MiB, total=2 * 95 * MiB, data=b"\xff" * MAX_CHUNK)
    sealed = session.seal(biggest)
    assert len(sealed) - 4 <= transport.SESSION_MAX
    body = sealed[4 + 8 : -32]
    assert type(transport.decode(body)["data"]) is bytes
    assert len(msgpack.packb(biggest, use_bin_type=True)) + 8 + 32 > transport.SESSION_MAX - 1024


def test_send_context_reads_in_chunks(tmp_path: Path) -> None:
    packed = pack_context(make_tree(tmp_path / "src"), tmp_path / "out")
    sent: list[dict[str, Any]] = []

    async def collect(msg: dict[str, Any]) -> None:
        sent.append(msg)

    asyncio.run(send_context(collect, packed, chunk=100_000))
    assert [m["off"] for m in sent] == list(range(0, packed.size, 100_000))
    assert [m["last"] for m in sent] == [False] * (len(sent) - 1) + [True]
    assert b"".join(m["data"] for m in sent) == packed.path.read_bytes()
    assert {m["total"] for m in sent} == {packed.size} and {m["t"] for m in sent} == {"blob"}
    with pytest.raises(ValueError, match="it must be 1.."):
        asyncio.run(send_context(collect, packed, chunk=MAX_CHUNK + 1))
    with open(packed.path, "ab") as f:
        f.write(b"x")
    with pytest.raises(BlobError) as err:
        asyncio.run(send_context(collect, packed))
    refused(err, "changed size since it was packed; pack it again")

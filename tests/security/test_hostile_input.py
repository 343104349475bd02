"""The shared daemon stays responsive under hostile input (issue 24, items 1 and 2).

Real users against a real root daemon (the `shared` fixture): bob drops decoding bombs into the
spool and into his own trial's session; each is refused with its one line, quickly, and the
daemon's memory does not grow; the zygote's import scan reads only regular files of the
trial's user inside the context snapshot, at most 1 MiB (else a cold start, said once).
"""

from __future__ import annotations

import json
import os
import socket
import stat
import struct
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from det_local import api
from det_local.errors import DetLocalError
from det_local.sched.intake import spool
from det_local.sched.run.launchplan import LaunchPlan
from det_local.sched.warm.zygotes import MAX_SOURCE_BYTES, Cold, WarmSpec, warm_spec
from det_local.wire import rpc
from tests.support.users import B, Shared, _submit_raw, start_sleeping_trial
from tests.support.world import wait_for

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0, reason="multi-user tests create real users: they need root"
)

MIB = 1024 * 1024
NESTED_MAPS = b"\x81\xa0" * (2 * MIB - 1) + b"\x80"  # {"": {"": ...}}: 4 MiB


def _wide(keys: int) -> bytes:
    return b"\xdf" + struct.pack(">I", keys) + b"\x00\xc0" * keys


# each bomb and the reason the decoder gives for it (wire/budget.py)
SPOOL_BOMBS = {
    "nested maps": (NESTED_MAPS, "message nests deeper than 100 levels (at byte 201)"),
    "nested arrays": (
        b"\x91" * (4 * MIB - 1) + b"\x90",
        "message nests deeper than 100 levels (at byte 101)",
    ),
    "4 GiB string": (
        b"\xdb\xff\xff\xff\xff" + b"x" * 1024,
        "a string of 4,294,967,295 bytes is over the limit of 4,194,304 (at byte 0)",
    ),
    "4 GiB array": (
        b"\xdd\xff\xff\xff\xff",
        "an array of 4,294,967,295 items is over the limit of 50,000 (at byte 0)",
    ),
    "bin bomb": (
        b"\xc6\xff\xff\xff\xff",
        "a binary of 4,294,967,295 bytes is over the limit of 4,194,304 (at byte 0)",
    ),
    "ext bomb": (
        b"\xc9\xff\xff\xff\xff\x01",
        "an extension value of 4,294,967,295 bytes is over the limit of 0 (at byte 0)",
    ),
    "100,000 levels": (
        b"\x91" * 100_000 + b"\xc0",
        "message nests deeper than 100 levels (at byte 101)",
    ),
    "1,000,000 keys": (
        _wide(1_000_000),
        "a map of 1,000,000 keys is over the limit of 50,000 (at byte 0)",
    ),
}

FRAME_BOMBS = {
    "nested maps": (
        b"\x81\xa0" * (2 * MIB - 1) + b"\x80",  # 4 MiB - 1: within the session's size limit
        "frame refused: message nests deeper than 64 levels (at byte 129); closed",
    ),
    "16 MiB of nested maps": (  # over the session's size limit: refused at its length
        b"\x81\xa0" * (8 * MIB - 1) + b"\x80",
        "a frame of 16777215 bytes (the limit is 4194304); closed",
    ),
    "100,000 levels": (
        b"\x91" * 100_000 + b"\xc0",
        "frame refused: message nests deeper than 64 levels (at byte 65); closed",
    ),
    "4 GiB string": (
        b"\xdb\xff\xff\xff\xff" + b"x" * 1024,
        "frame refused: a string of 4,294,967,295 bytes is over the limit of 1,048,576 (at "
        "byte 0); closed",
    ),
    "bin bomb": (
        b"\xc6\xff\xff\xff\xff",
        "frame refused: a binary of 4,294,967,295 bytes is over the limit of 1,048,576 (at "
        "byte 0); closed",
    ),
    "ext bomb": (
        b"\xc9\xff\xff\xff\xff\x01",
        "frame refused: an extension value of 4,294,967,295 bytes is over the limit of 0 (at "
        "byte 0); closed",
    ),
    "1,000,000 keys": (
        _wide(1_000_000),
        "frame refused: a map of 1,000,000 keys is over the limit of 100,000 (at byte 0); closed",
    ),
}


# ---------------------------------------------------------------------------- as bob
def drop_requests(bodies: list[bytes]) -> list[list[Any]]:
    """Write each body as a request file, as a client does; [request id, answer, seconds]."""
    paths = api.paths()
    out = []
    for i, body in enumerate(bodies):
        req_id = f"{time.time_ns():020d}-{os.getpid()}-bomb{i}"
        tmp = paths.queue / f".{req_id}.tmp"
        tmp.write_bytes(body)
        t0 = time.monotonic()
        os.rename(tmp, paths.queue / f"{req_id}{spool.SUFFIX}")
        try:
            answer = str(spool.wait_response(paths, req_id, timeout=60))
        except DetLocalError as err:
            answer = str(err)
        out.append([req_id, answer, time.monotonic() - t0])
    return out


def send_frames(env: dict[str, str], bodies: list[bytes], hello: bool = True) -> list[Any]:
    """Each body as a frame of a fresh session (after hello when `hello`); what the daemon
    sent back before closing."""
    out = []
    for body in bodies:
        sock = socket.socket(socket.AF_UNIX)
        sock.connect(env["DET_LOCAL_SOCKET"])
        sock.settimeout(30)
        if hello:
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
            assert answer is not None and answer["t"] == "hello" and "error" not in answer
        t0 = time.monotonic()
        try:
            sock.sendall(struct.pack(">I", len(body)) + body)
        except OSError:
            pass  # closed before all was sent: what it answered is still there to read
        frames = []
        try:
            while (msg := rpc.recv(sock)) is not None:
                frames.append(msg)
        except OSError:
            pass
        out.append([frames, time.monotonic() - t0])
        sock.close()
    return out


def send_header(env: dict[str, str], header: bytes) -> list[Any]:
    """A session frame announcing `header`'s length, and nothing more."""
    sock = socket.socket(socket.AF_UNIX)
    sock.connect(env["DET_LOCAL_SOCKET"])
    sock.settimeout(30)
    hello = {
        "t": "hello",
        "token": env["DET_LOCAL_TOKEN"],
        "trial_id": int(env["DET_TRIAL_ID"]),
        "run_id": int(env["DET_TRIAL_RUN_ID"]),
    }
    rpc.send(sock, hello)
    answer = rpc.recv(sock)
    assert answer is not None and answer["t"] == "hello" and "error" not in answer
    sock.sendall(header)
    frames = []
    while (msg := rpc.recv(sock)) is not None:
        frames.append(msg)
    return frames


def _rss_mb(shared: Shared) -> float:
    pid = shared.dl.daemon_pid()
    assert pid is not None
    return psutil.Process(pid).memory_info().rss / MIB


def _log(shared: Shared) -> str:
    path = shared.paths.run_dir / "daemon.log"
    return path.read_text() if path.exists() else ""


# ---------------------------------------------------------------------------- the tests
def test_spool_bombs_are_refused_in_one_line_each(shared: Shared) -> None:
    rss0 = _rss_mb(shared)
    answers = shared.as_user(B, drop_requests, [body for body, _ in SPOOL_BOMBS.values()])
    for (case, (_, reason)), (req_id, answer, seconds) in zip(
        SPOOL_BOMBS.items(), answers, strict=True
    ):
        assert answer == (
            f"request {req_id}.req refused: {reason}; submit it with the det-local CLI"
        ), case
        assert seconds < 10, (case, seconds)  # a round trip through the spool, on a busy box
    assert _rss_mb(shared) - rss0 < 50, (rss0, _rss_mb(shared))
    # one line per burst in the log, not one per request
    rejected = [ln for ln in _log(shared).splitlines() if "rejected request" in ln]
    assert 1 <= len(rejected) <= 2, rejected
    # the loop's lag, as `daemon status --json` reports it (written once a second)
    status = wait_for(
        lambda: (
            (s := json.loads(shared.dl.det("daemon", "status", "--json").out)).get("loop_lag_ms")
            and s
        ),
        what="the loop-lag probe's figures",
    )
    lag = status["loop_lag_ms"]
    assert set(lag) >= {"max", "p99", "window_s", "samples", "max_since_start", "at"}, lag
    assert lag["samples"] > 0 and lag["max"] >= lag["p99"] >= 0, lag


def test_trial_frame_bombs_are_refused_and_told(shared: Shared) -> None:
    bob = start_sleeping_trial(shared, B, "bob", {"metric": "loss"})
    rss0 = _rss_mb(shared)
    seen = shared.as_user(B, send_frames, bob["env"], [body for body, _ in FRAME_BOMBS.values()])
    for (case, (_, why)), (frames, seconds) in zip(FRAME_BOMBS.items(), seen, strict=True):
        assert frames == [{"t": "refused", "error": why}], case
        assert seconds < 10, (case, seconds)
    # a 4 GiB length prefix on the frame itself: refused before anything is read
    frames = shared.as_user(B, send_header, bob["env"], b"\xff\xff\xff\xff")
    assert frames == [
        {"t": "refused", "error": "a frame of 4294967295 bytes (the limit is 4194304); closed"}
    ]
    # before hello, the hello budget (a few ids and a token)
    seen = shared.as_user(B, send_frames, bob["env"], [b"\x81\xa0" * 2000 + b"\x80"], False)
    assert seen[0][0] == [
        {
            "t": "hello",
            "error": "frame refused: message nests deeper than 8 levels (at byte 17); closed",
        }
    ]
    assert _rss_mb(shared) - rss0 < 100, (rss0, _rss_mb(shared))
    log = _log(shared)
    assert f"trial socket: refused frame from {B}" in log
    assert "message nests deeper than 64 levels (at byte 129); closed" in log
    # the trial's own session still works
    env = bob["env"]
    seen = shared.as_user(B, send_frames, env, [rpc.pack({"t": "best_val", "id": 1})[4:]])
    assert seen[0][0][0] == {"t": "reply", "id": 1, "value": None}


def test_a_script_outside_the_snapshot_starts_cold_and_is_not_read(shared: Shared) -> None:
    """`python3 /<bob's dir>/huge.py`, a 1.5 GB sparse file outside the context: the root
    daemon does not read it (its memory stays put); the trials start cold, said once."""
    bobs = shared.out / "bob-home"
    bobs.mkdir()
    huge = bobs / "huge.py"
    with open(huge, "wb") as f:
        f.write(b"import torch\n")
        f.truncate(1536 * MIB)
    bin_dir = shared.out / "bin"
    bin_dir.mkdir()
    python = bin_dir / "python3"  # a "python" that does nothing: the trials end at once
    python.write_text("#!/bin/sh\nexit 0\n")
    for path in (bin_dir, python, bobs, huge):
        os.chmod(path, 0o755)
    ctx = shared.out / "ctx-outside"
    ctx.mkdir()
    (ctx / "train.py").write_text("")
    os.chmod(ctx, 0o755)
    config = {
        "name": "outside",
        "entrypoint": f"{python} {huge}",
        "searcher": {"name": "grid", "metric": "loss", "max_length": 1},
        "hyperparameters": {"x": {"type": "categorical", "vals": [0, 1]}},
        "max_restarts": 0,
    }
    rss0 = _rss_mb(shared)
    exp = int(shared.as_user(B, _submit_raw, config, str(ctx)))
    store = api.open_store(shared.paths)
    try:
        wait_for(
            lambda: store.get_experiment(exp).state.terminal, timeout=120, what="the experiment"
        )
        said = [e[3] for e in store.list_events(exp) if "start cold" in e[3]]
        context = store.get_experiment(exp).context_dir
    finally:
        store.close()
    assert said == [
        f"experiment {exp}: its trials start cold: script {huge} is not a path inside "
        f"{context} (a warm start reads only the context snapshot's own files)"
    ], said
    assert _rss_mb(shared) - rss0 < 50


# ---------------------------------------------------------------------------- the scan alone
def _plan(ctx: Path, script: str, uid: int | None = None) -> LaunchPlan:
    config = {"entrypoint": f"python3 {script}", "searcher": {"name": "grid"}}
    return LaunchPlan(
        argv=["sh", "-c", "x"],
        env={"DET_EXPERIMENT_ID": "7", "DET_EXPERIMENT_CONFIG": json.dumps(config)},
        cwd=str(ctx),
        user="u",
        slots=[0],
        log_path=str(ctx / "log"),
        info_dir=str(ctx),
        uid=uid,
    )


def _cold(ctx: Path, script: str, uid: int | None = None) -> str:
    t0 = time.monotonic()
    spec = warm_spec(_plan(ctx, script, uid))
    assert time.monotonic() - t0 < 2.0  # never blocks (a FIFO), never reads a device
    assert isinstance(spec, Cold), spec
    return spec.why


SAID = " (a warm start reads only the context snapshot's own files)"


def test_the_import_scan_reads_only_the_snapshots_own_regular_files(tmp_path: Path) -> None:
    ctx = tmp_path / "snapshot"
    ctx.mkdir()
    (ctx / "train.py").write_text("import helper\nimport numpy\n")
    (ctx / "helper.py").write_text("import yaml\n")
    spec = warm_spec(_plan(ctx, "train.py"))
    assert isinstance(spec, WarmSpec) and spec.preload[:2] == ("numpy", "yaml"), spec
    os.mkfifo(ctx / "fifo.py")
    assert (
        _cold(ctx, "fifo.py") == "script fifo.py is not a regular file; refusing to read it" + SAID
    )
    os.mknod(ctx / "zero.py", 0o644 | stat.S_IFCHR, os.makedev(1, 5))  # /dev/zero
    assert (
        _cold(ctx, "zero.py") == "script zero.py is not a regular file; refusing to read it" + SAID
    )
    (ctx / "devzero.py").symlink_to("/dev/zero")
    assert _cold(ctx, "devzero.py") == (
        "script devzero.py is a symbolic link; refusing to follow it" + SAID
    )
    (ctx / "shadow.py").symlink_to("/etc/shadow")
    assert _cold(ctx, "shadow.py") == (
        "script shadow.py is a symbolic link; refusing to follow it" + SAID
    )
    with open(ctx / "huge.py", "wb") as f:  # 1.5 GB, sparse: nothing on disk, all zeros
        f.truncate(1536 * MIB)
    assert _cold(ctx, "huge.py") == (
        f"script huge.py is {1536 * MIB} bytes, over the {MAX_SOURCE_BYTES}-byte limit" + SAID
    )
    outside = tmp_path / "outside.py"
    outside.write_text("import torch\n")
    assert _cold(ctx, str(outside)) == f"script {outside} is not a path inside {ctx}" + SAID
    assert _cold(ctx, "../outside.py") == f"script ../outside.py is not a path inside {ctx}" + SAID
    (ctx / "etc").symlink_to("/etc")  # a directory on the way swapped for a link
    assert _cold(ctx, "etc/x.py") == (
        f"script etc/x.py: etc is not a directory of {ctx} (a symbolic link or a file); "
        "refusing to follow it" + SAID
    )
    # a module the script imports, swapped for a link: the same rule
    (ctx / "helper.py").unlink()
    (ctx / "helper.py").symlink_to("/etc/passwd")
    assert (
        _cold(ctx, "train.py")
        == "module helper.py is a symbolic link; refusing to follow it" + SAID
    )
    # a root daemon reads only what the trial's user could: their own files or world-readable
    # ones (not a root-only file hard-linked in)
    (ctx / "helper.py").unlink()
    (ctx / "helper.py").write_text("import yaml\n")
    assert isinstance(warm_spec(_plan(ctx, "train.py", uid=12345)), WarmSpec)
    os.chmod(ctx / "train.py", 0o600)
    assert _cold(ctx, "train.py", uid=12345) == (
        "script train.py is owned by uid 0, not by uid 12345, and others may not read it; "
        "refusing it" + SAID
    )


def test_a_snapshot_file_swapped_after_the_walk_is_not_shipped(tmp_path: Path) -> None:
    """The root daemon packs a user's snapshot for a peer: a file swapped for a link (to a
    root-only file), a FIFO or a bigger file after the tree was listed is refused, not read."""
    import io
    import tarfile

    from det_local.errors import ContextError
    from det_local.federate import blobs

    root = tmp_path / "snap"
    root.mkdir()
    for name in ("a.py", "b.py", "c.py"):
        (root / name).write_text("x = 1\n")
    entries = {e.rel: e for e in blobs._tree(root, 100)}
    (root / "a.py").unlink()
    (root / "a.py").symlink_to("/etc/shadow")
    (root / "b.py").unlink()
    os.mkfifo(root / "b.py")
    (root / "c.py").write_text("x = 1\n" * 1000)
    with tarfile.TarFile(fileobj=io.BytesIO(), mode="w") as tar:
        for name in ("a.py", "b.py", "c.py"):
            t0 = time.monotonic()
            with pytest.raises(ContextError) as err:
                blobs._add(tar, root, entries[name])
            assert time.monotonic() - t0 < 2.0  # the FIFO never blocks
            assert name in str(err.value)
    assert str(err.value) == (
        f"context snapshot {root}: c.py changed while it was packed (no longer the regular "
        "file of the tree); submit the experiment again"
    )

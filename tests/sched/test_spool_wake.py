"""How requests and answers wake their waiters: inotify on Linux, with the fallbacks (watchfiles
in the engine, polling in the requester) where inotify cannot be had. The fallbacks are forced
by making inotify unavailable in the process under test (the platform edge), and then a real
daemon still takes and answers requests."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgpack
import pytest

from det_local.sched.intake import inotify, spool
from det_local.store.paths import Paths
from tests.support.paths import REPO
from tests.support.world import CLI_TIMEOUT, Env, wait_for


def test_watch_reports_files_renamed_into_the_directory(tmp_path: Path) -> None:
    with inotify.Watch(tmp_path) as watch:
        assert watch.wait(0.01) is False  # nothing yet: the wait times out
        assert watch.drain() == []
        (tmp_path / ".a.tmp").write_bytes(b"x")  # written and closed: an event for .a.tmp
        os.rename(tmp_path / ".a.tmp", tmp_path / "a.req")
        assert watch.wait(5.0) is True
        assert watch.drain() == [".a.tmp", "a.req"]
        assert watch.drain() == []


def test_watch_of_a_missing_directory_is_an_oserror(tmp_path: Path) -> None:
    with pytest.raises(OSError):
        inotify.Watch(tmp_path / "nope")
    (tmp_path / "file").write_text("")
    with pytest.raises(OSError):  # IN_ONLYDIR: a file is not a directory to watch
        inotify.Watch(tmp_path / "file")


def _answer_later(paths: Paths, req_id: str, delay_s: float) -> threading.Thread:
    """Write an answer the way the daemon does, from another thread, after delay_s."""

    def run() -> None:
        time.sleep(delay_s)  # the answer must come while the requester waits
        spool.respond(paths, req_id, os.geteuid(), {"value": req_id})

    t = threading.Thread(target=run)
    t.start()
    return t


def test_requester_is_woken_by_the_answer(tmp_path: Path) -> None:
    paths = Paths(tmp_path / "home")
    spool.responses_dir(paths).mkdir(parents=True)
    watch = spool.answer_watch(paths)
    assert watch.watch is not None
    assert spool.answer_watch(paths) is watch  # one per spool and process
    req_id = spool.submit(paths, "x", {}, durable=False)
    t = _answer_later(paths, req_id, 0.2)
    start = time.monotonic()
    assert spool.wait_response(paths, req_id, timeout=10, watch=watch) == req_id
    t.join()
    assert time.monotonic() - start < 5
    assert not (spool.responses_dir(paths) / f"{req_id}.resp").exists()  # collected


def test_requester_polls_where_no_answer_directory_can_be_watched(tmp_path: Path) -> None:
    """No responses directory yet (a daemon creates it): the requester polls, and still gets
    the answer that creates the directory."""
    paths = Paths(tmp_path / "home")
    paths.queue.mkdir(parents=True)
    watch = spool.AnswerWatch(paths)
    assert watch.watch is None
    req_id = spool.submit(paths, "x", {})
    t = _answer_later(paths, req_id, 0.2)
    assert spool.wait_response(paths, req_id, timeout=10, watch=watch) == req_id
    t.join()


def test_make_durable_keeps_a_waiting_request(tmp_path: Path) -> None:
    paths = Paths(tmp_path / "home")
    req_id = spool.submit(paths, "x", {"a": 1}, durable=False)
    spool.make_durable(paths, req_id)  # fsyncs; the request is unchanged
    body = msgpack.unpackb((paths.queue / f"{req_id}.req").read_bytes(), raw=False)
    assert body["op"] == "x" and body["payload"] == {"a": 1}
    spool.make_durable(paths, "gone-already")  # taken meanwhile: nothing to do, no error


_NO_INOTIFY = (
    "import det_local.sched.intake.inotify as i\n"
    "def _none():\n"
    "    raise OSError(38, 'inotify disabled for this test')\n"
    "i._lib = _none\n"
    "import sys\n"
    "from det_local.cli.main import main\n"
    "sys.argv[0] = 'det-local'\n"
    "main()\n"
)


def test_daemon_and_requester_without_inotify(dl: Env) -> None:
    """The engine falls back to watchfiles and the requester to polling: a command submitted
    to such a daemon is taken, answered and run."""
    env = {**dl.env, "DET_LOCAL_CPU_SLOTS": "1", "PYTHONPATH": str(REPO)}
    daemon = subprocess.Popen(
        [sys.executable, "-c", _NO_INOTIFY, "daemon"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for(lambda: dl.daemon_pid() == daemon.pid and dl.paths.socket.exists(), what="daemon")
        # watchfiles watches from a thread of its own (an inotify daemon has one thread here)
        wait_for(lambda: len(os.listdir(f"/proc/{daemon.pid}/task")) > 1, what="watchfiles")
        out = subprocess.run(
            [sys.executable, "-c", _NO_INOTIFY, "cmd", "run", "--", "true"],
            env=env,
            capture_output=True,
            text=True,
            timeout=CLI_TIMEOUT,
        )
        assert out.returncode == 0, out.stderr
        job_id = int(out.stdout.split()[-1])
        assert dl.wait_job(job_id).exit_code == 0
    finally:
        daemon.terminate()
        daemon.wait(timeout=CLI_TIMEOUT)

"""`python3 -m det_local.launch.wrap_rank RANK CMD...`: the `[rank=N] ` prefix, line ends
(\\n, \\r, \\r\\n), long lines, rank from variables, signal forwarding, exit statuses, and no
orphan when the wrapper itself is killed."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from det_local.launch.wrap_rank import LineSplitter
from tests.support import paths

REPO = paths.REPO
COMPAT = REPO / "det_local" / "compat"
LIMIT = io.DEFAULT_BUFFER_SIZE - 1


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(COMPAT), str(REPO)])
    env.pop("DET_LOCAL_SUPERVISOR", None)
    env.update(extra)
    return env


def wrap(*args: str, module: str = "det_local", **env: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [sys.executable, "-m", f"{module}.launch.wrap_rank", *args],
        env=_env(**env),
        capture_output=True,
        timeout=30,
    )


def test_line_splitter() -> None:
    s = LineSplitter()
    assert s.feed(b"a\nb\rc\r\nd") == [b"a", b"b", b"c"]
    assert s.feed(b"e\r") == [b"de"]
    assert s.feed(b"\nf") == []  # the \n of a \r\n split across reads ends nothing
    assert s.feed(b"\n\n") == [b"f", b""]
    assert s.flush() == []
    s.feed(b"tail")
    assert s.flush() == [b"tail"]
    # long lines are cut at io.DEFAULT_BUFFER_SIZE - 1; a line of exactly that is one line
    long = b"x" * (2 * LIMIT + 5)
    assert s.feed(long + b"\n") == [b"x" * LIMIT, b"x" * LIMIT, b"x" * 5]
    assert s.feed(b"y" * LIMIT + b"\n") == [b"y" * LIMIT]
    pieces = [s.feed(b"z" * 1000) for _ in range(9)]
    assert [len(line) for got in pieces for line in got] == [LIMIT]


def test_prefixes_both_streams() -> None:
    script = (
        "import sys; sys.stdout.write('one\\ntwo\\rthree'); sys.stdout.flush();"
        "sys.stderr.write('err line\\n'); sys.stdout.write('\\xe9 bytes\\n')"
    )
    proc = wrap("3", "--", sys.executable, "-c", script)
    assert proc.returncode == 0
    assert proc.stdout.decode() == "[rank=3] one\n[rank=3] two\n[rank=3] three\u00e9 bytes\n"
    assert proc.stderr == b"[rank=3] err line\n"


def test_rank_from_variables_and_errors() -> None:
    proc = wrap("HOROVOD_RANK,OMPI_COMM_WORLD_RANK", "echo", "hi", OMPI_COMM_WORLD_RANK="7")
    assert proc.stdout == b"[rank=7] hi\n"
    proc = wrap("--no-redirect-stdio", "RANK", "--", "echo", "x", module="determined", RANK="2")
    assert proc.stdout == b"[rank=2] x\n"
    proc = wrap("NOT_SET_A,NOT_SET_B", "echo")
    assert proc.returncode == 1 and b"none of NOT_SET_A,NOT_SET_B is set" in proc.stderr
    proc = wrap("0")
    assert proc.returncode == 1 and b"no command to run after RANK" in proc.stderr
    proc = wrap("0", "no-such-program-x")
    assert proc.returncode == 127
    assert b"[rank=0] det-local: error: cannot run 'no-such-program-x'" in proc.stderr


@pytest.mark.parametrize(
    ("script", "status", "message"),
    [
        ("import sys; sys.exit(5)", 5, b""),
        ("import os, signal; os.kill(os.getpid(), signal.SIGSEGV)", 139, b"SIGSEGV"),
    ],
)
def test_exit_status(script: str, status: int, message: bytes) -> None:
    proc = wrap("1", sys.executable, "-c", script)
    assert proc.returncode == status
    assert message in proc.stderr


def test_forwards_signals(tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    script = (
        "import signal, sys, time, pathlib\n"
        "def on(sig, _): print('got', signal.Signals(sig).name, flush=True); sys.exit(4)\n"
        "signal.signal(signal.SIGTERM, on)\n"
        f"pathlib.Path({str(ready)!r}).write_text('')\n"
        "time.sleep(60)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "det_local.launch.wrap_rank", "0", sys.executable, "-c", script],
        env=_env(),
        stdout=subprocess.PIPE,
    )
    deadline = time.monotonic() + 30
    while not ready.exists():
        assert time.monotonic() < deadline
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=30)
    assert out == b"[rank=0] got SIGTERM\n"
    assert proc.returncode == 4


def test_worker_dies_with_its_wrapper(tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    script = (
        f"import os, time, pathlib; pathlib.Path({str(pid_file)!r})"
        ".write_text(str(os.getpid())); time.sleep(60)"
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "det_local.launch.wrap_rank", "0", sys.executable, "-c", script],
        env=_env(),
    )
    deadline = time.monotonic() + 30
    while not pid_file.exists() or not pid_file.read_text():
        assert time.monotonic() < deadline
        time.sleep(0.02)
    child = psutil.Process(int(pid_file.read_text()))
    proc.kill()
    proc.wait()
    child.wait(timeout=10)  # SIGKILLed through PR_SET_PDEATHSIG, not orphaned

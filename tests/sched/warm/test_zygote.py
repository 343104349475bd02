"""The zygote process itself (`trial/zygote.py`), run for real: what it holds before it forks
(one thread, no CUDA), who it serves, how it ends."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from det_local.trial import zygote
from det_local.wire import rpc
from tests.support.world import wait_for

CHECK = r"""
import json, threading
from det_local.trial import zygote
assert zygote.preload(["torch", "numpy", "determined"]) is None
import sys
assert "torch._dynamo" not in sys.modules
zygote.preload_lazy()
import torch
before = zygote.threads()
zygote.probe_fork()
print(json.dumps({
    "before": before,
    "after": zygote.threads(),
    "python_threads": threading.active_count(),
    "cuda": zygote.cuda_initialised(),
    "parallel": torch.__config__.parallel_info(),
    "dynamo": "torch._dynamo" in sys.modules,
}))
"""


def _python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, **env}
    )


def test_preloaded_torch_leaves_one_thread_and_no_cuda() -> None:
    r = _python(CHECK)
    assert r.returncode == 0, r.stderr
    seen = json.loads(r.stdout)
    # numpy's OpenBLAS starts a pool at import; its own atfork handler stops it at a fork, so
    # after the probe fork only the main thread is left: nothing a fork would corrupt
    assert seen["after"] == ["python"], seen
    assert seen["python_threads"] == 1
    assert seen["cuda"] is False
    # what torch.optim imports on a trial's first optimizer is preloaded too, safely
    assert seen["dynamo"] is True
    # torch's intra-op pool (OpenMP) is started lazily: no OpenMP thread is among the tasks
    assert "OpenMP" in seen["parallel"] or "ATen" in seen["parallel"]


def _start(tmp_path: Path, daemon_pid: int, modules: str = "json") -> subprocess.Popen[str]:
    sock = tmp_path / "s"
    proc = subprocess.Popen(
        [sys.executable, "-m", "det_local.trial.zygote", str(sock), str(daemon_pid), "0", modules],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    return proc


# its socket's listen() watched: whether the socket's path existed when it was called
LISTEN_SPY = r"""
import os, socket, sys
from det_local.trial.zygote import Zygote
path = sys.argv[1]
seen = []
real = socket.socket.listen
def listen(self, *args):
    seen.append(os.path.lexists(path))
    return real(self, *args)
socket.socket.listen = listen
Zygote(path, os.getpid(), 0, {})
with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
    conn.connect(path)
print(seen, sorted(os.listdir(os.path.dirname(path))))
"""


def test_its_socket_path_appears_only_once_it_listens(tmp_path: Path) -> None:
    """The daemon takes the socket's path for "ready" and connects at once: a socket bound
    but not yet listening refuses that (ECONNREFUSED), and the daemon then distrusts the
    zygote (its experiment's trials all start cold). So the socket is bound under another
    name and renamed into place once it listens: the path never names a deaf socket."""
    r = subprocess.run(
        [sys.executable, "-c", LISTEN_SPY, str(tmp_path / "s")], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout == "[False] ['s']\n", r.stdout


def test_a_module_that_cannot_be_preloaded_ends_it_with_one_line(tmp_path: Path) -> None:
    proc = _start(tmp_path, os.getpid(), "json,no_such_module_xyz")
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == zygote.PRELOAD_FAILED
    assert err == (
        "det-local zygote: cannot preload no_such_module_xyz: No module named "
        "'no_such_module_xyz'; this experiment's trials start cold\n"
    )
    assert not (tmp_path / "s").exists()


def test_it_exits_when_its_daemon_is_gone(tmp_path: Path) -> None:
    daemon = subprocess.Popen(["sleep", "60"])
    proc = _start(tmp_path, daemon.pid)
    try:
        wait_for((tmp_path / "s").exists, timeout=60, what="the zygote's socket")
        daemon.kill()
        daemon.wait()
        assert proc.wait(timeout=30) == 0
        assert not (tmp_path / "s").exists()
    finally:
        daemon.kill()
        proc.kill()
        proc.wait()


def test_it_forks_a_script_and_records_its_status(tmp_path: Path) -> None:
    script = tmp_path / "t.py"
    script.write_text(
        "import os, sys\nprint('argv', sys.argv, os.environ['X'], os.getcwd(), flush=True)\n"
        "sys.exit(7)\n"
    )
    log = tmp_path / "log"
    exit_file = tmp_path / "exit"
    proc = _start(tmp_path, os.getpid())
    try:
        wait_for((tmp_path / "s").exists, timeout=60, what="the zygote's socket")
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.connect(str(tmp_path / "s"))
            socket.send_fds(conn, [b"F"], [fd])
            os.close(fd)
            rpc.send(
                conn,
                {
                    "t": "fork",
                    "argv": ["python3", str(script), "a"],
                    "env": {"X": "y", "PATH": os.environ["PATH"]},
                    "cwd": str(tmp_path),
                    "umask": 0o022,
                    "exit_file": str(exit_file),
                },
            )
            answer = rpc.recv(conn)
            assert answer is not None and answer["t"] == "forked"
            pid = answer["pid"]
            assert os.getsid(pid) == pid  # its own session
            rpc.send(conn, {"t": "go"})
        wait_for(exit_file.exists, timeout=30, what="the exit file")
        assert exit_file.read_text() == "7\n"
        assert log.read_text() == f"argv ['{script}', 'a'] y {tmp_path}\n"
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.skipif(os.geteuid() != 0, reason="connects as another uid: needs root")
def test_a_fork_request_from_another_uid_is_refused() -> None:
    where = Path(tempfile.mkdtemp(prefix="det-local-zygote-", dir="/tmp"))
    proc = _start(where, os.getpid())
    try:
        sock = where / "s"
        wait_for(sock.exists, timeout=60, what="the zygote's socket")
        os.chmod(where, 0o755)
        os.chmod(sock, 0o666)  # reachable, for the test: SO_PEERCRED is what refuses
        child = os.fork()
        if child == 0:
            code = 1
            try:
                os.setgid(65534)
                os.setuid(65534)
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
                    conn.connect(str(sock))
                    conn.settimeout(10)
                    code = 0 if conn.recv(1) == b"" else 2  # closed without an answer
            finally:
                os._exit(code)
        _, status = os.waitpid(child, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        proc.kill()
        _, err = proc.communicate()
        shutil.rmtree(where, ignore_errors=True)
    assert "refused a fork request from uid 65534 (only the daemon's is served)" in err


# What the common data-science stack starts at import: scikit-learn imports pandas, which imports
# pyarrow, whose bundled jemalloc starts its background thread as libarrow loads.
STACK = r"""
import json, sys
from det_local.trial import zygote
if sys.argv[1] == "quiet":
    zygote.quiet_allocators()
assert zygote.preload(["sklearn", "pandas", "pyarrow", "torch"]) is None
before = zygote.extra_threads()
zygote.probe_fork()
print(json.dumps({"before": before, "after": zygote.extra_threads(),
                  "unsafe": zygote.unsafe_threads()}))
"""


@pytest.mark.parametrize("mode", ["as-is", "quiet"])
def test_the_common_stack_leaves_no_thread_unsafe_to_fork(mode: str) -> None:
    pytest.importorskip("pyarrow")
    pytest.importorskip("pandas")
    env = {k: v for k, v in os.environ.items() if k != zygote.JEMALLOC_CONF_VAR}
    r = subprocess.run(
        [sys.executable, "-c", STACK, mode], capture_output=True, text=True, env=env, timeout=120
    )
    assert r.returncode == 0, r.stderr
    seen = json.loads(r.stdout)
    if mode == "as-is":
        # the environment: jemalloc's thread runs (tolerated, see FORK_SAFE_THREADS)
        assert seen["after"] == ["jemalloc_bg_thd"], seen
    else:
        # the zygote's: switched off through jemalloc's own configuration
        assert "jemalloc_bg_thd" not in seen["before"], seen
        assert seen["after"] == [], seen
    assert seen["unsafe"] == []


def test_quiet_allocators_keeps_the_users_jemalloc_options(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(zygote.JEMALLOC_CONF_VAR, "narenas:2")
    zygote.quiet_allocators()
    assert os.environ[zygote.JEMALLOC_CONF_VAR] == "narenas:2,background_thread:false"
    monkeypatch.delenv(zygote.JEMALLOC_CONF_VAR)
    zygote.quiet_allocators()
    assert os.environ[zygote.JEMALLOC_CONF_VAR] == "background_thread:false"


def test_an_unknown_thread_after_the_preload_ends_it_with_one_line(tmp_path: Path) -> None:
    # a module that starts a thread of its own (named, as a native library's would be)
    (tmp_path / "spinner.py").write_text(
        "import ctypes, threading, time\n"
        "def spin():\n"
        "    ctypes.CDLL(None).prctl(15, b'spinner', 0, 0, 0)  # PR_SET_NAME\n"
        "    while True:\n"
        "        time.sleep(1)\n"
        "threading.Thread(target=spin, daemon=True).start()\n"
        "time.sleep(0.2)\n"
    )
    sock = tmp_path / "s"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "det_local.trial.zygote",
            str(sock),
            str(os.getpid()),
            "0",
            "spinner",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": f"{tmp_path}:{os.environ.get('PYTHONPATH', '')}"},
    )
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == zygote.THREADS_RUNNING
    main = Path(sys.executable).name[:15]
    assert err == (
        f"det-local zygote: 2 threads run after preloading ({main}, spinner), not known to be "
        "safe to fork: spinner; this experiment's trials start cold\n"
    )
    assert not sock.exists()

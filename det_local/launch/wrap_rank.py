"""``python3 -m det_local.launch.wrap_rank [--no-redirect-stdio] RANK [--] CMD...``

Runs CMD (one worker of a distributed trial) and re-emits every line of its stdout and stderr
prefixed with ``[rank=N] `` (``det-local trial logs --rank N`` filters on it), as Determined's
``determined.launch.wrap_rank`` does:

* RANK is an integer, or comma-separated names of environment variables tried in order
  (``RANK``, ``HOROVOD_RANK,OMPI_COMM_WORLD_RANK,PMI_RANK``);
* a line ends at ``\\n``, ``\\r`` (so each tqdm refresh is its own line) or ``\\r\\n``, and a line
  longer than ``io.DEFAULT_BUFFER_SIZE - 1`` bytes is split there; bytes pass through undecoded;
* SIGINT, SIGTERM, SIGHUP, SIGUSR1, SIGUSR2 and SIGWINCH are forwarded to CMD, and CMD gets
  SIGKILL if this wrapper itself is killed (no orphaned workers);
* the exit status is CMD's; a CMD killed by a signal is reported in one line and exits
  128 + the signal number (139 for a segfault).

Under a det-local launcher (DET_LOCAL_SUPERVISOR set) the wrapper also tells the launcher's
supervisor its pids and CMD's exit status, so that one failed worker stops the others at once.
``--no-redirect-stdio`` is accepted for compatibility (det-local has no container log files).

This module is imported in every worker before the user's code: it imports nothing heavy.
"""

from __future__ import annotations

import ctypes
import io
import os
import re
import signal
import socket
import subprocess
import sys
import threading
from typing import IO

SUPERVISOR_ENV = "DET_LOCAL_SUPERVISOR"
# where the supervisor writes its first failing rank (set by `slurm/node.py` on a Slurm node)
FIRST_FAILURE_ENV = "DET_LOCAL_FIRST_FAILURE"
VISIBLE_DEVICES_ENV = "DET_LOCAL_VISIBLE_DEVICES"
FORWARDED = ("SIGINT", "SIGTERM", "SIGHUP", "SIGUSR1", "SIGUSR2", "SIGWINCH")
LINE_END = re.compile(rb"\r\n|[\r\n]")
PIPE_BUF = 4096  # writes up to this size are atomic on a pipe: ranks' lines never interleave
DRAIN_TIMEOUT = 5.0  # after CMD exits, how long its grandchildren may hold the pipes open
USAGE = "usage: python3 -m det_local.launch.wrap_rank [--no-redirect-stdio] RANK [--] CMD..."


class LineSplitter:
    """Bytes in, complete lines out (without their terminators)."""

    def __init__(self, limit: int = io.DEFAULT_BUFFER_SIZE - 1) -> None:
        self.limit = limit
        self._buf = bytearray()
        self._after_cr = False

    def feed(self, data: bytes) -> list[bytes]:
        lines: list[bytes] = []
        i, n = 0, len(data)
        if self._after_cr and data[:1] == b"\n":
            i = 1  # the \n of a \r\n split across two reads
        self._after_cr = False
        while i < n:
            m = LINE_END.search(data, i)
            end = n if m is None else m.start()
            while i < end:
                if len(self._buf) >= self.limit:
                    lines.append(bytes(self._buf))
                    self._buf.clear()
                take = min(self.limit - len(self._buf), end - i)
                self._buf += data[i : i + take]
                i += take
            if m is None:
                break
            lines.append(bytes(self._buf))
            self._buf.clear()
            i = m.end()
            if i == n and m.group() == b"\r":
                self._after_cr = True
        return lines

    def flush(self) -> list[bytes]:
        if not self._buf:
            return []
        line = bytes(self._buf)
        self._buf.clear()
        return [line]


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            k = os.write(fd, view)
        except BrokenPipeError:
            return
        view = view[k:]


def _emit(fd: int, prefix: bytes, lines: list[bytes]) -> None:
    batch = bytearray()
    for line in lines:
        item = prefix + line + b"\n"
        if batch and len(batch) + len(item) > PIPE_BUF:
            _write_all(fd, bytes(batch))
            batch.clear()
        batch += item
    if batch:
        _write_all(fd, bytes(batch))


def pump(src: IO[bytes], dst_fd: int, rank: int) -> None:
    """Copy src to dst_fd line by line with the rank prefix, until EOF."""
    prefix = f"[rank={rank}] ".encode()
    splitter = LineSplitter()
    fd = src.fileno()
    while True:
        try:
            data = os.read(fd, 65536)
        except OSError:
            break
        if not data:
            break
        _emit(dst_fd, prefix, splitter.feed(data))
    _emit(dst_fd, prefix, splitter.flush())


def resolve_rank(spec: str) -> int:
    """An integer, or the first of the comma-separated variables that is set."""
    if spec.isdigit():
        return int(spec)
    for name in spec.split(","):
        value = os.environ.get(name.strip())
        if value is not None:
            try:
                return int(value)
            except ValueError:
                raise SystemExit(
                    f"det-local: error: wrap_rank: {name}={value!r} is not an integer rank"
                ) from None
    raise SystemExit(
        f"det-local: error: wrap_rank: none of {spec} is set in the environment; pass the rank "
        "as a number or name the variable your launcher sets"
    )


def parse(argv: list[str]) -> tuple[str, list[str]]:
    args = list(argv)
    if args[:1] in (["-h"], ["--help"]):
        print(USAGE)
        print(__doc__)
        raise SystemExit(0)
    while args and args[0] == "--no-redirect-stdio":
        args.pop(0)
    if not args:
        raise SystemExit(f"det-local: error: wrap_rank: RANK and CMD are missing\n{USAGE}")
    rank, cmd = args[0], args[1:]
    if cmd[:1] == ["--"]:
        cmd = cmd[1:]
    if not cmd:
        raise SystemExit(f"det-local: error: wrap_rank: no command to run after RANK\n{USAGE}")
    return rank, cmd


def _die_with_parent() -> None:
    """In the child, before exec: SIGKILL when this wrapper dies (Linux prctl)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
    except Exception:
        pass


def _map_visible_devices(env: dict[str, str]) -> None:
    """Under the deepspeed launcher: DeepSpeed sets CUDA_VISIBLE_DEVICES to indices (0,1,...)
    of what the trial could see; map them back to the trial's own devices (GPU UUIDs)."""
    saved = env.get(VISIBLE_DEVICES_ENV)
    current = env.get("CUDA_VISIBLE_DEVICES")
    if not saved or current is None:
        return
    devices = [d for d in saved.split(",") if d]
    try:
        indices = [int(x) for x in current.split(",") if x.strip()]
    except ValueError:
        return
    if all(0 <= i < len(devices) for i in indices):
        env["CUDA_VISIBLE_DEVICES"] = ",".join(devices[i] for i in indices)


class _Report:
    """The connection to the launcher's supervisor (none outside a det-local launcher)."""

    def __init__(self, path: str | None) -> None:
        self._sock: socket.socket | None = None
        if not path:
            return
        try:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(path)
            self._sock = sock
        except OSError:
            self._sock = None

    def send(self, line: str) -> None:
        if self._sock is None:
            return
        try:
            self._sock.sendall(line.encode() + b"\n")
        except OSError:
            self._sock = None


def signal_name(sig: int) -> str:
    try:
        name = signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"
    desc = signal.strsignal(sig) if hasattr(signal, "strsignal") else None
    return f"{name} ({desc.lower()})" if desc else name


def main(argv: list[str] | None = None) -> int:
    spec, cmd = parse(sys.argv[1:] if argv is None else argv)
    rank = resolve_rank(spec)
    report = _Report(os.environ.get(SUPERVISOR_ENV))
    env = dict(os.environ)
    _map_visible_devices(env)
    try:
        proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            bufsize=0,
            env=env,
            preexec_fn=_die_with_parent,
        )
    except OSError as err:
        msg = f"[rank={rank}] det-local: error: cannot run {cmd[0]!r}: {err.strerror or err}\n"
        _write_all(2, msg.encode())
        report.send(f"start {rank} {os.getpid()} 0")
        report.send(f"exit {rank} 127")
        return 127
    report.send(f"start {rank} {os.getpid()} {proc.pid}")

    def forward(signum: int, _frame: object) -> None:
        try:
            proc.send_signal(signum)
        except OSError:
            pass

    for name in FORWARDED:
        sig = getattr(signal, name, None)
        if sig is not None:
            signal.signal(sig, forward)

    assert proc.stdout is not None and proc.stderr is not None
    threads = [
        threading.Thread(target=pump, args=(proc.stdout, 1, rank), daemon=True),
        threading.Thread(target=pump, args=(proc.stderr, 2, rank), daemon=True),
    ]
    for t in threads:
        t.start()
    code = proc.wait()
    for t in threads:
        t.join(DRAIN_TIMEOUT)
    report.send(f"exit {rank} {code}")
    if code < 0:
        msg = f"[rank={rank}] det-local: the worker was killed by {signal_name(-code)}\n"
        _write_all(2, msg.encode())
        return 128 - code
    return code


if __name__ == "__main__":
    sys.exit(main())

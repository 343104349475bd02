"""The det-local CLI on a pseudo-terminal, as a person's terminal shows it (rich's layout)."""

from __future__ import annotations

import fcntl
import os
import pty
import select
import struct
import subprocess
import sys
import termios
import time
from typing import Any


def cli_on_pty(env: dict[str, str], cols: int, *args: Any, stderr: bool = True) -> str:
    """Run the CLI on a pseudo-terminal `cols` wide (50 rows); returns what it wrote there
    (stderr too unless `stderr` is False). It must exit 0."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, cols, 0, 0))
    proc = subprocess.Popen(
        [sys.executable, "-m", "det_local.cli.main", *(str(a) for a in args)],
        env=env,
        stdin=slave,
        stdout=slave,
        stderr=slave if stderr else subprocess.DEVNULL,
        close_fds=True,
    )
    os.close(slave)
    chunks = []
    deadline = time.monotonic() + 60
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.5)
            if ready:
                try:
                    data = os.read(master, 65536)
                except OSError:  # EIO: the child closed the terminal
                    break
                if not data:
                    break
                chunks.append(data)
            elif proc.poll() is not None:
                break
        assert proc.wait(timeout=30) == 0, b"".join(chunks)
    finally:
        os.close(master)
    return b"".join(chunks).decode().replace("\r\n", "\n")

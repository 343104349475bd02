"""A Slurm pool whose compute node is not the daemon's host (slurmd hides every test's directory,
tests/support/slurmkit.py `hide`): the directory both share, the daemon started with the pool's TCP
channel behind a recording Proxy, and the config a trial on it needs."""

from __future__ import annotations

import os
import select
import shutil
import socket
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support import slurmkit
from tests.support.world import Env


class Proxy:
    """Forwards connections from ``port`` to the daemon's channel, recording what the trial
    sends (one bytes buffer per connection)."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self.listener.getsockname()[1])
        self.sent: list[bytearray] = []
        self.stopping = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.stopping:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(("127.0.0.1", self.target), timeout=10)
            except OSError:
                client.close()
                continue
            buf = bytearray()
            self.sent.append(buf)
            threading.Thread(target=self._pump, args=(client, server, buf), daemon=True).start()

    def _pump(self, client: socket.socket, server: socket.socket, buf: bytearray) -> None:
        pair = {client: server, server: client}
        try:
            while True:
                ready, _, _ = select.select(list(pair), [], [], 1.0)
                for s in ready:
                    data = s.recv(65536)
                    if not data:
                        return
                    if s is client:
                        buf += data
                    pair[s].sendall(data)
        except OSError:
            return
        finally:
            client.close()
            server.close()

    def close(self) -> None:
        self.stopping = True
        self.listener.close()


@pytest.fixture
def shared(slurm: slurmkit.Slurm) -> Iterator[Path]:
    """What the compute node and the daemon share (outside every hidden directory)."""
    path = Path(tempfile.mkdtemp(prefix="shared-", dir=slurm.root))  # this test's own
    for sub in ("", "stage", "ckpts"):
        (path / sub).mkdir(exist_ok=True)
        os.chmod(path / sub, 0o1777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def start(dl: Env, slurm: slurmkit.Slurm, shared: Path, **extra: Any) -> Proxy:
    (port,) = slurmkit._free_ports(1)
    proxy = Proxy(port)
    pool = {
        "partition": "debug",
        "channel": {"listen": f"127.0.0.1:{port}", "advertise": f"127.0.0.1:{proxy.port}"},
        "stage_dir": str(shared / "stage"),
        **extra,
    }
    dl.daemon_start({"resource_pools": {"hpc": {"slurm": pool}}}, SLURM_CONF=str(slurm.conf))
    return proxy


def config(shared: Path) -> dict[str, Any]:
    return {
        "resources": {"resource_pool": "hpc"},
        "checkpoint_storage": {"type": "shared_fs", "host_path": str(shared / "ckpts")},
    }


def daemon_log(dl: Env) -> str:
    path = dl.paths.run_dir / "daemon.log"
    return path.read_text(errors="replace") if path.exists() else ""

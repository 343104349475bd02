"""DistributedContext across real processes: the explicit constructor, the collectives, the
construction collective's checks, and what a dead peer does to the others (they raise at
once, naming it; nothing hangs). No torch: these are det-local's own sockets."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from det_local.launch.ports import allocate_ports
from det_local.trial.core import DistributedContext, DummyDistributedContext
from det_local.trial.core._hub import DistributedError
from tests.support import paths
from tests.support.ranks import PRELUDE, TIMEOUT, run_ranks

REPO = paths.REPO


COLLECTIVES = """
d = make()
r = d.rank
emit({
    "gather": d.gather(r * 10),
    "allgather": d.allgather({"r": r}),
    "broadcast": d.broadcast("chief" if r == 0 else "ignored"),
    "gather_local": d.gather_local(r),
    "allgather_local": d.allgather_local(r),
    "broadcast_local": d.broadcast_local(f"local chief {r}" if d.local_rank == 0 else None),
    "big": [len(x) for x in d.allgather(b"x" * (3 << 20))],
    "many": sum(d.allgather(i)[-1] for i in range(200)),
    "numbers": [d.get_rank(), d.get_size(), d.get_local_rank(), d.get_num_agents()],
    "shared": d._local is d._global,
})
d.close()
d.close()
"""


def test_collectives_one_machine(tmp_path: Path) -> None:
    results = run_ranks(tmp_path, COLLECTIVES, size=3)
    for rank, (code, res, err) in enumerate(results):
        assert code == 0, err
        assert res["gather"] == ([0, 10, 20] if rank == 0 else None)
        assert res["allgather"] == [{"r": 0}, {"r": 1}, {"r": 2}]
        assert res["broadcast"] == "chief"
        assert res["gather_local"] == ([0, 1, 2] if rank == 0 else None)
        assert res["allgather_local"] == [0, 1, 2]
        assert res["broadcast_local"] == "local chief 0"
        assert res["big"] == [3 << 20] * 3
        assert res["many"] == sum(range(200))
        assert res["numbers"] == [rank, 3, rank, 1]
        assert res["shared"] is True  # one machine: one set of connections


@pytest.mark.parametrize("force_tcp", ["0", "1"])
def test_collectives_two_machines(tmp_path: Path, force_tcp: str) -> None:
    """4 ranks as 2 'machines' of 2: the local collectives stay within a machine (unix
    sockets, or TCP with force_tcp)."""
    results = run_ranks(tmp_path, COLLECTIVES, size=4, local_size=2, env={"FORCE_TCP": force_tcp})
    for rank, (code, res, err) in enumerate(results):
        assert code == 0, err
        machine = rank // 2
        assert res["gather"] == ([0, 10, 20, 30] if rank == 0 else None)
        assert res["allgather"] == [{"r": r} for r in range(4)]
        assert res["broadcast"] == "chief"
        assert res["gather_local"] == ([2 * machine, 2 * machine + 1] if rank % 2 == 0 else None)
        assert res["allgather_local"] == [2 * machine, 2 * machine + 1]
        assert res["broadcast_local"] == f"local chief {2 * machine}"
        assert res["numbers"] == [rank, 4, rank % 2, 2]
        assert res["shared"] is False


def test_dead_peer_raises_instead_of_hanging(tmp_path: Path) -> None:
    body = """
    d = make()
    if d.rank == 2:
        sys.exit(3)
    try:
        d.allgather(d.rank)
        emit("no error")
    except DistributedError as err:
        emit(str(err))
        sys.exit(1)
    """
    started = time.monotonic()
    results = run_ranks(tmp_path, body, size=3)
    assert time.monotonic() - started < 20
    assert results[2][0] == 3
    assert results[0][0] == 1
    assert "rank 2 exited during allgather()" in results[0][1]
    assert results[1][0] == 1
    assert "rank 1 lost its connection to the chief" in results[1][1]


def test_mismatched_collectives_are_named(tmp_path: Path) -> None:
    body = """
    d = make()
    try:
        if d.rank == 0:
            d.gather(1)
        else:
            d.allgather(1)
        emit("no error")
    except DistributedError as err:
        emit(str(err))
    """
    results = run_ranks(tmp_path, body, size=2)
    assert "called gather() while rank 1 called allgather()" in results[0][1]


def test_ranks_must_agree_on_the_world(tmp_path: Path) -> None:
    body = """
    try:
        d = make(cross_size=2, cross_rank=0, chief_ip="127.0.0.1") if rank == 1 else make()
        emit("no error")
    except DistributedError as err:
        emit(str(err))
    """
    results = run_ranks(tmp_path, body, size=2)
    for _, res, err in results:
        assert "disagree on cross_size" in res, err


def test_a_stranger_on_the_port_is_refused(tmp_path: Path) -> None:
    """Another process listening on the chief's port: the worker's handshake fails with a
    message naming the port variable, instead of unpickling whatever it sends."""
    port = allocate_ports()["INTER_TRAIN_PROCESS_COMM_PORT_1"]
    stranger = socket.socket()
    stranger.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    stranger.bind(("127.0.0.1", port))
    stranger.listen(4)
    try:
        body = f"""
        try:
            make(pub_port={port})
        except DistributedError as err:
            emit(str(err))
        """
        script_env = {"DET_LOCAL_DIST_TIMEOUT": "5"}
        # only rank 1 runs: it connects to the stranger
        script = tmp_path / "one.py"
        script.write_text(PRELUDE + textwrap.dedent(body))
        env = dict(os.environ, PYTHONPATH=str(REPO), **script_env)
        proc = subprocess.Popen(
            [sys.executable, str(script), "1", "2", "2"],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        conn, _ = stranger.accept()
        conn.sendall(b"DLH1" + b"\0" * 16)
        conn.recv(1024)
        conn.sendall(b"\0" * 32)  # a wrong proof
        stdout, _ = proc.communicate(timeout=TIMEOUT)
        conn.close()
        assert "handshake failed" in stdout
        assert "INTER_TRAIN_PROCESS_COMM_PORT_1" in stdout
    finally:
        stranger.close()


def test_chief_port_in_use(tmp_path: Path) -> None:
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen(1)
    port = holder.getsockname()[1]
    try:
        with pytest.raises(DistributedError, match=f"cannot listen on 127.0.0.1:{port}"):
            DistributedContext(
                rank=0, size=2, local_rank=0, local_size=2, cross_rank=0, cross_size=1,
                pub_port=port,
            )  # fmt: skip
    finally:
        holder.close()


def test_size_one_and_dummy_need_no_sockets() -> None:
    d = DummyDistributedContext()
    assert d.gather(1) == [1]
    assert d.allgather(2) == [2]
    assert d.broadcast(3) == 3
    assert d.gather_local(4) == [4]
    assert d.allgather_local(5) == [5]
    assert d.broadcast_local(6) == 6
    d.close()


def test_constructor_checks_its_arguments(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="rank 2 is outside size 2"):
        DistributedContext(rank=2, size=2, local_rank=0, local_size=2, cross_rank=0, cross_size=1)
    with pytest.raises(ValueError, match="no chief_ip"):
        DistributedContext(rank=1, size=4, local_rank=1, local_size=2, cross_rank=0, cross_size=2)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ValueError, match="RANK is not set.*torchrun"):
        DistributedContext.from_torch_distributed()
    with pytest.raises(ValueError, match="RANK is not set.*DeepSpeed"):
        DistributedContext.from_deepspeed()


def test_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    env = {
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "1",
        "GROUP_RANK": "0",
        "GROUP_WORLD_SIZE": "1",
        "LOCAL_SIZE": "1",
        "CROSS_RANK": "0",
        "CROSS_SIZE": "1",
        "DET_CHIEF_IP": "10.0.0.1",
    }
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    for d in (DistributedContext.from_torch_distributed(), DistributedContext.from_deepspeed()):
        assert (d.rank, d.size, d.local_rank, d.local_size, d.cross_rank, d.cross_size) == (
            0, 1, 0, 1, 0, 1,
        )  # fmt: skip

    class Hvd:
        def rank(self) -> int:
            return 0

        size = local_size = cross_size = lambda self: 1  # noqa: E731
        local_rank = cross_rank = rank

    d = DistributedContext.from_horovod(Hvd())
    assert (d.rank, d.size, d.cross_size) == (0, 1, 1)

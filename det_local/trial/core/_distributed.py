"""DistributedContext: who this process is among the trial's workers, and small collectives.

As Determined's: rank/size/local/cross numbers from the launcher's environment, and gather /
allgather / broadcast of picklable Python objects across all ranks or the ranks of one machine.
These need no torch: they run over det-local's own sockets (``_hub``), a TCP hub on the chief
at INTER_TRAIN_PROCESS_COMM_PORT_1 (+ port_offset) for the trial and, when the trial spans
several machines, a unix-socket hub per machine. On one machine the chief listens on loopback
and the machine's group is the trial's, so the same connections carry both; on several the
chief listens on DET_CHIEF_IP (its LAN address, or every interface when that address is not
its own), and the members dial DET_CHIEF_IP:INTER_TRAIN_PROCESS_COMM_PORT_1. Every node must
share the secret (DET_LOCAL_DIST_SECRET: each node's session token is its own).

Constructing one is itself a collective: every rank must construct it, and the ranks check
that they agree on the sizes. A peer that exits makes the collectives of the others raise
(``DistributedError``) instead of hanging.
"""

from __future__ import annotations

import errno
import os
import shutil
import socket
import tempfile
import weakref
from typing import Any

from det_local.trial.core import _hub
from det_local.trial.core._hub import DistributedError

PORT_1_ENV = "INTER_TRAIN_PROCESS_COMM_PORT_1"
PORT_2_ENV = "INTER_TRAIN_PROCESS_COMM_PORT_2"
DEFAULT_PORT_1 = 12360
MAX_SLOTS_PER_AGENT = 16  # Determined's default gap between the two ports


def default_ports() -> tuple[int, int]:
    """(pub, pull) from INTER_TRAIN_PROCESS_COMM_PORT_1/_2, else 12360 and PORT_1 + 16."""
    try:
        port1 = int(os.environ.get(PORT_1_ENV) or DEFAULT_PORT_1)
        port2 = int(os.environ.get(PORT_2_ENV) or port1 + MAX_SLOTS_PER_AGENT)
    except ValueError:
        raise DistributedError(
            f"{PORT_1_ENV}/{PORT_2_ENV} must be port numbers; got "
            f"{os.environ.get(PORT_1_ENV)!r}/{os.environ.get(PORT_2_ENV)!r}"
        ) from None
    return port1, port2


class _Group:
    """Collectives over one hub: this process is the hub's chief or one of its members."""

    def __init__(self, index: int, size: int, hub: _hub.Hub | None, link: _hub.Link | None) -> None:
        self.index = index
        self.size = size
        self.hub = hub
        self.link = link

    def gather(self, stuff: Any) -> list[Any] | None:
        if self.hub is not None:
            others = self.hub.collect("gather")
            # Released only once everyone has sent: a fast worker cannot run into the next one.
            self.hub.send_all("gather_ack", None)
            return [stuff, *others]
        assert self.link is not None
        self.link.send("gather", stuff)
        self.link.recv("gather_ack")
        return None

    def allgather(self, stuff: Any) -> list[Any]:
        if self.hub is not None:
            everything = [stuff, *self.hub.collect("allgather")]
            self.hub.send_all("allgather", everything)
            return everything
        assert self.link is not None
        self.link.send("allgather", stuff)
        result: list[Any] = self.link.recv("allgather")
        return result

    def broadcast(self, stuff: Any) -> Any:
        if self.hub is not None:
            self.hub.send_all("broadcast", stuff)
            return stuff
        assert self.link is not None
        return self.link.recv("broadcast")

    def close(self) -> None:
        if self.hub is not None:
            self.hub.close()
        if self.link is not None:
            self.link.close()


def _not_here(err: OSError) -> bool:
    """A bind failed because the address is not one of this machine's (or not an address)."""
    return isinstance(err, socket.gaierror) or err.errno in (
        errno.EADDRNOTAVAIL,
        errno.EAFNOSUPPORT,
    )


def _close_groups(groups: list[_Group], tempdir: list[str]) -> None:
    for g in groups:
        g.close()
    groups.clear()
    for d in tempdir:
        shutil.rmtree(d, ignore_errors=True)
    tempdir.clear()


class DistributedContext:
    """Rank information plus gather/allgather/broadcast of Python objects across workers.

    ``rank, size`` number the trial's processes; ``local_rank, local_size`` those on this
    machine; ``cross_rank, cross_size`` the machines. When the trial spans machines
    (``local_size != size``) ``chief_ip`` must name the chief's address; on one machine the
    chief is reached at 127.0.0.1. The collectives are for coordination (a few objects), not
    a replacement for the training framework's own.
    """

    def __init__(
        self,
        *,
        rank: int,
        size: int,
        local_rank: int,
        local_size: int,
        cross_rank: int,
        cross_size: int,
        chief_ip: str | None = None,
        pub_port: int | None = None,
        pull_port: int | None = None,
        port_offset: int = 0,
        force_tcp: bool = False,
    ) -> None:
        numbers = {
            "rank": rank,
            "size": size,
            "local_rank": local_rank,
            "local_size": local_size,
            "cross_rank": cross_rank,
            "cross_size": cross_size,
        }
        for name, value in numbers.items():
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"DistributedContext: {name} must be an int, not {value!r}")
        for index, count in (("rank", "size"), ("local_rank", "local_size")):
            if not 0 <= numbers[index] < numbers[count]:
                raise ValueError(
                    f"DistributedContext: {index} {numbers[index]} is outside "
                    f"{count} {numbers[count]} (expected 0 <= {index} < {count})"
                )
        if not 0 <= cross_rank < cross_size:
            raise ValueError(
                f"DistributedContext: cross_rank {cross_rank} is outside cross_size {cross_size}"
            )
        if local_size > size:
            raise ValueError(
                f"DistributedContext: local_size {local_size} is larger than size {size}"
            )
        self.rank = rank
        self.size = size
        self.local_rank = local_rank
        self.local_size = local_size
        self.cross_rank = cross_rank
        self.cross_size = cross_size
        self._is_chief = rank == 0
        self._is_local_chief = local_rank == 0
        if local_size != size:
            if not chief_ip:
                raise ValueError(
                    f"DistributedContext: this trial spans machines (local_size {local_size} != "
                    f"size {size}) but no chief_ip was given; pass chief_ip= or set DET_CHIEF_IP"
                )
            self._chief_ip = chief_ip
        else:
            self._chief_ip = "127.0.0.1"
        default_pub, default_pull = default_ports() if size > 1 else (DEFAULT_PORT_1, 0)
        self._pub_port = (default_pub if pub_port is None else int(pub_port)) + port_offset
        self._pull_port = (default_pull if pull_port is None else int(pull_port)) + port_offset
        self._groups: list[_Group] = []
        self._tempdirs: list[str] = []
        self._global: _Group | None = None
        self._local: _Group | None = None
        self._finalizer = weakref.finalize(self, _close_groups, self._groups, self._tempdirs)
        if size > 1:
            try:
                self._init_ipc(force_tcp)
            except BaseException:
                self.close()
                raise

    # -- set-up -------------------------------------------------------------------------
    def _init_ipc(self, force_tcp: bool) -> None:
        key = _hub.secret()
        timeout = _hub.connect_timeout()
        one_machine = self.local_size == self.size
        if self._is_chief:
            # one machine: loopback only; several: the chief's address the others dial
            # (DET_CHIEF_IP), or every interface when that is not one of this machine's
            host = "127.0.0.1" if one_machine else self._chief_ip
            try:
                try:
                    listener, _ = _hub.listen(("tcp", host, self._pub_port), self.size)
                except OSError as err:
                    if one_machine or not _not_here(err):
                        raise
                    host = "0.0.0.0"
                    listener, _ = _hub.listen(("tcp", host, self._pub_port), self.size)
            except OSError as err:
                raise DistributedError(
                    f"the chief (rank 0) cannot listen on {host}:{self._pub_port} "
                    f"({err.strerror or err}): another trial or program uses that port; set "
                    f"{PORT_1_ENV} to a free port on every rank (det-local's launchers do)"
                ) from None
            hub = _hub.Hub(listener, self.size, key, "the chief (rank 0)")
            self._global = _Group(0, self.size, hub, None)
            self._groups.append(self._global)
            hub.accept_all(timeout)
        else:
            link = _hub.Link(
                ("tcp", self._chief_ip, self._pub_port),
                self.rank,
                key,
                f"rank {self.rank}",
                timeout,
            )
            self._global = _Group(self.rank, self.size, None, link)
            self._groups.append(self._global)

        me = (self.rank, self.local_rank, self.cross_rank, self.size, self.local_size)
        everyone = self._global.allgather((*me, self.cross_size))
        self._check_world(everyone)
        if self.cross_size == 1 and all(r == lr for r, lr, *_ in everyone):
            self._local = self._global  # one machine: its group is the trial's
            return
        # every rank decides alike (from what all of them said): a machine that runs one rank
        # still takes part in the collective that sets up the other machines' groups
        if max(e[4] for e in everyone) < 2:
            return  # one rank per machine: no machine has a group of its own
        self._init_local(key, timeout, force_tcp)

    def _init_local(self, key: bytes, timeout: float, force_tcp: bool) -> None:
        assert self._global is not None
        listener: socket.socket | None = None
        addr: _hub.Address | None = None
        if self._is_local_chief and self.local_size > 1:
            if force_tcp or not hasattr(socket, "AF_UNIX"):
                listener, addr = _hub.listen(("tcp", "127.0.0.1", 0), self.local_size)
            else:
                tempdir = tempfile.mkdtemp(prefix="det-local-dist-")
                self._tempdirs.append(tempdir)
                listener, addr = _hub.listen(
                    ("unix", os.path.join(tempdir, "local.sock")), self.local_size
                )
        chiefs = self._global.allgather((self.cross_rank, addr) if addr else None)
        if self.local_size < 2:
            return  # alone on its machine: gather_local() and co. need no group
        if listener is not None:
            hub = _hub.Hub(
                listener,
                self.local_size,
                key,
                f"the local chief (rank {self.rank})",
                names="local rank",
            )
            self._local = _Group(0, self.local_size, hub, None)
            self._groups.append(self._local)
            hub.accept_all(timeout)
            return
        mine = [a for c in chiefs if c is not None and c[0] == self.cross_rank for a in c[1:]]
        if len(mine) != 1:
            raise DistributedError(
                f"rank {self.rank}: found {len(mine)} local chiefs (local_rank 0) for machine "
                f"{self.cross_rank}; expected exactly one"
            )
        link = _hub.Link(mine[0], self.local_rank, key, f"rank {self.rank}", timeout)
        self._local = _Group(self.local_rank, self.local_size, None, link)
        self._groups.append(self._local)

    def _check_world(self, everyone: list[tuple[int, ...]]) -> None:
        """Every rank must describe the same world: fail on all of them if not."""
        sizes = {e[3] for e in everyone}
        if sizes != {self.size}:
            said = ", ".join(f"rank {e[0]} says {e[3]}" for e in everyone)
            raise DistributedError(f"the ranks disagree on the trial's size: {said}")
        if {e[5] for e in everyone} != {self.cross_size}:
            said = ", ".join(f"rank {e[0]} says {e[5]}" for e in everyone)
            raise DistributedError(f"the ranks disagree on cross_size: {said}")
        machines: dict[int, list[tuple[int, ...]]] = {}
        for e in everyone:
            machines.setdefault(e[2], []).append(e)
        if len(machines) != self.cross_size:
            raise DistributedError(
                f"the ranks name {len(machines)} machines (cross_rank values "
                f"{sorted(machines)}) but cross_size is {self.cross_size}"
            )
        for cross, members in sorted(machines.items()):
            local_sizes = {m[4] for m in members}
            local_ranks = sorted(m[1] for m in members)
            if local_sizes != {len(members)} or local_ranks != list(range(len(members))):
                ranks = [m[0] for m in members]
                raise DistributedError(
                    f"machine {cross} (ranks {ranks}) has local ranks {local_ranks} and "
                    f"local_size {sorted(local_sizes)}; expected local ranks 0..n-1 and "
                    f"local_size n = {len(members)}"
                )

    # -- constructors from launchers' environments ----------------------------------------
    @staticmethod
    def _env_int(name: str, launcher: str) -> int:
        value = os.environ.get(name)
        if value is None:
            raise ValueError(
                f"{name} is not set: DistributedContext.from_{launcher}() reads the variables "
                f"that {_LAUNCHERS[launcher]} sets; run the script under it"
            )
        try:
            return int(value)
        except ValueError:
            raise ValueError(f"{name}={value!r} is not an integer") from None

    @classmethod
    def from_torch_distributed(cls, chief_ip: str | None = None) -> DistributedContext:
        """From torchrun's RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK and
        GROUP_WORLD_SIZE; chief_ip from the argument or DET_CHIEF_IP."""

        def get(name: str) -> int:
            return cls._env_int(name, "torch_distributed")

        return cls(
            rank=get("RANK"),
            size=get("WORLD_SIZE"),
            local_rank=get("LOCAL_RANK"),
            local_size=get("LOCAL_WORLD_SIZE"),
            cross_rank=get("GROUP_RANK"),
            cross_size=get("GROUP_WORLD_SIZE"),
            chief_ip=chief_ip or os.environ.get("DET_CHIEF_IP"),
        )

    @classmethod
    def from_deepspeed(cls, chief_ip: str | None = None) -> DistributedContext:
        """From DeepSpeed's launcher: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_SIZE, CROSS_RANK and
        CROSS_SIZE; chief_ip from the argument or DET_CHIEF_IP."""

        def get(name: str) -> int:
            return cls._env_int(name, "deepspeed")

        return cls(
            rank=get("RANK"),
            size=get("WORLD_SIZE"),
            local_rank=get("LOCAL_RANK"),
            local_size=get("LOCAL_SIZE"),
            cross_rank=get("CROSS_RANK"),
            cross_size=get("CROSS_SIZE"),
            chief_ip=chief_ip or os.environ.get("DET_CHIEF_IP"),
        )

    @classmethod
    def from_horovod(cls, hvd: Any, chief_ip: str | None = None) -> DistributedContext:
        """From an initialised ``horovod.<framework>`` module (``hvd.init()`` called)."""
        return cls(
            rank=hvd.rank(),
            size=hvd.size(),
            local_rank=hvd.local_rank(),
            local_size=hvd.local_size(),
            cross_rank=hvd.cross_rank(),
            cross_size=hvd.cross_size(),
            chief_ip=chief_ip or os.environ.get("DET_CHIEF_IP"),
        )

    # -- accessors -----------------------------------------------------------------------
    def get_rank(self) -> int:
        return self.rank

    def get_local_rank(self) -> int:
        return self.local_rank

    def get_size(self) -> int:
        return self.size

    def get_local_size(self) -> int:
        return self.local_size

    def get_cross_rank(self) -> int:
        return self.cross_rank

    def get_cross_size(self) -> int:
        return self.cross_size

    def get_num_agents(self) -> int:
        return self.cross_size

    # -- collectives ----------------------------------------------------------------------
    def _group(self, local: bool) -> _Group:
        group = self._local if local else self._global
        if group is None:
            raise DistributedError(
                f"rank {self.rank}: this DistributedContext is closed; collectives need an open one"
            )
        return group

    def gather(self, stuff: Any) -> list[Any] | None:
        """The chief gets every rank's ``stuff`` in rank order; the others get None."""
        if self.size < 2:
            return [stuff]
        return self._group(False).gather(stuff)

    def gather_local(self, stuff: Any) -> list[Any] | None:
        """The local chief gets every local rank's ``stuff`` in local-rank order; others None."""
        if self.local_size < 2:
            return [stuff]
        return self._group(True).gather(stuff)

    def allgather(self, stuff: Any) -> list[Any]:
        """Every rank gets every rank's ``stuff``, in rank order."""
        if self.size < 2:
            return [stuff]
        return self._group(False).allgather(stuff)

    def allgather_local(self, stuff: Any) -> list[Any]:
        """Every local rank gets every local rank's ``stuff``, in local-rank order."""
        if self.local_size < 2:
            return [stuff]
        return self._group(True).allgather(stuff)

    def broadcast(self, stuff: Any) -> Any:
        """Every rank gets the chief's ``stuff`` (what the others pass is ignored)."""
        if self.size < 2:
            return stuff
        return self._group(False).broadcast(stuff)

    def broadcast_local(self, stuff: Any = None) -> Any:
        """Every local rank gets the local chief's ``stuff``."""
        if self.local_size < 2:
            return stuff
        return self._group(True).broadcast(stuff)

    def close(self) -> None:
        """Close the sockets (idempotent). Determined's close() does not synchronise either."""
        self._global = None
        self._local = None
        _close_groups(self._groups, self._tempdirs)


_LAUNCHERS = {
    "torch_distributed": "torchrun (or python3 -m determined.launch.torch_distributed)",
    "deepspeed": "DeepSpeed's launcher (python3 -m determined.launch.deepspeed)",
}


class DummyDistributedContext(DistributedContext):
    """Rank 0 of 1."""

    def __init__(self) -> None:
        super().__init__(rank=0, size=1, local_rank=0, local_size=1, cross_rank=0, cross_size=1)


__all__ = ["DistributedContext", "DistributedError", "DummyDistributedContext", "default_ports"]

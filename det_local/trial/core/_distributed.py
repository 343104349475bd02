"""DistributedContext: who this process is among the trial's workers."""

from __future__ import annotations

import os
from typing import Any

from det_local.errors import NotSupportedYet


class DistributedContext:
    """Rank information plus small collectives over Python objects.

    This version runs every trial as one process (rank 0 of 1); a size above one needs the
    launchers (torch_distributed, deepspeed) and is refused with a clear message until then.
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
        if size > 1:
            raise NotSupportedYet(
                f"DistributedContext of size {size}: multi-process trials need the "
                "torch_distributed/deepspeed launchers, which this det-local version does not "
                "ship yet; run with slots_per_trial: 1"
            )
        if not 0 <= rank < max(size, 1):
            raise ValueError(f"DistributedContext: rank {rank} is outside size {size}")
        self.rank = rank
        self.size = size
        self.local_rank = local_rank
        self.local_size = local_size
        self.cross_rank = cross_rank
        self.cross_size = cross_size
        self._chief_ip = chief_ip

    # -- constructors from launchers' environments ----------------------------------------
    @classmethod
    def from_torch_distributed(cls, chief_ip: str | None = None) -> DistributedContext:
        env = os.environ
        return cls(
            rank=int(env["RANK"]),
            size=int(env["WORLD_SIZE"]),
            local_rank=int(env["LOCAL_RANK"]),
            local_size=int(env["LOCAL_WORLD_SIZE"]),
            cross_rank=int(env["GROUP_RANK"]),
            cross_size=int(env["GROUP_WORLD_SIZE"]),
            chief_ip=chief_ip or env.get("DET_CHIEF_IP"),
        )

    @classmethod
    def from_deepspeed(cls, chief_ip: str | None = None) -> DistributedContext:
        env = os.environ
        return cls(
            rank=int(env["RANK"]),
            size=int(env["WORLD_SIZE"]),
            local_rank=int(env["LOCAL_RANK"]),
            local_size=int(env["LOCAL_SIZE"]),
            cross_rank=int(env["CROSS_RANK"]),
            cross_size=int(env["CROSS_SIZE"]),
            chief_ip=chief_ip or env.get("DET_CHIEF_IP"),
        )

    @classmethod
    def from_horovod(cls, hvd: Any, chief_ip: str | None = None) -> DistributedContext:
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

    # -- collectives (one process: each is the identity) ----------------------------------
    def gather(self, stuff: Any) -> list[Any] | None:
        return [stuff]

    def gather_local(self, stuff: Any) -> list[Any] | None:
        return [stuff]

    def allgather(self, stuff: Any) -> list[Any]:
        return [stuff]

    def allgather_local(self, stuff: Any) -> list[Any]:
        return [stuff]

    def broadcast(self, stuff: Any) -> Any:
        return stuff

    def broadcast_local(self, stuff: Any = None) -> Any:
        return stuff

    def close(self) -> None:
        pass


class DummyDistributedContext(DistributedContext):
    """Rank 0 of 1."""

    def __init__(self) -> None:
        super().__init__(rank=0, size=1, local_rank=0, local_size=1, cross_rank=0, cross_size=1)

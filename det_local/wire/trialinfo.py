"""ClusterInfo / TrialInfo: what a trial knows about itself (Determined's `det.get_cluster_info()`).

det-local writes ``cluster.json`` and ``trial.json`` (Determined's keys) for each run of a trial
into a directory named by DET_LOCAL_INFO_DIR. Off det-local the variable is unset and
``get_cluster_info()`` returns None, as Determined does off-cluster.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

INFO_DIR_ENV = "DET_LOCAL_INFO_DIR"


class TrialInfo:
    def __init__(
        self,
        trial_id: int,
        experiment_id: int,
        trial_seed: int,
        hparams: dict[str, Any],
        config: dict[str, Any],
        steps_completed: int,
        trial_run_id: int,
        debug: bool = False,
        inter_node_network_interface: str | None = None,
    ) -> None:
        self.trial_id = trial_id
        self.experiment_id = experiment_id
        self.trial_seed = trial_seed
        self.hparams = hparams
        self._config = config
        self._steps_completed = steps_completed
        self._trial_run_id = trial_run_id
        self._debug = debug
        self._inter_node_network_interface = inter_node_network_interface

    @classmethod
    def _from_json(cls, d: dict[str, Any]) -> TrialInfo:
        return cls(
            trial_id=d["trial_id"],
            experiment_id=d["experiment_id"],
            trial_seed=d["trial_seed"],
            hparams=d["hparams"],
            config=d["config"],
            steps_completed=d["steps_completed"],
            trial_run_id=d["trial_run_id"],
            debug=d.get("debug", False),
            inter_node_network_interface=d.get("inter_node_network_interface"),
        )

    def _to_json(self) -> dict[str, Any]:
        return {
            "trial_id": self.trial_id,
            "experiment_id": self.experiment_id,
            "trial_seed": self.trial_seed,
            "hparams": self.hparams,
            "config": self._config,
            "steps_completed": self._steps_completed,
            "trial_run_id": self._trial_run_id,
            "debug": self._debug,
            "inter_node_network_interface": self._inter_node_network_interface,
        }


class RendezvousInfo:
    def __init__(
        self, container_addrs: list[str], container_rank: int, container_slot_counts: list[int]
    ) -> None:
        self.container_addrs = container_addrs
        self.container_rank = container_rank
        self.container_slot_counts = container_slot_counts


class ResourcesInfo:
    def __init__(self, gpu_uuids: list[str]) -> None:
        self.gpu_uuids = gpu_uuids


class ClusterInfo:
    def __init__(
        self,
        master_url: str,
        cluster_id: str,
        agent_id: str,
        slot_ids: list[int],
        task_id: str,
        allocation_id: str,
        session_token: str,
        task_type: str,
        master_cert_name: str | None = None,
        master_cert_file: str | None = None,
        latest_checkpoint: str | None = None,
        trial_info: TrialInfo | None = None,
        rendezvous_info: RendezvousInfo | None = None,
        resources_info: ResourcesInfo | None = None,
        user_data: dict[str, Any] | None = None,
    ) -> None:
        self.master_url = master_url
        self.cluster_id = cluster_id
        self.agent_id = agent_id
        self.slot_ids = slot_ids
        self.task_id = task_id
        self.allocation_id = allocation_id
        self.session_token = session_token
        self.task_type = task_type
        self.master_cert_name = master_cert_name
        self.master_cert_file = master_cert_file
        self._latest_checkpoint = latest_checkpoint
        self._trial_info = trial_info
        self._rendezvous_info = rendezvous_info or RendezvousInfo(["127.0.0.1"], 0, [len(slot_ids)])
        self._resources_info = resources_info or ResourcesInfo([])
        self._user_data = user_data or {}

    @property
    def latest_checkpoint(self) -> str | None:
        return self._latest_checkpoint if self.task_type == "TRIAL" else None

    @property
    def user_data(self) -> dict[str, Any]:
        return self._user_data

    @property
    def trial(self) -> TrialInfo:
        if self.task_type != "TRIAL" or self._trial_info is None:
            raise RuntimeError(
                f"ClusterInfo.trial is only available for TRIAL tasks, not {self.task_type}"
            )
        return self._trial_info

    @property
    def container_addrs(self) -> list[str]:
        return self._rendezvous_info.container_addrs

    @property
    def container_rank(self) -> int:
        return self._rendezvous_info.container_rank

    @property
    def container_slot_counts(self) -> list[int]:
        return self._rendezvous_info.container_slot_counts

    @property
    def gpu_uuids(self) -> list[str]:
        return self._resources_info.gpu_uuids

    # ------------------------------------------------------------------ files
    def _to_files(self, directory: Path, owner: tuple[int, int] | None = None) -> None:
        """Write the files. cluster.json holds the session token: mode 0600, owned by
        ``owner`` (uid, gid: the trial's user, for a root daemon) or the writer."""
        directory.mkdir(parents=True, exist_ok=True)
        cluster = {
            "master_url": self.master_url,
            "cluster_id": self.cluster_id,
            "agent_id": self.agent_id,
            "slot_ids": self.slot_ids,
            "task_id": self.task_id,
            "allocation_id": self.allocation_id,
            "session_token": self.session_token,
            "task_type": self.task_type,
            "master_cert_name": self.master_cert_name,
            "master_cert_file": self.master_cert_file,
            "latest_checkpoint": self._latest_checkpoint,
            "user_data": self._user_data,
        }
        _write_json(directory / "cluster.json", cluster, private=True, owner=owner)
        if self._trial_info is not None:
            _write_json(directory / "trial.json", self._trial_info._to_json())
        r = self._rendezvous_info
        _write_json(
            directory / "rendezvous.json",
            {
                "container_addrs": r.container_addrs,
                "container_rank": r.container_rank,
                "container_slot_counts": r.container_slot_counts,
            },
        )
        _write_json(directory / "resources.json", {"gpu_uuids": self._resources_info.gpu_uuids})

    @classmethod
    def _from_files(cls, directory: Path) -> ClusterInfo | None:
        cluster_file = directory / "cluster.json"
        if not cluster_file.exists():
            return None
        c = json.loads(cluster_file.read_text())
        trial_file = directory / "trial.json"
        trial = (
            TrialInfo._from_json(json.loads(trial_file.read_text()))
            if trial_file.exists()
            else None
        )
        rdzv = None
        if (directory / "rendezvous.json").exists():
            r = json.loads((directory / "rendezvous.json").read_text())
            rdzv = RendezvousInfo(
                r["container_addrs"], r["container_rank"], r["container_slot_counts"]
            )
        res = None
        if (directory / "resources.json").exists():
            res = ResourcesInfo(json.loads((directory / "resources.json").read_text())["gpu_uuids"])
        return cls(
            master_url=c["master_url"],
            cluster_id=c["cluster_id"],
            agent_id=c["agent_id"],
            slot_ids=c["slot_ids"],
            task_id=c["task_id"],
            allocation_id=c["allocation_id"],
            session_token=c["session_token"],
            task_type=c["task_type"],
            master_cert_name=c.get("master_cert_name"),
            master_cert_file=c.get("master_cert_file"),
            latest_checkpoint=c.get("latest_checkpoint"),
            trial_info=trial,
            rendezvous_info=rdzv,
            resources_info=res,
            user_data=c.get("user_data"),
        )


def _write_json(
    path: Path, value: Any, *, private: bool = False, owner: tuple[int, int] | None = None
) -> None:
    """Atomically (a temporary file, then a rename); ``private``: mode 0600 from its creation
    (never readable by others, not even for a moment), chowned to ``owner``."""
    tmp = path.with_suffix(".tmp")
    try:
        tmp.unlink()  # left by a crash; never written through (nor through a link)
    except FileNotFoundError:
        pass
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(tmp, flags, 0o600 if private else 0o644)
    try:
        if owner is not None:
            os.fchown(fd, owner[0], owner[1])
        data = json.dumps(value, indent=2).encode()
        while data:
            data = data[os.write(fd, data) :]
    finally:
        os.close(fd)
    os.replace(tmp, path)


_info: ClusterInfo | None = None
_loaded = False


def get_cluster_info() -> ClusterInfo | None:
    """The running task's ClusterInfo, or None when not launched by det-local (cached)."""
    global _info, _loaded
    if not _loaded:
        directory = os.environ.get(INFO_DIR_ENV)
        _info = ClusterInfo._from_files(Path(directory)) if directory else None
        if _info is not None:
            _node_overlay(_info)
        _loaded = True
    return _info


NODE_INFO_ENV = "DET_LOCAL_NODE_INFO"


def _node_overlay(info: ClusterInfo) -> None:
    """A trial over several Slurm nodes shares one info directory; each node's own part (its
    agent, rank, the nodes' addresses and slots) comes in DET_LOCAL_NODE_INFO, set on the node
    by ``det_local.slurm.node``. Anything malformed there is ignored."""
    raw = os.environ.get(NODE_INFO_ENV)
    if not raw:
        return
    try:
        node = json.loads(raw)
        addrs = [str(a) for a in node["container_addrs"]]
        rank = int(node["container_rank"])
        counts = [int(c) for c in node["container_slot_counts"]]
        agent = str(node["agent_id"])
    except (ValueError, TypeError, KeyError):
        return
    if len(addrs) != len(counts) or not 0 <= rank < len(addrs):
        return
    info.agent_id = agent
    info._rendezvous_info = RendezvousInfo(addrs, rank, counts)

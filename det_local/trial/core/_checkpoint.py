"""CheckpointContext: Determined's checkpoint API over a shared_fs-style directory.

A checkpoint is the directory ``<storage>/<uuid>/`` holding the user's files and a
``metadata.json``. On det-local the storage directory is the experiment's checkpoint_storage
(shared_fs host_path/storage_path) or DET_LOCAL_HOME/checkpoints; the daemon records every
checkpoint before ``store_path``/``upload`` returns.
"""

from __future__ import annotations

import contextlib
import enum
import json
import os
import shutil
import uuid as uuidlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from det_local.errors import CheckpointError
from det_local.trial.core._distributed import DistributedContext
from det_local.trial.session import Session


class DownloadMode(enum.Enum):
    LocalWorkersShareDownload = "LOCAL_WORKERS_SHARE_DOWNLOAD"
    NoSharedDownload = "NO_SHARED_DOWNLOAD"


def _resources(root: Path) -> dict[str, int]:
    """{relative path: size} for every file (directories end in '/', size 0), as Determined."""
    out: dict[str, int] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = os.path.relpath(dirpath, root)
        for d in dirnames:
            out[os.path.normpath(os.path.join(rel_dir, d)) + "/"] = 0
        for f in filenames:
            full = os.path.join(dirpath, f)
            out[os.path.normpath(os.path.join(rel_dir, f))] = os.path.getsize(full)
    return out


def _write_metadata(path: Path, metadata: dict[str, Any]) -> None:
    with open(path / "metadata.json", "w") as f:
        json.dump(metadata, f, indent=2, default=str)


class CheckpointContext:
    def __init__(
        self,
        dist: DistributedContext,
        storage_dir: Path,
        session: Session | None = None,
        *,
        require_steps: bool = True,
    ) -> None:
        self._dist = dist
        self._storage = storage_dir
        self._session = session
        self._require_steps = require_steps and session is not None

    # ------------------------------------------------------------------ helpers
    def _dir_of(self, storage_id: str) -> Path:
        return self._storage / storage_id

    def _check_metadata(self, metadata: dict[str, Any] | None) -> dict[str, Any]:
        metadata = dict(metadata or {})
        if self._require_steps and "steps_completed" not in metadata:
            raise CheckpointError(
                "checkpoint metadata must contain 'steps_completed' (e.g. "
                "store_path({'steps_completed': batches_done})) so that a resumed trial knows "
                "where it stopped"
            )
        return metadata

    def _report(self, storage_id: str, metadata: dict[str, Any]) -> None:
        path = self._dir_of(storage_id)
        _write_metadata(path, metadata)
        if self._session is None:
            return
        self._session.request(
            "checkpoint",
            uuid=storage_id,
            path=str(path),
            steps_completed=int(metadata.get("steps_completed", 0)),
            metadata=metadata,
            resources=_resources(path),
        )

    # ------------------------------------------------------------------ writing
    @contextlib.contextmanager
    def store_path(
        self, metadata: dict[str, Any] | None = None, *, shard: bool = False
    ) -> Iterator[tuple[Path, str]]:
        """Yield (path, storage_id) of a new checkpoint directory; report it on exit."""
        metadata = self._check_metadata(metadata)
        if self._dist.rank != 0 and not shard:
            raise CheckpointError(
                "store_path(shard=False) may only be called on the chief (rank 0); use "
                "shard=True to write from every rank"
            )
        storage_id = str(uuidlib.uuid4())
        path = self._dir_of(storage_id)
        path.mkdir(parents=True, exist_ok=False)
        try:
            yield path, storage_id
        except BaseException:
            shutil.rmtree(path, ignore_errors=True)
            raise
        self._report(storage_id, metadata)

    def upload(
        self,
        ckpt_dir: str | os.PathLike[str] | None,
        metadata: dict[str, Any] | None = None,
        *,
        shard: bool = False,
        selector: Callable[[str], bool] | None = None,
    ) -> str:
        """Copy the contents of ckpt_dir into a new checkpoint; returns its storage_id."""
        metadata = self._check_metadata(metadata)
        if ckpt_dir is None:
            raise CheckpointError("upload(ckpt_dir=None) is only valid with shard=True on a worker")
        src = Path(ckpt_dir)
        if not src.is_dir():
            raise CheckpointError(f"upload: {src} is not a directory")
        with self.store_path(metadata, shard=shard) as (path, storage_id):
            for dirpath, _dirs, files in os.walk(src):
                for f in files:
                    rel = os.path.relpath(os.path.join(dirpath, f), src)
                    if selector is not None and not selector(rel):
                        continue
                    dest = path / rel
                    dest.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(os.path.join(dirpath, f), dest)
        return storage_id

    # ------------------------------------------------------------------ reading
    def _existing(self, storage_id: str) -> Path:
        path = self._dir_of(storage_id)
        if not path.is_dir():
            raise CheckpointError(
                f"checkpoint {storage_id}: its directory {path} is gone; restore from another "
                "checkpoint (`det-local checkpoint list EXPERIMENT_ID`) or start the trial fresh"
            )
        return path

    @contextlib.contextmanager
    def restore_path(
        self,
        storage_id: str,
        download_mode: DownloadMode = DownloadMode.LocalWorkersShareDownload,
        *,
        selector: Callable[[str], bool] | None = None,
    ) -> Iterator[Path]:
        """Yield the checkpoint's directory (shared storage: read in place)."""
        yield self._existing(storage_id)

    def download(
        self,
        storage_id: str,
        ckpt_dir: str | os.PathLike[str],
        download_mode: DownloadMode = DownloadMode.LocalWorkersShareDownload,
        *,
        selector: Callable[[str], bool] | None = None,
    ) -> None:
        src = self._existing(storage_id)
        dest = Path(ckpt_dir)
        dest.mkdir(parents=True, exist_ok=True)
        for dirpath, _dirs, files in os.walk(src):
            for f in files:
                rel = os.path.relpath(os.path.join(dirpath, f), src)
                if selector is not None and not selector(rel):
                    continue
                (dest / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(os.path.join(dirpath, f), dest / rel)

    def get_metadata(self, storage_id: str) -> dict[str, Any]:
        path = self._existing(storage_id) / "metadata.json"
        if not path.exists():
            return {}
        result: dict[str, Any] = json.loads(path.read_text())
        return result

    def delete(self, storage_id: str) -> None:
        shutil.rmtree(self._dir_of(storage_id), ignore_errors=True)
        if self._session is not None:
            self._session.request("ckpt_delete", uuid=storage_id)

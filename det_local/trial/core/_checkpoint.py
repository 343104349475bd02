"""CheckpointContext: Determined's checkpoint API over a shared_fs-style directory.

A checkpoint is the directory ``<storage>/<uuid>/`` holding the user's files and a
``metadata.json``. On det-local the storage directory is the experiment's checkpoint_storage
(shared_fs host_path/storage_path) or DET_LOCAL_HOME/checkpoints; the daemon records every
checkpoint before ``store_path``/``upload`` returns. It also hears of each one before its
directory is made (``ckpt_begin``): a directory whose checkpoint was never recorded (its trial
died while writing it) is removed at the trial's next start or by checkpoint GC, never listed.

With several ranks, as in Determined:

* ``shard=False``: only the chief may store or upload;
* ``store_path(shard=True)``: a collective; every rank writes straight into the same
  directory (shared storage is "direct access"), then the metadata of all ranks is merged
  (dicts deep-merged; a key with different values on two ranks is an error) and the chief
  records the checkpoint; every rank returns once it is recorded;
* ``upload(ckpt_dir, shard=True)``: a collective; the checkpoint is the union of the ranks'
  directories (``None`` for a rank with nothing). Ranks sharing one directory upload it once
  (the lowest rank); a file offered by several ranks must have the same content on each (md5)
  or the upload fails naming the file and the ranks;
* ``download`` / ``restore_path`` with ``DownloadMode.LocalWorkersShareDownload`` (default):
  the ranks of one machine call in step and the local chief does the work (restore_path reads
  shared storage in place, so there is nothing to download); ``NoSharedDownload``: each rank
  on its own, no communication.
"""

from __future__ import annotations

import contextlib
import enum
import hashlib
import json
import os
import shutil
import uuid as uuidlib
from collections.abc import Callable, Collection, Iterator
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


def _files(root: Path, selector: Callable[[str], bool] | None = None) -> dict[str, int]:
    """{relative path: size} of the files under root that the selector keeps."""
    out: dict[str, int] = {}
    for dirpath, _dirs, filenames in os.walk(root):
        for f in filenames:
            full = os.path.join(dirpath, f)
            rel = os.path.relpath(full, root)
            if selector is None or selector(rel):
                out[rel] = os.path.getsize(full)
    return out


def _copy(src: Path, dest: Path, rels: list[str]) -> None:
    for rel in rels:
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src / rel, target)


def _md5(path: Path) -> str:
    digest = hashlib.md5()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _write_metadata(path: Path, metadata: dict[str, Any]) -> None:
    with open(path / "metadata.json", "w") as f:
        json.dump(metadata, f, indent=2, default=str)


def sync_tree(root: Path, skip: Collection[str] = ()) -> None:
    """fsync every file and directory of a checkpoint, so that once it is recorded its bytes
    are on the disk (a crash right after cannot leave a recorded checkpoint with empty files).
    Files already fsynced (the Trainer's own writes) cost almost nothing the second time.
    `skip`: top-level directories whose files are not synced (the Trainers' code/: a copy of
    the working directory that no resume reads; fsyncing it file by file cost 0.16-0.9 s for
    673 files, issue 28), though their entries are."""
    dirs: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirs.append(dirpath)
        if dirpath == str(root):
            dirnames[:] = [d for d in dirnames if d not in skip]
        for name in filenames:
            _fsync_path(os.path.join(dirpath, name), os.O_RDONLY)
    dirs.append(str(root.parent))  # the checkpoint's own entry in the storage directory
    for d in reversed(dirs[:-1]):  # children before parents: each entry durable in its parent
        _fsync_path(d, os.O_RDONLY | os.O_DIRECTORY)
    _fsync_path(dirs[-1], os.O_RDONLY | os.O_DIRECTORY)


def _fsync_path(path: str, flags: int) -> None:
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW)
    except OSError:  # a symlink, a socket, a file the user removed meanwhile: nothing to sync
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # a filesystem without fsync on this kind of file
    finally:
        os.close(fd)


def merge_metadata(
    all_metadata: list[dict[str, Any]],
) -> tuple[dict[str, Any], dict[str, list[int]]]:
    """Deep-merge the ranks' metadata: (merged, {"/key/path": ranks that disagree})."""
    merged: dict[str, Any] = {}
    owners: dict[str, list[int]] = {}
    conflicts: dict[str, list[int]] = {}

    def merge(into: dict[str, Any], new: dict[str, Any], rank: int, prefix: str) -> None:
        for key, value in new.items():
            full = f"{prefix}/{key}"
            owners.setdefault(full, []).append(rank)
            if isinstance(value, dict) and isinstance(into.get(key, {}), dict):
                merge(into.setdefault(key, {}), value, rank, full)
            elif key in into and into[key] != value:
                conflicts[full] = list(owners[full])
            elif key not in into:
                into[key] = value

    for rank, metadata in enumerate(all_metadata):
        merge(merged, metadata or {}, rank, "")
    return merged, conflicts


def merge_resources(
    all_resources: list[dict[str, int]],
) -> tuple[dict[str, int], dict[str, list[int]]]:
    """(union of the ranks' files, {file: ranks} for files offered by several ranks)."""
    merged: dict[str, int] = {}
    owners: dict[str, list[int]] = {}
    for rank, resources in enumerate(all_resources):
        for rel, size in resources.items():
            merged[rel] = size
            owners.setdefault(rel, []).append(rank)
    return merged, {rel: ranks for rel, ranks in owners.items() if len(ranks) > 1}


def _conflict_error(what: str, conflicts: dict[str, list[int]]) -> CheckpointError:
    listed = "; ".join(f"{name} from ranks {ranks}" for name, ranks in sorted(conflicts.items()))
    return CheckpointError(
        f"refusing to store a sharded checkpoint with conflicting {what}: {listed}; give each "
        f"rank its own {'file names' if what == 'files' else 'metadata keys'} or identical "
        "values"
    )


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

    def _report(
        self, storage_id: str, metadata: dict[str, Any], unsynced: Collection[str] = ()
    ) -> None:
        path = self._dir_of(storage_id)
        _write_metadata(path, metadata)
        admin = os.environ.get("DET_LOCAL_ADMIN_GID", "")
        if admin.isdigit():  # a root daemon's trial: its admins read even private checkpoints
            from det_local.store.acl import grant_admin_tree

            grant_admin_tree(path, int(admin))
        sync_tree(path, unsynced)  # durable before it is recorded (and before the trial goes on)
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

    def _begin(self, storage_id: str) -> Path:
        """Make a new checkpoint's directory, told to the daemon first: should the trial die
        before the checkpoint is recorded, the daemon removes the directory it left (at the
        trial's next start, or by checkpoint GC). One round trip, next to the checkpoint's
        own fsyncs and the round trip that records it."""
        if self._session is not None:
            self._session.request("ckpt_begin", uuid=storage_id)
        path = self._dir_of(storage_id)
        path.mkdir(parents=True, exist_ok=False)
        return path

    def _new_shared_dir(self) -> tuple[str, Path]:
        """The chief makes a new checkpoint directory; every rank learns its id."""
        storage_id = None
        if self._dist.rank == 0:
            storage_id = str(uuidlib.uuid4())
            self._begin(storage_id)
        storage_id = self._dist.broadcast(storage_id)
        assert isinstance(storage_id, str)
        return storage_id, self._dir_of(storage_id)

    def _merged_metadata(self, metadata: dict[str, Any] | None) -> dict[str, Any]:
        merged, conflicts = merge_metadata(self._dist.allgather(dict(metadata or {})))
        if conflicts:
            raise _conflict_error("metadata", conflicts)
        return self._check_metadata(merged)

    def _finish_shared(
        self,
        storage_id: str,
        metadata: dict[str, Any],
        error: str | None,
        unsynced: Collection[str] = (),
    ) -> None:
        """Every rank's part is written (or ``error``): the chief records the checkpoint, and
        every rank returns once it is recorded (or raises with the same message)."""
        errors = self._dist.allgather(error)
        failed = [f"rank {r}: {e}" for r, e in enumerate(errors) if e]
        chief_error = None
        if self._dist.rank == 0:
            if failed:
                shutil.rmtree(self._dir_of(storage_id), ignore_errors=True)
            else:
                try:
                    self._report(storage_id, metadata, unsynced)
                except Exception as err:
                    chief_error = str(err)
        chief_error = self._dist.broadcast(chief_error)
        if failed:
            raise CheckpointError(
                f"sharded checkpoint {storage_id} was not stored: " + "; ".join(failed)
            )
        if chief_error:
            raise CheckpointError(f"sharded checkpoint {storage_id}: {chief_error}")

    # ------------------------------------------------------------------ writing
    @contextlib.contextmanager
    def store_path(
        self,
        metadata: dict[str, Any] | None = None,
        *,
        shard: bool = False,
        _unsynced: Collection[str] = (),
    ) -> Iterator[tuple[Path, str]]:
        """Yield (path, storage_id) of a new checkpoint directory; record it on exit.

        With ``shard=True`` every rank must call it; they all write into the same path.
        ``_unsynced`` (the Trainers'): top-level directories not fsynced (`sync_tree`)."""
        if shard and self._dist.size > 1:
            with self._store_path_sharded(metadata, _unsynced) as out:
                yield out
            return
        metadata = self._check_metadata(metadata)
        if self._dist.rank != 0:
            raise CheckpointError(
                "store_path(shard=False) may only be called on the chief (rank 0); use "
                "shard=True to write from every rank"
            )
        storage_id = str(uuidlib.uuid4())
        path = self._begin(storage_id)
        try:
            yield path, storage_id
        except BaseException:
            shutil.rmtree(path, ignore_errors=True)
            raise
        self._report(storage_id, metadata, _unsynced)

    @contextlib.contextmanager
    def _store_path_sharded(
        self, metadata: dict[str, Any] | None, unsynced: Collection[str] = ()
    ) -> Iterator[tuple[Path, str]]:
        storage_id, path = self._new_shared_dir()
        try:
            yield path, storage_id
        except BaseException:
            if self._dist.rank == 0:
                shutil.rmtree(path, ignore_errors=True)
            raise
        try:
            merged = self._merged_metadata(metadata)
        except CheckpointError:
            if self._dist.rank == 0:
                shutil.rmtree(path, ignore_errors=True)
            raise
        self._finish_shared(storage_id, merged, None, unsynced)

    def upload(
        self,
        ckpt_dir: str | os.PathLike[str] | None,
        metadata: dict[str, Any] | None = None,
        *,
        shard: bool = False,
        selector: Callable[[str], bool] | None = None,
    ) -> str:
        """Copy the contents of ckpt_dir into a new checkpoint; returns its storage_id."""
        if shard:
            return self._upload_sharded(ckpt_dir, metadata, selector)
        if self._dist.rank != 0:
            raise CheckpointError(
                f"upload(shard=False) may only be called on the chief (rank 0), not rank "
                f"{self._dist.rank}; use shard=True to upload from every rank"
            )
        metadata = self._check_metadata(metadata)
        if ckpt_dir is None:
            raise CheckpointError(
                "upload(ckpt_dir=None) would store nothing; ckpt_dir=None is only for ranks "
                "with nothing to add to a shard=True upload"
            )
        src = Path(ckpt_dir)
        if not src.is_dir():
            raise CheckpointError(f"upload: {src} is not a directory")
        with self.store_path(metadata) as (path, storage_id):
            _copy(src, path, sorted(_files(src, selector)))
        return storage_id

    def _upload_sharded(
        self,
        ckpt_dir: str | os.PathLike[str] | None,
        metadata: dict[str, Any] | None,
        selector: Callable[[str], bool] | None,
    ) -> str:
        dist = self._dist
        if selector is not None and ckpt_dir is None:
            raise CheckpointError("upload(shard=True): a selector needs a ckpt_dir")
        src = None if ckpt_dir is None else Path(ckpt_dir)
        problem = None
        if src is not None and not src.is_dir():
            problem = f"{src} is not a directory"
        problems = dist.allgather(problem)
        if any(problems):
            raise CheckpointError(
                "upload(shard=True): "
                + "; ".join(f"rank {r}: {p}" for r, p in enumerate(problems) if p)
            )
        if not any(dist.allgather(src is not None)):
            raise CheckpointError(
                "upload(ckpt_dir=None, shard=True) on every rank: at least one rank must "
                "pass a directory"
            )
        merged_metadata = self._merged_metadata(metadata)
        # Ranks that share one directory (same device and inode) upload it once: the lowest.
        uid = None
        if src is not None:
            st = os.stat(src)
            uid = (st.st_dev, st.st_ino)
        uids = dist.allgather(uid)
        uploads = src is not None and (selector is not None or uids.index(uid) == dist.rank)
        mine = _files(src, selector) if uploads and src is not None else {}
        _, shared = merge_resources(dist.allgather(mine))
        # A file several ranks offer must be the same file: compare md5s, in one round.
        assert src is not None or not mine
        sums = {rel: _md5(src / rel) for rel in shared if rel in mine} if src else {}
        all_sums = dist.allgather(sums)
        conflicts = {
            rel: ranks
            for rel, ranks in shared.items()
            if len({all_sums[r][rel] for r in ranks}) > 1
        }
        if conflicts:
            raise _conflict_error("files", conflicts)
        ours = sorted(rel for rel in mine if rel not in shared or min(shared[rel]) == dist.rank)
        storage_id, path = self._new_shared_dir()
        error = None
        try:
            if src is not None:
                _copy(src, path, ours)
        except OSError as err:
            error = f"copying {src}: {err}"
        self._finish_shared(storage_id, merged_metadata, error)
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

    def _local_chief_check(self, storage_id: str) -> Path:
        """LocalWorkersShareDownload: the local chief checks; every local rank gets the result
        (or raises the same error)."""
        dist = self._dist
        if dist.local_size < 2:
            return self._existing(storage_id)
        answer: tuple[str, str] | None = None
        if dist.local_rank == 0:
            try:
                answer = ("ok", str(self._existing(storage_id)))
            except CheckpointError as err:
                answer = ("error", str(err))
        answer = dist.broadcast_local(answer)
        assert answer is not None
        if answer[0] == "error":
            raise CheckpointError(answer[1])
        return Path(answer[1])

    @contextlib.contextmanager
    def restore_path(
        self,
        storage_id: str,
        download_mode: DownloadMode = DownloadMode.LocalWorkersShareDownload,
        *,
        selector: Callable[[str], bool] | None = None,
    ) -> Iterator[Path]:
        """Yield the checkpoint's directory (shared storage: read in place).

        With LocalWorkersShareDownload all ranks of a machine call it in step."""
        if DownloadMode(download_mode) == DownloadMode.NoSharedDownload:
            yield self._existing(storage_id)
            return
        path = self._local_chief_check(storage_id)
        try:
            yield path
        finally:
            if self._dist.local_size > 1:
                self._dist.gather_local(None)  # the local chief waits for its workers

    def download(
        self,
        storage_id: str,
        ckpt_dir: str | os.PathLike[str],
        download_mode: DownloadMode = DownloadMode.LocalWorkersShareDownload,
        *,
        selector: Callable[[str], bool] | None = None,
    ) -> None:
        """Copy the checkpoint's files (those the selector keeps) into ckpt_dir.

        With LocalWorkersShareDownload all ranks of a machine call in step; the local chief
        copies once, every file some local rank's selector keeps, into its ckpt_dir."""
        dest = Path(ckpt_dir)
        dist = self._dist
        if DownloadMode(download_mode) == DownloadMode.NoSharedDownload or dist.local_size < 2:
            src = self._existing(storage_id)
            dest.mkdir(parents=True, exist_ok=True)
            _copy(src, dest, sorted(_files(src, selector)))
            return
        src = self._local_chief_check(storage_id)
        want_filter = any(dist.allgather_local(selector is not None))
        names = sorted(_files(src)) if dist.local_rank == 0 else None
        if want_filter:
            names = dist.broadcast_local(names)
            assert names is not None
            keep = [selector is None or selector(n) for n in names]
            picks = dist.gather_local(keep)
            if picks is not None:
                names = [n for i, n in enumerate(names) if any(p[i] for p in picks)]
        error = None
        if dist.local_rank == 0:
            assert names is not None
            try:
                dest.mkdir(parents=True, exist_ok=True)
                _copy(src, dest, names)
            except OSError as err:
                error = f"downloading checkpoint {storage_id} to {dest}: {err}"
        error = dist.broadcast_local(error)
        if error:
            raise CheckpointError(error)

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

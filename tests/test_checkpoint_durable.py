"""A checkpoint is on the disk before it is recorded: every file and directory of it, and its
entry in the storage directory, are fsynced (DESIGN rule 2: durable before acting)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from det_local.trial.core import _checkpoint


@pytest.fixture
def synced(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The paths os.fsync is called on, in order (the real fsync still runs)."""
    seen: list[str] = []
    real = os.fsync

    def record(fd: int) -> None:
        seen.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(os, "fsync", record)
    return seen


def test_sync_tree_covers_files_directories_and_the_parent_entry(
    tmp_path: Path, synced: list[str]
) -> None:
    ckpt = tmp_path / "storage" / "uuid-1"
    (ckpt / "code" / "sub").mkdir(parents=True)
    (ckpt / "state_dict.pth").write_bytes(b"w" * 10_000)
    (ckpt / "code" / "sub" / "model_def.py").write_text("x = 1\n")
    (ckpt / "link").symlink_to(ckpt / "state_dict.pth")  # not followed, not an error
    _checkpoint.sync_tree(ckpt)
    files = {str(ckpt / "state_dict.pth"), str(ckpt / "code" / "sub" / "model_def.py")}
    dirs = [str(ckpt / "code" / "sub"), str(ckpt / "code"), str(ckpt), str(ckpt.parent)]
    assert files <= set(synced)
    assert [p for p in synced if p in dirs] == dirs  # children before their parents
    assert str(ckpt / "link") not in synced


def test_a_core_api_checkpoint_is_synced_before_store_path_returns(
    tmp_path: Path, synced: list[str]
) -> None:
    from det_local.trial.core import init

    with init(checkpoint_storage=str(tmp_path / "ckpts")) as ctx:
        with ctx.checkpoint.store_path({"steps_completed": 1}) as (path, storage_id):
            (path / "weights").write_bytes(b"1" * 4096)
            assert synced == []  # nothing yet: the user is still writing
        assert str(path / "weights") in synced
        assert str(path / "metadata.json") in synced
        assert str(path) in synced and str(path.parent) in synced
        assert (path / "metadata.json").exists() and storage_id == path.name

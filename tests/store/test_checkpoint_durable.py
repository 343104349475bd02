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


def test_sync_tree_leaves_the_skipped_directories_files_alone(
    tmp_path: Path, synced: list[str]
) -> None:
    ckpt = tmp_path / "storage" / "uuid-2"
    (ckpt / "code" / "sub").mkdir(parents=True)
    (ckpt / "state_dict.pth").write_bytes(b"w" * 10_000)
    (ckpt / "code" / "train.py").write_text("x = 1\n")
    (ckpt / "code" / "sub" / "model_def.py").write_text("x = 1\n")
    _checkpoint.sync_tree(ckpt, ("code",))
    assert str(ckpt / "state_dict.pth") in synced
    assert not [p for p in synced if p.startswith(str(ckpt / "code"))], synced
    assert synced[-2:] == [str(ckpt), str(ckpt.parent)]  # code/'s entry is in ckpt's


def test_a_trainers_code_copy_is_not_synced_file_by_file(
    tmp_path: Path, synced: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An off-cluster fit's checkpoint: its own files are on the disk, its code/ (a copy of the
    working directory, which no resume reads) is copied but not fsynced per file (issue 28)."""
    import torch

    from det_local.compat.determined import pytorch

    work = tmp_path / "work"
    (work / "pkg").mkdir(parents=True)
    for i in range(30):
        (work / "pkg" / f"m{i}.py").write_text(f"x = {i}\n")
    monkeypatch.chdir(work)

    class Tiny(pytorch.PyTorchTrial):
        def __init__(self, context: pytorch.PyTorchTrialContext) -> None:
            self.context = context
            self.model = context.wrap_model(torch.nn.Linear(2, 1))
            self.opt = context.wrap_optimizer(torch.optim.SGD(self.model.parameters(), lr=0.1))

        def train_batch(self, batch: object, epoch_idx: int, batch_idx: int) -> object:
            loss = self.model(torch.ones(4, 2)).sum()
            self.context.backward(loss)
            self.context.step_optimizer(self.opt)
            return {"loss": loss}

        def evaluate_batch(self, batch: object) -> dict[str, object]:
            return {"v": 1.0}

        def build_training_data_loader(self) -> object:
            return pytorch.DataLoader(
                torch.utils.data.TensorDataset(torch.ones(8, 2)), batch_size=4
            )

        def build_validation_data_loader(self) -> object:
            return pytorch.DataLoader(
                torch.utils.data.TensorDataset(torch.ones(4, 2)), batch_size=4
            )

    with pytorch.init(hparams={"global_batch_size": 4}, enable_tensorboard_logging=False) as ctx:
        pytorch.Trainer(Tiny(ctx), ctx).fit(max_length=pytorch.Batch(2))
    [state] = [Path(p) for p in synced if p.endswith("/state_dict.pth")]
    ckpt = state.parent
    assert (ckpt / "code" / "pkg" / "m29.py").read_text() == "x = 29\n"
    assert str(ckpt / "metadata.json") in synced
    assert not [p for p in synced if p.startswith(str(ckpt / "code"))]

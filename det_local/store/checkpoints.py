"""Copying checkpoints out of storage (`checkpoint download`, client checkpoint download)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from det_local.errors import CheckpointError
from det_local.store.records import CheckpointRecord
from det_local.store.states import CHECKPOINT_DOWNLOADABLE as _DOWNLOADABLE


def download_checkpoint(ckpt: CheckpointRecord, dest: Path) -> None:
    """Copy a checkpoint's files to dest (Determined's Checkpoint.download): nothing is copied
    when dest already holds a metadata.json; metadata.json is written last."""
    where = f"checkpoint {ckpt.uuid} of trial {ckpt.trial_id}"
    if ckpt.state not in _DOWNLOADABLE:
        raise CheckpointError(
            f"{where} is {ckpt.state}; only {' or '.join(_DOWNLOADABLE)} checkpoints can be "
            f"downloaded: pick another with `det-local checkpoint list {ckpt.experiment_id}`"
        )
    if (dest / "metadata.json").exists():
        return  # already downloaded
    src = Path(ckpt.path)
    if not src.is_dir():
        raise CheckpointError(
            f"{where}: its files at {src} are gone (deleted or moved outside det-local); "
            "put them back there, or pick another checkpoint with "
            f"`det-local checkpoint list {ckpt.experiment_id}`"
        )
    try:
        # metadata.json goes last, so that its presence means a complete copy.
        shutil.copytree(
            src,
            dest,
            dirs_exist_ok=True,
            ignore=lambda d, names: ["metadata.json"] if Path(d) == src else [],
        )
        partial = dest / f".metadata.json.{os.getpid()}.partial"
        if (src / "metadata.json").is_file():
            shutil.copyfile(src / "metadata.json", partial)
        else:  # as Determined does, write one from the record
            partial.write_text(json.dumps(ckpt.metadata, indent=2, sort_keys=True) + "\n")
        os.replace(partial, dest / "metadata.json")
    except OSError as err:
        raise CheckpointError(
            f"{where}: copying {src} to {dest} failed: {err}; "
            "free some space or choose another directory with --output"
        ) from err

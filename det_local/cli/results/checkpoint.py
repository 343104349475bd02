"""`det-local checkpoint`: list, describe and download a trial's checkpoints.

Also holds the small formatting helpers that the experiment and trial commands share (times,
sizes, the checkpoints table). Top level imports typer and the standard library only.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer

from det_local.tables import fmt_time, fmt_value

if TYPE_CHECKING:
    from det_local.store.records import CheckpointRecord

app = typer.Typer(
    no_args_is_help=True,
    rich_markup_mode=None,
    help="Checkpoints: list, describe, download, delete.",
)

__all__ = ["JsonFlag", "fmt_time", "fmt_value"]

JsonFlag = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")]


# ---------------------------------------------------------------------------- shared formatting
def fmt_bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{int(size)} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"  # unreachable


def checkpoint_size(ckpt: CheckpointRecord) -> int:
    return sum(int(v) for v in ckpt.resources.values() if isinstance(v, (int, float)))


def checkpoints_table(ckpts: Iterable[CheckpointRecord]) -> str:
    from det_local.cli.common import table

    rows = [
        [
            c.uuid,
            c.trial_id,
            c.steps_completed,
            c.state,
            fmt_bytes(checkpoint_size(c)),
            fmt_time(c.created_at),
        ]
        for c in ckpts
    ]
    headers = ["UUID", "Trial", "Steps", "State", "Size", "Created"]
    return table(headers, rows, flex=(), optional=("Created",))


def confirm(question: str) -> bool:
    """Ask a yes/no question (no by default); False when there is nobody to answer (stdin
    closed), so that a script without --yes deletes nothing."""
    try:
        return bool(typer.confirm(question, default=False))
    except Exception as err:  # click's Abort (typer may bundle its own click): EOF, Ctrl-C
        if type(err).__name__ == "Abort":
            return False
        raise


# ---------------------------------------------------------------------------- commands
@app.command("list")
def list_checkpoints(
    experiment_id: Annotated[
        int, typer.Argument(metavar="EXPERIMENT_ID", help="The experiment's id.")
    ],
    trial: Annotated[
        Optional[int], typer.Option("--trial", "-t", help="Only this trial's checkpoints.")
    ] = None,
    as_json: JsonFlag = False,
) -> None:
    """List an experiment's checkpoints, oldest first."""
    from det_local.api import open_store
    from det_local.cli.common import print_json
    from det_local.errors import NotFoundError

    store = open_store()
    store.get_experiment(experiment_id)  # a clear error for an unknown id
    if trial is not None and store.get_trial(trial).experiment_id != experiment_id:
        raise NotFoundError(
            f"trial {trial} is not part of experiment {experiment_id}; "
            f"`det-local trial list {experiment_id}` shows its trials"
        )
    ckpts = store.list_checkpoints(experiment_id=experiment_id, trial_id=trial)
    if as_json:
        print_json([c.to_json() for c in ckpts])
    else:
        print(checkpoints_table(ckpts))


@app.command("describe")
def describe(
    uuid: Annotated[str, typer.Argument(metavar="UUID", help="The checkpoint's UUID.")],
    as_json: JsonFlag = False,
) -> None:
    """Show a checkpoint: its record, metadata and files."""
    from det_local.api import open_store
    from det_local.cli.common import print_json, table
    from det_local.tables import wrap_lines

    ckpt = open_store().get_checkpoint(uuid)
    if as_json:
        print_json(ckpt.to_json())
        return
    files = sorted(ckpt.resources.items())
    lines = [
        f"Checkpoint {ckpt.uuid}",
        f"  Experiment: {ckpt.experiment_id}",
        f"  Trial:      {ckpt.trial_id}",
        f"  Steps:      {ckpt.steps_completed}",
        f"  State:      {ckpt.state}",
        f"  Created:    {fmt_time(ckpt.created_at)}",
        *wrap_lines("Path:       ", str(ckpt.path)),
        f"  Size:       {fmt_bytes(checkpoint_size(ckpt))} in {len(files)} files",
        "",
        "Metadata:",
    ]
    if ckpt.metadata:
        for k, v in sorted(ckpt.metadata.items()):
            lines += wrap_lines(f"{k}: ", fmt_value(v))
    else:
        lines.append("  (none)")
    lines += ["", "Files:"]
    rows = [[p, fmt_bytes(int(s))] for p, s in files]
    lines.append(table(["Path", "Size"], rows, flex=("Path",)))
    print("\n".join(lines))


@app.command("download")
def download(
    uuid: Annotated[str, typer.Argument(metavar="UUID", help="The checkpoint's UUID.")],
    output: Annotated[
        Optional[Path],
        typer.Option(
            "--output",
            "-o",
            help="Directory to copy it to (default: checkpoints/<uuid> under the current one).",
        ),
    ] = None,
) -> None:
    """Copy a checkpoint's files to a directory and print its path.

    As with Determined, nothing is copied when the directory already holds a metadata.json."""
    from det_local.api import open_store

    ckpt = open_store().get_checkpoint(uuid)
    dest = (output if output is not None else Path("checkpoints") / ckpt.uuid).absolute()
    from det_local.store.checkpoints import download_checkpoint

    download_checkpoint(ckpt, dest)
    print(dest)


@app.command("delete")
def delete(
    uuids: Annotated[list[str], typer.Argument(metavar="UUID...", help="The checkpoints' UUIDs.")],
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")] = False,
) -> None:
    """Delete checkpoints' files (their records stay, DELETED). Refused for a checkpoint
    registered in a model or one of a running experiment."""
    from det_local.api import control_job, open_store

    store = open_store()
    for uuid in uuids:
        store.get_checkpoint(uuid)  # a clear error for an unknown uuid, before asking
    n = len(uuids)
    if not yes and not confirm(f"Delete the files of {n} checkpoint{'s' if n != 1 else ''}?"):
        print("aborted; nothing was deleted")
        raise typer.Exit(1)
    print(control_job("checkpoint_delete", {"uuids": uuids}))

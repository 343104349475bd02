"""Day-two verbs on experiments and slots (issue 27): `experiment download-model-def ID`,
`slot list|disable|enable`. Registered on their groups by cli/main.py."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import typer

if TYPE_CHECKING:
    from tarfile import TarInfo

slot_app = typer.Typer(
    no_args_is_help=True,
    rich_markup_mode=None,
    help="This machine's slots; admins drain one with disable (Determined's `det slot`).",
)


def download_model_def(
    experiment_id: int = typer.Argument(..., metavar="EXPERIMENT_ID", help="The experiment."),
    output_dir: Path = typer.Option(
        Path("."), "--output-dir", "-o", help="Where to write the tarball."
    ),
) -> None:
    """Write the experiment's context snapshot (the code its trials ran) as
    experiment_ID_model_def.tgz, as Determined's `det experiment download-model-def`."""
    from det_local import api
    from det_local.errors import DetLocalError

    api.open_store().get_experiment(experiment_id)  # a clear error for an unknown id
    context = api.paths().context_dir(experiment_id)
    if not context.is_dir():
        raise DetLocalError(
            f"experiment {experiment_id} has no context snapshot at {context} (deleted with "
            "the experiment, or an unmanaged core_v2 run that never had one)"
        )
    out = output_dir / f"experiment_{experiment_id}_model_def.tgz"
    import tarfile

    try:
        with tarfile.open(out, "w:gz") as tar:
            tar.add(context, arcname=".", filter=_plain_files)
    except PermissionError as err:
        out.unlink(missing_ok=True)
        raise DetLocalError(
            f"cannot read experiment {experiment_id}'s snapshot ({err.filename}): only its "
            "owner and the admin group may"
        ) from None
    print(f"Wrote {out}")


def _plain_files(info: TarInfo) -> TarInfo | None:
    """Regular files and directories only (no device nodes or links out of the snapshot);
    owners left out of the archive."""
    if not (info.isfile() or info.isdir()):
        return None
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info


def _drain(target: str, disabled: bool) -> None:
    from det_local import api

    print(api.control_job("drain", {"target": target, "disabled": disabled}))


@slot_app.command("list")
def slot_list(as_json: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """This machine's slots (as `det-local slots`), disabled ones marked."""
    from det_local.cli.slots import slots_command

    slots_command(as_json=as_json, cluster=False)


@slot_app.command("disable")
def slot_disable(
    slot: int = typer.Argument(..., metavar="SLOT", help="The slot's index (`det-local slots`)."),
) -> None:
    """Drain a slot (admins): what runs there finishes, nothing new is placed there; kept
    across daemon restarts."""
    _drain(f"slot:{slot}", True)


@slot_app.command("enable")
def slot_enable(
    slot: int = typer.Argument(..., metavar="SLOT", help="The slot's index (`det-local slots`)."),
) -> None:
    """Give a disabled slot back to the scheduler (admins)."""
    _drain(f"slot:{slot}", False)


node_app = typer.Typer(
    no_args_is_help=True,
    rich_markup_mode=None,
    help="This cluster node; admins disable it (Determined's `det agent disable`).",
)


@node_app.command("disable")
def node_disable(
    name: str = typer.Argument(..., metavar="NAME", help="This node's name (`cluster peers`)."),
) -> None:
    """Take no new gang shares or anywhere jobs from peers (admins, on the node itself); what
    runs finishes and the node's own queue still runs. Kept across daemon restarts."""
    _drain(f"node:{name}", True)


@node_app.command("enable")
def node_enable(
    name: str = typer.Argument(..., metavar="NAME", help="This node's name."),
) -> None:
    """Take work from peers again (admins)."""
    _drain(f"node:{name}", False)


def continue_experiment(
    experiment_id: int = typer.Argument(..., metavar="EXPERIMENT_ID", help="The experiment."),
    config: list[str] = typer.Option(
        [],
        "--config",
        metavar="KEY=VALUE",
        help="A config override, dotted keys, a YAML value (repeatable): "
        "--config searcher.max_length.batches=600",
    ),
    config_file: Path | None = typer.Option(
        None, "--config-file", help="A YAML file of config overrides laid over the config."
    ),
) -> None:
    """Train an ended single-trial experiment further, from its latest checkpoint, with the
    config changed where the overrides say (Determined's `det experiment continue`). With no
    daemon running it runs here, in the foreground, as `experiment activate` does."""
    from det_local import api
    from det_local.config.overrides import parse_overrides

    overrides = parse_overrides(config, config_file)
    print(api.control(experiment_id, "continue", overrides=overrides))


def fork_experiment(
    experiment_id: int = typer.Argument(..., metavar="EXPERIMENT_ID", help="The experiment."),
    config: list[str] = typer.Option(
        [],
        "--config",
        metavar="KEY=VALUE",
        help="A config edit, dotted keys, a YAML value (repeatable): "
        "--config hyperparameters.lr=0.01",
    ),
    config_file: Path | None = typer.Option(
        None, "--config-file", help="A YAML file of config edits laid over the config."
    ),
    follow: bool = typer.Option(
        False, "--follow", "-f", help="Stay and stream its trials' output, as `run` does."
    ),
) -> None:
    """A new experiment from another's config and code (Determined's `det experiment fork`):
    its config with the edits laid over it, checked as a config file is, and its context
    snapshot (read with your rights: a private experiment is its owner's to fork)."""
    from det_local import api
    from det_local.config.overrides import parse_overrides

    overrides = parse_overrides(config, config_file)
    code = api.fork_experiment(experiment_id, overrides, follow=follow)
    if code:
        raise typer.Exit(code)

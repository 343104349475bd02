"""The `det-local` command. Thin over det_local.api; imports nothing heavy at start-up."""

from __future__ import annotations

import sys

import typer

from det_local.cli import cluster, cmd, config, daemon, daytwo, experiment, job, trial
from det_local.cli.common import run_cli
from det_local.cli.completion import completion_command
from det_local.cli.dashboard import dashboard_command
from det_local.cli.group import DetGroup
from det_local.cli.results import checkpoint, model
from det_local.cli.results.usage import usage_command
from det_local.cli.run import run_command
from det_local.cli.slots import slots_command
from det_local.cli.tasks import notebook_app, shell_app, tensorboard_app

app = typer.Typer(
    name="det-local",
    help="Determined experiments on the machines you already have.",
    cls=DetGroup,
    add_completion=False,
    no_args_is_help=True,
    rich_markup_mode=None,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool) -> None:
    if value:
        from det_local.cli.completion import version

        print(f"det-local {version()}")
        raise typer.Exit(0)


@app.callback()
def _top(
    version: bool = typer.Option(
        False,
        "--version",
        help="Print det-local's version and exit.",
        is_eager=True,
        callback=_version,
    ),
) -> None:
    """Determined experiments on the machines you already have."""


app.command("run")(run_command)
# Determined's short names (e, t, c, command, j, ls...) are aliases: det_local/cli/group.py
experiment.app.command("download-model-def")(daytwo.download_model_def)
experiment.app.command("continue")(daytwo.continue_experiment)
experiment.app.command("fork")(daytwo.fork_experiment)
app.add_typer(experiment.app, name="experiment", cls=DetGroup)
app.add_typer(trial.app, name="trial", cls=DetGroup)
app.add_typer(checkpoint.app, name="checkpoint", cls=DetGroup)
app.add_typer(model.app, name="model", cls=DetGroup)
app.add_typer(config.app, name="config", cls=DetGroup)
app.add_typer(job.app, name="job", cls=DetGroup)
app.add_typer(cmd.app, name="cmd", cls=DetGroup)
app.add_typer(daemon.app, name="daemon", cls=DetGroup)
cluster.app.add_typer(daytwo.node_app, name="node", cls=DetGroup)
app.add_typer(cluster.app, name="cluster", cls=DetGroup)
app.command("slots")(slots_command)
app.command("usage")(usage_command)
app.add_typer(daytwo.slot_app, name="slot", cls=DetGroup)
app.add_typer(shell_app, name="shell", cls=DetGroup)
app.add_typer(notebook_app, name="notebook", cls=DetGroup)
app.add_typer(tensorboard_app, name="tensorboard", cls=DetGroup)
app.command("dashboard")(dashboard_command)
app.command("completion")(completion_command)


def main() -> None:
    sys.exit(run_cli(app))


if __name__ == "__main__":
    main()

"""The `det-local` command. Thin over det_local.api; imports nothing heavy at start-up."""

from __future__ import annotations

import sys

import typer

from det_local.cli import checkpoint, cluster, cmd, config, daemon, experiment, job, trial
from det_local.cli.common import run_cli
from det_local.cli.run import run_command
from det_local.cli.slots import slots_command
from det_local.cli.tasks import notebook_app, shell_app, tensorboard_app

app = typer.Typer(
    name="det-local",
    help="Determined experiments on the machines you already have.",
    add_completion=False,
    no_args_is_help=True,
    rich_markup_mode=None,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)
app.command("run")(run_command)
app.add_typer(experiment.app, name="experiment")
app.add_typer(experiment.app, name="e", hidden=True)
app.add_typer(trial.app, name="trial")
app.add_typer(trial.app, name="t", hidden=True)
app.add_typer(checkpoint.app, name="checkpoint")
app.add_typer(config.app, name="config")
app.add_typer(job.app, name="job")
app.add_typer(cmd.app, name="cmd")
app.add_typer(daemon.app, name="daemon")
app.add_typer(cluster.app, name="cluster")
app.command("slots")(slots_command)
app.add_typer(shell_app, name="shell")
app.add_typer(notebook_app, name="notebook")
app.add_typer(tensorboard_app, name="tensorboard")


def main() -> None:
    sys.exit(run_cli(app))


if __name__ == "__main__":
    main()

"""The `det-local` command. Thin over det_local.api; imports nothing heavy at start-up.

A command group's module is imported when that group is invoked (`cli/start/lazy.py`)."""

from __future__ import annotations

import sys
from typing import Any

import typer

from det_local.cli.common import run_cli
from det_local.cli.group import DetGroup
from det_local.cli.start.lazy import Lazy, LazyGroup


def _experiment() -> Any:
    from det_local.cli import daytwo, experiment

    experiment.app.command("download-model-def")(daytwo.download_model_def)
    experiment.app.command("continue")(daytwo.continue_experiment)
    experiment.app.command("fork")(daytwo.fork_experiment)
    return experiment.app


def _cluster() -> Any:
    from det_local.cli import cluster, daytwo

    cluster.app.add_typer(daytwo.node_app, name="node", cls=DetGroup)
    return cluster.app


def _attr(module: str, name: str) -> Any:
    def load() -> Any:
        # __import__, not importlib.import_module: `python -X importtime` shows only the former
        return getattr(__import__(module, fromlist=[name]), name)

    return load


class TopGroup(LazyGroup):
    # the order of `det-local -h` (typer's: commands, then groups); Determined's short names
    # (e, t, c, command, j, ls...) are aliases: det_local/cli/group.py
    TABLE = (
        Lazy("run", _attr("det_local.cli.run", "run_command"), group=False),
        Lazy("slots", _attr("det_local.cli.slots", "slots_command"), group=False),
        Lazy("usage", _attr("det_local.cli.results.usage", "usage_command"), group=False),
        Lazy("dashboard", _attr("det_local.cli.dashboard", "dashboard_command"), group=False),
        Lazy("completion", _attr("det_local.cli.completion", "completion_command"), group=False),
        Lazy("experiment", _experiment, group=True),
        Lazy("trial", _attr("det_local.cli.trial", "app"), group=True),
        Lazy("checkpoint", _attr("det_local.cli.results.checkpoint", "app"), group=True),
        Lazy("model", _attr("det_local.cli.results.model", "app"), group=True),
        Lazy("config", _attr("det_local.cli.config", "app"), group=True),
        Lazy("job", _attr("det_local.cli.job", "app"), group=True),
        Lazy("cmd", _attr("det_local.cli.cmd", "app"), group=True),
        Lazy("daemon", _attr("det_local.cli.daemon", "app"), group=True),
        Lazy("cluster", _cluster, group=True),
        Lazy("slot", _attr("det_local.cli.daytwo", "slot_app"), group=True),
        Lazy("shell", _attr("det_local.cli.tasks", "shell_app"), group=True),
        Lazy("notebook", _attr("det_local.cli.tasks", "notebook_app"), group=True),
        Lazy("tensorboard", _attr("det_local.cli.tasks", "tensorboard_app"), group=True),
    )


app = typer.Typer(
    name="det-local",
    help="Determined experiments on the machines you already have.",
    cls=TopGroup,
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


def main() -> None:
    sys.exit(run_cli(app))


if __name__ == "__main__":
    main()

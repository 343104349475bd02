"""`det-local run CONFIG CONTEXT`."""

from __future__ import annotations

from pathlib import Path

import typer


def run_command(
    config: Path = typer.Argument(
        ..., metavar="CONFIG", help="Experiment config (Determined's YAML format)."
    ),
    context: Path = typer.Argument(
        ..., metavar="CONTEXT", help="Context directory: the code the trials run."
    ),
    detach: bool = typer.Option(
        False, "--detach", "-d", help="Submit to the running daemon and return at once."
    ),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Do not stream the trials' output."),
    test: bool = typer.Option(
        False,
        "--test",
        help="Test mode: train one batch, validate, checkpoint, restore that checkpoint in a "
        "new process and train one more batch; print pass/fail per step.",
    ),
    anywhere: bool = typer.Option(
        False,
        "--anywhere",
        help="A trial may run on an idle machine of the cluster when this one is full "
        "(as resources.federate: true; needs shared_fs checkpoint storage): the experiment's "
        "config, context and hyperparameters travel to that machine, which reports the "
        "trial's output, metrics and exit status.",
    ),
    config_edits: list[str] = typer.Option(
        [],
        "--config",
        metavar="KEY=VALUE",
        help="A config edit laid over CONFIG, Determined's dotted keys, a YAML value "
        "(repeatable), checked as the file is: --config hyperparameters.lr=0.01",
    ),
    pool: str | None = typer.Option(
        None,
        "--pool",
        metavar="NAME",
        help="The resource pool its trials run in (`det-local slots` lists them): "
        "--config resources.resource_pool=NAME.",
    ),
) -> None:
    """Run an experiment: prints its id, streams the trials' output, ends with a summary.

    Exit status: 0 COMPLETED, 1 ERROR, 2 CANCELED, 3 PAUSED. Ctrl-C pauses (the trials
    checkpoint); `det-local experiment activate ID` resumes."""
    from det_local import api
    from det_local.config.overrides import parse_overrides

    code = api.run(
        config,
        context,
        follow=not detach,
        quiet=quiet,
        test_mode=test,
        anywhere=anywhere,
        overrides=parse_overrides(config_edits),
        pool=pool,
    )
    if code:
        raise typer.Exit(code)

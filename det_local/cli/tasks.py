"""`det-local shell start`, `notebook start`, `tensorboard start`: interactive tasks on slots."""

from __future__ import annotations

import typer

from det_local.priority import DEFAULT_PRIORITY
from det_local.priority import HELP as PRIORITY_HELP

shell_app = typer.Typer(no_args_is_help=True, rich_markup_mode=None, help="Interactive shells.")
notebook_app = typer.Typer(no_args_is_help=True, rich_markup_mode=None, help="Jupyter notebooks.")
tensorboard_app = typer.Typer(no_args_is_help=True, rich_markup_mode=None, help="TensorBoard.")


@shell_app.command("start")
def shell_start(
    slots: int = typer.Option(1, "--slots", help="Slots the shell holds until it exits."),
    priority: int = typer.Option(DEFAULT_PRIORITY, "--priority", "-p", help=PRIORITY_HELP),
    config: list[str] = typer.Option(
        None,
        "--config",
        metavar="KEY=VALUE",
        help="Determined's task config: idle_timeout=30m (idle slots past it are flagged, "
        "or ended per daemon.yaml's idle_policy).",
    ),
) -> None:
    """An interactive shell that holds slots (CUDA_VISIBLE_DEVICES set) until it exits."""
    from det_local import api
    from det_local.priority import check_priority, check_slots

    check_slots(slots)
    check_priority(priority)
    from det_local.client.tasks import shell
    from det_local.usage.settings import parse_task_config

    extra = parse_task_config(config)
    raise typer.Exit(shell(api.paths(), slots=slots, priority=priority, extra=extra))


@notebook_app.command("start")
def notebook_start(
    slots: int = typer.Option(1, "--slots", help="Slots the notebook server holds."),
    config: list[str] = typer.Option(
        None,
        "--config",
        metavar="KEY=VALUE",
        help="Determined's task config: idle_timeout=30m (idle slots past it are flagged, "
        "or ended per daemon.yaml's idle_policy).",
    ),
) -> None:
    """A JupyterLab server on localhost as a queued job; prints its URL."""
    from det_local import api
    from det_local.priority import check_slots

    check_slots(slots)
    from det_local.client.tasks import notebook
    from det_local.usage.settings import parse_task_config

    extra = parse_task_config(config)
    job_id, url = notebook(api.paths(), slots=slots, extra=extra)
    print(f"notebook (job {job_id}): {url}\nstop it with: det-local cmd kill {job_id}")


@tensorboard_app.command("start")
def tensorboard_start(
    experiment_ids: list[int] = typer.Argument(
        ..., metavar="EXPERIMENT_ID...", help="Experiment ids to show."
    ),
) -> None:
    """TensorBoard over the experiments' trials on localhost; prints its URL."""
    from det_local import api
    from det_local.client.tasks import tensorboard

    job_id, url = tensorboard(api.paths(), experiment_ids)
    print(f"tensorboard (job {job_id}): {url}\nstop it with: det-local cmd kill {job_id}")

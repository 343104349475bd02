"""`det-local experiment logs ID [-f]` and `experiment wait ID`: back to an experiment from any
shell, after `run --detach`, a Ctrl-C or an `activate` elsewhere (`client/attach.py`).
Registered on the experiment group (`cli/experiment.py`)."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

ExperimentId = Annotated[int, typer.Argument(metavar="EXPERIMENT_ID", help="The experiment's id.")]


def _note(line: str) -> None:
    print(f"det-local: {line}", file=sys.stderr, flush=True)


def _interrupted(experiment_id: int, what: str) -> typer.Exit:
    """Ctrl-C: one line (the experiment goes on), exit 130."""
    lead = "\n" if sys.stderr.isatty() else ""  # past the terminal's ^C
    print(f"{lead}stopped {what}; experiment {experiment_id} goes on", file=sys.stderr)
    return typer.Exit(130)


def experiment_logs(
    experiment_id: ExperimentId,
    follow: Annotated[
        bool,
        typer.Option(
            "--follow",
            "-f",
            help="Keep printing every trial's new lines (and a search's progress) until the "
            "experiment completes, is canceled or fails.",
        ),
    ] = False,
) -> None:
    """Print every trial's output, each line prefixed [trial N]."""
    from det_local import api
    from det_local.client import attach

    store = api.open_store()
    try:
        if follow:
            attach.follow_logs(store, api.paths(), experiment_id, sys.stdout, _note)
        else:
            attach.print_logs(store, api.paths(), experiment_id, sys.stdout)
    except KeyboardInterrupt:
        raise _interrupted(experiment_id, "following") from None
    except BrokenPipeError:  # the reader went away (`| head`): stop quietly
        _quiet_stdout()


def experiment_wait(experiment_id: ExperimentId) -> None:
    """Wait until the experiment completes, is canceled or fails (a paused one is waited for
    until it is activated and ends). Exits as `det-local run` does: 0 completed, 1 error,
    2 canceled."""
    import time

    from det_local import api
    from det_local.client import attach

    store = api.open_store()
    started = time.time()
    try:
        state = attach.wait(store, api.paths(), experiment_id, _note)
    except KeyboardInterrupt:
        raise _interrupted(experiment_id, "waiting") from None
    from det_local.textsafe import visible

    exp = store.get_experiment(experiment_id)
    line = f"experiment {experiment_id} ({visible(exp.name)}) {state.value}"
    if exp.message and state.value != "COMPLETED":
        line += f": {visible(exp.message)}"
    print(f"{line} (waited {time.time() - started:.1f}s)", flush=True)
    raise typer.Exit(attach.exit_code(state))


def _quiet_stdout() -> None:
    """Keep Python's exit-time flush from raising again on a closed pipe."""
    import os

    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass

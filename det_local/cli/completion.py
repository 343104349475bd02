"""`det-local completion bash|zsh|fish` and `det-local --version`.

The scripts are typer's: the shell calls `det-local` back with _DET_LOCAL_COMPLETE set, and
`run_cli` answers with the completions (det_local/cli/common.py)."""

from __future__ import annotations

import typer

SHELLS = ("bash", "zsh", "fish")
COMPLETE_VAR = "_DET_LOCAL_COMPLETE"


def version() -> str:
    """The installed package's version (the source's when it is not installed)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("det-local")
    except PackageNotFoundError:
        from det_local import __version__

        return __version__


def completion_command(
    shell: str = typer.Argument(..., metavar="SHELL", help="bash, zsh or fish."),
) -> None:
    """Print a completion script: `source <(det-local completion bash)` in ~/.bashrc;
    zsh: `det-local completion zsh > "${fpath[1]}/_det-local"`;
    fish: `det-local completion fish > ~/.config/fish/completions/det-local.fish`."""
    from det_local.errors import DetLocalError

    if shell not in SHELLS:
        raise DetLocalError(f"completion: no shell {shell!r}; choose one of {', '.join(SHELLS)}")
    from typer.completion import get_completion_script

    print(get_completion_script(prog_name="det-local", complete_var=COMPLETE_VAR, shell=shell))

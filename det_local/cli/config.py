"""`det-local config check CONFIG [CONTEXT]`: the filled-in config and the launch plan."""

from __future__ import annotations

from pathlib import Path

import typer

app = typer.Typer(no_args_is_help=True, rich_markup_mode=None, help="Experiment configs.")


@app.command("check")
def check(
    config: Path = typer.Argument(..., help="Experiment config (YAML)."),
    context: Path | None = typer.Argument(None, help="Context directory (checks the entrypoint)."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Validate CONFIG, print it with defaults filled in and the launch plan; runs nothing."""
    from det_local.sched.preview import preview

    result = preview(config, context)
    if as_json:
        from det_local.cli.common import print_json

        print_json(result)
        return
    import yaml

    print(f"# {config}: valid")
    print(yaml.safe_dump(result["config"], sort_keys=False).rstrip())
    plan = result["plan"]
    if plan is None:
        print(f"\n# launch plan: not runnable by this det-local version: {result['not_runnable']}")
        return
    print("\n# launch plan")
    print(f"trials: {plan['trials']}")
    print(f"slots per trial: {plan['slots_per_trial']}")
    print(f"argv: {plan['argv']}")
    print(f"cwd: {plan['cwd']}")
    print("environment:")
    for key, value in plan["env"].items():
        shown = value if len(value) <= 100 else value[:97] + "..."
        print(f"  {key}={shown}")

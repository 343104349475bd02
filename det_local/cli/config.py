"""`det-local config check CONFIG [CONTEXT]`: the filled-in config, the search plan (how many
trials, ASHA brackets and rungs, grid axes) and the first trial's launch plan."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

app = typer.Typer(no_args_is_help=True, rich_markup_mode=None, help="Experiment configs.")


@app.command("check")
def check(
    config: Path = typer.Argument(..., metavar="CONFIG", help="Experiment config (YAML)."),
    context: Path | None = typer.Argument(
        None, metavar="[CONTEXT]", help="Context directory (checks the entrypoint)."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Validate CONFIG, print it with defaults filled in, the search plan (how many trials) and
    the launch plan; runs nothing."""
    from det_local.client.preview import preview

    result = preview(config, context)
    if as_json:
        from det_local.cli.common import print_json

        print_json(result)
        return
    import yaml

    print(f"# {config}: valid")
    print_warnings(result["warnings"], result["deprecations"])
    print(yaml.safe_dump(result["config"], sort_keys=False).rstrip())
    plan = result["plan"]
    if plan is None:
        print(f"\n# launch plan: not runnable by this det-local version: {result['not_runnable']}")
        return
    print("\n# search plan")
    for line in search_lines(plan["search"], plan["initial_trials"]):
        print(line)
    print("\n# launch plan (first trial)")
    print(f"slots per trial: {plan['slots_per_trial']}")
    print(f"argv: {plan['argv']}")
    print(f"cwd: {plan['cwd']}")
    print("environment:")
    for key, value in plan["env"].items():
        shown = value if len(value) <= 100 else value[:97] + "..."
        print(f"  {key}={shown}")
    if plan.get("batch_script"):
        print(f"\n# batch script (resource pool {plan['pool']}: each trial run is one Slurm job)")
        print(plan["batch_script"].rstrip())


def print_warnings(warnings: list[str], deprecations: list[str]) -> None:
    """One line each on stderr: a key det-local parses but does not act on (what it does
    instead), then a deprecated key it still honours."""
    import sys

    for line in warnings:
        print(f"warning: {line}", file=sys.stderr)
    for line in deprecations:
        print(f"deprecated: {line}", file=sys.stderr)


GENERATIONS = {
    "stopping": "0.38, stops trials on their validation reports",
    "promotion": "<=0.37, promotion-based",
    "stop_once": "<=0.37, stop-once",
}


def _at_once(n: int) -> str:
    return "no limit at once" if n == 0 else f"up to {n} at once"


def search_lines(search: dict[str, Any], initial: int) -> list[str]:
    """The search plan in words: the searcher, how many trials, and for ASHA each bracket with
    its rungs (where trials are compared, in the time metric's units), for grid its axes."""
    order = "smaller is better" if search.get("smaller_is_better", True) else "larger is better"
    head = f"searcher: {search['name']}"
    if search.get("generation"):
        head += f" ({GENERATIONS.get(search['generation'], search['generation'])})"
    lines = [f"{head}, metric {search['metric']} ({order})"]
    trials = int(search["trials"])
    word = "trial" if trials == 1 else "trials"
    if "brackets" in search:
        bks = search["brackets"]
        unit = search["time_metric"]
        lines.append(
            f"trials: {trials} in {len(bks)} bracket{'s' if len(bks) != 1 else ''}, "
            f"{initial} created at the start"
        )
        keep = search.get("divisor", 4.0)
        keep_s = f"{keep:g}"
        for i, b in enumerate(bks, 1):
            rungs = ", ".join(str(r) for r in b["rungs"])
            lines.append(
                f"  bracket {i}: {b['max_trials']} trials ({_at_once(b['max_concurrent_trials'])}),"
                f" {b['num_rungs']} rung{'s' if b['num_rungs'] != 1 else ''} at {rungs} {unit}"
                + (f"; the best 1 in {keep_s} go on at each rung" if b["num_rungs"] > 1 else "")
            )
        return lines
    if search["name"] == "grid":
        axes = " x ".join(f"{a['name']} {a['values']}" for a in search.get("grid", []))
        lines.append(
            f"trials: {trials} grid point{'s' if trials != 1 else ''}"
            + (f" ({axes})" if axes else "")
        )
    elif search["name"] == "random":
        lines.append(f"trials: {trials} random {word}")
    else:
        lines.append(f"trials: {trials}")
    if search["name"] != "single":
        lines[-1] += f", {_at_once(int(search['max_concurrent_trials']))}"
    if search.get("max_length"):
        ml = search["max_length"]
        length = ", ".join(f"{v} {k}" for k, v in ml.items()) if isinstance(ml, dict) else str(ml)
        lines.append(f"each trial: max_length {length}")
    return lines

"""`det-local usage`: slot-hours allocated and used, per user, experiment, slot or kind."""

from __future__ import annotations

import typer


def usage_command(
    since: str = typer.Option("30d", "--since", help="How far back: 30d, 12h, or a date."),
    by: str = typer.Option("user", "--by", help="Group by user, experiment, slot or kind."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON (keys: README, Usage)."),
    as_csv: bool = typer.Option(False, "--csv", help="Print CSV."),
) -> None:
    """Who used the slots: slot-hours (GPU-hours on GPUs) each user's jobs held, and how much
    of them they used (mean utilisation from the daemon's system samples)."""
    from det_local.errors import DetLocalError
    from det_local.usage.report import parse_since
    from det_local.views import cluster as clusterviews

    if as_json and as_csv:
        raise DetLocalError("--json and --csv: choose one")
    rep = clusterviews.usage(parse_since(since), by=by)
    if as_json:
        from det_local.cli.common import print_json

        print_json(rep)
        return
    cols = ["key", "allocations", "slot_hours", "used_slot_hours", "mean_util_pct"]
    if as_csv:
        import csv
        import sys

        out = csv.writer(sys.stdout, lineterminator="\n")
        out.writerow([by, *cols[1:]])
        for r in [*rep["rows"], rep["total"]]:
            out.writerow(["" if r[c] is None else r[c] for c in cols])
        return
    from det_local.cli.common import table

    def fmt(r: dict[str, object]) -> list[object]:
        util = r["mean_util_pct"]
        return [
            r["key"] if r["key"] is not None else "-",
            r["allocations"],
            f"{r['slot_hours']:.2f}",
            f"{r['used_slot_hours']:.2f}",
            "-" if util is None else f"{util}%",
        ]

    headers = [by.capitalize(), "Allocations", "Slot-hours", "Used slot-hours", "Mean util"]
    print(table(headers, [*map(fmt, rep["rows"]), fmt(rep["total"])]))

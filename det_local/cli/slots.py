"""`det-local slots`: this machine's GPUs (or CPU slots), and who is using them.

Top level imports typer and the standard library only; the inventory (and with it NVML and
psutil) is loaded when the command runs.
"""

from __future__ import annotations

from typing import Any

import typer


def slots_command(
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
    cluster: bool = typer.Option(
        False, "--cluster", help="Every node's slots, read through the peers."
    ),
) -> None:
    """Show this machine's slots: GPUs from NVML (or CPU slots), memory, utilisation, and who
    uses each one, including processes det-local did not start. The running daemon's view
    (its slots, its jobs); discovered here only when no daemon runs."""
    if cluster:
        _cluster_slots(as_json)
        return
    from det_local.api import paths
    from det_local.cli.common import print_json
    from det_local.client.slotview import FROM_ENGINE, current

    view = current(paths())
    from det_local.views.cluster import mark_disabled

    rows = mark_disabled(view.rows())  # `slot disable`: drained, kept across restarts
    if as_json:
        print_json(rows)
        return
    print(slots_table(rows))
    note = view.inventory.note
    if note and view.origin == FROM_ENGINE:  # its environment, not this shell's
        note = f"as the running det-local engine found them: {note}"
    if note:
        print(note)
    _print_pools()


def _print_pools() -> None:
    """The resource pools besides this machine's slots (daemon.yaml's resource_pools)."""
    from det_local.cli.common import table
    from det_local.views import cluster as clusterviews

    pools = clusterviews.pools_rows()
    if len(pools) > 1:
        print()
        print(table(["Pool", "Kind", "Where"], [[p["pool"], p["kind"], p["where"]] for p in pools]))


def slots_table(rows: list[dict[str, Any]]) -> str:
    from det_local.cli.common import table

    # the holding job's time and idleness (issue 30), when any slot is held
    held = any(r.get("job_id") is not None for r in rows)
    headers = ["Slot", "Kind", "Name", "UUID", "Memory", "Util", "Used by"]
    headers += ["For", "Idle"] if held else []
    return table(
        headers,
        flex=("Name", "Used by"),
        optional=("For",),
        rows=[
            [
                r["index"],
                r["kind"],
                r["name"],
                short_uuid(r["uuid"]),
                fmt_memory(r["memory_used_mb"], r["memory_total_mb"]),
                "-" if r["utilization_pct"] is None else f"{r['utilization_pct']}%",
                r["used_by"],
                *([fmt_age(r.get("held_for_s")), fmt_idle(r)] if held else []),
            ]
            for r in rows
        ],
    )


def fmt_age(secs: float | None) -> str:
    if secs is None:
        return ""
    if secs < 120:
        return f"{secs:.0f}s"
    if secs < 7200:
        return f"{secs / 60:.0f}m"
    return f"{secs / 3600:.1f}h"


def fmt_idle(r: dict[str, Any]) -> str:
    """How long the holding job's slots have been idle; IDLE once it was flagged."""
    secs = r.get("idle_for_s")
    if secs is None:
        return ""
    return f"IDLE {fmt_age(secs)}" if r.get("idle_flagged") else fmt_age(secs)


def short_uuid(uuid: str | None) -> str:
    """ "GPU-1a2b3c4d-...-0123456789ab" -> "GPU-1a2b3c4d..89ab": the head names the GPU to a
    person, the tail keeps fake (and look-alike) UUIDs apart. --json has the whole UUID."""
    if not uuid:
        return "-"
    if len(uuid) <= 18:
        return uuid
    return f"{uuid[:12]}..{uuid[-4:]}"


def fmt_memory(used: int | None, total: int | None) -> str:
    if total is None:
        return "-"
    return f"{'?' if used is None else used}/{total} MiB"


def _cluster_slots(as_json: bool) -> None:
    """`slots --cluster`: every node's slots through this machine's daemon and its peers."""
    from det_local.cli.cluster import cluster_rows
    from det_local.cli.common import print_json, table

    nodes = cluster_rows("slots")
    if as_json:
        print_json(nodes)
        return
    rows: list[list[Any]] = []
    for node in nodes:
        if "error" in node:
            rows.append([node["node"], "-", "-", "-", "-", f"({node['error']})"])
            continue
        for r in node.get("value") or []:  # type: ignore[attr-defined]
            rows.append(
                [
                    node["node"],
                    r["index"],
                    r["kind"],
                    r["name"],
                    fmt_memory(r.get("memory_used_mb"), r.get("memory_total_mb")),
                    r.get("used_by") or "",
                ]
            )
    headers = ["Node", "Slot", "Kind", "Name", "Memory", "Used by"]
    print(table(headers, rows, flex=("Node", "Name", "Used by")))

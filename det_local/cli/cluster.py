"""`det-local cluster init|join|leave|token|peers`: this machine in a cluster of workstations.

Imports typer and the standard library only; the federation's modules (never zeroconf) load
when a command runs.
"""

from __future__ import annotations

import typer

app = typer.Typer(
    rich_markup_mode=None,
    no_args_is_help=True,
    help="Join this machine's daemon to others on the LAN (a shared cluster key).",
)


def _reload(what: str) -> None:
    """Tell a running daemon to pick the change up; fine when none runs."""
    from det_local import api
    from det_local.federate.client import NoDaemon, request

    try:
        status = request(api.paths(), {"t": "reload" if what != "leave" else "leave"})
    except NoDaemon:
        return
    if isinstance(status, dict) and status.get("federation") == "off" and status.get("why"):
        print(f"the daemon does not federate: {status['why']}")


@app.command("init")
def init(
    as_json: bool = typer.Option(False, "--json", help='Print {"token": ...}.'),
    force: bool = typer.Option(False, "--force", help="Replace an existing key (a new cluster)."),
) -> None:
    """Create the cluster key and print the join token for the other machines."""
    from det_local import api
    from det_local.errors import DetLocalError
    from det_local.federate import keys

    paths = api.paths().ensure()
    if paths.cluster_key.exists() and not force:
        raise DetLocalError(
            f"{paths.cluster_key} exists: `det-local cluster token` prints its join token; "
            "`det-local cluster init --force` makes a new cluster (every node must join again)"
        )
    key = keys.new_key()
    keys.write_key(paths.cluster_key, key)
    paths.cluster_left.unlink(missing_ok=True)
    _print_token(key, as_json)
    _reload("init")


def _print_token(key: bytes, as_json: bool) -> None:
    from det_local.federate import keys

    token = keys.token_for(key)
    if as_json:
        from det_local.cli.common import print_json

        print_json({"token": token, "cluster": keys.cluster_id(key)})
    else:
        print(token)


@app.command("token")
def token(as_json: bool = typer.Option(False, "--json", help='Print {"token": ...}.')) -> None:
    """Print this cluster's join token again (it is the key: keep it secret)."""
    from det_local import api
    from det_local.errors import DetLocalError
    from det_local.federate import keys

    paths = api.paths()
    key = keys.read_key(paths.cluster_key)
    if key is None:
        raise DetLocalError(f"no cluster key in {paths.home}: `det-local cluster init` first")
    _print_token(key, as_json)


@app.command("join")
def join(
    token: str = typer.Argument(
        ..., metavar="TOKEN", help="The line `det-local cluster init` printed."
    ),
) -> None:
    """Join the cluster whose token this is (writes the key; the daemon starts federating)."""
    from det_local import api
    from det_local.errors import DetLocalError
    from det_local.federate import keys

    paths = api.paths().ensure()
    key = keys.key_from_token(token)
    try:
        old = keys.read_key(paths.cluster_key)
    except keys.KeyError_:
        old = None  # a broken key file is replaced
    if old is not None and old != key:
        raise DetLocalError(
            f"{paths.cluster_key} holds another cluster's key: `det-local cluster leave "
            "--forget` first"
        )
    keys.write_key(paths.cluster_key, key)
    paths.cluster_left.unlink(missing_ok=True)
    print(f"joined cluster {keys.cluster_id(key)}")
    _reload("join")


@app.command("leave")
def leave(
    forget: bool = typer.Option(False, "--forget", help="Delete the cluster key as well."),
) -> None:
    """Stop federating: the daemon says goodbye to its peers. The key is kept unless --forget
    (`det-local cluster join TOKEN` joins again)."""
    from det_local import api

    paths = api.paths().ensure()
    if forget:
        paths.cluster_key.unlink(missing_ok=True)
        paths.cluster_left.unlink(missing_ok=True)
    else:
        paths.cluster_left.write_text("left\n")
    _reload("leave")
    print("left the cluster" + ("; the key is deleted" if forget else "; the key is kept"))


@app.command("peers")
def peers(as_json: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """Every node of the cluster, this one included: state, address, slots, version."""
    from det_local.views import cluster as clusterviews

    view = clusterviews.cluster_view()
    rows = view["peers"]
    if as_json:
        from det_local.cli.common import print_json

        print_json(rows)
        return
    if view.get("federation") != "on":
        print(f"federation is off: {view.get('why', '')}")
        return
    from det_local.cli.common import table

    if view.get("collision"):
        print(f"warning: {view['collision']}")
    print(
        table(
            ["Node", "Address", "State", "Slots free", "Version", "Last seen", "Queued"],
            flex=("Node", "Address"),
            rows=[
                [
                    r["id"],
                    r["address"],
                    r["state"],
                    f"{r['slots_free']}/{r['slots_total']}",
                    r["version"],
                    f"{r['last_seen_s']:.1f}s",
                    (r.get("queue") or {}).get("queued", "-"),
                ]
                for r in rows
            ],
        )
    )


def cluster_rows(what: str, include_done: bool = False) -> list[dict[str, object]]:
    """Every node's jobs or slots, through this machine's daemon (`--cluster`)."""
    from det_local import api
    from det_local.federate.client import request

    rows = request(api.paths(), {"t": what, "all": include_done})
    return list(rows)

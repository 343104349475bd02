"""`det-local model`: the model registry (Determined's `det model` verbs): create, list,
describe, register-version, list-versions, delete."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Optional

import typer

from det_local.cli.results.checkpoint import JsonFlag, confirm, fmt_time

if TYPE_CHECKING:
    from det_local.store.tables.registry import ModelRecord, VersionRecord

app = typer.Typer(
    no_args_is_help=True,
    rich_markup_mode=None,
    help="The model registry: create, list, describe, register-version, list-versions, delete.",
)

ModelName = Annotated[str, typer.Argument(metavar="MODEL", help="The model's name (or id).")]


def _models_table(models: list[ModelRecord]) -> str:
    from det_local.cli.common import table

    rows = [
        [
            m.id,
            m.name + (" (archived)" if m.archived else ""),
            m.num_versions,
            ",".join(m.labels),
            m.user,
            fmt_time(m.updated_at),
            m.description,
        ]
        for m in models
    ]
    headers = ["ID", "Name", "Versions", "Labels", "User", "Updated", "Description"]
    return table(headers, rows, flex=("Name", "Labels", "Description"), optional=("Updated",))


def _versions_table(versions: list[VersionRecord]) -> str:
    from det_local.api import open_store
    from det_local.cli.common import table
    from det_local.errors import NotFoundError

    store = open_store()
    rows = []
    for v in versions:
        try:
            c = store.get_checkpoint(v.checkpoint_uuid)
            where = f"{c.experiment_id}/{c.trial_id}"
            steps: object = c.steps_completed
        except NotFoundError:
            where, steps = "-", "-"
        rows.append([v.version, v.checkpoint_uuid, where, steps, v.user, fmt_time(v.created_at)])
    headers = ["Version", "Checkpoint", "Exp/Trial", "Steps", "User", "Registered"]
    return table(headers, rows, flex=(), optional=("Registered",))


def _send(op: str, payload: dict[str, object]) -> object:
    from det_local.api import control_job

    return control_job(op, payload)


@app.command("create")
def create(
    name: Annotated[str, typer.Argument(metavar="NAME", help="The new model's name.")],
    description: Annotated[
        str, typer.Option("--description", "-d", help="What the model is.")
    ] = "",
    label: Annotated[
        Optional[list[str]], typer.Option("--label", "-l", help="A label (repeatable).")
    ] = None,
    as_json: JsonFlag = False,
) -> None:
    """Create a model in the registry (you own it)."""
    from det_local.cli.common import print_json

    rec = _send("model_create", {"name": name, "description": description, "labels": label or []})
    if as_json:
        print_json(rec)
    else:
        assert isinstance(rec, dict)
        print(f"Created model {rec['name']!r} (id {rec['id']})")


@app.command("list")
def list_models(
    name: Annotated[str, typer.Option("--name", help="Only models whose name has this.")] = "",
    as_json: JsonFlag = False,
) -> None:
    """List the registry's models, by name."""
    from det_local.api import open_store
    from det_local.cli.common import print_json

    models = open_store().models.select(name=name)
    if as_json:
        print_json([m.to_json() for m in models])
    else:
        print(_models_table(models))


@app.command("describe")
def describe(model: ModelName, as_json: JsonFlag = False) -> None:
    """Show a model and its versions."""
    from det_local.api import open_store
    from det_local.cli.common import print_json
    from det_local.tables import fmt_value, wrap_lines

    store = open_store()
    m = store.models.get(model)
    versions = store.models.versions(m.id)
    if as_json:
        print_json({"model": m.to_json(), "versions": [v.to_json() for v in versions]})
        return
    from det_local.textsafe import visible

    lines = [f"Model {visible(m.name)} (id {m.id}){' (archived)' if m.archived else ''}"]
    for k, v in (
        ("Description", m.description),
        ("Labels", ", ".join(m.labels)),
        ("User", m.user),
        ("Created", fmt_time(m.created_at)),
        ("Updated", fmt_time(m.updated_at)),
        ("Metadata", fmt_value(m.metadata) if m.metadata else ""),
    ):
        lines += wrap_lines(f"{k + ':':<13}", str(v))
    lines += ["", "Versions:", _versions_table(versions)]
    print("\n".join(lines))


@app.command("register-version")
def register_version(
    model: ModelName,
    uuid: Annotated[str, typer.Argument(metavar="CHECKPOINT_UUID", help="The checkpoint.")],
    as_json: JsonFlag = False,
) -> None:
    """Register a checkpoint as the model's next version; checkpoint GC and deletions keep
    it from then on."""
    from det_local.cli.common import print_json

    rec = _send("model_register_version", {"model": model, "checkpoint_uuid": uuid})
    if as_json:
        print_json(rec)
    else:
        assert isinstance(rec, dict)
        print(f"Registered checkpoint {uuid} as version {rec['version']} of {rec['model_name']!r}")


@app.command("list-versions")
def list_versions(model: ModelName, as_json: JsonFlag = False) -> None:
    """List a model's versions, oldest first."""
    from det_local.api import open_store
    from det_local.cli.common import print_json

    store = open_store()
    versions = store.models.versions(store.models.get(model).id)
    if as_json:
        print_json([v.to_json() for v in versions])
    else:
        print(_versions_table(versions))


@app.command("delete")
def delete(
    model: ModelName,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")] = False,
) -> None:
    """Delete a model and its versions (the checkpoints stay; GC may collect them later)."""
    from det_local.api import open_store

    m = open_store().models.get(model)
    if not yes and not confirm(f"Delete model {m.name!r} and its {m.num_versions} versions?"):
        print("aborted; nothing was deleted")
        raise typer.Exit(1)
    print(_send("model_delete", {"model": m.name}))

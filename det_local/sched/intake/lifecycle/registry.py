"""The model registry's requests: create a model, register a checkpoint as its next version,
change or delete it (`store/tables/registry.py` holds the tables).

Anyone may create a model; only its owner (or root, the daemon's user, the admin group) may
change it, register versions in it or delete it. Registering a checkpoint keeps it from
checkpoint GC and from deletion, so it also needs the right to change that checkpoint's
experiment, or, that experiment deleted, to be the checkpoint's creator (recorded when the
experiment went: `ModelRegistry.checkpoint_owner`): nobody pins another user's files.
"""

from __future__ import annotations

from typing import Any

from det_local.errors import StateError
from det_local.sched.intake.handlers import Controls, Handler, authorize
from det_local.sched.intake.spool import Request
from det_local.store.states import CHECKPOINT_DOWNLOADABLE
from det_local.store.tables.registry import ModelRecord, check_labels, check_metadata, check_name


def _own_model(c: Controls, req: Request) -> ModelRecord:
    model = c.store.models.get(req.payload["model"])
    authorize(c.settings, req, model.user, f"model {model.name!r}")
    return model


def model_create(c: Controls, req: Request) -> dict[str, Any]:
    p = req.payload
    name = check_name(p.get("name"))
    description = p.get("description") or ""
    if not isinstance(description, str):
        raise StateError("a model's description must be a string")
    created = c.store.models.create(
        name,
        description=description,
        metadata=check_metadata(p.get("metadata") or {}),
        labels=check_labels(p.get("labels") or []),
        user=req.user,
    )
    return created.to_json()


def model_update(c: Controls, req: Request) -> dict[str, Any]:
    """description / labels / metadata / archived (those in the payload)."""
    model = _own_model(c, req)
    p = req.payload
    fields: dict[str, Any] = {}
    if "description" in p:
        if not isinstance(p["description"], str):
            raise StateError("a model's description must be a string")
        fields["description"] = p["description"]
    if "labels" in p:
        fields["labels"] = check_labels(p["labels"])
    if "metadata" in p:
        fields["metadata"] = check_metadata(p["metadata"])
    if "archived" in p:
        fields["archived"] = int(bool(p["archived"]))
    if fields:
        c.store.models.update(model.id, **fields)
    return c.store.models.get(model.id).to_json()


def model_register_version(c: Controls, req: Request) -> dict[str, Any]:
    model = _own_model(c, req)
    if model.archived:
        raise StateError(
            f"model {model.name!r} is archived; unarchive it before registering versions"
        )
    uuid = str(req.payload["checkpoint_uuid"])
    ckpt = c.store.get_checkpoint(uuid)
    if ckpt.state not in CHECKPOINT_DOWNLOADABLE:
        raise StateError(
            f"checkpoint {uuid} is {ckpt.state}: its files are gone, so it cannot be registered"
        )
    # its experiment's owner, or (that experiment deleted) its creator: never the model's
    # owner, so that nobody pins another user's files by registering them
    owner = c.store.models.checkpoint_owner(uuid, ckpt.experiment_id)
    authorize(
        c.settings, req, owner or "nobody", f"checkpoint {uuid} (experiment {ckpt.experiment_id})"
    )
    number = c.store.models.add_version(model.id, uuid, user=req.user)
    return c.store.models.version(model.id, number).to_json()


def model_version_update(c: Controls, req: Request) -> dict[str, Any]:
    model = _own_model(c, req)
    version = int(req.payload["version"])
    c.store.models.version(model.id, version)  # NotFoundError naming it
    fields = {k: str(req.payload[k]) for k in ("name", "notes", "comment") if k in req.payload}
    c.store.models.update_version(model.id, version, **fields)
    return c.store.models.version(model.id, version).to_json()


def model_version_delete(c: Controls, req: Request) -> str:
    model = _own_model(c, req)
    version = int(req.payload["version"])
    uuid = c.store.models.version(model.id, version).checkpoint_uuid
    c.store.models.delete_version(model.id, version)
    return f"model {model.name!r}: version {version} deleted" + _orphans_note(c, [uuid])


def model_delete(c: Controls, req: Request) -> str:
    model = _own_model(c, req)
    uuids = [v.checkpoint_uuid for v in c.store.models.versions(model.id)]
    c.store.models.delete(model.id)
    n = model.num_versions
    return f"model {model.name!r} deleted ({n} version{'s' if n != 1 else ''})" + _orphans_note(
        c, uuids
    )


def _orphans_note(c: Controls, uuids: list[str]) -> str:
    """What the answer adds when a checkpoint of a deleted experiment lost its last version:
    nothing keeps its files any more but its creator's `checkpoint delete`."""
    orphans = c.store.models.unregistered_orphans(list(dict.fromkeys(uuids)))
    if not orphans:
        return ""
    return (
        f"; {len(orphans)} checkpoint{'s' if len(orphans) != 1 else ''} of a deleted experiment "
        f"no longer registered (its creator removes the files: `det-local checkpoint delete "
        f"{' '.join(orphans)}`)"
    )


HANDLERS: dict[str, Handler] = {
    "model_create": model_create,
    "model_update": model_update,
    "model_register_version": model_register_version,
    "model_version_update": model_version_update,
    "model_version_delete": model_version_delete,
    "model_delete": model_delete,
}

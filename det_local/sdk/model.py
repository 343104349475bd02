"""`Model` and `ModelVersion` (Determined 0.38's model registry) over det-local's store
(`store/tables/registry.py`); changes go to the engine as the caller
(`sched/intake/lifecycle/registry.py`)."""

from __future__ import annotations

import datetime
import warnings
from typing import Any

from det_local.sdk._session import Session
from det_local.sdk.checkpoint import Checkpoint
from det_local.sdk.enums import ModelSortBy, OrderBy, descending
from det_local.sdk.metrics import TrialMetrics
from det_local.store.tables.registry import ModelRecord, VersionRecord


def _time(t: float) -> datetime.datetime:
    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc)


class ModelVersion:
    """One registered version of a model: ``checkpoint`` is the Checkpoint it points at."""

    def __init__(self, session: Session, model_version: int, model_name: str) -> None:
        self._session = session
        self.model_name = model_name
        self.model_version = model_version
        self.model_id: int | None = None
        self.checkpoint: Checkpoint | None = None
        self.metadata: dict[str, Any] | None = None
        self.name: str | None = None
        self.comment: str | None = None
        self.notes: str | None = None
        self.username: str | None = None
        self.creation_time: datetime.datetime | None = None

    @classmethod
    def _from_record(cls, session: Session, rec: VersionRecord) -> ModelVersion:
        v = cls(session, rec.version, rec.model_name)
        v._hydrate(rec)
        return v

    def _hydrate(self, rec: VersionRecord) -> None:
        from det_local.errors import NotFoundError
        from det_local.sdk.checkpoint import get_checkpoint

        self.model_id = rec.model_id
        self.model_version = rec.version
        self.metadata = dict(rec.metadata)
        self.name = rec.name
        self.comment = rec.comment
        self.notes = rec.notes
        self.username = rec.user
        self.creation_time = _time(rec.created_at)
        try:
            self.checkpoint = get_checkpoint(self._session, rec.checkpoint_uuid)
        except NotFoundError:
            self.checkpoint = None

    def reload(self) -> None:
        with self._session.store() as store:
            model = store.models.get(self.model_name)
            self._hydrate(store.models.version(model.id, self.model_version))

    def _update(self, **fields: str) -> None:
        rec = self._session.send(
            "model_version_update",
            {"model": self.model_name, "version": self.model_version, **fields},
        )
        self.name, self.notes = rec["name"], rec["notes"]

    def set_name(self, name: str) -> None:
        self._update(name=name)

    def set_notes(self, notes: str) -> None:
        self._update(notes=notes)

    def delete(self) -> None:
        self._session.send(
            "model_version_delete", {"model": self.model_name, "version": self.model_version}
        )

    def iter_metrics(self, group: str | None = None) -> list[TrialMetrics]:
        """The metrics its checkpoint's trial reported at the checkpoint's steps."""
        if self.checkpoint is None:
            return []
        return self.checkpoint.get_metrics(group)

    def get_metrics(self, group: str | None = None) -> list[TrialMetrics]:
        warnings.warn(
            "ModelVersion.get_metrics() has been deprecated and will be removed in a future "
            "version.Please call ModelVersion.iter_metrics() instead.",
            FutureWarning,
            stacklevel=2,
        )
        return self.iter_metrics(group)

    def __repr__(self) -> str:
        return f"ModelVersion(model_name={self.model_name}, version={self.model_version})"


class Model:
    """A model of the registry. Attributes: name, model_id, description, metadata, labels,
    username (its owner), archived, creation_time, last_updated_time, workspace_id (None)."""

    def __init__(self, session: Session, name: str) -> None:
        self._session = session
        self.name = name
        self.model_id: int | None = None
        self.description: str | None = None
        self.creation_time: datetime.datetime | None = None
        self.last_updated_time: datetime.datetime | None = None
        self.metadata: dict[str, Any] | None = None
        self.labels: list[str] | None = None
        self.username: str | None = None
        self.archived: bool | None = None
        self.workspace_id: int | None = None

    @classmethod
    def _from_record(cls, session: Session, rec: ModelRecord) -> Model:
        m = cls(session, rec.name)
        m._hydrate(rec)
        return m

    @classmethod
    def _from_json(cls, session: Session, data: dict[str, Any]) -> Model:
        return cls._from_record(session, ModelRecord(**data))

    def _hydrate(self, rec: ModelRecord) -> None:
        self.model_id = rec.id
        self.name = rec.name
        self.description = rec.description
        self.creation_time = _time(rec.created_at)
        self.last_updated_time = _time(rec.updated_at)
        self.metadata = dict(rec.metadata)
        self.labels = list(rec.labels)
        self.username = rec.user
        self.archived = rec.archived

    def reload(self) -> None:
        with self._session.store() as store:
            self._hydrate(store.models.get(self.name))

    def _update(self, **fields: Any) -> None:
        self._hydrate(
            ModelRecord(**self._session.send("model_update", {"model": self.name, **fields}))
        )

    # ------------------------------------------------------------------ versions
    def get_version(self, version: int = -1) -> ModelVersion | None:
        """The version numbered `version`; -1: the latest, or None when it has none."""
        with self._session.store() as store:
            model = store.models.get(self.name)
            if version == -1:
                versions = store.models.versions(model.id)
                if not versions:
                    return None
                return ModelVersion._from_record(self._session, versions[-1])
            return ModelVersion._from_record(self._session, store.models.version(model.id, version))

    def list_versions(self, order_by: OrderBy = OrderBy.DESC) -> list[ModelVersion]:
        """The model's versions, newest first by default."""
        with self._session.store() as store:
            versions = store.models.versions(store.models.get(self.name).id)
        if descending(order_by):
            versions.reverse()
        return [ModelVersion._from_record(self._session, v) for v in versions]

    def get_versions(self, order_by: OrderBy = OrderBy.DESC) -> list[ModelVersion]:
        warnings.warn(
            "Model.get_versions() has been deprecated and will be removed in a future version."
            "Please call Model.list_versions() instead.",
            FutureWarning,
            stacklevel=2,
        )
        return self.list_versions(order_by=order_by)

    def register_version(self, checkpoint_uuid: str) -> ModelVersion:
        """Register the checkpoint as the model's next version (checkpoint GC and deletions
        keep it from then on)."""
        rec = self._session.send(
            "model_register_version", {"model": self.name, "checkpoint_uuid": checkpoint_uuid}
        )
        return ModelVersion._from_record(self._session, VersionRecord(**rec))

    # ------------------------------------------------------------------ the model itself
    def add_metadata(self, metadata: dict[str, Any]) -> None:
        updated = dict(self.metadata or {}, **metadata)
        self._update(metadata=updated)

    def remove_metadata(self, keys: list[str]) -> None:
        if not isinstance(keys, list):
            raise ValueError(
                f"remove_metadata() requires a list of strings as input but got: {keys}"
            )
        self._update(metadata={k: v for k, v in (self.metadata or {}).items() if k not in keys})

    def set_labels(self, labels: list[str]) -> None:
        if not isinstance(labels, list) or not all(isinstance(x, str) for x in labels):
            raise ValueError(f"set_labels() requires a list of strings as input but got: {labels}")
        self._update(labels=labels)

    def set_description(self, description: str) -> None:
        self._update(description=description)

    def archive(self) -> None:
        self._update(archived=True)

    def unarchive(self) -> None:
        self._update(archived=False)

    def delete(self) -> None:
        """Delete the model and its versions (their checkpoints are no longer kept from GC)."""
        self._session.send("model_delete", {"model": self.name})

    def __repr__(self) -> str:
        return f"Model(id={self.model_id}, name={self.name})"


def create_model(
    session: Session, name: str, description: str | None = "", metadata: Any = None
) -> Model:
    rec = session.send(
        "model_create", {"name": name, "description": description or "", "metadata": metadata}
    )
    return Model._from_json(session, rec)


def get_model(session: Session, identifier: str | int) -> Model:
    with session.store() as store:
        return Model._from_record(session, store.models.get(identifier))


def get_models(
    session: Session,
    sort_by: ModelSortBy = ModelSortBy.NAME,
    order_by: OrderBy = OrderBy.ASCENDING,
    name: str = "",
    description: str = "",
) -> list[Model]:
    with session.store() as store:
        records = store.models.select(name=name or "", description=description or "")
    keys: dict[ModelSortBy, Any] = {
        ModelSortBy.NAME: lambda m: m.name,
        ModelSortBy.DESCRIPTION: lambda m: m.description,
        ModelSortBy.CREATION_TIME: lambda m: m.created_at,
        ModelSortBy.LAST_UPDATED_TIME: lambda m: m.updated_at,
        ModelSortBy.NUM_VERSIONS: lambda m: m.num_versions,
    }
    records.sort(key=keys.get(sort_by, keys[ModelSortBy.NAME]), reverse=descending(order_by))
    return [Model._from_record(session, r) for r in records]

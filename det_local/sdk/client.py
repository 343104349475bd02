"""`determined.experimental.client` as in Determined 0.38, over det-local's home
(DET_LOCAL_HOME): module functions acting on a default :class:`Determined`, and the class
for code that builds one. There is no master to log in to: ``login()`` only (re)binds the
home, and ``master``/``user``/``password`` are accepted and ignored — the caller's Unix user
is who acts, as with the CLI.

The notebook flow::

    from determined.experimental import client
    exp = client.create_experiment(config="const.yaml", model_dir=".")
    exp.wait()
    path = exp.list_checkpoints(max_results=1)[0].download()
"""

from __future__ import annotations

import pathlib
import warnings
from collections.abc import Iterable, Iterator
from typing import Any

from det_local.sdk import checkpoint as _ck
from det_local.sdk import experiment as _exp
from det_local.sdk import experiment as _experiment
from det_local.sdk import model as _model
from det_local.sdk._session import Session
from det_local.sdk.checkpoint import (
    Checkpoint,
    CheckpointStateException,
    CheckpointTrainingMetadata,
)
from det_local.sdk.enums import (
    CheckpointOrderBy,
    CheckpointSortBy,
    CheckpointState,
    DownloadMode,
    ExperimentOrderBy,
    ExperimentSortBy,
    ExperimentState,
    LogLevel,
    ModelOrderBy,
    ModelSortBy,
    OrderBy,
    TrialOrderBy,
    TrialSortBy,
    TrialState,
)
from det_local.sdk.experiment import Experiment, Trial
from det_local.sdk.metrics import (
    TrainingMetrics,
    TrialMetrics,
    ValidationMetrics,
    iter_legacy,
)
from det_local.sdk.metrics import (
    iter_trials_metrics as _iter_metrics,
)
from det_local.sdk.model import Model, ModelVersion
from det_local.store.paths import Paths


class Determined:
    """A det-local home as Determined's client object. ``master``, ``user``, ``password``
    and the certificate arguments are accepted for code written for a cluster; det-local
    acts as the calling Unix user on DET_LOCAL_HOME (``home`` chooses another)."""

    def __init__(
        self,
        master: str | None = None,
        user: str | None = None,
        password: str | None = None,
        cert_path: str | None = None,
        cert_name: str | None = None,
        noverify: bool = False,
        *,
        home: str | pathlib.Path | None = None,
    ) -> None:
        paths = Paths(pathlib.Path(home).absolute()) if home is not None else Paths.from_env()
        self._session = Session(paths)

    def create_experiment(
        self,
        config: str | pathlib.Path | dict[str, Any],
        model_dir: str | pathlib.Path | None = None,
        includes: Iterable[str | pathlib.Path] | None = None,
        project_id: int | None = None,
        template: str | None = None,
    ) -> Experiment:
        from det_local.sdk.submit import create

        exp_id = create(self._session, config, model_dir, includes, project_id, template)
        return _exp.get_experiment(self._session, exp_id)

    def get_experiment(self, experiment_id: int) -> Experiment:
        return _exp.get_experiment(self._session, experiment_id)

    def list_experiments(
        self,
        sort_by: ExperimentSortBy | None = None,
        order_by: OrderBy | None = None,
        experiment_ids: list[int] | None = None,
        labels: list[str] | None = None,
        users: list[str] | None = None,
        states: list[ExperimentState] | None = None,
        name: str | None = None,
        project_id: int | None = None,
    ) -> list[Experiment]:
        found = _exp.list_experiments(
            self._session,
            experiment_ids=experiment_ids,
            labels=labels,
            users=users,
            states=states,
            name=name,
        )
        if order_by is not None and order_by.value == "ORDER_BY_DESC":
            found.reverse()
        return found

    def get_trial(self, trial_id: int) -> Trial:
        return _experiment.get_trial(self._session, trial_id)

    def get_checkpoint(self, uuid: str) -> Checkpoint:
        return _ck.get_checkpoint(self._session, uuid)

    def create_model(
        self, name: str, description: str | None = "", metadata: dict[str, Any] | None = None
    ) -> Model:
        return _model.create_model(self._session, name, description, metadata)

    def get_model(self, identifier: str | int) -> Model:
        return _model.get_model(self._session, identifier)

    def get_model_by_id(self, model_id: int) -> Model:
        warnings.warn(
            "Determined.get_model_by_id() has been deprecated and will be removed in a future "
            "version. Please call Determined.get_model() with either a string-type name or "
            "an integer-type model ID.",
            FutureWarning,
            stacklevel=2,
        )
        return self.get_model(model_id)

    def get_models(
        self,
        sort_by: ModelSortBy = ModelSortBy.NAME,
        order_by: OrderBy = OrderBy.ASCENDING,
        name: str = "",
        description: str = "",
    ) -> list[Model]:
        return _model.get_models(self._session, sort_by, order_by, name, description)

    def list_models(
        self,
        sort_by: ModelSortBy = ModelSortBy.NAME,
        order_by: OrderBy = OrderBy.ASCENDING,
        name: str | None = None,
        description: str | None = None,
        model_id: int | None = None,
        workspace_names: list[str] | None = None,
        workspace_ids: list[int] | None = None,
    ) -> list[Model]:
        found = _model.get_models(self._session, sort_by, order_by, name or "", description or "")
        return [m for m in found if model_id is None or m.model_id == model_id]

    def get_model_labels(self) -> list[str]:
        return sorted({label for m in self.get_models() for label in m.labels or []})

    def iter_trials_metrics(self, trial_ids: list[int], group: str) -> Iterator[TrialMetrics]:
        return _iter_metrics(self._session, trial_ids, group)

    def stream_trials_metrics(self, trial_ids: list[int], group: str) -> Iterator[TrialMetrics]:
        warnings.warn(
            "Determined.stream_trials_metrics is deprecated."
            "Use Determined.iter_trials_metrics instead",
            FutureWarning,
            stacklevel=2,
        )
        return self.iter_trials_metrics(trial_ids, group)

    def stream_trials_training_metrics(self, trial_ids: list[int]) -> Iterator[TrialMetrics]:
        warnings.warn(
            "Determined.stream_trials_training_metrics is deprecated."
            "Use Determined.iter_trials_metrics instead with `group` set to 'training'",
            FutureWarning,
            stacklevel=2,
        )
        return iter_legacy(self._session, trial_ids, "training")

    def stream_trials_validation_metrics(self, trial_ids: list[int]) -> Iterator[TrialMetrics]:
        warnings.warn(
            "Determined.stream_trials_validation_metrics is deprecated."
            "Use Determined.iter_trials_metrics instead with `group` set to 'validation'",
            FutureWarning,
            stacklevel=2,
        )
        return iter_legacy(self._session, trial_ids, "validation")

    def get_session_username(self) -> str:
        from det_local.store.tables.experiments import current_user

        return current_user()

    def logout(self) -> None:
        """Nothing to log out of: det-local acts as the calling Unix user."""


_determined: Determined | None = None


def _client() -> Determined:
    """The client login() made, else one for DET_LOCAL_HOME as it is now."""
    return _determined if _determined is not None else Determined()


def login(
    master: str | None = None,
    user: str | None = None,
    password: str | None = None,
    cert_path: str | None = None,
    cert_name: str | None = None,
    noverify: bool = False,
) -> None:
    """Bind the module functions to DET_LOCAL_HOME as it is now (the arguments are accepted
    and ignored: there is no master; the caller's Unix user acts)."""
    global _determined
    _determined = Determined(master, user, password, cert_path, cert_name, noverify)


def create_experiment(
    config: str | pathlib.Path | dict[str, Any],
    model_dir: str | None = None,
    includes: Iterable[str | pathlib.Path] | None = None,
    project_id: int | None = None,
    template: str | None = None,
) -> Experiment:
    """Submit an experiment (a config file's path or a dict, and the directory of its code)
    and return it at once; ``exp.wait()`` waits for it to end."""
    return _client().create_experiment(config, model_dir, includes, project_id, template)


def get_experiment(experiment_id: int) -> Experiment:
    return _client().get_experiment(experiment_id)


def list_experiments(
    sort_by: ExperimentSortBy | None = None,
    order_by: OrderBy | None = None,
    experiment_ids: list[int] | None = None,
    labels: list[str] | None = None,
    users: list[str] | None = None,
    states: list[ExperimentState] | None = None,
    name: str | None = None,
    project_id: int | None = None,
) -> list[Experiment]:
    return _client().list_experiments(
        sort_by, order_by, experiment_ids, labels, users, states, name, project_id
    )


def get_trial(trial_id: int) -> Trial:
    return _client().get_trial(trial_id)


def get_checkpoint(uuid: str) -> Checkpoint:
    return _client().get_checkpoint(uuid)


def create_model(
    name: str, description: str | None = "", metadata: dict[str, Any] | None = None
) -> Model:
    return _client().create_model(name, description, metadata)


def get_model(identifier: str | int) -> Model:
    return _client().get_model(identifier)


def get_model_by_id(model_id: int) -> Model:
    warnings.warn(
        "client.get_model_by_id() has been deprecated and will be removed in a future "
        "version. Please call client.get_model() with either a string-type name or an "
        "integer-type model ID.",
        FutureWarning,
        stacklevel=2,
    )
    return _client().get_model(model_id)


def get_models(
    sort_by: ModelSortBy = ModelSortBy.NAME,
    order_by: OrderBy = OrderBy.ASCENDING,
    name: str = "",
    description: str = "",
) -> list[Model]:
    return _client().get_models(sort_by, order_by, name, description)


def list_models(
    sort_by: ModelSortBy = ModelSortBy.NAME,
    order_by: OrderBy = OrderBy.ASCENDING,
    name: str | None = None,
    description: str | None = None,
    model_id: int | None = None,
    workspace_names: list[str] | None = None,
    workspace_ids: list[int] | None = None,
) -> list[Model]:
    return _client().list_models(sort_by, order_by, name, description, model_id)


def get_model_labels() -> list[str]:
    return _client().get_model_labels()


def iter_trials_metrics(trial_ids: list[int], group: str) -> Iterator[TrialMetrics]:
    """Every metric report of `group` of these trials, as TrialMetrics."""
    return _client().iter_trials_metrics(trial_ids, group)


def stream_trials_metrics(trial_ids: list[int], group: str) -> Iterator[TrialMetrics]:
    warnings.warn(
        "client.stream_trials_metrics is deprecated. Use client.iter_trials_metrics instead",
        FutureWarning,
        stacklevel=2,
    )
    return iter_trials_metrics(trial_ids, group=group)


def stream_trials_training_metrics(trial_ids: list[int]) -> Iterator[TrialMetrics]:
    warnings.warn(
        "client.stream_trials_training_metrics is deprecated."
        "Use client.iter_trials_metrics instead with `group` set to 'training'",
        FutureWarning,
        stacklevel=2,
    )
    return iter_legacy(_client()._session, trial_ids, "training")


def stream_trials_validation_metrics(trial_ids: list[int]) -> Iterator[TrialMetrics]:
    warnings.warn(
        "client.stream_trials_validation_metrics is deprecated."
        "Use client.iter_trials_metrics instead with `group` set to 'validation'",
        FutureWarning,
        stacklevel=2,
    )
    return iter_legacy(_client()._session, trial_ids, "validation")


def get_session_username() -> str:
    return _client().get_session_username()


def logout() -> None:
    """Nothing to log out of."""


__all__ = [
    "Checkpoint",
    "CheckpointOrderBy",
    "CheckpointSortBy",
    "CheckpointState",
    "CheckpointStateException",
    "CheckpointTrainingMetadata",
    "Determined",
    "DownloadMode",
    "Experiment",
    "ExperimentOrderBy",
    "ExperimentSortBy",
    "ExperimentState",
    "LogLevel",
    "Model",
    "ModelOrderBy",
    "ModelSortBy",
    "ModelVersion",
    "OrderBy",
    "TrainingMetrics",
    "Trial",
    "TrialMetrics",
    "TrialOrderBy",
    "TrialSortBy",
    "TrialState",
    "ValidationMetrics",
    "create_experiment",
    "create_model",
    "get_checkpoint",
    "get_experiment",
    "get_model",
    "get_model_by_id",
    "get_model_labels",
    "get_models",
    "get_session_username",
    "get_trial",
    "iter_trials_metrics",
    "list_experiments",
    "list_models",
    "login",
    "logout",
    "stream_trials_metrics",
    "stream_trials_training_metrics",
    "stream_trials_validation_metrics",
]

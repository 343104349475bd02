"""The SDK's enums, with Determined 0.38's member names and values (the REST API's strings),
so that code comparing or printing them behaves as it did against a Determined master."""

from __future__ import annotations

import enum
import warnings
from typing import Any

from det_local.store.states import CheckpointState as StoreCheckpointState
from det_local.store.states import State


class OrderBy(enum.Enum):
    """Ascending or descending order of a sorted list."""

    ASCENDING = "ORDER_BY_ASC"
    ASC = "ORDER_BY_ASC"
    DESCENDING = "ORDER_BY_DESC"
    DESC = "ORDER_BY_DESC"


class _DeprecatedOrderBy(enum.Enum):
    """Determined's per-kind OrderBy classes: deprecated for ``OrderBy``; a member warns."""

    def __getattribute__(self, name: str) -> Any:
        if name.startswith("_"):  # the enum machinery's own lookups
            return super().__getattribute__(name)
        kind = type(self).__name__
        warnings.warn(
            f"'{kind}' is deprecated and will be removed in a future release. Please use "
            "'experimental.OrderBy' instead.",
            FutureWarning,
            stacklevel=2,
        )
        return super().__getattribute__(name)


class ExperimentOrderBy(_DeprecatedOrderBy):
    ASCENDING = "ORDER_BY_ASC"
    DESCENDING = "ORDER_BY_DESC"


class TrialOrderBy(_DeprecatedOrderBy):
    ASCENDING = "ORDER_BY_ASC"
    ASC = "ORDER_BY_ASC"
    DESCENDING = "ORDER_BY_DESC"
    DESC = "ORDER_BY_DESC"


class CheckpointOrderBy(_DeprecatedOrderBy):
    ASC = "ORDER_BY_ASC"
    DESC = "ORDER_BY_DESC"


class ModelOrderBy(_DeprecatedOrderBy):
    ASCENDING = "ORDER_BY_ASC"
    ASC = "ORDER_BY_ASC"
    DESCENDING = "ORDER_BY_DESC"
    DESC = "ORDER_BY_DESC"


def descending(order_by: Any) -> bool:
    return getattr(order_by, "value", order_by) == "ORDER_BY_DESC"


class ExperimentState(enum.Enum):
    ACTIVE = "STATE_ACTIVE"
    PAUSED = "STATE_PAUSED"
    STOPPING_COMPLETED = "STATE_STOPPING_COMPLETED"
    STOPPING_CANCELED = "STATE_STOPPING_CANCELED"
    STOPPING_ERROR = "STATE_STOPPING_ERROR"
    COMPLETED = "STATE_COMPLETED"
    CANCELED = "STATE_CANCELED"
    ERROR = "STATE_ERROR"
    DELETED = "STATE_DELETED"
    DELETING = "STATE_DELETING"
    DELETE_FAILED = "STATE_DELETE_FAILED"
    STOPPING_KILLED = "STATE_STOPPING_KILLED"
    QUEUED = "STATE_QUEUED"
    PULLING = "STATE_PULLING"
    STARTING = "STATE_STARTING"
    RUNNING = "STATE_RUNNING"


TERMINAL_STATES = frozenset(
    {
        ExperimentState.COMPLETED,
        ExperimentState.CANCELED,
        ExperimentState.DELETED,
        ExperimentState.ERROR,
    }
)


class TrialState(enum.Enum):
    ACTIVE = "STATE_ACTIVE"
    PAUSED = "STATE_PAUSED"
    STOPPING_CANCELED = "STATE_STOPPING_CANCELED"
    STOPPING_KILLED = "STATE_STOPPING_KILLED"
    STOPPING_COMPLETED = "STATE_STOPPING_COMPLETED"
    STOPPING_ERROR = "STATE_STOPPING_ERROR"
    CANCELED = "STATE_CANCELED"
    COMPLETED = "STATE_COMPLETED"
    ERROR = "STATE_ERROR"
    QUEUED = "STATE_QUEUED"
    PULLING = "STATE_PULLING"
    STARTING = "STATE_STARTING"
    RUNNING = "STATE_RUNNING"


def experiment_state(state: State) -> ExperimentState:
    """det-local's state as Determined names it (STOPPING_PAUSED is still pausing: PAUSED
    once its trials stop; Determined has no such state, so it reads as ACTIVE until then)."""
    if state == State.STOPPING_PAUSED:
        return ExperimentState.ACTIVE
    return ExperimentState[state.value]


def trial_state(state: State) -> TrialState:
    if state == State.STOPPING_PAUSED:
        return TrialState.ACTIVE
    return TrialState[state.value]


class CheckpointState(enum.Enum):
    ACTIVE = "STATE_ACTIVE"
    COMPLETED = "STATE_COMPLETED"
    ERROR = "STATE_ERROR"
    DELETED = "STATE_DELETED"
    PARTIALLY_DELETED = "STATE_PARTIALLY_DELETED"


def checkpoint_state(state: StoreCheckpointState | str) -> CheckpointState:
    return CheckpointState[str(state)]


class CheckpointSortBy(enum.Enum):
    UUID = "SORT_BY_UUID"
    TRIAL_ID = "SORT_BY_TRIAL_ID"
    BATCH_NUMBER = "SORT_BY_BATCH_NUMBER"
    END_TIME = "SORT_BY_END_TIME"
    STATE = "SORT_BY_STATE"
    SEARCHER_METRIC = "SORT_BY_SEARCHER_METRIC"


class TrialSortBy(enum.Enum):
    ID = "SORT_BY_ID"
    START_TIME = "SORT_BY_START_TIME"
    END_TIME = "SORT_BY_END_TIME"
    STATE = "SORT_BY_STATE"
    BEST_VALIDATION_METRIC = "SORT_BY_BEST_VALIDATION_METRIC"
    LATEST_VALIDATION_METRIC = "SORT_BY_LATEST_VALIDATION_METRIC"
    BATCHES_PROCESSED = "SORT_BY_BATCHES_PROCESSED"
    DURATION = "SORT_BY_DURATION"
    RESTARTS = "SORT_BY_RESTARTS"
    CHECKPOINT_SIZE = "SORT_BY_CHECKPOINT_SIZE"
    LOG_RETENTION_DAYS = "SORT_BY_LOG_RETENTION_DAYS"


class ExperimentSortBy(enum.Enum):
    ID = "SORT_BY_ID"
    DESCRIPTION = "SORT_BY_DESCRIPTION"
    START_TIME = "SORT_BY_START_TIME"
    END_TIME = "SORT_BY_END_TIME"
    STATE = "SORT_BY_STATE"
    NUM_TRIALS = "SORT_BY_NUM_TRIALS"
    PROGRESS = "SORT_BY_PROGRESS"
    USER = "SORT_BY_USER"
    NAME = "SORT_BY_NAME"
    FORKED_FROM = "SORT_BY_FORKED_FROM"
    RESOURCE_POOL = "SORT_BY_RESOURCE_POOL"
    PROJECT_ID = "SORT_BY_PROJECT_ID"
    CHECKPOINT_SIZE = "SORT_BY_CHECKPOINT_SIZE"
    CHECKPOINT_COUNT = "SORT_BY_CHECKPOINT_COUNT"
    SEARCHER_METRIC_VAL = "SORT_BY_SEARCHER_METRIC_VAL"


class ModelSortBy(enum.Enum):
    NAME = "SORT_BY_NAME"
    DESCRIPTION = "SORT_BY_DESCRIPTION"
    CREATION_TIME = "SORT_BY_CREATION_TIME"
    LAST_UPDATED_TIME = "SORT_BY_LAST_UPDATED_TIME"
    NUM_VERSIONS = "SORT_BY_NUM_VERSIONS"
    WORKSPACE = "SORT_BY_WORKSPACE"


class DownloadMode(enum.Enum):
    """How a checkpoint is downloaded: det-local always copies it from its storage (a
    shared_fs or directory path on this machine), whatever the mode."""

    DIRECT = "direct"
    MASTER = "master"
    AUTO = "auto"

    def __str__(self) -> str:
        return self.value


class LogLevel(enum.Enum):
    TRACE = "LOG_LEVEL_TRACE"
    DEBUG = "LOG_LEVEL_DEBUG"
    INFO = "LOG_LEVEL_INFO"
    WARNING = "LOG_LEVEL_WARNING"
    ERROR = "LOG_LEVEL_ERROR"
    CRITICAL = "LOG_LEVEL_CRITICAL"

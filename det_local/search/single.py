"""The single searcher: one trial, trained for max_length (or as long as the trial decides)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from det_local.search.actions import Action, Close, Create, SearchState, ValidateAfter


class SingleSearch:
    def __init__(self, max_length: int | None) -> None:
        self.max_length = max_length

    def initial_actions(self, new_trial: Callable[[], Create]) -> list[Action]:
        create = new_trial()
        actions: list[Action] = [create]
        if self.max_length is not None:
            actions.append(ValidateAfter(create.request_id, self.max_length))
        actions.append(Close(create.request_id))
        return actions

    def on_validation(
        self, request_id: str, metrics: dict[str, Any], new_trial: Callable[[], Create]
    ) -> list[Action]:
        return []

    def on_op_completed(
        self, request_id: str, length: int, metric: float, new_trial: Callable[[], Create]
    ) -> list[Action]:
        return []

    def on_trial_exited(self, request_id: str, new_trial: Callable[[], Create]) -> list[Action]:
        return []

    def on_trial_exited_early(
        self, request_id: str, reason: str, new_trial: Callable[[], Create]
    ) -> list[Action]:
        return []

    def progress(self, state: SearchState) -> float:
        return 1.0 if state.shutdown else 0.0

    def snapshot(self) -> dict[str, Any]:
        return {"max_length": self.max_length}

    def restore(self, data: dict[str, Any]) -> None:
        self.max_length = data["max_length"]

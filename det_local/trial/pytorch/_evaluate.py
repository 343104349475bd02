"""The validation a Trainer's loop runs: evaluate_batch() over the validation loader on every
rank, reduced across them, or evaluate_full_dataset() on the chief; the callbacks' validation
hooks around it. Reporting the metrics and the checkpoint policy are the loop's."""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from det_local.trial.pytorch._callback import PyTorchCallback
from det_local.trial.pytorch._errors import InvalidTrialError
from det_local.trial.pytorch._fit import TrialEnv
from det_local.trial.pytorch._metrics import to_host, to_python
from det_local.trial.pytorch._reducer import evaluation_reducers, reduce_validation
from det_local.trial.pytorch._training_data import TrainingData
from det_local.trial.pytorch._trial import evaluate_batch_caller

logger = logging.getLogger("determined.pytorch")


class Evaluator:
    """Runs a PyTorchTrial's validation; evaluate() returns its reduced metrics."""

    def __init__(self, env: TrialEnv, data: TrainingData) -> None:
        self.env = env
        self.data = data
        self.eval_by_batch = data.eval_by_batch
        self.call_evaluate_batch = evaluate_batch_caller(env.trial)

    def evaluate(self) -> dict[str, Any]:
        """Run the validation and return its reduced metrics (plain Python values)."""
        env = self.env
        context, dist, callbacks = env.context, env.dist, env.callbacks
        context.reset_reducers()
        for model in context.models:
            model.eval()
        for cb in callbacks.values():
            cb.on_validation_start()
        started = time.time()
        metrics: dict[str, Any] = {}
        if self.eval_by_batch:
            for cb in callbacks.values():
                cb.on_validation_epoch_start()
            rows, keys, records = self.evaluate_batches()
            rows = to_host(rows)
            for cb in callbacks.values():
                cb.on_validation_epoch_end(rows)
            reducers = evaluation_reducers(env.trial.evaluation_reducer(), list(keys), env.name)
            metrics = reduce_validation(dist, rows, reducers)
            counts = dist.gather((records, len(rows)))
            if env.is_chief and counts:
                total_records = sum(c[0] for c in counts)
                total_batches = sum(c[1] for c in counts)
                took = time.time() - started
                logger.info(
                    f"validated: {total_records} records in {took:.3f}s "
                    f"({total_records / max(took, 1e-9):.3f} records/s), in {total_batches} batches"
                )
        elif env.is_chief:
            out = env.trial.evaluate_full_dataset(data_loader=self.data.validation_loader)
            if not isinstance(out, dict):
                raise InvalidTrialError(
                    f"{env.name}.evaluate_full_dataset() returned a {type(out).__name__}; return "
                    "a dict of metric name -> value"
                )
            metrics = {k: to_python(v) for k, v in out.items()}
        metrics.update(context.reduce_metrics(for_training=False))
        if dist.size > 1 and any(
            type(cb).on_validation_end is not PyTorchCallback.on_validation_end
            for cb in callbacks.values()
        ):
            metrics = dist.broadcast(metrics)
        for cb in callbacks.values():
            cb.on_validation_end(metrics)
        return metrics

    def evaluate_batches(self) -> tuple[list[dict[str, Any]], list[str], int]:
        """evaluate_batch() over the validation loader: (its metrics per batch, their names,
        records seen)."""
        env = self.env
        keys: Any = None
        rows: list[dict[str, Any]] = []
        records = 0
        for idx, batch in enumerate(self.data.validation_loader):
            if env.context.experimental._auto_to_device:
                batch = env.context.to_device(batch)
            records += env.trial.get_batch_length(batch)
            out = self.call_evaluate_batch(batch, idx)
            keys = self.check_row(out, idx, keys)
            rows.append(
                {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in out.items()}
            )
            if env.settings.test_mode:
                break
        if not rows:
            raise InvalidTrialError(
                f"{env.name}.build_validation_data_loader() gave no batches"
                + (f" on rank {env.dist.rank}" if env.dist.size > 1 else "")
                + "; validation needs at least one batch"
            )
        return rows, list(keys), records

    def check_row(self, out: Any, idx: int, keys: Any) -> Any:
        """evaluate_batch()'s answer is a dict with the names of the batches before; its keys."""
        name = self.env.name
        if not isinstance(out, dict):
            raise InvalidTrialError(
                f"{name}.evaluate_batch() returned a {type(out).__name__}; return a "
                "dict of metric name -> value"
            )
        if keys is None:
            return out.keys()
        if out.keys() != keys:
            raise InvalidTrialError(
                f"{name}.evaluate_batch() returned metrics {sorted(out)} for batch "
                f"{idx} but {sorted(keys)} before; return the same names for every batch"
            )
        return keys

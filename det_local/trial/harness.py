"""The Trial harness: runs a legacy ``entrypoint: model_def:MyTrial`` (Determined's
``python3 -m determined.exec.harness model_def:MyTrial``).

What Determined 0.38's harness does for a PyTorchTrial, and so what this does:

1. import the class from the context (the working directory is on sys.path);
2. ``pytorch.init(hparams=<trial hparams>, exp_conf=<config>,
   aggregation_frequency=optimizations.aggregation_frequency)``, mark the context as a
   pre-Trainer one (checkpoints say so) and default ``average_aggregated_gradients`` from the
   config;
3. ``TrialClass(context)``, then ``Trainer(trial, context).fit(...)`` with the periods the
   config names: ``min_checkpoint_period`` / ``min_validation_period`` (``{batches: 0}``, the
   default, means "only at the end"), ``reporting_period=Batch(scheduling_unit)``,
   ``checkpoint_policy``, ``step_zero_validation=perform_initial_validation``,
   ``profiling_enabled=profiling.enabled``, ``latest_checkpoint`` from the cluster info, and no
   ``max_length``: the Trainer trains for ``searcher.max_length`` (records become batches of
   ``global_batch_size``).

A DeepSpeedTrial goes the same way through ``deepspeed.init(hparams=..., exp_conf=...)`` and
``deepspeed.Trainer`` (no aggregation_frequency: the DeepSpeed config has
gradient_accumulation_steps); lengths in epochs need ``records_per_epoch`` in its config, as in
Determined 0.37, where an epoch was records_per_epoch // train_batch_size batches.

An exception from the trial's code ends the process with its traceback (exit 1). A mistake
det-local can name (a missing module or class, a class that is not a PyTorchTrial, a config the
harness cannot run) is one line, ``det-local: error: ...``, and exit 1; with ``debug: true`` in
the config (or DET_LOCAL_DEBUG=1) the traceback is printed as well.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import importlib
import inspect
import logging
import os
import sys
import traceback
import types
import warnings
from typing import Any

from det_local.errors import ConfigError, DetLocalError

logger = logging.getLogger("determined")

TEST_MODE_ENV = "DET_LOCAL_TEST_MODE"
DEBUG_ENV = "DET_LOCAL_DEBUG"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python3 -m determined.exec.harness",
        description="Train a PyTorchTrial class inside a det-local trial.",
    )
    parser.add_argument("train_entrypoint", help="module:TrialClass, e.g. model_def:MyTrial")
    args = parser.parse_args(argv)

    from det_local.trial import LOG_FORMAT, get_cluster_info

    info = get_cluster_info()
    debug = bool(
        os.environ.get(DEBUG_ENV)
        or (info is not None and info.task_type == "TRIAL" and info.trial._debug)
    )
    logging.basicConfig(level=logging.DEBUG if debug else logging.INFO, format=LOG_FORMAT)
    try:
        run(args.train_entrypoint)
    except DetLocalError as err:
        if debug:
            traceback.print_exc()
        print(f"det-local: error: {err}{_where(err)}", file=sys.stderr, flush=True)
        return err.exit_code
    return 0


def run(train_entrypoint: str) -> None:
    """Import the Trial class named by ``train_entrypoint`` and train it as Determined does."""
    from det_local.trial import get_cluster_info

    info = get_cluster_info()
    if info is None or info.task_type != "TRIAL":
        raise DetLocalError(
            f"the Trial harness runs '{train_entrypoint}' inside a det-local trial; run the "
            "experiment with `det-local run CONFIG CONTEXT`, or train the class yourself with "
            "pytorch.Trainer(trial, context).fit(max_length=...)"
        )
    config: dict[str, Any] = info.trial._config
    slots = int((config.get("resources") or {}).get("slots_per_trial") or 1)
    if (slots > 1 or len(info.slot_ids) > 1) and not os.environ.get("WORLD_SIZE"):
        raise DetLocalError(
            f"entrypoint '{train_entrypoint}' with resources.slots_per_trial: {slots} runs one "
            "harness per slot under the torch_distributed launcher; use the entrypoint "
            f"'{train_entrypoint}' (det-local wraps it) or 'python3 -m "
            f"determined.launch.torch_distributed --trial {train_entrypoint}'"
        )
    hparams = info.trial.hparams
    gbs = _global_batch_size(hparams)
    searcher = config.get("searcher") or {}
    if searcher.get("max_length") is None and not _truthy(os.environ.get(TEST_MODE_ENV)):
        raise ConfigError(
            f"entrypoint '{train_entrypoint}' is a Trial class, which trains for "
            "searcher.max_length, and the config has none: add e.g. "
            "'searcher: {max_length: {batches: 1000}}', or train with a script that calls "
            "pytorch.Trainer(...).fit(max_length=...)"
        )
    max_length = searcher.get("max_length")
    if isinstance(max_length, dict) and "records" in max_length and not gbs:
        raise ConfigError(
            f"searcher.max_length is {{records: {max_length['records']}}}, which needs the "
            "global_batch_size hyperparameter to be converted to batches; add "
            "global_batch_size to hyperparameters or give max_length in batches"
        )
    checkpoint_period = period(config, "min_checkpoint_period", gbs)
    validation_period = period(config, "min_validation_period", gbs)
    optimizations = config.get("optimizations") or {}
    aggregation_frequency = int(optimizations.get("aggregation_frequency") or 1)
    average_aggregated = bool(optimizations.get("average_aggregated_gradients", True))
    scheduling_unit = int(config.get("scheduling_unit") or 100)
    trial_class = load_trial_class(train_entrypoint)
    deepspeed = _is_deepspeed_trial(trial_class)
    if deepspeed and not config.get("records_per_epoch"):
        lengths = {
            "searcher.max_length": max_length,
            "min_validation_period": config.get("min_validation_period"),
            "min_checkpoint_period": config.get("min_checkpoint_period"),
        }
        for name, value in lengths.items():
            if isinstance(value, dict) and value.get("epochs"):
                raise ConfigError(
                    f"{name} is {{epochs: {value['epochs']}}}: a DeepSpeedTrial class counts "
                    "epochs in records, so the config needs records_per_epoch (e.g. "
                    "'records_per_epoch: 50000'), or give the length in batches"
                )

    if train_entrypoint == config.get("entrypoint"):
        warnings.warn(
            f"Support for legacy entrypoint format ({train_entrypoint}) has been deprecated in "
            "Determined 0.38.0 and will be removed in a future version.  You can keep your "
            "PyTorchTrial, but please replace your model_def:TrialClass-style entrypoint "
            "with a script-style entrypoint, and use the det.pytorch.Trainer() to train your "
            "PyTorchTrial.",
            FutureWarning,
            stacklevel=2,
        )

    # The Trainer's own "set fit(max_length=X)" advice does not apply to a Trial class (it has
    # no fit() call); the warning above already points at the script form.
    warnings.filterwarnings(
        "ignore", message="Configuring `max_length` from the `searcher.max_length`"
    )
    from det_local.trial import pytorch

    with contextlib.ExitStack() as stack:
        context: Any
        if deepspeed:
            from det_local.trial.pytorch import deepspeed as det_ds

            context = stack.enter_context(det_ds.init(hparams=hparams, exp_conf=config))
            trainer_class: Any = det_ds.Trainer
        else:
            context = stack.enter_context(
                pytorch.init(
                    hparams=hparams, exp_conf=config, aggregation_frequency=aggregation_frequency
                )
            )
            context._set_default_average_aggregated_gradients(average_aggregated)
            trainer_class = pytorch.Trainer
        context._set_is_pre_trainer()
        trial = trial_class(context)
        if context.distributed.size > 1 and context.distributed.rank != 0:
            level = logging.DEBUG if info.trial._debug else logging.WARNING
            logging.getLogger().setLevel(level)
        logger.info(f"Creating Trainer with {trial_class.__name__}.")
        trainer_class(trial, context).fit(
            checkpoint_period=checkpoint_period,
            validation_period=validation_period,
            reporting_period=pytorch.Batch(scheduling_unit),
            checkpoint_policy=str(config.get("checkpoint_policy") or "best"),
            latest_checkpoint=info.latest_checkpoint,
            step_zero_validation=bool(config.get("perform_initial_validation")),
            profiling_enabled=bool((config.get("profiling") or {}).get("enabled")),
        )


# ---------------------------------------------------------------------------- the class
def _is_deepspeed_trial(cls: type) -> bool:
    from det_local.trial.pytorch.deepspeed import DeepSpeedTrial

    return issubclass(cls, DeepSpeedTrial)


def load_trial_class(spec: str) -> type:
    """The PyTorchTrial or DeepSpeedTrial subclass that ``module:QualName`` names, imported
    from the working directory (put first on sys.path, as Determined does with the model
    directory)."""
    from det_local.trial.pytorch import PyTorchTrial
    from det_local.trial.pytorch.deepspeed import DeepSpeedTrial

    module_name, _, qualname = spec.partition(":")
    if not module_name or not qualname:
        raise ConfigError(f"entrypoint '{spec}' is not of the form module:TrialClass")
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    # Determined drops a module of the same name first, so that the context's wins.
    sys.modules.pop(module_name, None)
    rel = module_name.replace(".", "/")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        missing = err.name or ""
        if missing and (module_name == missing or module_name.startswith(missing + ".")):
            raise ConfigError(
                f"entrypoint '{spec}': no module '{module_name}' in {cwd}: expected {rel}.py "
                f"(or {rel}/__init__.py) there"
            ) from None
        raise  # the module itself imports something missing: its traceback says where
    where = _module_file(module)
    obj: Any = module
    for i, part in enumerate(qualname.split(".")):
        if not hasattr(obj, part):
            scope = where if i == 0 else f"{'.'.join(qualname.split('.')[:i])} in {where}"
            raise ConfigError(
                f"entrypoint '{spec}': {scope} has no class '{part}'"
                + _suggest(part, module, PyTorchTrial)
            )
        obj = getattr(obj, part)
    if not isinstance(obj, type):
        kind = (
            "function"
            if isinstance(obj, (types.FunctionType, types.BuiltinFunctionType))
            else "module"
            if isinstance(obj, types.ModuleType)
            else f"{type(obj).__name__} value"
        )
        raise ConfigError(
            f"entrypoint '{spec}' names a {kind} in {where}, not a Trial class; name a "
            "pytorch.PyTorchTrial subclass" + _suggest(qualname, module, PyTorchTrial)
        )
    if not issubclass(obj, (PyTorchTrial, DeepSpeedTrial)):
        bases = [c for c in obj.__mro__[1:] if c is not object]
        what = (
            "derives from " + ", ".join(f"{c.__module__}.{c.__qualname__}" for c in bases[:3])
            if bases
            else "derives from object only"
        )
        raise ConfigError(
            f"entrypoint '{spec}': class {qualname} in {where} {what}, not "
            "determined.pytorch.PyTorchTrial; a Trial-class entrypoint must name a "
            "pytorch.PyTorchTrial (or pytorch.deepspeed.DeepSpeedTrial) subclass"
            + _suggest(qualname, module, PyTorchTrial)
        )
    _check_constructor(obj, spec)
    return obj


def _check_constructor(cls: type, spec: str) -> None:
    """The harness builds the trial as ``cls(context)``; say so when that cannot work (a
    Trainer-style ``__init__(self, context, hparams)``)."""
    try:
        signature = inspect.signature(cls)
    except (TypeError, ValueError):
        return
    try:
        signature.bind(object())
    except TypeError:
        raise ConfigError(
            f"entrypoint '{spec}': the harness builds the trial as {cls.__name__}(context), but "
            f"its __init__ takes {signature}; give the other parameters defaults, or use a "
            "script entrypoint (python3 train.py) that builds it and calls pytorch.Trainer"
        ) from None


def _suggest(name: str, module: Any, base: type) -> str:
    """'; did you mean X?' or '; its PyTorchTrial classes: A, B' (or nothing)."""
    trials = sorted(
        n
        for n, v in vars(module).items()
        if isinstance(v, type) and issubclass(v, base) and v is not base
    )
    close = difflib.get_close_matches(name, trials, n=1)
    if close:
        return f"; did you mean '{close[0]}'?"
    if trials:
        return f"; its PyTorchTrial classes: {', '.join(trials)}"
    return f"; it defines no {base.__name__} subclass"


def _module_file(module: Any) -> str:
    path = getattr(module, "__file__", None)
    if not path:
        return f"module '{module.__name__}'"
    try:
        return os.path.relpath(path)
    except ValueError:
        return path


# ---------------------------------------------------------------------------- the config
def period(config: dict[str, Any], name: str, global_batch_size: int | None) -> Any:
    """``min_validation_period`` / ``min_checkpoint_period`` as a TrainUnit: Batch(n) or
    Epoch(n), records as Batch(records // global_batch_size); None (only at the end) for 0."""
    from det_local.trial.pytorch import Batch, Epoch

    value = config.get(name)
    if value is None:
        return None
    if not isinstance(value, dict) or len(value) != 1:
        raise ConfigError(
            f"{name} is {value!r}; expected {{batches: N}}, {{records: N}} or {{epochs: N}}"
        )
    ((unit, n),) = value.items()
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise ConfigError(f"{name}.{unit} is {n!r}; expected a whole number >= 0")
    if n == 0:
        return None
    if unit == "batches":
        return Batch(n)
    if unit == "epochs":
        return Epoch(n)
    if unit == "records":
        if not global_batch_size:
            raise ConfigError(
                f"{name} is {{records: {n}}}, which needs the global_batch_size hyperparameter "
                "to be converted to batches; add global_batch_size to hyperparameters or give "
                f"{name} in batches"
            )
        return Batch._from_records(n, global_batch_size)
    raise ConfigError(f"{name} has unit '{unit}'; expected batches, records or epochs")


def _global_batch_size(hparams: dict[str, Any]) -> int | None:
    value = hparams.get("global_batch_size")
    if value is None:
        return None
    try:
        gbs = int(value)
    except (TypeError, ValueError):
        raise ConfigError(
            f"hyperparameters.global_batch_size is {value!r}; expected a whole number"
        ) from None
    if gbs < 1:
        raise ConfigError(f"hyperparameters.global_batch_size is {gbs}; expected at least 1")
    return gbs


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


def _where(err: BaseException) -> str:
    """' (raised at model_def.py:42, in __init__)' for an error raised under the trial's own
    code (the innermost frame in the working directory), else ''."""
    root = os.getcwd() + os.sep
    found = None
    for frame, lineno in traceback.walk_tb(err.__traceback__):
        filename = os.path.abspath(frame.f_code.co_filename)
        if filename.startswith(root):
            found = (os.path.relpath(filename), lineno, frame.f_code.co_name)
    if found is None:
        return ""
    return f" (raised at {found[0]}:{found[1]}, in {found[2]})"


if __name__ == "__main__":
    sys.exit(main())

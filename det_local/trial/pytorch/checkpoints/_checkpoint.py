"""PyTorchTrial checkpoints in Determined's layout, and loading them back.

A checkpoint directory holds::

    state_dict.pth   torch.save({models_state_dict, optimizers_state_dict,
                     lr_schedulers_state_dict, callbacks, rng_state, [scaler_state_dict]})
    trial_state.pkl  pickle of {trial_id, last_ckpt, step_id, last_val, batches_trained,
                     epochs_trained}
    load_data.json   {trial_type, experiment_config, hparams, trial_cls_spec, is_trainer}
    code/            the trial's working directory, filtered by .detignore
    metadata.json    written by core's store_path (steps_completed, framework, format, ...)

The key names are Determined's, so checkpoints move between the two in both directions.
"""

from __future__ import annotations

import copy
import importlib
import json
import logging
import os
import pickle
import random
import shutil
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from det_local.errors import CheckpointError, DetLocalError
from det_local.trial.pytorch._callback import PyTorchCallback
from det_local.trial.pytorch._context import PyTorchTrialContext, TrialContextBase

logger = logging.getLogger("determined.pytorch")

STATE_DICT_FILES = (
    ("state_dict.pth",),
    ("determined", "state_dict.pth"),
    ("pedl", "state_dict.pth"),
    ("checkpoint.pt",),
)


def _np() -> Any:
    try:
        import numpy

        return numpy
    except ImportError:  # pragma: no cover
        return None


def one_line(err: BaseException, limit: int = 300) -> str:
    text = " ".join(str(err).split()) or type(err).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ---------------------------------------------------------------------------- RNG
def capture_rng(device: torch.device) -> dict[str, Any]:
    """torch (CPU and the trial's GPU), numpy and python RNG states, Determined's keys."""
    state: dict[str, Any] = {
        "cpu_rng_state": torch.random.get_rng_state(),
        "random_rng_state": random.getstate(),
    }
    np = _np()
    if np is not None:
        state["np_rng_state"] = np.random.get_state()
    if device.type == "cuda":
        state["gpu_rng_state"] = torch.cuda.get_rng_state(device)
    return state


def restore_rng(state: dict[str, Any], device: torch.device) -> None:
    torch.random.set_rng_state(state["cpu_rng_state"])
    random.setstate(state["random_rng_state"])
    np = _np()
    if np is not None and "np_rng_state" in state:
        np.random.set_state(state["np_rng_state"])
    if device.type == "cuda":
        if "gpu_rng_state" in state:
            torch.cuda.set_rng_state(state["gpu_rng_state"], device)
        else:
            logger.warning("the checkpoint has no GPU RNG state (it was written on a CPU)")


# ---------------------------------------------------------------------------- code/ and class spec
# code/ is not fsynced when the checkpoint is recorded (core's sync_tree): it is a copy of the
# working directory that no resume reads (load_trial_from_checkpoint_path imports from it, and a
# file a crash truncated fails there loudly), and syncing it file by file was most of the cost
# of an off-cluster fit's final checkpoint (issue 28: 673 files, 0.38 s).
UNSYNCED = ("code",)


def write_code(ckpt_dir: Path, exclude: Sequence[Path] = (), root: Path | None = None) -> None:
    """Copy the working directory (or `root`), filtered by .detignore, to ckpt_dir/code, leaving
    out `exclude` (the checkpoint storage, when it lies inside). Skipped with a warning when the
    directory cannot be listed (too large, unreadable files)."""
    from det_local.store.context import list_context

    root = Path.cwd() if root is None else root
    try:
        files = list_context(root)
    except DetLocalError as err:
        logger.warning(f"checkpoint written without code/: {err}")
        return
    skip = [os.path.abspath(p) + os.sep for p in (*exclude, ckpt_dir)]
    code = ckpt_dir / "code"
    code.mkdir(exist_ok=True)
    for f in files:
        src = root / f.rel_path
        if any((os.path.abspath(src) + os.sep).startswith(s) for s in skip):
            continue
        dest = code / f.rel_path
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dest)
    os.chmod(code, 0o755)


def trial_cls_spec(cls: type) -> tuple[str, bool]:
    """("module:QualName", defined_in_main). A class defined in the entrypoint script is named by
    the script's module path relative to the working directory (e.g. train:MyTrial)."""
    module = cls.__module__
    if module != "__main__":
        return f"{module}:{cls.__qualname__}", False
    main_file = getattr(sys.modules.get("__main__"), "__file__", None)
    module = ""
    if main_file:
        rel = os.path.relpath(os.path.abspath(main_file), os.getcwd())
        if rel.endswith(".py") and not rel.startswith(".."):
            module = rel[: -len(".py")].replace(os.sep, ".")
    return f"{module}:{cls.__qualname__}", True


def resolve_spec(spec: str) -> type:
    module_name, _, qualname = spec.partition(":")
    if not module_name or not qualname:
        raise ValueError(f"{spec!r} is not of the form 'module:Class'")
    obj: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    if not isinstance(obj, type):
        raise ValueError(f"{spec} is a {type(obj).__name__}, not a class")
    return obj


def _qualname_of(spec: str | None) -> str | None:
    return spec.partition(":")[2] or None if spec else None


# ---------------------------------------------------------------------------- saving
def capture(
    context: PyTorchTrialContext,
    callbacks: dict[str, PyTorchCallback],
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The state_dict.pth dict of the trial as it is now (its tensors are the live ones).
    `extra` is det-local's own state, saved under the "det_local" key (Determined ignores it).
    Callbacks' on_checkpoint_save_start() may add to it."""
    checkpoint: dict[str, Any] = {
        "models_state_dict": [m.state_dict() for m in context.models],
        "optimizers_state_dict": [o.state_dict() for o in context.optimizers],
        "lr_schedulers_state_dict": [s.state_dict() for s in context.lr_schedulers],
        "callbacks": {name: cb.state_dict() for name, cb in callbacks.items()},
        "rng_state": capture_rng(context.device),
    }
    if context._scaler is not None:
        checkpoint["scaler_state_dict"] = context._scaler.state_dict()
    if extra:
        checkpoint["det_local"] = dict(extra)
    for cb in callbacks.values():
        cb.on_checkpoint_save_start(checkpoint)
    return checkpoint


_IMMUTABLE = (int, float, complex, bool, str, bytes, type(None), torch.dtype, torch.device)


def host_copy(obj: Any, memo: dict[int, Any] | None = None) -> Any:
    """A snapshot of `obj` that later training cannot change: every tensor copied to the host
    (CPU tensors cloned too), containers rebuilt, other mutable values deep-copied. A tensor that
    appears twice (tied weights) is copied once and stays shared."""
    memo = {} if memo is None else memo
    key = id(obj)
    if key in memo:
        return memo[key]
    out: Any
    if isinstance(obj, torch.Tensor):
        out = obj.detach().to("cpu", copy=True)
    elif isinstance(obj, _IMMUTABLE):
        return obj
    elif isinstance(obj, dict):
        out = copy.copy(obj)  # keeps the type, a state_dict's _metadata, a default_factory
        for k, v in obj.items():
            out[k] = host_copy(v, memo)
    elif isinstance(obj, list):
        out = [host_copy(v, memo) for v in obj]
    elif isinstance(obj, tuple):
        items = [host_copy(v, memo) for v in obj]
        make = getattr(obj, "_make", None) if hasattr(obj, "_fields") else None
        out = make(items) if make is not None else type(obj)(items)
    else:
        try:
            out = copy.deepcopy(obj)
        except Exception:
            logger.debug(f"checkpoint snapshot keeps a {type(obj).__name__} as is: cannot copy")
            out = obj
    memo[key] = out
    return out


def load_data_of(
    context: TrialContextBase, trial: Any, trial_type: str = "PyTorchTrial"
) -> dict[str, Any]:
    """load_data.json: what load_trial_from_checkpoint_path needs to rebuild the trial."""
    spec, in_main = trial_cls_spec(type(trial))
    load_data: dict[str, Any] = {
        "trial_type": trial_type,
        "experiment_config": context._exp_conf,
        "hparams": context._hparams,
        "trial_cls_spec": spec,
        "is_trainer": True,
    }
    if in_main:
        load_data["trial_in_main"] = True
    if context._is_pre_trainer:
        load_data.pop("is_trainer")
    return load_data


_CRC_LOCK = threading.Lock()


def torch_save(obj: Any, path: Path, fsync: bool = False) -> None:
    """torch.save without the zip CRC-32 (most of torch.save's cost: PyTorch #124195). torch.load
    of every version reads such a file (its zip reader does not check CRCs); only zip tools warn.
    The switch is process-wide for the duration of the call."""
    getter = getattr(torch.serialization, "get_crc32_options", None)
    setter = getattr(torch.serialization, "set_crc32_options", None)
    if getter is None or setter is None:  # pragma: no cover - torch < 2.4
        torch.save(obj, str(path))
    else:
        with _CRC_LOCK:
            before = getter()
            setter(False)
            try:
                torch.save(obj, str(path))
            finally:
                setter(before)
    if fsync:
        _fsync(path)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write(
    ckpt_dir: Path,
    checkpoint: dict[str, Any],
    *,
    trial_state: dict[str, Any],
    load_data: dict[str, Any],
    code_root: Path | None = None,
    exclude: Sequence[Path] = (),
    fsync: bool = False,
) -> None:
    """Write the checkpoint files into ckpt_dir (metadata.json is core's). With `fsync`,
    state_dict.pth, trial_state.pkl, load_data.json and their directory entries are on the disk
    when this returns (code/ is not synced: a resume does not read it)."""
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    write_code(ckpt_dir, exclude, root=code_root)
    torch_save(checkpoint, ckpt_dir / "state_dict.pth", fsync=fsync)
    write_trial_files(ckpt_dir, trial_state=trial_state, load_data=load_data, fsync=fsync)


def write_trial_files(
    ckpt_dir: Path, *, trial_state: dict[str, Any], load_data: dict[str, Any], fsync: bool = False
) -> None:
    """trial_state.pkl and load_data.json (with `fsync`: on the disk, with the directory)."""
    with open(ckpt_dir / "trial_state.pkl", "wb") as f:
        pickle.dump(trial_state, f)
        if fsync:
            f.flush()
            os.fsync(f.fileno())
    with open(ckpt_dir / "load_data.json", "w") as f:
        json.dump(load_data, f, default=str)
        if fsync:
            f.flush()
            os.fsync(f.fileno())
    if fsync:
        _fsync(ckpt_dir)


def save(
    ckpt_dir: Path,
    *,
    context: PyTorchTrialContext,
    trial: Any,
    callbacks: dict[str, PyTorchCallback],
    trial_state: dict[str, Any],
    exclude: Sequence[Path] = (),
    extra: dict[str, Any] | None = None,
) -> None:
    """Write the trial's checkpoint files into ckpt_dir, on the calling thread."""
    checkpoint = capture(context, callbacks, extra)
    write(
        ckpt_dir,
        checkpoint,
        trial_state=dict(trial_state),
        load_data=load_data_of(context, trial),
        exclude=exclude,
    )
    for cb in callbacks.values():
        cb.on_checkpoint_end(str(ckpt_dir))
        cb.on_checkpoint_write_end(str(ckpt_dir))


class AsyncWrite:
    """One checkpoint being written by a background thread: `job` writes the files and reports
    the checkpoint. wait() joins it and raises a CheckpointError if it failed."""

    def __init__(self, job: Callable[[], None], *, uuid: str, steps: int, path: Path) -> None:
        self.uuid = uuid
        self.steps = steps
        self.path = path
        self.write_ms: float | None = None
        self._job = job
        self._error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._run, name=f"det-local-checkpoint-{uuid[:8]}", daemon=True
        )
        self._thread.start()

    def _run(self) -> None:
        started = time.perf_counter()
        try:
            self._job()
        except BaseException as err:  # surfaced on the training thread by wait()
            self._error = err
        self.write_ms = (time.perf_counter() - started) * 1000

    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self) -> None:
        self._thread.join()
        if self._error is not None:
            err = self._error
            raise CheckpointError(
                f"checkpoint {self.uuid} (batch {self.steps}) failed to write in the background "
                f"to {self.path}: {one_line(err)}; it was not saved (the checkpoint before it "
                "is the latest): fix the cause (disk space, permissions) and resume from that one"
            ) from err


# ---------------------------------------------------------------------------- reading
def load_dict_file(
    path: Path, where: str, load: Callable[[Path], Any], not_dict: str = "not a dict"
) -> dict[str, Any]:
    """One checkpoint file that must hold a dict, read with `load`: unreadable or not a dict
    is one CheckpointError naming the file (a corrupt or truncated checkpoint)."""
    try:
        state = load(path)
    except Exception as err:
        raise CheckpointError(
            f"{where}: {path} cannot be loaded ({one_line(err)}); the file is corrupt or "
            "truncated: resume from an earlier checkpoint (`det-local checkpoint list`) or "
            "start the trial fresh"
        ) from err
    if not isinstance(state, dict):
        raise CheckpointError(f"{where}: {path} holds a {type(state).__name__}, {not_dict}")
    return state


def _unpickle(path: Path) -> Any:
    with open(path, "rb") as f:
        return pickle.load(f)


def read_trial_state(ckpt_dir: Path, where: str) -> dict[str, Any] | None:
    """trial_state.pkl (or the older workload_sequencer.pkl) as a dict; None if absent."""
    for name in ("trial_state.pkl", "workload_sequencer.pkl"):
        path = ckpt_dir / name
        if not path.exists():
            continue
        state = load_dict_file(path, where, _unpickle)
        if name == "workload_sequencer.pkl":
            steps = int(state.get("steps_completed") or 0)
            state = {
                "trial_id": state.get("trial_id"),
                "last_ckpt": state.get("last_ckpt") or 0,
                "last_val": state.get("last_val") or 0,
                "step_id": state.get("step_id") or 0,
                "batches_trained": steps,
                "epochs_trained": None,  # derived from the epoch length by the loop
            }
        return state
    return None


def read_load_data(ckpt_dir: Path) -> dict[str, Any] | None:
    path = ckpt_dir / "load_data.json"
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def read_state_dict(
    ckpt_dir: Path, where: str, torch_load_kwargs: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The first state_dict file found (newest layout first), loaded with torch.load."""
    kwargs: dict[str, Any] = {"map_location": "cpu", "weights_only": False}
    kwargs.update(torch_load_kwargs or {})
    for parts in STATE_DICT_FILES:
        path = ckpt_dir.joinpath(*parts)
        if not path.exists():
            continue
        return load_dict_file(
            path,
            where,
            lambda p: torch.load(str(p), **kwargs),
            "not the dict a PyTorchTrial checkpoint has; was it written by pytorch.Trainer?",
        )
    found = sorted(p.name for p in ckpt_dir.iterdir()) if ckpt_dir.is_dir() else []
    raise CheckpointError(
        f"{where} has no state_dict.pth (it holds {found or 'nothing'}); it was not written by a "
        "PyTorchTrial: start without latest_checkpoint or pick a PyTorchTrial checkpoint"
    )


def _with_prefix(state: dict[str, Any], prefix: str) -> dict[str, Any]:
    out: dict[str, Any] = OrderedDict(
        (k if k.startswith(prefix) else prefix + k, v) for k, v in state.items()
    )
    meta = getattr(state, "_metadata", None)
    if meta is not None:
        out._metadata = OrderedDict(  # type: ignore[attr-defined]
            (k if k.startswith(prefix) else prefix + k, v) for k, v in meta.items()
        )
    return out


def _without_prefix(state: dict[str, Any], prefix: str) -> dict[str, Any]:
    out = OrderedDict(state)
    meta = getattr(state, "_metadata", None)
    if meta is not None:
        out._metadata = OrderedDict(meta)  # type: ignore[attr-defined]
    nn.modules.utils.consume_prefix_in_state_dict_if_present(out, prefix)
    return out


def _class_mismatch(saved_spec: str | None, current: type) -> str | None:
    saved = _qualname_of(saved_spec)
    if saved is None or saved == current.__qualname__:
        return None
    return saved


def load_models(
    models: Sequence[nn.Module],
    checkpoint: dict[str, Any],
    where: str,
    saved_spec: str | None,
    current_cls: type,
) -> None:
    """Load each model's weights, fixing the DDP `module.` prefix in either direction."""
    other = _class_mismatch(saved_spec, current_cls)

    def fail(detail: str, err: BaseException | None = None) -> CheckpointError:
        if other is not None:
            return CheckpointError(
                f"{where} was written by trial class {other} ({saved_spec}), not "
                f"{current_cls.__qualname__}, and its weights do not fit ({detail}); load it with "
                f"{other}, or start {current_cls.__qualname__} without this checkpoint"
            )
        return CheckpointError(f"{where}: {detail}")

    if "model_state_dict" in checkpoint and "models_state_dict" not in checkpoint:
        states = [checkpoint["model_state_dict"]]
    else:
        states = list(checkpoint.get("models_state_dict") or [])
    if len(states) != len(models):
        raise fail(
            f"it holds {len(states)} model(s) but the trial wrapped {len(models)}; wrap the same "
            "models, in the same order, as the trial that wrote it"
        )
    for i, (model, state) in enumerate(zip(models, states, strict=True)):
        try:
            model.load_state_dict(state)
            continue
        except Exception as first:
            is_ddp = isinstance(model, nn.parallel.DistributedDataParallel)
            fixed = _with_prefix(state, "module.") if is_ddp else _without_prefix(state, "module.")
            try:
                model.load_state_dict(fixed)
            except Exception:
                raise fail(
                    f"model {i} ({type(model).__name__}) does not load: {one_line(first)}",
                    first,
                ) from first
    if other is not None:
        logger.warning(
            f"{where} was written by trial class {other}; its weights fit "
            f"{current_cls.__qualname__}, so they are used"
        )


def restore(
    checkpoint: dict[str, Any],
    *,
    where: str,
    context: PyTorchTrialContext,
    trial: Any,
    callbacks: dict[str, PyTorchCallback],
    saved_spec: str | None,
) -> None:
    """Restore models, optimizers, LR schedulers, scaler, RNG and callbacks from state_dict.pth."""
    for cb in callbacks.values():
        cb.on_checkpoint_load_start(checkpoint)
    load_models(context.models, checkpoint, where, saved_spec, type(trial))

    def load_list(key: str, legacy: str, objs: Sequence[Any], what: str) -> None:
        if legacy in checkpoint and key not in checkpoint:
            states = [checkpoint[legacy]]
        else:
            states = list(checkpoint.get(key) or [])
        if len(states) != len(objs):
            raise CheckpointError(
                f"{where} holds {len(states)} {what}(s) but the trial wrapped {len(objs)}; wrap "
                f"the same {what}s, in the same order, as the trial that wrote it"
            )
        for i, (obj, state) in enumerate(zip(objs, states, strict=True)):
            try:
                obj.load_state_dict(state)
            except Exception as err:
                raise CheckpointError(
                    f"{where}: {what} {i} ({type(obj).__name__}) does not load: {one_line(err)}"
                ) from err

    load_list("optimizers_state_dict", "optimizer_state_dict", context.optimizers, "optimizer")
    load_list("lr_schedulers_state_dict", "lr_scheduler", context.lr_schedulers, "LR scheduler")

    if "scaler_state_dict" in checkpoint:
        if context._scaler is not None:
            context._scaler.load_state_dict(checkpoint["scaler_state_dict"])
        else:
            logger.warning(f"{where} has a GradScaler state but the trial does not use AMP")
    elif context._scaler is not None:
        logger.warning(f"the trial uses AMP but {where} has no GradScaler state")

    if "rng_state" in checkpoint:
        restore_rng(checkpoint["rng_state"], context.device)
    else:
        logger.warning(f"{where} has no RNG state to restore")

    saved_callbacks = checkpoint.get("callbacks") or {}
    for name, cb in callbacks.items():
        if name in saved_callbacks:
            cb.load_state_dict(saved_callbacks[name])
        elif type(cb).load_state_dict is not PyTorchCallback.load_state_dict:
            logger.warning(
                f"callback '{name}' implements load_state_dict(), but {where} has no state for "
                "it; it starts from scratch"
            )

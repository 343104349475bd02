"""pytorch.load_trial_from_checkpoint_path(): a trial rebuilt from one of its checkpoints,
outside training, with its models' weights loaded (a DeepSpeedTrial's through
deepspeed._load)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
from pathlib import Path
from typing import Any

from det_local.errors import CheckpointError
from det_local.trial.pytorch.checkpoints._checkpoint import (
    load_models,
    one_line,
    read_load_data,
    read_state_dict,
    resolve_spec,
)
from det_local.trial.pytorch.checkpoints._load_context import CheckpointLoadContext

logger = logging.getLogger("determined.pytorch")


def load_trial_from_checkpoint_path(
    path: str | os.PathLike[str],
    trial_class: type | None = None,
    trial_kwargs: dict[str, Any] | None = None,
    torch_load_kwargs: dict[str, Any] | None = None,
    **kwargs: Any,
) -> Any:
    """A trial instance with its models' weights loaded from a checkpoint directory (e.g. from
    ``client.get_checkpoint(uuid).download()``). The class is imported from the checkpoint's
    code/ unless `trial_class` is given; `trial_kwargs` go to its constructor after the context;
    `torch_load_kwargs` to torch.load (default map_location="cpu", weights_only=False: the
    checkpoint holds RNG states that weights_only refuses).

    A DeepSpeedTrial's checkpoint (which Determined 0.38's loader does not read) is loaded too:
    the trial is built with a DeepSpeedTrialContext in a world of this process alone (or the
    launcher's, under one), in the checkpoint's code/ as working directory (where the DeepSpeed
    config file a trial reads in __init__ is), then each engine's weights come from its
    ``model<i>`` tag (or the trial's own load() does it, when the trial overrides it)."""
    from det_local.trial import import_from_path

    if kwargs:
        if torch_load_kwargs:
            raise ValueError("pass torch.load arguments as torch_load_kwargs, not both")
        logger.warning(
            "load_trial_from_checkpoint_path(**kwargs) is deprecated; use torch_load_kwargs"
        )
        torch_load_kwargs = kwargs
    ckpt_dir = Path(path)
    where = f"checkpoint {ckpt_dir.name}"
    if not ckpt_dir.is_dir():
        raise CheckpointError(f"{where}: {ckpt_dir} is not a directory; download it first")
    load_data = read_load_data(ckpt_dir)
    saved_type = load_data.get("trial_type") if load_data is not None else None
    if load_data is not None:
        if saved_type not in ("PyTorchTrial", "DeepSpeedTrial"):
            logger.warning(f"{where} does not look like a PyTorchTrial checkpoint; trying anyway")
        spec = load_data.get("trial_cls_spec")
        hparams = load_data.get("hparams")
        exp_conf = load_data.get("experiment_config")
    else:
        meta: dict[str, Any] = {}
        try:
            meta = json.loads((ckpt_dir / "metadata.json").read_text())
        except (OSError, ValueError):
            pass
        exp_conf = meta.get("experiment_config") if isinstance(meta, dict) else None
        hparams = meta.get("hparams") if isinstance(meta, dict) else None
        spec = exp_conf.get("entrypoint") if isinstance(exp_conf, dict) else None
        if trial_class is None and not spec:
            raise CheckpointError(
                f"{where} ({ckpt_dir}) has no load_data.json, so the trial class that wrote it "
                "is unknown; pass trial_class=YourTrial"
            )
    if trial_class is None and (not spec or ":" not in str(spec)):
        raise CheckpointError(
            f"{where} does not name its trial class (trial_cls_spec {spec!r}); pass "
            "trial_class=YourTrial"
        )
    context: Any
    with contextlib.ExitStack() as stack:
        if trial_class is None:
            # built while code/ is importable, so imports inside __init__ find their modules
            try:
                stack.enter_context(import_from_path(ckpt_dir / "code"))
                trial_class = resolve_spec(str(spec))
            except Exception as err:
                raise CheckpointError(
                    f"{where}: cannot import its trial class {spec} from {ckpt_dir / 'code'} "
                    f"({one_line(err)}); pass trial_class=YourTrial"
                ) from err
        deepspeed = _is_deepspeed_trial(trial_class, saved_type, spec, where)
        if deepspeed:
            from det_local.trial.pytorch.deepspeed import _load

            context = _load.checkpoint_load_context(hparams, exp_conf)
            # built in code/, where its __init__ finds the DeepSpeed config file it trained with
            stack.enter_context(_load.in_dir(ckpt_dir / "code"))
            stack.enter_context(_load.building(trial_class, exp_conf, where))
        else:
            context = CheckpointLoadContext(hparams, exp_conf)
        trial = trial_class(context, **(trial_kwargs or {}))
    if deepspeed:
        from det_local.trial.pytorch.deepspeed._load import load_weights

        if torch_load_kwargs:
            logger.warning(
                "torch_load_kwargs are not used for a DeepSpeedTrial checkpoint: DeepSpeed "
                "reads its own files"
            )
        load_weights(trial, context, ckpt_dir, where)
        return trial
    checkpoint = read_state_dict(ckpt_dir, where, torch_load_kwargs)
    load_models(context.models, checkpoint, where, spec, trial_class)
    return trial


def _is_deepspeed_trial(cls: type, saved_type: Any, spec: Any, where: str) -> bool:
    """Whether `cls` is a DeepSpeedTrial (checked against the trial_type the checkpoint's
    load_data.json names, when it names one)."""
    from det_local.trial.pytorch.deepspeed._trial import DeepSpeedTrial

    deepspeed = isinstance(cls, type) and issubclass(cls, DeepSpeedTrial)
    if saved_type == "DeepSpeedTrial" and not deepspeed:
        raise CheckpointError(
            f"{where} was written by a DeepSpeedTrial ({spec}), but {cls.__qualname__} is not "
            "one; pass the DeepSpeedTrial class that wrote it as trial_class"
        )
    if saved_type == "PyTorchTrial" and deepspeed:
        raise CheckpointError(
            f"{where} was written by a PyTorchTrial ({spec}), but {cls.__qualname__} is a "
            "DeepSpeedTrial; pass the PyTorchTrial class that wrote it as trial_class"
        )
    return deepspeed

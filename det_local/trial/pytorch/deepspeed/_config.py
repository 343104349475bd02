"""overwrite_deepspeed_config(): a DeepSpeed config with values from the experiment."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from det_local.launch.deepspeed import merge_config
from det_local.trial.pytorch._errors import InvalidTrialError


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def overwrite_deepspeed_config(
    base_ds_config: str | dict[str, Any], source_ds_dict: dict[str, Any]
) -> dict[str, Any]:
    """``base_ds_config`` (a DeepSpeed config dict, or the path of its JSON file) with the
    leaves of ``source_ds_dict`` written over it: nested dicts are merged key by key, any other
    value replaces the base's. Typically
    ``overwrite_deepspeed_config(hparams["deepspeed_config"], hparams["overwrite_deepspeed_args"])``
    so that a search can vary DeepSpeed settings. Neither argument is changed."""
    if isinstance(base_ds_config, (str, Path)):
        path = Path(base_ds_config)
        try:
            text = path.read_text()
        except OSError as err:
            raise InvalidTrialError(
                f"overwrite_deepspeed_config(): cannot read the DeepSpeed config {str(path)!r} "
                f"in {Path.cwd()}: {err.strerror or err}"
            ) from None
        try:
            loaded = json.loads(text, object_pairs_hook=_no_duplicates)
        except ValueError as err:
            raise InvalidTrialError(
                f"overwrite_deepspeed_config(): the DeepSpeed config {path} is not valid JSON: "
                f"{err}"
            ) from None
        if not isinstance(loaded, dict):
            raise InvalidTrialError(
                f"overwrite_deepspeed_config(): the DeepSpeed config {path} holds a "
                f"{type(loaded).__name__}, not a JSON object"
            )
        base = loaded
    elif isinstance(base_ds_config, dict):
        base = base_ds_config
    else:
        raise TypeError(
            "overwrite_deepspeed_config(): expected the path of a DeepSpeed config file or a "
            f"dict for base_ds_config, found {type(base_ds_config).__name__}"
        )
    if source_ds_dict is None:
        source_ds_dict = {}
    if not isinstance(source_ds_dict, dict):
        raise TypeError(
            "overwrite_deepspeed_config(): source_ds_dict must be a dict, found "
            f"{type(source_ds_dict).__name__}"
        )
    return merge_config(base, source_ds_dict)

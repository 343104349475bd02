"""Config edits given on the command line: `--config KEY=VALUE` (Determined's dotted paths,
repeatable) and `--config-file`, as one nested mapping laid over a config before it is checked
as a config file is.

One parser for every command that takes them: `run`, `experiment create`, `experiment
continue`, `experiment fork`. A VALUE is read as a YAML scalar (or flow collection) the way the
config file's own values are (`load.load_yaml`: YAML 1.2, so `1e-3` is a float and `yes` a
string). Hyperparameters are the user's own names, which no schema can check: an edit naming
one the config does not define but close to one it does (`hyperparameters.lrr` beside `lr`) is
refused with a did-you-mean; a name close to none adds a hyperparameter.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import TYPE_CHECKING, Any

from det_local.errors import ConfigError

if TYPE_CHECKING:
    from det_local.config.experiment import ExperimentConfig

EXAMPLE = "--config searcher.max_length.batches=600"


def parse_overrides(pairs: list[str], config_file: Path | None = None) -> dict[str, Any]:
    """`--config-file` then each `--config a.b=VALUE` as one nested mapping."""
    from det_local.config.load import load_yaml

    out: dict[str, Any] = {}
    if config_file is not None:
        from det_local.config.limits import read_config_bytes

        try:  # bounded, a regular file only (a FIFO is refused, never waited on)
            text = read_config_bytes(config_file, "--config-file").decode("utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise ConfigError(f"cannot read --config-file {config_file}: {err}") from None
        loaded = load_yaml(text, f"--config-file {config_file}")
        if not isinstance(loaded, dict):
            raise ConfigError(f"--config-file {config_file} must hold a mapping of overrides")
        out.update(loaded)
    for pair in pairs:
        key, eq, raw = pair.partition("=")
        key = key.strip()
        if not eq or not key or any(not part for part in key.split(".")):
            raise ConfigError(
                f"--config {pair!r}: expected KEY=VALUE with a dotted key, e.g. {EXAMPLE}"
            )
        value = load_yaml(raw, f"--config {key}") if raw.strip() else None
        node = out
        parts = key.split(".")
        for part in parts[:-1]:
            child = node.get(part)
            if not isinstance(child, dict):
                child = {}
                node[part] = child
            node = child
        node[parts[-1]] = value
    return out


def load_edited(path: Path, overrides: dict[str, Any]) -> ExperimentConfig:
    """The config file with the edits laid over its mapping, then checked as the file is (so
    an edit's errors are the file's: one line, the field's dotted path, a did-you-mean)."""
    from det_local.config.experiment import parse_config
    from det_local.config.load import load_config, read_mapping

    if not overrides:
        return load_config(path)
    raw = read_mapping(path)
    check_hyperparameter_names(raw.get("hyperparameters"), overrides, str(path))
    return parse_config(merge(raw, overrides), f"{path} with the --config edits")


def merge(config: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """`config` with `overrides` laid over it (mappings merged key by key, the rest
    replaced)."""
    out = copy.deepcopy(config)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def check_hyperparameter_names(original: Any, overrides: dict[str, Any], owner: str) -> None:
    """Refuse an edit under `hyperparameters` that names what ``original`` (the config's
    hyperparameters; ``owner`` names it: "experiment 3", "const.yaml") does not define while it
    is close to a name it does (a typo would otherwise run the original value under the name
    the code reads)."""
    from det_local.suggest import closest

    def walk(defined: Any, edits: Any, path: str) -> None:
        if not isinstance(defined, dict) or not isinstance(edits, dict):
            return
        for key, value in edits.items():
            here = f"{path}.{key}"
            if key in defined:
                walk(defined[key], value, here)
                continue
            guess = closest(str(key), [str(k) for k in defined])
            if guess is not None:
                raise ConfigError(
                    f"--config {here}: {owner} has no {here}; did you mean '{path}.{guess}'?"
                )

    walk(original, overrides.get("hyperparameters"), "hyperparameters")

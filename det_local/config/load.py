"""Reading an experiment config file.

Determined's CLI reads configs with ruamel.yaml (YAML 1.2, duplicate keys are errors). PyYAML is
YAML 1.1, so the loader here resolves scalars the 1.2 way: `1e-3` is a float (1.1 reads a
string), only true/false are booleans (`yes`, `on` stay strings), no sexagesimal or 0-prefixed
octal ints; dates stay strings so that the config is JSON-serialisable."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from det_local.config.experiment import ExperimentConfig, parse_config
from det_local.errors import ConfigError

_BOOL = "tag:yaml.org,2002:bool"
_INT = "tag:yaml.org,2002:int"
_FLOAT = "tag:yaml.org,2002:float"
_NULL = "tag:yaml.org,2002:null"
_TIMESTAMP = "tag:yaml.org,2002:timestamp"

_BOOL_RE = re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$")
_INT_RE = re.compile(r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$")
_FLOAT_RE = re.compile(
    r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?"
    r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"
)


class _Loader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2 core-schema scalars and duplicate-key errors."""


_Loader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag not in (_BOOL, _INT, _FLOAT, _TIMESTAMP)]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver(_BOOL, _BOOL_RE, list("tTfF"))
_Loader.add_implicit_resolver(_INT, _INT_RE, list("-+0123456789"))
_Loader.add_implicit_resolver(_FLOAT, _FLOAT_RE, list("-+.0123456789"))


def _construct_bool(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> bool:
    return str(loader.construct_scalar(node)).lower() == "true"


def _construct_int(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> int:
    text = str(loader.construct_scalar(node)).replace("_", "")
    try:
        return int(text, 10)
    except ValueError:
        return int(text, 0)  # 0o17, 0x1f (and an explicit !!int 0b101)


_MERGE = "tag:yaml.org,2002:merge"


def _construct_mapping(loader: yaml.SafeLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    seen: dict[Any, yaml.Node] = {}
    for key_node, _ in node.value:
        if key_node.tag == _MERGE:
            continue  # `<<: *anchor` keys may be overridden; only the mapping's own keys count
        key = loader.construct_object(key_node, deep=True)
        if isinstance(key, (dict, list)):
            raise yaml.constructor.ConstructorError(
                "while constructing a mapping",
                node.start_mark,
                "found a mapping or list used as a key",
                key_node.start_mark,
            )
        if key in seen:
            first = seen[key].start_mark
            raise yaml.constructor.ConstructorError(
                None,
                None,
                f"found duplicate key {key!r} (first defined on line {first.line + 1})",
                key_node.start_mark,
            )
        seen[key] = key_node
    return loader.construct_mapping(node, deep=True)


_Loader.add_constructor(_BOOL, _construct_bool)
_Loader.add_constructor(_INT, _construct_int)
_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def load_yaml(text: str, source: str) -> Any:
    """Parse YAML text; a syntax error becomes a ConfigError with file:line:column."""
    try:
        return yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass
    except yaml.MarkedYAMLError as err:
        raise ConfigError(_yaml_message(err, source)) from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{source}: malformed YAML ({err}); fix the file's syntax") from None


def _yaml_message(err: yaml.MarkedYAMLError, source: str) -> str:
    mark = err.problem_mark or err.context_mark
    where = f"{source}:{mark.line + 1}:{mark.column + 1}" if mark else source
    problem = err.problem or "syntax error"
    context = ""
    if err.context and err.problem:
        started = err.context_mark
        if started is not None and mark is not None and started.line != mark.line:
            context = f" ({err.context} that starts on line {started.line + 1})"
        else:
            context = f" ({err.context})"
    if "duplicate key" in problem:
        todo = "remove one of them"
    elif "\\t" in problem or "tab" in problem:
        todo = "indent with spaces, not tabs"
    else:
        todo = (
            "fix the YAML syntax there (indent with spaces; quote values containing ': ' or ' #')"
        )
    at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
    return f"{where}: malformed YAML{at}: {problem}{context}; {todo}"


def load_config(path: str | Path) -> ExperimentConfig:
    """Read, validate and fill in an experiment config YAML file. Raises ConfigError."""
    source = str(path)
    file = Path(path)
    try:
        text = file.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(
            f"config file {source} not found (looked in {file.absolute().parent}); check the path"
        ) from None
    except IsADirectoryError:
        raise ConfigError(f"{source} is a directory; pass the experiment's YAML file") from None
    except UnicodeDecodeError as err:
        raise ConfigError(f"{source} is not UTF-8 text ({err.reason}); save it as UTF-8") from None
    except OSError as err:
        raise ConfigError(f"cannot read config file {source}: {err.strerror or err}") from None
    raw = load_yaml(text, source)
    if raw is None:
        raise ConfigError(
            f"{source} is empty: an experiment config is a YAML mapping with at least "
            "'entrypoint' and 'searcher'"
        )
    if not isinstance(raw, dict):
        kind = "a list" if isinstance(raw, list) else f"a {type(raw).__name__}"
        raise ConfigError(
            f"{source}: expected a YAML mapping of config fields (entrypoint, searcher, ...) "
            f"at the top level, found {kind}"
        )
    return parse_config(raw, source)

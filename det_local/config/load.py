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

from det_local.config import limits
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
    """Parse YAML text; a syntax error becomes a ConfigError with file:line:column. A document
    nested deeper than limits.MAX_DEPTH, or whose aliases expand past limits.MAX_ALIAS_NODES
    nodes, is refused before anything is built from it (see `_checked_events`)."""
    try:
        events = _checked_events(text, source)
        loader = _Replay(events)
        try:
            return loader.get_single_data()
        finally:
            loader.dispose()
    except yaml.MarkedYAMLError as err:
        raise ConfigError(_yaml_message(err, source)) from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{source}: malformed YAML ({err}); fix the file's syntax") from None


class _Frame:
    """A mapping or sequence being parsed: where it is, and what it holds so far."""

    __slots__ = ("anchor", "at_key", "height", "index", "is_map", "key", "path", "size")

    def __init__(self, is_map: bool, path: list[object], anchor: str | None) -> None:
        self.is_map = is_map
        self.path = path
        self.anchor = anchor
        self.at_key = True  # a mapping: the next node is a key
        self.key: object = "?"
        self.index = 0
        self.size = 1  # nodes, aliases expanded
        self.height = 1  # levels of nesting below and including this one, aliases expanded

    def child_path(self) -> list[object]:
        if not self.is_map:
            return [*self.path, self.index]
        return [*self.path, self.key if not self.at_key else "?"]

    def took(self, size: int, height: int, scalar: object = None) -> None:
        """A child node ended (of `size` nodes, `height` levels)."""
        self.size += size
        self.height = max(self.height, height + 1)
        if self.is_map:
            if self.at_key:
                self.key = scalar if scalar is not None else "?"
            self.at_key = not self.at_key
        else:
            self.index += 1


def _checked_events(text: str, source: str) -> list[yaml.Event]:
    """The document's parse events, once its nesting and its alias expansion are known to be
    within the limits. One pass, no recursion: the composer and constructor that then replay
    the events recurse at most limits.MAX_DEPTH levels, and build at most MAX_ALIAS_NODES nodes
    more than the document holds."""
    events: list[yaml.Event] = []
    stack: list[_Frame] = []
    anchors: dict[str, tuple[int, int]] = {}  # anchor -> (size, height), once complete
    expanded = 0
    loader = _Loader(text)
    try:
        while loader.check_event():
            event = loader.get_event()
            events.append(event)
            parent = stack[-1] if stack else None
            if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
                path = parent.child_path() if parent is not None else []
                if len(stack) >= limits.MAX_DEPTH:
                    raise limits.too_deep(source, path)
                is_map = isinstance(event, yaml.MappingStartEvent)
                stack.append(_Frame(is_map, path, event.anchor))
            elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
                done = stack.pop()
                if done.anchor is not None:
                    anchors[done.anchor] = (done.size, done.height)
                if stack:
                    stack[-1].took(done.size, done.height)
            elif isinstance(event, yaml.ScalarEvent):
                if event.anchor is not None:
                    anchors[event.anchor] = (1, 0)
                if parent is not None:
                    parent.took(1, 0, event.value)
            elif isinstance(event, yaml.AliasEvent):
                known = anchors.get(event.anchor or "")
                if known is None:
                    if any(f.anchor == event.anchor for f in stack):
                        path = parent.child_path() if parent is not None else []
                        raise ConfigError(
                            f"{limits.short_path(path) or 'the document'} in {source}: alias "
                            f"*{event.anchor} refers to the mapping or list that contains it; "
                            "a config cannot be recursive"
                        )
                    continue  # an undefined alias: the composer names it
                size, height = known
                expanded += size
                if expanded > limits.MAX_ALIAS_NODES:
                    raise ConfigError(
                        f"{source}: its anchors and aliases expand past the limit of "
                        f"{limits.MAX_ALIAS_NODES} nodes (*{event.anchor}{_line(event)} "
                        f"alone adds {size}); write the values "
                        "out, or use fewer aliases"
                    )
                if height and len(stack) + height > limits.MAX_DEPTH:
                    path = parent.child_path() if parent is not None else []
                    raise limits.too_deep(source, [*path, f"*{event.anchor}"])
                if parent is not None:
                    parent.took(size, height, f"*{event.anchor}")
    finally:
        loader.dispose()
    return events


def _line(event: yaml.Event) -> str:
    mark = event.start_mark
    return f" on line {mark.line + 1}" if mark is not None else ""


class _Replay(_Loader):
    """The composer and constructor of `_Loader`, fed with events already parsed (and checked)
    instead of parsing the text again."""

    def __init__(self, events: list[yaml.Event]) -> None:  # noqa: D107 - no Reader, no Parser
        self._events = events
        self._at = 0
        yaml.composer.Composer.__init__(self)
        yaml.constructor.SafeConstructor.__init__(self)
        yaml.resolver.Resolver.__init__(self)

    def check_event(self, *choices: Any) -> bool:
        if self._at >= len(self._events):
            return False
        return not choices or isinstance(self._events[self._at], choices)

    def peek_event(self) -> Any:
        return self._events[self._at] if self._at < len(self._events) else None

    def get_event(self) -> Any:
        event = self._events[self._at]
        self._at += 1
        return event

    def dispose(self) -> None:
        pass


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
    return parse_config(read_mapping(path), str(path))


def read_mapping(path: str | Path) -> dict[str, Any]:
    """The config file's top-level mapping, read bounded and unchecked (`load_config` checks
    it; `overrides.load_edited` lays `--config` edits over it first). Raises ConfigError."""
    source = str(path)
    file = Path(path)
    try:
        # a regular file only (a FIFO would hang us), read bounded
        text = limits.read_config_bytes(file).decode("utf-8")
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
    return raw

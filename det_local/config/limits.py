"""Bounds on an experiment config, checked before anything recurses into it or expands it.

A config is small: a few kilobytes of YAML. A config file over MAX_CONFIG_BYTES, a YAML document
whose anchors and aliases would expand past MAX_ALIAS_NODES nodes (a "billion laughs"), or a
structure nested deeper than MAX_DEPTH levels is refused with one line naming the file and, for
depth, the field path. The same bounds apply to a config that reaches the daemon as msgpack in a
request. Every check here is iterative: nothing recurses over user input.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Sequence
from typing import Any

from det_local.errors import ConfigError
from det_local.nesting import deep_path, short_path

MAX_CONFIG_BYTES = 1024 * 1024  # 1 MiB: Determined configs are a few KiB
MAX_DEPTH = 64  # nested mappings/lists, the top-level mapping counting as 1
MAX_ALIAS_NODES = 100_000  # nodes that YAML aliases may add to a document


def size_limit_text() -> str:
    return f"the {MAX_CONFIG_BYTES // (1024 * 1024)} MiB ({MAX_CONFIG_BYTES}-byte) limit"


def too_big(source: str, size: int, how: str = "") -> ConfigError:
    return ConfigError(
        f"config {source} is {size} bytes{how}, over {size_limit_text()} on experiment configs; "
        "keep data out of the config (put it in the context directory and read it from there)"
    )


def read_config_bytes(path: str | os.PathLike[str], what: str = "config file") -> bytes:
    """A config file's bytes (an experiment config, daemon.yaml, --config-file): a regular file
    only, read bounded. A FIFO, a device or a socket is refused with one line (opened without
    blocking, so a FIFO nobody writes cannot hang the command); OSError for the rest
    (not found, a directory, permission), for the caller to name."""
    source = os.fspath(path)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise IsADirectoryError(21, "Is a directory", source)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(
                f"{what} {source} is not a regular file (a FIFO, a device or a socket); "
                "refusing to read it: pass a YAML file (save a pipe's output to one first)"
            )
        if st.st_size > MAX_CONFIG_BYTES:
            raise too_big(source, st.st_size)
        chunks: list[bytes] = []
        left = MAX_CONFIG_BYTES + 1  # one more than allowed: a file that grows is caught
        while left > 0 and (chunk := os.read(fd, min(left, 1 << 16))):
            chunks.append(chunk)
            left -= len(chunk)
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if len(data) > MAX_CONFIG_BYTES:
        raise too_big(source, len(data), " or more")
    return data


def read_settings_text(path: str | os.PathLike[str]) -> str:
    """daemon.yaml's text for each of its readers (the engine, pools, federation, usage, the
    dashboard): a regular file only, read bounded (`read_config_bytes`)."""
    return read_config_bytes(path, "daemon settings").decode("utf-8", errors="replace")


def too_deep(source: str, parts: Sequence[object], limit: int = MAX_DEPTH) -> ConfigError:
    return ConfigError(
        f"{short_path(parts)} in {source}: nested deeper than {limit} levels "
        f"(at level {len(parts) + 1}); flatten that structure"
    )


def check_depth(value: Any, source: str, limit: int = MAX_DEPTH) -> None:
    path = deep_path(value, limit)
    if path is not None:
        raise too_deep(source, path, limit)


def check_config_value(config: Any, source: str) -> None:
    """The bounds on a config that arrived as data (msgpack in a request, the Python API):
    nesting first (the size is measured by packing it, which recurses), then its size."""
    check_depth(config, source)
    import msgpack

    try:
        size = len(msgpack.packb(config, use_bin_type=True))
    except (TypeError, ValueError, OverflowError):
        return  # not packable data: the validation that follows names what is wrong
    if size > MAX_CONFIG_BYTES:
        raise too_big(source, size, " as sent")

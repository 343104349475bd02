"""msgpack decoding with a budget, for every message that crosses a trust boundary.

A hostile sender can make a small message cost a lot to decode: 4 MiB of nested empty maps
become four million dicts (~1 GB), a length prefix of 4 GiB asks for a 4 GiB string, a
100,000-level nest overflows whatever walks it recursively. ``decode`` refuses all of them
before building anything: one pass over the bytes (``scan``) counts the objects, measures every
string, binary, extension, array and map against the ``Budget`` and tracks the nesting depth
with a stack of counters (nothing is allocated per node; runs of one-byte objects are skipped
in C by a regular expression); only then does msgpack build the value, with its own
``max_*_len`` limits as a second line. The pass stops at the first thing over budget, so a
refusal costs time proportional to the budget, never to the message.

Each boundary picks a ``Budget`` from what a legitimate message of its kind needs
(``SPOOL_REQUEST``, ``TRIAL_HELLO``, ``TRIAL_SESSION``, ``ZYGOTE_REPLY``, ``PEER_FRAME`` ...).
A refusal is ``Refused``, whose text is one line (the caller adds where the message came from).

This module imports nothing heavy (msgpack only), so the CLI, trials and peers can use it.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass
from typing import Any

import msgpack

__all__ = [
    "Budget",
    "Refused",
    "decode",
    "scan",
    "SPOOL_REQUEST",
    "SPOOL_ANSWER",
    "TRIAL_HELLO",
    "TRIAL_SESSION",
    "DAEMON_TO_TRIAL",
    "ZYGOTE_REPLY",
    "ZYGOTE_REQUEST",
    "PEER_FRAME",
]


@dataclass(frozen=True)
class Budget:
    """The most a message of one kind may hold. Sizes are in bytes (``max_str``: a string's
    UTF-8 bytes), counts in elements (``max_map``: keys), ``max_depth`` counts nested arrays
    and maps (the outermost is level 1), ``max_objects`` every value, containers included,
    ``max_containers`` the maps and arrays alone (what makes a small message costly to decode:
    1 MB of empty maps is a million dicts, ~100 MB)."""

    max_bytes: int
    max_str: int
    max_bin: int
    max_array: int
    max_map: int
    max_ext: int
    max_depth: int
    max_objects: int
    # maps and arrays, empty ones included: each costs ~100 bytes decoded (an empty map in a
    # 1-byte value) and the scan's slow path; 0: as many as max_objects
    max_containers: int = 0


class Refused(Exception):
    """A message over its budget or not msgpack at all; ``str()`` is one line saying which
    limit and where (the byte offset)."""


# Budgets per message kind. Each is generous for what det-local itself sends and far below
# what would cost the daemon noticeable time or memory (objects: ~100 bytes of RAM each).

# A spool request: an experiment config (<= 1 MiB, 64 levels: config/limits.py) with its
# submission's metadata, or a control request (ids, a few fields: `cmd run`'s environment is
# the largest, a few hundred strings).
# A string may be as long as the request (one costs no more than its bytes): a config too big
# is then named by the config's own check (config/limits.py), which says what to do.
# 20,000 maps and lists: a config's hyperparameters, searcher and data sections hold a few
# hundred; 100,000 values: a 1 MiB config of short list items. Decoded, the worst request within
# it is ~25 MB (4 MiB of 2-byte strings and 20,000 maps); the spool reads and decodes requests
# off the event loop (sched/intake/spoolserver.py), one batch at a time.
SPOOL_REQUEST = Budget(
    max_bytes=4 * 1024 * 1024,
    max_str=4 * 1024 * 1024,
    max_bin=4 * 1024 * 1024,
    max_array=50_000,
    max_map=50_000,
    max_ext=0,
    max_depth=100,
    max_objects=100_000,
    max_containers=20_000,
)
# An answer the daemon wrote (read by clients: trusted writer, bounded all the same).
SPOOL_ANSWER = Budget(
    max_bytes=64 * 1024 * 1024,
    max_str=64 * 1024 * 1024,
    max_bin=64 * 1024 * 1024,
    max_array=1_000_000,
    max_map=1_000_000,
    max_ext=0,
    max_depth=200,
    max_objects=5_000_000,
)
# The first frame of a trial connection: a few ids and a token.
TRIAL_HELLO = Budget(
    max_bytes=4 * 1024,
    max_str=1024,
    max_bin=1024,
    max_array=64,
    max_map=64,
    max_ext=0,
    max_depth=8,
    max_objects=512,
)
# A session frame (rpc.SESSION_MAX_FRAME, 4 MiB). What trials send: a metric batch (the trial
# side splits a batch to fit this budget, trial/session.py: a report is 3 containers and ~12
# values, plus one map per batch of its batch_metrics), a checkpoint with its file list (one
# map, {path: size}: up to ~45,000 files of 80-byte paths in 4 MiB, 49,000 files at most), an
# unmanaged run's config (a few hundred maps). Everything else is a few ids. A frame within this
# budget decodes to at most ~7 MB (100,000 two-byte strings ~6 MB, 10,000 maps ~1 MB), and the
# daemon decodes one large frame at a time (sched/sessions/trialserver.py).
TRIAL_SESSION = Budget(
    max_bytes=4 * 1024 * 1024,
    max_str=1024 * 1024,
    max_bin=1024 * 1024,
    max_array=100_000,
    max_map=100_000,
    max_ext=0,
    max_depth=64,
    max_objects=100_000,
    max_containers=10_000,
)
# What a trial reads from its daemon (rpc.MAX_FRAME): a trusted writer, bounded all the same.
DAEMON_TO_TRIAL = Budget(
    max_bytes=64 * 1024 * 1024,
    max_str=64 * 1024 * 1024,
    max_bin=64 * 1024 * 1024,
    max_array=2_000_000,
    max_map=2_000_000,
    max_ext=0,
    max_depth=200,
    max_objects=5_000_000,
)
# A zygote's answer to the daemon (a pid, a status, one line of error).
ZYGOTE_REPLY = Budget(
    max_bytes=64 * 1024,
    max_str=16 * 1024,
    max_bin=16 * 1024,
    max_array=256,
    max_map=256,
    max_ext=0,
    max_depth=8,
    max_objects=4096,
)
# What the daemon asks a zygote (a fork: argv, env, cwd, fds): read by the zygote.
ZYGOTE_REQUEST = Budget(
    max_bytes=4 * 1024 * 1024,
    max_str=1024 * 1024,
    max_bin=1024 * 1024,
    max_array=20_000,
    max_map=20_000,
    max_ext=0,
    max_depth=16,
    max_objects=100_000,
)
# A federation frame between authenticated peers (membership, gang control, relayed trial
# frames, which carry a session frame's worth).
PEER_FRAME = Budget(
    max_bytes=32 * 1024 * 1024,
    max_str=16 * 1024 * 1024,
    max_bin=16 * 1024 * 1024,
    max_array=500_000,
    max_map=500_000,
    max_ext=0,
    max_depth=100,
    max_objects=1_000_000,
)

# ------------------------------------------------------------------ the format, as a table
# For each first byte: what follows it.
_ATOM = 0  # nothing more: the byte is the value (fixint, nil, bool) -- handled by _RUN
_FIXED = 1  # `arg` more bytes (numbers)
_STR = 2  # a length of `arg` bytes (0: in the byte itself), then that many bytes
_BIN = 3
_EXT = 4  # a length of `arg` bytes (0: fixext, its size in _EXT_FIXED), a type byte, data
_ARRAY = 5  # a count of `arg` bytes (0: in the byte itself)
_MAP = 6
_BAD = 7  # 0xc1: never used

_KIND = [0] * 256
_ARG = [0] * 256
for _b in range(256):
    if _b <= 0x7F or _b >= 0xE0 or _b in (0xC0, 0xC2, 0xC3):
        _KIND[_b] = _ATOM
    elif 0x80 <= _b <= 0x8F:
        _KIND[_b] = _MAP
    elif 0x90 <= _b <= 0x9F:
        _KIND[_b] = _ARRAY
    elif 0xA0 <= _b <= 0xBF:
        _KIND[_b] = _STR
_KIND[0xC1] = _BAD
for _b, _k, _a in (
    (0xC4, _BIN, 1),
    (0xC5, _BIN, 2),
    (0xC6, _BIN, 4),
    (0xC7, _EXT, 1),
    (0xC8, _EXT, 2),
    (0xC9, _EXT, 4),
    (0xCA, _FIXED, 4),
    (0xCB, _FIXED, 8),
    (0xCC, _FIXED, 1),
    (0xCD, _FIXED, 2),
    (0xCE, _FIXED, 4),
    (0xCF, _FIXED, 8),
    (0xD0, _FIXED, 1),
    (0xD1, _FIXED, 2),
    (0xD2, _FIXED, 4),
    (0xD3, _FIXED, 8),
    (0xD4, _EXT, 0),
    (0xD5, _EXT, 0),
    (0xD6, _EXT, 0),
    (0xD7, _EXT, 0),
    (0xD8, _EXT, 0),
    (0xD9, _STR, 1),
    (0xDA, _STR, 2),
    (0xDB, _STR, 4),
    (0xDC, _ARRAY, 2),
    (0xDD, _ARRAY, 4),
    (0xDE, _MAP, 2),
    (0xDF, _MAP, 4),
):
    _KIND[_b] = _k
    _ARG[_b] = _a
_EXT_FIXED = {0xD4: 1, 0xD5: 2, 0xD6: 4, 0xD7: 8, 0xD8: 16}
_UINT = {1: struct.Struct(">B"), 2: struct.Struct(">H"), 4: struct.Struct(">I")}

# runs of one-byte values, skipped in C: scalars only, or scalars and empty maps/arrays/strings
_SCALARS = re.compile(rb"[\x00-\x7f\xa0\xc0\xc2\xc3\xe0-\xff]+")
_ONE_BYTE = re.compile(rb"[\x00-\x80\x90\xa0\xc0\xc2\xc3\xe0-\xff]+")


def _n(value: int) -> str:
    return f"{value:,}"


def _too_deep(max_depth: int, pos: int) -> Refused:
    return Refused(f"message nests deeper than {_n(max_depth)} levels (at byte {_n(pos)})")


def _too_many(max_containers: int, pos: int) -> Refused:
    return Refused(
        f"message holds more than {_n(max_containers)} maps and arrays (at byte {_n(pos)})"
    )


def _header(
    buf: bytes | bytearray, pos: int, size: int, lead: int, kind: int, budget: Budget
) -> tuple[int, int]:
    """A value with a length or a count at ``pos``: where the next value starts and how many
    elements follow (an array's items, a map's keys and values; 0 for the rest). Refused when
    over budget, truncated or not msgpack."""
    start = pos
    if kind == _BAD:
        raise Refused(f"message is not msgpack (byte 0xc1 at {_n(pos)})")
    arg = _ARG[lead]
    if arg == 0:
        length = _EXT_FIXED[lead] if kind == _EXT else lead & (0x1F if kind == _STR else 0x0F)
        pos += 1
    else:
        if pos + 1 + arg > size:
            raise Refused(f"message is truncated at byte {_n(start)} (a length)")
        if pos + 1 + arg > len(buf):
            raise _Short  # a prefix (scan's total): the rest decides
        (length,) = _UINT[arg].unpack_from(buf, pos + 1)
        pos += 1 + arg
    if kind in (_STR, _BIN):
        limit = budget.max_str if kind == _STR else budget.max_bin
        name = "string" if kind == _STR else "binary"
        if length > limit:
            raise Refused(
                f"a {name} of {_n(length)} bytes is over the limit of {_n(limit)} "
                f"(at byte {_n(start)})"
            )
        if pos + length > size:
            raise Refused(
                f"message is truncated: a {name} of {_n(length)} bytes at byte "
                f"{_n(start)} runs past its end ({_n(size)} bytes)"
            )
        return pos + length, 0
    if kind == _EXT:
        if length > budget.max_ext:
            raise Refused(
                f"an extension value of {_n(length)} bytes is over the limit of "
                f"{_n(budget.max_ext)} (at byte {_n(start)})"
            )
        if pos + 1 + length > size:
            raise Refused(f"message is truncated at byte {_n(start)} (an extension value)")
        return pos + 1 + length, 0
    # an array or a map: `length` elements (a map: keys), each at least one byte
    if kind == _MAP:
        if length > budget.max_map:
            raise Refused(
                f"a map of {_n(length)} keys is over the limit of {_n(budget.max_map)} "
                f"(at byte {_n(start)})"
            )
        count = 2 * length
    else:
        if length > budget.max_array:
            raise Refused(
                f"an array of {_n(length)} items is over the limit of "
                f"{_n(budget.max_array)} (at byte {_n(start)})"
            )
        count = length
    if count > size - pos:
        what = "a map" if kind == _MAP else "an array"
        raise Refused(
            f"message is truncated: {what} of {_n(length)} at byte {_n(start)} "
            f"cannot fit in its {_n(size)} bytes"
        )
    return pos, count


class _Short(Exception):
    """The scan of a prefix reached its end."""


def scan(data: bytes | bytearray | memoryview, budget: Budget, total: int | None = None) -> int:
    """Check ``data`` against ``budget`` without building anything; the number of objects it
    holds. Refused at the first thing over budget (or not msgpack).

    ``total``: ``data`` is the first bytes of a message of that many bytes: what the prefix
    shows is checked (a bomb is refused before the rest is even read), and the scan stops
    quietly where the prefix ends (and returns -1)."""
    have = len(data)
    size = have if total is None else total
    if size > budget.max_bytes:
        raise Refused(f"message of {_n(size)} bytes is over the limit of {_n(budget.max_bytes)}")
    if size == 0:
        raise Refused("empty message")
    buf = data if isinstance(data, bytes | bytearray) else bytes(data)
    try:
        pos, objects = _walk(buf, budget, size)
    except _Short:
        return -1
    if pos > size:
        raise Refused(f"message is truncated: its last value runs past its end ({_n(size)} bytes)")
    if pos != size:
        raise Refused(f"message has {_n(size - pos)} bytes after its value (at byte {_n(pos)})")
    return objects


def _walk(buf: bytes | bytearray, budget: Budget, size: int) -> tuple[int, int]:
    """The scan itself: (where the value ends, how many values it holds). _Short where a
    prefix of the message ends."""
    have = len(buf)
    max_depth = budget.max_depth
    max_objects = budget.max_objects
    max_containers = budget.max_containers or max_objects
    containers = 0
    kinds = _KIND
    args = _ARG
    stack: list[int] = []  # the elements still to come in each enclosing container
    depth = 0  # len(stack)
    remaining = 1  # the top level holds exactly one value
    objects = 0
    pos = 0
    while remaining:
        if pos >= have:
            if have < size:
                raise _Short
            raise Refused(f"message is truncated at byte {_n(pos)} (a value is missing)")
        lead = buf[pos]
        kind = kinds[lead]
        if kind == _FIXED:
            pos += 1 + args[lead]
            objects += 1
            remaining -= 1
        elif kind == _ATOM or lead == 0x80 or lead == 0x90 or lead == 0xA0:
            # a run of one-byte values (an empty map or array counts as a level of nesting;
            # an empty string does not)
            run = (_ONE_BYTE if depth < max_depth else _SCALARS).match(buf, pos)
            if run is None:  # an empty container one level too deep
                raise _too_deep(max_depth, pos)
            take = min(run.end() - pos, remaining)
            if depth < max_depth:  # empty maps and arrays in the run are containers too
                containers += buf.count(b"\x80", pos, pos + take) + buf.count(
                    b"\x90", pos, pos + take
                )
                if containers > max_containers:
                    raise _too_many(max_containers, pos)
            pos += take
            remaining -= take
            objects += take
        elif kind == _STR and lead < 0xC0:  # a fixstr
            length = lead & 0x1F
            pos += 1 + length
            objects += 1
            remaining -= 1
        else:
            objects += 1
            remaining -= 1
            pos, count = _header(buf, pos, size, lead, kind, budget)
            if kind in (_ARRAY, _MAP):
                containers += 1
                if containers > max_containers:
                    raise _too_many(max_containers, pos)
            if count:
                stack.append(remaining)
                depth += 1
                if depth > max_depth:
                    raise _too_deep(max_depth, pos)
                remaining = count
            elif count == 0 and kind in (_ARRAY, _MAP) and depth >= max_depth:
                raise _too_deep(max_depth, pos)
        if objects > max_objects:
            raise Refused(f"message holds more than {_n(max_objects)} values (at byte {_n(pos)})")
        while not remaining and depth:
            remaining = stack.pop()
            depth -= 1
    return pos, objects


def decode(data: bytes | bytearray, budget: Budget) -> Any:
    """The value in ``data``, or ``Refused`` (one line) when it is over ``budget`` or not
    msgpack. Strings decode as str (UTF-8), binaries as bytes; map keys may be any hashable."""
    scan(data, budget)
    try:
        return msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=False,
            max_str_len=budget.max_str,
            max_bin_len=budget.max_bin,
            max_array_len=budget.max_array,
            max_map_len=budget.max_map,
            max_ext_len=budget.max_ext,
        )
    except Exception as err:  # invalid UTF-8, an unhashable key, ...: msgpack's own kinds
        raise Refused(f"message is not valid msgpack ({type(err).__name__})") from None

"""The budgeted msgpack decoder (det_local/wire/budget.py): every bomb the issue names is refused
with its one line, quickly, and legitimate messages decode exactly as msgpack would."""

from __future__ import annotations

import struct
import time

import msgpack
import pytest

from det_local.wire.budget import (
    SPOOL_REQUEST,
    TRIAL_HELLO,
    TRIAL_SESSION,
    Budget,
    Refused,
    decode,
    scan,
)

MIB = 1024 * 1024


def refused(data: bytes, budget: Budget = SPOOL_REQUEST) -> str:
    start = time.perf_counter()
    with pytest.raises(Refused) as info:
        decode(data, budget)
    elapsed = time.perf_counter() - start
    assert elapsed < 1.0, f"refusing took {elapsed:.3f}s"
    text = str(info.value)
    assert "\n" not in text
    return text


def test_nested_empty_maps_refused_at_the_depth_limit() -> None:
    # {"": {"": {... {}}}}: 4 MiB of it, the bomb that froze the daemon
    bomb = b"\x81\xa0" * (2 * MIB - 1) + b"\x80"
    assert refused(bomb) == "message nests deeper than 100 levels (at byte 201)"


def test_nested_empty_arrays_refused_at_the_depth_limit() -> None:
    bomb = b"\x91" * (4 * MIB - 1) + b"\x90"
    assert refused(bomb) == "message nests deeper than 100 levels (at byte 101)"


def test_many_empty_maps_refused_by_count() -> None:
    # one array of four million empty maps (each one byte)
    n = 4 * MIB - 5
    assert refused(b"\xdd" + struct.pack(">I", n) + b"\x80" * n) == (
        f"an array of {n:,} items is over the limit of 50,000 (at byte 0)"
    )
    # arrays within their limit, but together too many maps: stopped at the budget (maps and
    # arrays are what a small message spends memory on)
    chunk = b"\xdc" + struct.pack(">H", 50_000) + b"\x80" * 50_000
    assert refused(b"\x93" + chunk * 3) == (
        "message holds more than 20,000 maps and arrays (at byte 4)"
    )
    # and too many values of any kind
    ints = b"\xdc" + struct.pack(">H", 50_000) + b"\x00" * 50_000
    assert refused(b"\x93" + ints * 3) == (
        "message holds more than 100,000 values (at byte 100,007)"
    )


def test_a_1_mb_session_frame_of_empty_maps_is_refused_at_its_container_budget() -> None:
    """Issue 34: 1 MB of empty maps was a million dicts (+100-133 MB) within the old budget."""
    chunk = b"\xdc" + struct.pack(">H", 60_000) + b"\x80" * 60_000
    frame = b"\xdc" + struct.pack(">H", 16) + chunk * 16
    assert len(frame) > 960_000
    start = time.perf_counter()
    assert refused(frame, TRIAL_SESSION) == (
        "message holds more than 10,000 maps and arrays (at byte 6)"
    )
    assert time.perf_counter() - start < 0.1
    # a 16 MiB frame is over the session's size limit before anything is scanned
    assert refused(frame * 17, TRIAL_SESSION) == (
        f"message of {len(frame) * 17:,} bytes is over the limit of 4,194,304"
    )


def test_4_gib_length_prefixes() -> None:
    assert refused(b"\xdb\xff\xff\xff\xff" + b"a" * 64) == (
        "a string of 4,294,967,295 bytes is over the limit of 4,194,304 (at byte 0)"
    )
    assert refused(b"\xdd\xff\xff\xff\xff") == (
        "an array of 4,294,967,295 items is over the limit of 50,000 (at byte 0)"
    )
    assert refused(b"\xdf\xff\xff\xff\xff") == (
        "a map of 4,294,967,295 keys is over the limit of 50,000 (at byte 0)"
    )


def test_str_bin_ext_bombs() -> None:
    # within the message size, over the per-value limit
    two = 2 * MIB
    assert refused(b"\xdb" + struct.pack(">I", two) + b"x" * two, TRIAL_SESSION) == (
        "a string of 2,097,152 bytes is over the limit of 1,048,576 (at byte 0)"
    )
    assert refused(b"\xc6" + struct.pack(">I", two) + b"x" * two, TRIAL_SESSION) == (
        "a binary of 2,097,152 bytes is over the limit of 1,048,576 (at byte 0)"
    )
    assert refused(b"\xc9\xff\xff\xff\xff\x01") == (
        "an extension value of 4,294,967,295 bytes is over the limit of 0 (at byte 0)"
    )
    assert refused(b"\xd4\x01\x01") == (
        "an extension value of 1 bytes is over the limit of 0 (at byte 0)"
    )


def test_deep_nest_of_100000_levels() -> None:
    assert refused(b"\x91" * 100_000 + b"\xc0") == (
        "message nests deeper than 100 levels (at byte 101)"
    )
    # exactly at the limit is fine
    assert decode(b"\x91" * 99 + b"\x90", SPOOL_REQUEST) is not None


def test_wide_map_of_a_million_keys() -> None:
    body = b"\x00\xc0" * 1_000_000
    assert refused(b"\xdf" + struct.pack(">I", 1_000_000) + body, TRIAL_SESSION) == (
        "a map of 1,000,000 keys is over the limit of 100,000 (at byte 0)"
    )


def test_size_truncation_and_garbage() -> None:
    assert refused(b"\x80" * 5000, TRIAL_HELLO) == (
        "message of 5,000 bytes is over the limit of 4,096"
    )
    assert refused(b"") == "empty message"
    assert refused(b"\x92\x01") == (
        "message is truncated: an array of 2 at byte 0 cannot fit in its 2 bytes"
    )
    assert refused(b"\xa5ab") == "message is truncated: its last value runs past its end (3 bytes)"
    assert refused(b"\x92\x01\x01\x01") == "message has 1 bytes after its value (at byte 3)"
    assert refused(b"\xc1") == "message is not msgpack (byte 0xc1 at 0)"
    assert refused(b"\xa2\xff\xfe") == "message is not valid msgpack (UnicodeDecodeError)"
    assert refused(b"\x81\x90\x01") == "message is not valid msgpack (TypeError)"


def test_legitimate_messages_decode_as_msgpack_would() -> None:
    values = [
        {"t": "hello", "token": "x" * 64, "trial_id": 3, "run_id": 9, "rank": 0, "pid": 123},
        {
            "t": "metrics",
            "reports": [
                ["training", i, {"loss": 0.5 / (i + 1), "acc": i, "n": None}, 1.7e9, None]
                for i in range(2000)
            ],
        },
        {"op": "submit", "payload": {"config": {"a": [1, -1, 2**40, -(2**40), 1.5, True]}}},
        {"b": b"\x00" * 300, "s": "é" * 40_000, "neg": -33, "big": 2**64 - 1, "f32": 0.0},
        [[[]], {}, "", 0],
    ]
    for value in values:
        data = msgpack.packb(value, use_bin_type=True)
        assert decode(data, TRIAL_SESSION) == msgpack.unpackb(data, raw=False)
    # scan's count: the array, its four items, the inner array and map
    assert scan(msgpack.packb([[[]], {}, "", 0]), TRIAL_SESSION) == 6
    # float32 is read as msgpack reads it
    f32 = b"\xca" + struct.pack(">f", 1.5)
    assert decode(f32, TRIAL_SESSION) == 1.5


def test_a_prefix_shows_a_bomb_before_the_rest_is_read() -> None:
    bomb = b"\x81\xa0" * (2 * MIB - 1) + b"\x80"
    with pytest.raises(Refused) as info:
        scan(bomb[:65536], SPOOL_REQUEST, total=len(bomb))
    assert str(info.value) == "message nests deeper than 100 levels (at byte 201)"
    huge = b"\xdb\xff\xff\xff\xff" + b"x" * 100_000
    with pytest.raises(Refused, match="a string of 4,294,967,295 bytes is over the limit"):
        scan(huge[:65536], SPOOL_REQUEST, total=len(huge))
    # the claimed total is what must hold: over the message limit, or a count that cannot fit
    with pytest.raises(Refused, match="message of 5,242,880 bytes is over the limit"):
        scan(b"\x90", SPOOL_REQUEST, total=5 * MIB)
    with pytest.raises(Refused, match="an array of 40,000 at byte 0 cannot fit in its 1,000"):
        scan(b"\xdc\x9c\x40" + b"\x00" * 100, SPOOL_REQUEST, total=1000)
    # a legitimate message's prefix: nothing to say yet (-1), and the whole decodes
    good = msgpack.packb({"config": {"a": "b" * 100_000, "c": list(range(1000))}})
    assert scan(good[:65536], SPOOL_REQUEST, total=len(good)) == -1
    assert decode(good, SPOOL_REQUEST) == msgpack.unpackb(good)

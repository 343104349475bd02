"""TensorBoard event files of scalars, written without TensorFlow or the tensorboard package.

An event file is a sequence of TFRecords (length, masked CRC32C of the length, the data, masked
CRC32C of the data), each holding one serialized ``tensorflow.Event`` protobuf: first the file
version, then one event per scalar (wall_time, step, Summary{Value{tag, simple_value}}). That is
what ``torch.utils.tensorboard.SummaryWriter.add_scalar`` writes, and what TensorBoard's scalars
dashboard reads; the few protobuf fields are encoded here by hand.
"""

from __future__ import annotations

import os
import socket
import struct
import time
from pathlib import Path
from typing import BinaryIO

FILE_VERSION = b"brain.Event:2"


def _crc32c_table() -> list[int]:
    table = []
    for i in range(256):
        crc = i
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1
        table.append(crc)
    return table


_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli), as TFRecord framing uses."""
    crc = 0xFFFFFFFF
    table = _TABLE
    for byte in data:
        crc = table[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def masked_crc(data: bytes) -> int:
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def record(data: bytes) -> bytes:
    """One TFRecord holding `data`."""
    length = struct.pack("<Q", len(data))
    return (
        length + struct.pack("<I", masked_crc(length)) + data + struct.pack("<I", masked_crc(data))
    )


def _varint(value: int) -> bytes:
    value &= (1 << 64) - 1  # int64 as protobuf sends it (a negative one in ten bytes)
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _field_bytes(number: int, payload: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _event(wall_time: float, step: int | None = None, **fields: bytes) -> bytes:
    out = b"\x09" + struct.pack("<d", wall_time)  # 1: wall_time (double)
    if step is not None:
        out += b"\x10" + _varint(step)  # 2: step (int64)
    if "file_version" in fields:
        out += _field_bytes(3, fields["file_version"])
    if "summary" in fields:
        out += _field_bytes(5, fields["summary"])
    return out


def scalar_event(tag: str, value: float, step: int, wall_time: float) -> bytes:
    """An Event holding one scalar: Summary{value: [Value{tag, simple_value}]}."""
    val = _field_bytes(1, tag.encode()) + b"\x15" + struct.pack("<f", value)  # 2: float
    return _event(wall_time, step, summary=_field_bytes(1, val))


class EventFileWriter:
    """Writes one new event file in `directory` (``events.out.tfevents.<time>.<host>...``)."""

    def __init__(self, directory: Path, suffix: str = "") -> None:
        directory.mkdir(parents=True, exist_ok=True)
        now = time.time()
        name = f"events.out.tfevents.{int(now)}.{socket.gethostname()}.{os.getpid()}{suffix}"
        self.path = directory / name
        self._file: BinaryIO = open(self.path, "wb")  # noqa: SIM115 (closed by close())
        self._file.write(record(_event(now, 0, file_version=FILE_VERSION)))

    def add_scalar(self, tag: str, value: float, step: int, wall_time: float) -> None:
        self._file.write(record(scalar_event(tag, float(value), int(step), wall_time)))

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> EventFileWriter:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

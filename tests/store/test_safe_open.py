"""det_local.store.safe_open: what a root daemon reads from user-writable places."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from det_local.store.safe_open import UnsafeFile, read_bounded


def test_reads_a_small_regular_file(tmp_path: Path) -> None:
    f = tmp_path / "exit"
    f.write_bytes(b"0\n")
    assert read_bounded(f, 64) == b"0\n"
    assert read_bounded(f, 64, owner=os.getuid()) == b"0\n"


def test_refuses_a_symlink_even_to_a_regular_file(tmp_path: Path) -> None:
    target = tmp_path / "t"
    target.write_text("1")
    (tmp_path / "link").symlink_to(target)
    with pytest.raises(UnsafeFile, match="symbolic link"):
        read_bounded(tmp_path / "link", 64, what="exit file")


def test_refuses_a_symlink_to_dev_zero(tmp_path: Path) -> None:
    (tmp_path / "z").symlink_to("/dev/zero")
    with pytest.raises(UnsafeFile, match="symbolic link"):
        read_bounded(tmp_path / "z", 64)


def test_a_fifo_neither_blocks_nor_is_read(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    done = threading.Event()
    errors: list[BaseException] = []

    def attempt() -> None:
        try:
            read_bounded(fifo, 64)
        except BaseException as err:
            errors.append(err)
        done.set()

    threading.Thread(target=attempt, daemon=True).start()
    assert done.wait(5), "reading a FIFO blocked"
    assert isinstance(errors[0], UnsafeFile) and "not a regular file" in str(errors[0])


def test_refuses_a_device_and_a_directory(tmp_path: Path) -> None:
    with pytest.raises(UnsafeFile, match="not a regular file"):
        read_bounded("/dev/null", 64)
    with pytest.raises(UnsafeFile, match="not a regular file"):
        read_bounded(tmp_path, 64)


def test_refuses_a_file_over_the_bound(tmp_path: Path) -> None:
    f = tmp_path / "big"
    f.write_bytes(b"x" * 65)
    with pytest.raises(UnsafeFile, match="65 bytes, over the 64-byte limit"):
        read_bounded(f, 64)


def test_refuses_a_file_of_another_owner(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("chown to another uid needs root")
    f = tmp_path / "theirs"
    f.write_text("0")
    os.chown(f, 12345, 12345)
    with pytest.raises(UnsafeFile, match="owned by uid 12345, expected uid 4242"):
        read_bounded(f, 64, owner=4242)


def test_a_missing_file_is_file_not_found(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        read_bounded(tmp_path / "absent", 64)

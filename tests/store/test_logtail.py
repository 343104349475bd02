"""det_local/store/logtail.py: the one log follower (trial logs, command output, `run`'s
output), on real files, without a daemon."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest

from det_local.store.logtail import BLOCK, LogTail, follow, follow_async


def _append(path: Path, data: bytes) -> None:
    with path.open("ab") as f:
        f.write(data)


class _Out:
    def __init__(self) -> None:
        self.chunks: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.chunks.append(data)

    @property
    def text(self) -> bytes:
        return b"".join(self.chunks)


def test_whole_lines_only_and_the_rest_at_the_end(tmp_path: Path) -> None:
    log = tmp_path / "log"
    tail, out = LogTail(log), _Out()
    assert tail.pump(out.write) is False  # no file yet: nothing, no error
    _append(log, b"one\ntw")
    assert tail.pump(out.write) is True
    assert out.text == b"one\n"  # "tw" waits for its newline
    assert tail.pump(out.write) is False
    _append(log, b"o\nthr")
    tail.pump(out.write)
    assert out.text == b"one\ntwo\n"
    assert tail.rest() == b"thr"
    assert tail.rest() == b""  # handed over once


def test_raw_mode_passes_partial_lines(tmp_path: Path) -> None:
    log = tmp_path / "log"
    log.write_bytes(b"prompt> ")
    tail, out = LogTail(log, lines=False), _Out()
    tail.pump(out.write)
    assert out.text == b"prompt> "
    assert tail.rest() == b""


def test_prefix_and_last_lines(tmp_path: Path) -> None:
    log = tmp_path / "log"
    lines = [f"[rank={i % 2}] line {i}\n".encode() for i in range(10)]
    log.write_bytes(b"".join(lines))
    out = _Out()
    LogTail(log, prefix=b"[rank=1] ", last=2).pump(out.write)
    assert out.text == b"[rank=1] line 7\n[rank=1] line 9\n"
    out = _Out()
    LogTail(log, last=3).pump(out.write)
    assert out.text == b"".join(lines[-3:])
    out = _Out()
    LogTail(log, last=0).pump(out.write)
    assert out.text == b""
    out = _Out()
    LogTail(log, last=50).pump(out.write)  # fewer lines than asked: all of them
    assert out.text == b"".join(lines)


def test_last_lines_across_blocks(tmp_path: Path) -> None:
    """--tail reads backwards block by block: lines longer than a block, and a prefix cut by a
    block boundary, still count right."""
    log = tmp_path / "log"
    long = b"[rank=0] " + b"x" * (BLOCK + 10) + b"\n"
    log.write_bytes(long + b"[rank=1] a\n" + long + b"[rank=1] b\n")
    out = _Out()
    LogTail(log, prefix=b"[rank=0] ", last=1).pump(out.write)
    assert out.text == long
    out = _Out()
    LogTail(log, last=3).pump(out.write)
    assert out.text == b"[rank=1] a\n" + long + b"[rank=1] b\n"


def test_last_applies_only_to_what_exists_at_the_first_pump(tmp_path: Path) -> None:
    log = tmp_path / "log"
    tail, out = LogTail(log, last=1), _Out()
    tail.pump(out.write)  # not there yet
    log.write_bytes(b"a\nb\n")
    tail.pump(out.write)
    assert out.text == b"a\nb\n"


def test_start_offset_skips_what_was_shown(tmp_path: Path) -> None:
    log = tmp_path / "log"
    log.write_bytes(b"shown before\n")
    tail, out = LogTail(log, start=len(b"shown before\n")), _Out()
    assert tail.pump(out.write) is False
    _append(log, b"new\n")
    tail.pump(out.write)
    assert out.text == b"new\n"


def test_truncated_file_is_read_again_from_its_start(tmp_path: Path) -> None:
    log = tmp_path / "log"
    log.write_bytes(b"first run, a long line\n")
    tail, out = LogTail(log), _Out()
    tail.pump(out.write)
    log.write_bytes(b"again\n")  # shorter than what was read
    assert tail.pump(out.write) is True
    assert out.text == b"first run, a long line\nagain\n"


def test_follow_drains_what_was_written_before_the_end(tmp_path: Path) -> None:
    """done() is asked only when a pump found nothing; once it says done, one more pump
    picks up what the writer wrote just before it finished."""
    log = tmp_path / "log"
    tail, out = LogTail(log), _Out()
    asked = []

    def done() -> bool:
        asked.append(out.text)
        if len(asked) == 3:
            _append(log, b"last words\n")  # written, then the writer is seen as done
            return True
        return False

    _append(log, b"hello\n")
    follow(lambda: tail.pump(out.write), done, poll=0.001, max_poll=0.002)
    assert out.text == b"hello\nlast words\n"
    assert asked[0] == b"hello\n"  # the first output came before the first question


def test_follow_sees_lines_from_another_thread(tmp_path: Path) -> None:
    log = tmp_path / "log"
    tail, out = LogTail(log), _Out()
    finished = threading.Event()

    def writer() -> None:
        for i in range(50):
            _append(log, f"line {i}\n".encode())
        finished.set()

    t = threading.Thread(target=writer)
    t.start()
    follow(lambda: tail.pump(out.write), finished.is_set, poll=0.001, max_poll=0.01)
    t.join()
    assert out.text == b"".join(f"line {i}\n".encode() for i in range(50))


def test_ctrl_c_reaches_the_caller(tmp_path: Path) -> None:
    """KeyboardInterrupt is the caller's to report (each says something different)."""
    log = tmp_path / "log"
    tail = LogTail(log)

    def done() -> bool:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        follow(lambda: tail.pump(lambda _: None), done, poll=0.001)


def test_follow_async_yields_after_every_pump(tmp_path: Path) -> None:
    """In the engine's event loop the follower never pumps twice without yielding, and it asks
    done() after every pump, output or not."""
    log = tmp_path / "log"
    log.write_bytes(b"x\n" * 10)
    tail, out = LogTail(log), _Out()
    events: list[str] = []

    def pump() -> bool:
        events.append("pump")
        _append(log, b"more\n")  # output never stops
        return tail.pump(out.write)

    def done() -> bool:
        events.append("done?")
        return events.count("tick") >= 3

    async def other_work() -> None:
        while True:
            events.append("tick")
            await asyncio.sleep(0)

    async def main() -> None:
        ticker = asyncio.create_task(other_work())
        await follow_async(pump, done, poll=0.001)
        ticker.cancel()

    asyncio.run(main())
    assert events[:2] == ["pump", "done?"]
    assert events[-2:] == ["done?", "pump"]  # the last pump drains after done
    assert "tick" in events

"""stdout and stderr that never block the CLI and never raise: Ctrl-C always works.

`det-local run ... 2>&1 | head -3`: once ``head`` exits, every write raises BrokenPipeError;
with ``| sleep 1000`` (a full pipe) or a terminal stopped with Ctrl-S, every write blocks. The
CLI's event loop writes (trial output, "pausing..." from its signal handler), so either one
used to break it: an exception in the middle of handling a trial's exit left the experiment
STOPPING_PAUSED forever, or a blocked write kept the loop from ever running the second Ctrl-C.

`install` replaces ``sys.stdout`` and ``sys.stderr`` (when they are real descriptors) with
streams whose writes go to a queue; one thread per descriptor writes the queue out. So:

* a write never blocks longer than ``FULL_WAIT_S`` (once, when ``MAX_QUEUED`` bytes wait
  unread; after that, output is dropped, not waited for, until the reader catches up, and a
  line says how much was dropped);
* a closed reader (EPIPE) ends that stream silently: later writes are dropped;
* ``flush`` waits at most ``FLUSH_WAIT_S`` for what is queued to be written (so output stays in
  order with what child processes write to the same terminal), and at exit what is queued is
  written while the reader keeps reading (given up after ``EXIT_IDLE_S`` without progress).
"""

from __future__ import annotations

import atexit
import contextlib
import io
import os
import sys
import threading
import time
from collections import deque
from typing import Any, TextIO

MAX_QUEUED = 8 * 1024 * 1024  # bytes waiting for a slow reader before output is dropped
FULL_WAIT_S = 0.5  # how long one write may wait for room, once per overflow
FLUSH_WAIT_S = 0.05  # how long flush() waits for the queue to be written
EXIT_IDLE_S = 1.0  # at exit: give up when the reader took nothing for this long


class _Writer:
    """One descriptor's queue and the thread that writes it out."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.cond = threading.Condition()
        self.chunks: deque[bytes] = deque()
        self.queued = 0
        self.closed = False  # the reader went away (EPIPE) or the descriptor failed
        self.overflowing = False
        self.dropped = 0
        self.progress = time.monotonic()
        self.thread: threading.Thread | None = None
        # set at exit, once what was queued is written: the interpreter's last flush of
        # sys.stdout comes when the writer thread can no longer run (and may hold the lock)
        self.final = False

    def put(self, data: bytes) -> None:
        if not data or self.final:
            return
        with self.cond:
            if self.closed:
                return
            if self.overflowing and self.queued > MAX_QUEUED // 2:
                self.dropped += len(data)
                return
            if self.queued + len(data) > MAX_QUEUED:
                self.cond.wait_for(lambda: self.queued + len(data) <= MAX_QUEUED, FULL_WAIT_S)
                if self.queued + len(data) > MAX_QUEUED:
                    self.overflowing = True
                    self.dropped += len(data)
                    return
            if self.dropped:
                note = (
                    f"\n[det-local: {self.dropped} bytes of output dropped: the reader fell "
                    "behind]\n"
                )
                self.chunks.append(note.encode())
                self.queued += len(note)
                self.dropped = 0
            self.overflowing = False
            if not self.chunks:  # the reader's idle time counts from now
                self.progress = time.monotonic()
            self.chunks.append(data)
            self.queued += len(data)
            if self.thread is None:
                self.thread = threading.Thread(target=self._run, name=f"det-local-out-{self.fd}")
                self.thread.daemon = True
                self.thread.start()
            self.cond.notify_all()

    def after_fork(self) -> None:
        """In a forked child: no writer thread was inherited; start afresh (what the parent
        had queued is the parent's to write)."""
        self.cond = threading.Condition()
        self.chunks = deque()
        self.queued = 0
        self.thread = None

    def _run(self) -> None:
        while True:
            with self.cond:
                self.cond.wait_for(lambda: bool(self.chunks))
                data = self.chunks[0]
            try:
                n = os.write(self.fd, data)
            except InterruptedError:
                continue
            except OSError:  # EPIPE (the reader is gone), EBADF...: nothing more is written
                with self.cond:
                    self.closed = True
                    self.chunks.clear()
                    self.queued = 0
                    self.cond.notify_all()
                return
            with self.cond:
                self.progress = time.monotonic()
                if n >= len(data):
                    self.chunks.popleft()
                else:
                    self.chunks[0] = data[n:]
                self.queued -= n
                self.cond.notify_all()

    def drain(self, wait_s: float) -> None:
        if self.final:
            return
        with self.cond:
            if not self.overflowing:
                self.cond.wait_for(lambda: not self.chunks, wait_s)

    def drain_at_exit(self) -> None:
        with self.cond:
            while self.chunks and not self.closed:
                if time.monotonic() - self.progress > EXIT_IDLE_S:
                    return
                self.cond.wait(EXIT_IDLE_S / 4)


class _Bytes(io.RawIOBase):
    """``sys.stdout.buffer``: bytes into the same queue."""

    def __init__(self, writer: _Writer) -> None:
        super().__init__()
        self._w = writer

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        b = bytes(data)
        self._w.put(b)
        return len(b)

    def flush(self) -> None:
        self._w.drain(FLUSH_WAIT_S)

    def fileno(self) -> int:
        return self._w.fd

    def isatty(self) -> bool:
        return os.isatty(self._w.fd)


class GuardedStream(io.TextIOBase):
    """A text stream over a `_Writer`: never blocks long, never raises on a closed reader."""

    def __init__(self, original: TextIO, writer: _Writer) -> None:
        super().__init__()
        self._w = writer
        self._original = original
        self._encoding = getattr(original, "encoding", None) or "utf-8"
        self._errors = getattr(original, "errors", None) or "strict"
        self.buffer = _Bytes(writer)

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return self._encoding

    @property
    def errors(self) -> str:  # type: ignore[override]
        return self._errors

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        self._w.put(text.encode(self._encoding, "backslashreplace"))
        return len(text)

    def flush(self) -> None:
        self._w.drain(FLUSH_WAIT_S)

    def fileno(self) -> int:
        return self._w.fd

    def isatty(self) -> bool:
        return os.isatty(self._w.fd)


_installed: list[_Writer] = []


def install() -> None:
    """Guard ``sys.stdout`` and ``sys.stderr`` (once; streams without a descriptor, such as a
    test runner's captures, are left alone)."""
    if _installed:
        return
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        try:
            fd = stream.fileno()
            stream.flush()
        except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
            continue
        writer = _Writer(fd)
        _installed.append(writer)
        setattr(sys, name, GuardedStream(stream, writer))
    if _installed:
        atexit.register(_at_exit)
        os.register_at_fork(after_in_child=_after_fork)


def _after_fork() -> None:
    for writer in _installed:
        writer.after_fork()


def _at_exit() -> None:
    for writer in _installed:
        with contextlib.suppress(Exception):
            writer.drain_at_exit()
        writer.final = True

"""Checks at submission that run a command (``sbatch --test-only``, a stage_dir's ``test -w``
as the submitter) in a thread of their own, never on the engine's loop.

A check is keyed by what it asks (its command line); one under way, or ended less than
``FRESH_S`` ago, serves every submission that asks the same. On the engine's loop
(``errors.DEFER`` set) a submission that would wait for one raises ``errors.Pending``: the
spool server holds that owner's requests and applies them again when the check ends; the
one-request engines (embedded, offline) wait for it, bounded by the command's own timeout.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from det_local.errors import DEFER, Pending

FRESH_S = 10.0  # a check's answer serves the submissions that ask the same this long


class Check:
    """``work`` run in a thread: it returns a refusal (one line) or None (accepted, or the
    command did not answer: skipped, the run's own step says what is wrong)."""

    def __init__(self, work: Callable[[], str | None]) -> None:
        self.refusal: str | None = None
        self.ended_at: float | None = None  # monotonic, once it has ended
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[], None]] = []
        self._done = threading.Event()
        threading.Thread(target=self._run, args=(work,), name="submit-check", daemon=True).start()

    def _run(self, work: Callable[[], str | None]) -> None:
        try:
            self.refusal = work()
        except Exception:  # noqa: BLE001 - never leave a submission waiting for it
            self.refusal = None
        with self._lock:
            self.ended_at = time.monotonic()
            self._done.set()
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback()

    def on_ready(self, callback: Callable[[], None]) -> None:
        with self._lock:
            if not self._done.is_set():
                self._callbacks.append(callback)
                return
        callback()

    def wait(self) -> None:
        self._done.wait()


_checks: dict[tuple[str, ...], Check] = {}
_checks_lock = threading.Lock()


def check_of(key: tuple[str, ...], work: Callable[[], str | None]) -> Check:
    """The check of ``key`` under way, or ended less than FRESH_S ago; else a new one running
    ``work`` (the ones gone stale are forgotten at the same time)."""
    now = time.monotonic()
    with _checks_lock:
        for old_key, old in list(_checks.items()):
            if old.ended_at is not None and now - old.ended_at > FRESH_S:
                del _checks[old_key]
        check = _checks.get(key)
        if check is None:
            check = _checks[key] = Check(work)
        return check


def refusal(key: tuple[str, ...], work: Callable[[], str | None], what: str) -> str | None:
    """The refusal of the check ``key`` (None: none); on the engine's loop, Pending while it
    runs (``what`` names it)."""
    check = check_of(key, work)
    if check.ended_at is None:
        if DEFER.get():  # the engine's loop: never wait there; asked again once it has ended
            raise Pending(what, check.on_ready)
        check.wait()
    return check.refusal

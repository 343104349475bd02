"""The spool intake: requests in ``queue/*.req``, read, applied, answered, removed.

The engine serves the spool at start and whenever a request arrives (inotify, or watchfiles
where inotify is unavailable; a one-second sweep covers what a watch can miss), round-robin
across owners (`sched/intake/backlog.py`). Each request is applied by the dispatcher
(`sched/intake/dispatch.py`) and its answer recorded in the store in one transaction, so that a
replay
after a crash answers the same without applying twice; it is answered, and only then removed
(off the event loop). Requests over their owner's cap and unreadable ones are refused, logged
once per burst per user.

Reading a request (open, check, budgeted decode: `spool.read`) costs time in proportion to what
its writer put in it, up to its budget (wire/budget.py: SPOOL_REQUEST), so it is done off the
event loop: the loop takes a batch of requests in their serving order (at most SPOOL_BATCH), a
worker thread reads them (after SPOOL_BATCH_S seconds only the small ones, of owners none of
whose requests was left out: a user whose requests are costly to read waits for them, not the
users behind in the round), and the loop applies what was read, in that order, then takes the
next batch (the ones not read are put back first in their owners' turns). One batch is read at
a time, and an owner's requests are applied in their order.
"""

from __future__ import annotations

import asyncio
import functools
import os
import sqlite3
import time
from collections import deque
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, cast

from det_local.errors import DEFER, Pending
from det_local.sched.intake import spool
from det_local.sched.intake.backlog import Backlog, Bursts
from det_local.sched.intake.spool import Request, SpoolError
from det_local.sched.queue.jobqueue import JobQueue
from det_local.store.db import Store
from det_local.store.paths import Paths

SPOOL_RETRY_S = 1.0  # a request that could not be applied (full disk...) is tried again after
SPOOL_SWEEP_S = 1.0
SPOOL_BATCH = 32  # requests applied in one go before the event loop gets a turn ...
SPOOL_BATCH_S = 0.03  # ... or fewer, once they took this long (large or refused requests)
SPOOL_SMALL = 16 * 1024  # bytes: a request read past SPOOL_BATCH_S (a few ms at most)
SPOOL_PRUNE_S = 600.0  # answers older than an hour that nobody collected are removed
SPOOL_LOG_WINDOW_S = 10.0  # rejections from one user: one line, then a count every window
WATCH_DELAY_EMBEDDED_S = 0.3


class SpoolServer:
    def __init__(
        self,
        paths: Paths,
        store: Store,
        queue: JobQueue,
        apply: Callable[[Request], dict[str, Any]],
        *,
        note: Callable[..., None],
        out: Callable[[str], None],
        daemon: bool,
        closing: Callable[[], bool],
        tasks: list[asyncio.Future[None]],
    ) -> None:
        self.paths = paths
        self.store = store
        self.queue = queue  # its passes wait for a batch of requests to be committed
        self.apply = apply  # the dispatcher: a request's answer ({"value"} or {"error"})
        self.note = note
        self.out = out
        self.daemon = daemon  # the daemon watches at once; an embedded run a moment later
        self.closing = closing
        self._tasks = tasks  # the engine's background tasks (cancelled at its stop)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.watch_stop = asyncio.Event()
        self.backlog = Backlog(paths.queue, spool.SUFFIX)  # the pending requests, by owner
        self._retry_timer: asyncio.TimerHandle | None = None  # a retry of what could not apply
        self._failed: str | None = None  # the last failure logged (logged once)
        self._watch_close: Callable[[], None] | None = None  # stops the inotify watch
        self._removing: set[str] = set()  # answered requests whose files are being removed
        self._more_due = False  # the rest of a long backlog is due at the loop's next turn
        self._remover: Any = None  # the remover thread's work queue, once started
        self._answering: set[str] = set()  # refused requests whose answers are being written
        self._bursts: Bursts | None = None  # rejections logged once per burst
        self._burst_summary: Any = None
        self._burst_timer: asyncio.TimerHandle | None = None
        self._reading = False  # a batch is being read off the loop, or applied
        self._ready: deque[tuple[str, int, Request | SpoolError]] = deque()  # read, to apply
        self._inflight: set[str] = set()  # the names of the batch being read or applied
        self._stopped = False

    def stop(self) -> None:
        self._stopped = True  # a batch still being read is left in the spool (the next engine's)
        if self._watch_close is not None:
            self._watch_close()
            self._watch_close = None
        if self._burst_timer is not None:
            self._burst_timer.cancel()
            self._flush_log(force=True)  # the counts of rejections not logged yet
        # what the remover thread has not got to yet (refused requests not answered yet stay:
        # the next engine answers them)
        for name in list(self._removing - self._answering):
            try:
                spool.remove(self.paths.queue / name)
            except OSError:
                pass

    # ------------------------------------------------------------------ the watcher
    def start(self) -> None:
        self.serve()
        spool.prune_responses(self.paths)
        try:  # where requesters wait for answers (they watch it; they never create it)
            spool.responses_dir(self.paths).mkdir(parents=True, exist_ok=True)
        except OSError:
            pass  # a full disk...: requesters poll until the first answer creates it
        if not self._watch_inotify():
            # an embedded run starts watchfiles a moment later: importing it costs ~70 ms,
            # which a short run need not pay (the sweep covers that moment)
            watch = self._watch() if self.daemon else self._watch_later()
            self._tasks.append(asyncio.ensure_future(watch))
        self._tasks.append(asyncio.ensure_future(self._sweep()))

    def _watch_inotify(self) -> bool:
        """Wake on each request the moment it is renamed into the spool: an inotify descriptor
        in the event loop. False where inotify is unavailable (watchfiles then)."""
        from det_local.sched.intake import inotify

        assert self.loop is not None
        try:
            watch = inotify.Watch(self.paths.queue)
        except OSError:
            return False

        def on_event() -> None:
            names = [n for n in watch.drain() if not n or n.endswith(spool.SUFFIX)]
            if names:  # "" (the kernel's event queue overflowed): the directory is listed
                self.serve(names)

        def stop() -> None:
            assert self.loop is not None
            self.loop.remove_reader(watch.fd)
            watch.close()

        self.loop.add_reader(watch.fd, on_event)
        self._watch_close = stop
        return True

    async def _watch_later(self) -> None:
        await asyncio.sleep(WATCH_DELAY_EMBEDDED_S)
        await self._watch()

    async def _sweep(self) -> None:
        """A bounded safety tick: a request written before the watcher was watching (at start)
        would otherwise wait for the next filesystem event. One directory listing a second.
        Answers nobody collected (a flood's, a requester that went away) are pruned every
        SPOOL_PRUNE_S, off the event loop."""
        import time

        pruned = time.monotonic()
        while not self.watch_stop.is_set():
            await asyncio.sleep(SPOOL_SWEEP_S)
            if not self.backlog:  # a backlog being served is listed again once served
                self.serve()
            if time.monotonic() - pruned > SPOOL_PRUNE_S:
                pruned = time.monotonic()
                assert self.loop is not None
                await self.loop.run_in_executor(None, spool.prune_responses, self.paths)

    async def _watch(self) -> None:
        import watchfiles

        queue = str(self.paths.queue)
        try:
            async for changes in watchfiles.awatch(
                queue,
                recursive=False,
                debounce=0,
                step=5,  # ms between checks: ~200 wake-ups/s at most
                watch_filter=lambda _c, p: p.endswith(spool.SUFFIX),
                stop_event=self.watch_stop,
            ):
                self.serve([os.path.basename(p) for _c, p in changes])
        except asyncio.CancelledError:
            raise
        except Exception as err:  # the watcher broke: fall back to a bounded tick
            self.log_safely(f"watching {queue} failed ({err}); checking it every 0.5 s instead")
            while True:
                await asyncio.sleep(0.5)
                self.serve()

    def serve(self, names: Iterable[str] | None = None) -> None:
        """Serve the pending requests: round-robin across their owners, in name order within
        one owner (see `backlog`). `names`: the requests that just arrived (the watch's events);
        None (or a name "") lists the whole directory. A request that cannot be applied or
        answered for a reason outside it (a full disk, an I/O error) stays in the spool, and so
        do its owner's later ones (their order is kept): they are tried again shortly."""
        if self.closing():
            return  # an embedded engine about to stop: the next engine takes the requests
        # One scheduling pass after the batch, not one per request: each request is committed
        # and answered first, then the jobs it queued start (durable before acting still holds).
        with self.queue.deferred():
            self._process_pending(names)

    def _process_pending(self, names: Iterable[str] | None) -> None:
        backlog = self.backlog
        inflight, removing = self._inflight, self._removing

        def skip(name: str) -> bool:  # being read or applied; answered and being removed
            return name in inflight or name in removing

        if names is None:
            refused = backlog.refresh(skip)
        else:
            names = list(names)
            if "" in names:
                refused = backlog.refresh(skip)
            else:
                refused = backlog.add(n for n in names if not skip(n))
        if refused:
            self._refuse_over_cap(refused)
        if self._reading or self.loop is None:
            return  # the batch being read is applied first; the rest follows it
        batch: list[tuple[str, int]] = []
        while len(batch) < SPOOL_BATCH and (item := backlog.take()) is not None:
            batch.append(item)
        if not batch:
            self._failed = None
            return
        self._reading = True
        self._inflight.update(name for name, _ in batch)
        items = [(self.paths.queue / name, uid) for name, uid in batch]
        future = self.loop.run_in_executor(None, _read_batch, items)
        future.add_done_callback(lambda f: self._apply_batch(batch, f))

    def _apply_batch(
        self,
        batch: list[tuple[str, int]],
        future: asyncio.Future[list[Request | SpoolError | None]],
    ) -> None:
        """On the loop: what the worker read is applied in order (`_apply_ready`); what it did
        not get to is put back first in its owners' turns."""
        if self._stopped or self.closing() or future.cancelled():
            self._reading = False
            self._inflight.clear()
            return  # still in the spool: the next engine serves it
        err = future.exception()
        read: list[Request | SpoolError | None] = [None] * len(batch)
        if err is None:
            read = future.result()
        ready = []
        for (name, uid), r in zip(batch, read, strict=True):
            if r is None:  # not read this time (its owner's turn ended): first again next time
                self._inflight.discard(name)
                self.backlog.put_back(name, uid)
            else:
                ready.append((name, uid, r))
        if err is not None:  # could not even open the first (EIO...): tried again shortly
            self._reading = False
            self._failed_once(f"could not read request {batch[0][0]} ({type(err).__name__}: {err})")
            self._retry_later()
            return
        self._ready.extend(ready)
        self._apply_ready()

    def _apply_ready(self) -> None:
        """Apply the requests read, in order, for at most SPOOL_BATCH_S a turn of the loop; then
        the next batch is read."""
        if self._stopped or self.closing():
            self._ready.clear()
            self._inflight.clear()
            self._reading = False
            return
        until = time.monotonic() + SPOOL_BATCH_S
        with self.queue.deferred():
            while self._ready:
                if time.monotonic() > until:
                    assert self.loop is not None
                    self.loop.call_soon(self._apply_ready)  # the rest after one turn
                    return
                name, uid, read = self._ready.popleft()
                try:
                    self._process_request(self.paths.queue / name, uid, read)
                except Pending as wait:  # e.g. a Slurm pool's check, off the loop: again after it
                    self._hold(name, uid, wait)
                    continue
                except Exception as failure:
                    for later, later_uid, _ in [(name, uid, read), *self._ready]:
                        self._inflight.discard(later)
                        self.backlog.put_back(later, later_uid)
                    self._ready.clear()
                    self._reading = False
                    self._failed_once(
                        f"could not apply request {name} ({type(failure).__name__}: {failure})"
                    )
                    self._retry_later()
                    return
                self._inflight.discard(name)
            self._failed = None
            self._reading = False
            if self.backlog:
                self._more()  # the next batch after one turn of the event loop

    def _failed_once(self, why: str) -> None:
        if why != self._failed:  # once, not at every retry
            self._failed = why
            self.log_safely(
                f"{why}; it stays in {self.paths.queue} and is tried again every "
                f"{SPOOL_RETRY_S:.0f} s",
                level="ERROR",
            )

    def _refuse_over_cap(self, refused: list[tuple[str, int]]) -> None:
        """Answer requests over their owner's cap with a refusal (off the event loop), and
        log one line per burst of them."""
        backlog = self.backlog
        for name, uid in refused:
            user = spool.user_name(uid)
            message = (
                f"{backlog.pending_of(uid)} requests from {user} are pending, over the limit of "
                f"{backlog.cap}; request {name[: -len(spool.SUFFIX)]} was refused: wait for them "
                "to be answered, then submit it again"
            )
            self._log_burst(("cap", uid), f"refused request {name} from {user}: {message}")
            self._answer_and_remove(self.paths.queue / name, {"error": message})

    def _hold(self, name: str, uid: int, wait: Pending) -> None:
        """`uid`'s request `name` waits for something off the loop: it and the owner's later
        requests already read go back to the backlog (in order: its heaps are by name), the
        owner is held until `wait` ends, and the other owners are served meanwhile."""
        later = [item for item in self._ready if item[1] == uid]
        for held_name, held_uid in [(name, uid), *((n, u) for n, u, _ in later)]:
            self._inflight.discard(held_name)
            self.backlog.put_back(held_name, held_uid)
        if later:
            self._ready = deque(item for item in self._ready if item[1] != uid)
        self.backlog.held.add(uid)
        wait.on_ready(functools.partial(self._resume, uid))

    def _resume(self, uid: int) -> None:
        """What `uid`'s first request waited for has ended (called from any thread): serve
        it, and the owner's later ones, again."""
        loop = self.loop

        def resume() -> None:
            self.backlog.held.discard(uid)
            self.serve(())

        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(resume)
            except RuntimeError:  # the loop closed meanwhile: the next engine serves it
                pass

    def _more(self) -> None:
        if self._more_due or self.loop is None:
            return
        self._more_due = True

        def more() -> None:
            self._more_due = False
            self.serve(())

        self.loop.call_soon(more)

    def _retry_later(self) -> None:
        if self._retry_timer is not None or self.loop is None:
            return

        def again() -> None:
            self._retry_timer = None
            self.serve(())

        self._retry_timer = self.loop.call_later(SPOOL_RETRY_S, again)

    def log_safely(self, message: str, level: str = "WARNING") -> None:
        """note(), falling back to the daemon's log when the store cannot be written."""
        try:
            self.note(message, level=level)
        except Exception:
            try:
                self.out(f"det-local: {message}")
            except Exception:
                pass

    def _log_burst(self, key: tuple[str, int], line: str) -> None:
        """A rejection or refusal, logged (in the store and the daemon's log) once per burst
        from one user, then as a count (`backlog.Bursts`): a flood is not a write each."""
        bursts = self._bursts
        if bursts is None:

            def summary(key: object, count: int, secs: float, last: str) -> str:
                kind, uid = cast(tuple[str, int], key)
                what = "refused" if kind == "cap" else "rejected"
                return (
                    f"{what} {count} more requests from {spool.user_name(uid)} in the last "
                    f"{secs:.0f} s (the last: {last})"
                )

            bursts = self._bursts = Bursts(self.log_safely, window=SPOOL_LOG_WINDOW_S)
            self._burst_summary = summary
        if bursts.event(key, line) and self._burst_timer is None and self.loop is not None:
            self._burst_timer = self.loop.call_later(SPOOL_LOG_WINDOW_S, self._flush_log)

    def _flush_log(self, force: bool = False) -> None:
        self._burst_timer = None
        bursts = self._bursts
        if bursts is not None and bursts.flush(self._burst_summary, force) and not force:
            assert self.loop is not None
            self._burst_timer = self.loop.call_later(SPOOL_LOG_WINDOW_S, self._flush_log)

    def _process_request(self, path: Path, uid: int, read: Request | SpoolError) -> None:
        if isinstance(read, SpoolError):
            self._reject(path, uid, str(read))
            return
        req = read
        done = self.store.jobs.request_result(req.id)
        # applied before a crash: answer again from the store, do not apply twice
        if done is None:
            token = DEFER.set(True)  # a slow check raises Pending rather than wait here
            try:
                answer = self.apply_and_record(req)
            finally:
                DEFER.reset(token)
        else:
            answer = done
        # e.g. a full disk: OSError, and the request stays, to be answered later (from the store)
        spool.respond(self.paths, req.id, req.uid, answer)
        self._remove_request(path)

    def _remove_request(self, path: Path) -> None:
        """Remove an answered request's file off the event loop: an unlink waits for the
        filesystem (its journal, the directory's lock while the next request is being written)
        and the loop has processes to start. Until it is gone the engine skips its name; if
        the engine stops first, the next one answers it again from the store."""
        self._removing.add(path.name)
        self._work().put((path, None))

    def _answer_and_remove(self, path: Path, answer: dict[str, Any]) -> None:
        """Answer a request that is refused without being applied (nothing of it is kept), and
        remove it, both off the event loop. If the engine stops first, the next one sees it."""
        self._removing.add(path.name)
        self._answering.add(path.name)
        self._work().put((path, answer))

    def _work(self) -> Any:
        """The remover thread's work queue (started at the first use): (request path, answer
        to write first or None). Names done are handed back to the loop in batches."""
        import queue
        import threading

        if self._remover is not None:
            return self._remover
        work: queue.SimpleQueue[tuple[Path, dict[str, Any] | None]] = queue.SimpleQueue()
        loop = self.loop

        def done(names: list[str]) -> None:
            for name in names:
                self._removing.discard(name)
                self._answering.discard(name)

        def run() -> None:
            finished: list[str] = []
            while True:
                if finished and work.empty() or len(finished) >= 256:
                    if loop is not None and not loop.is_closed():
                        try:
                            loop.call_soon_threadsafe(done, finished)
                        except RuntimeError:  # the loop closed meanwhile
                            pass
                    finished = []
                path, answer = work.get()
                try:
                    if answer is not None and os.path.lexists(path):
                        req_id = path.name[: -len(spool.SUFFIX)]
                        spool.respond(self.paths, req_id, -1, answer)
                    spool.remove(path)
                except OSError:
                    pass  # still there: answered (again) once the engine lists it next
                finished.append(path.name)

        threading.Thread(target=run, name="spool-remover", daemon=True).start()
        self._remover = work
        return work

    def apply_and_record(self, req: Request) -> dict[str, Any]:
        """Apply the request and record its answer in one transaction: after a crash it is
        either applied and answered from the store, or not applied at all (and still in the
        spool). Scheduling passes wait for the commit, so no process starts for a change that
        could still be rolled back."""
        conn = self.store.conn
        # passes asked for meanwhile only note that one is due: it runs after the commit
        with self.queue.deferred(on_error=False):
            nested = conn.in_transaction
            conn.execute("SAVEPOINT request")
            try:
                answer = self.apply(req)
                self.store.jobs.record_request(req.id, answer)
                conn.execute("RELEASE request")
            except BaseException:
                # the job table's in-memory copy may hold changes undone here (or by SQLite
                # itself, when no transaction is left): it is read again from the store when
                # next needed
                self.store.jobs.reload()
                if conn.in_transaction:
                    try:
                        conn.execute("ROLLBACK TO request")
                        conn.execute("RELEASE request")  # commits nothing, yet can fail (full disk)
                    except sqlite3.Error:
                        pass
                    if conn.in_transaction and not nested:
                        # never leave it open: later requests would nest in it and never commit
                        conn.execute("ROLLBACK")
                raise
        return answer

    def _reject(self, path: Path, uid: int, message: str) -> None:
        """A request that cannot be read: answer the file's owner, keep nothing (not even a
        log line per request: one per burst from one user)."""
        if "vanished before it was read" in message:
            return  # withdrawn by its owner: nobody waits for an answer
        user = spool.user_name(uid)
        self._log_burst(("reject", uid), f"rejected request {path.name} from {user}: {message}")
        self._answer_and_remove(path, {"error": message})


def _read_batch(items: list[tuple[Path, int]]) -> list[Request | SpoolError | None]:
    """In a worker thread: each request read (or why not; None: not read this time), by
    position in the batch. Small requests (at most SPOOL_SMALL bytes: cheap to read) first,
    each owner's up to its first large one; then the large ones in the batch's order until
    SPOOL_BATCH_S seconds have gone (one at least): a user whose requests are costly to read
    waits for them, not the users behind in the round. An owner's requests are read in their
    order, and one not read leaves that owner's later ones for the next batch. An OSError other
    than what `spool.read` answers does the same (when nothing could be read: raised, and the
    loop tries again a moment later)."""
    out: list[Request | SpoolError | None] = [None] * len(items)
    until = time.monotonic() + SPOOL_BATCH_S
    stopped: set[int] = set()  # owners whose next request is large (pass 1) or not read
    done = 0
    failed: list[OSError] = []

    def read(i: int, path: Path, uid: int) -> None:
        nonlocal done
        try:
            out[i] = spool.read(path)
        except SpoolError as err:
            out[i] = err
        except OSError as err:
            failed.append(err)
            stopped.add(uid)
            return
        done += 1

    large: list[int] = []
    for i, (path, uid) in enumerate(items):  # pass 1: the small ones
        if uid in stopped:
            continue
        if _small(path):
            read(i, path, uid)
        else:
            stopped.add(uid)
            large.append(i)
    for i in large:  # pass 2: the large ones, each owner's first, while there is time
        path, uid = items[i]
        if done and time.monotonic() > until:
            break
        read(i, path, uid)
    if not done and failed:
        raise failed[0]
    return out


def _small(path: Path) -> bool:
    try:
        return os.lstat(path).st_size <= SPOOL_SMALL
    except OSError:
        return True  # gone: reading it says so at once

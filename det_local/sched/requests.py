# mypy: disable-error-code="misc"
# (the mixin methods annotate `self: Engine`; mypy checks them against the whole engine)
"""Spool requests inside the engine: one handler per operation, with ownership checks.

The engine reads `queue/*.req` at start and whenever a request arrives (inotify, or
watchfiles where inotify is unavailable), in name order. Each request is applied, its result
recorded in the store (so a replay after a crash answers the same without applying twice),
answered, and only then removed.
"""

from __future__ import annotations

import asyncio
import grp
import os
import pwd
import sqlite3
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from det_local.errors import DetLocalError
from det_local.sched import spool, unmanaged
from det_local.sched.backlog import Backlog, Bursts
from det_local.sched.spool import Request, SpoolError

if TYPE_CHECKING:
    from det_local.sched.engine import Engine

SPOOL_RETRY_S = 1.0  # a request that could not be applied (full disk...) is tried again after


SPOOL_SWEEP_S = 1.0
SPOOL_BATCH = 32  # requests applied in one go before the event loop gets a turn
SPOOL_PRUNE_S = 600.0  # answers older than an hour that nobody collected are removed
SPOOL_LOG_WINDOW_S = 10.0  # rejections from one user: one line, then a count every window
WATCH_DELAY_EMBEDDED_S = 0.3


class PermissionDenied(DetLocalError):
    pass


def _transient(err: BaseException) -> bool:
    """An error of the machine, not of the request (a full disk, a locked database): trying
    the request again later can succeed."""
    import errno

    if isinstance(err, sqlite3.OperationalError):
        return True
    return isinstance(err, OSError) and err.errno in (
        errno.ENOSPC,
        errno.EDQUOT,
        errno.EIO,
        errno.ENOMEM,
        errno.EMFILE,
        errno.ENFILE,
    )


def _uid_of(user: str) -> int | None:
    try:
        return pwd.getpwnam(user).pw_uid
    except KeyError:
        return None


class RequestsMixin:
    _spool_retry: asyncio.TimerHandle | None  # a retry of requests that could not be applied
    _spool_failed: str | None
    _spool_watch_close: Callable[[], None] | None  # stops the inotify watch of the spool
    _spool_removing: set[str]  # answered requests whose files are being removed
    _spool_more_due: bool  # the rest of a long backlog is due at the loop's next turn
    _spool_remover: Any  # the remover thread's work queue, once started
    _spool_answering: set[str]  # refused requests whose answers are being written
    _spool_backlog: Backlog  # the pending requests, by owner
    _spool_bursts: Bursts | None  # rejections logged once per burst
    _spool_burst_summary: Any
    _spool_burst_timer: asyncio.TimerHandle | None

    # ------------------------------------------------------------------ the watcher
    def _start_spool(self: Engine) -> None:
        self.process_spool()
        spool.prune_responses(self.paths)
        try:  # where requesters wait for answers (they watch it; they never create it)
            spool.responses_dir(self.paths).mkdir(parents=True, exist_ok=True)
        except OSError:
            pass  # a full disk...: requesters poll until the first answer creates it
        if not self._watch_spool_inotify():
            # an embedded run starts watchfiles a moment later: importing it costs ~70 ms,
            # which a short run need not pay (the sweep covers that moment)
            watch = self._watch_spool() if self.daemon else self._watch_spool_later()
            self._tasks.append(asyncio.ensure_future(watch))
        self._tasks.append(asyncio.ensure_future(self._sweep_spool()))

    def _watch_spool_inotify(self: Engine) -> bool:
        """Wake on each request the moment it is renamed into the spool: an inotify descriptor
        in the event loop. False where inotify is unavailable (watchfiles then)."""
        from det_local.sched import inotify

        assert self.loop is not None
        try:
            watch = inotify.Watch(self.paths.queue)
        except OSError:
            return False

        def on_event() -> None:
            names = [n for n in watch.drain() if not n or n.endswith(spool.SUFFIX)]
            if names:  # "" (the kernel's event queue overflowed): the directory is listed
                self.process_spool(names)

        def stop() -> None:
            assert self.loop is not None
            self.loop.remove_reader(watch.fd)
            watch.close()

        self.loop.add_reader(watch.fd, on_event)
        self._spool_watch_close = stop
        return True

    async def _watch_spool_later(self: Engine) -> None:
        await asyncio.sleep(WATCH_DELAY_EMBEDDED_S)
        await self._watch_spool()

    async def _sweep_spool(self: Engine) -> None:
        """A bounded safety tick: a request written before the watcher was watching (at start)
        would otherwise wait for the next filesystem event. One directory listing a second.
        Answers nobody collected (a flood's, a requester that went away) are pruned every
        SPOOL_PRUNE_S, off the event loop."""
        import time

        pruned = time.monotonic()
        while not self._watch_stop.is_set():
            await asyncio.sleep(SPOOL_SWEEP_S)
            if not self._spool_backlog:  # a backlog being served is listed again once served
                self.process_spool()
            if time.monotonic() - pruned > SPOOL_PRUNE_S:
                pruned = time.monotonic()
                assert self.loop is not None
                await self.loop.run_in_executor(None, spool.prune_responses, self.paths)

    async def _watch_spool(self: Engine) -> None:
        import watchfiles

        queue = str(self.paths.queue)
        try:
            async for changes in watchfiles.awatch(
                queue,
                recursive=False,
                debounce=0,
                step=5,  # ms between checks: ~200 wake-ups/s at most
                watch_filter=lambda _c, p: p.endswith(spool.SUFFIX),
                stop_event=self._watch_stop,
            ):
                self.process_spool([os.path.basename(p) for _c, p in changes])
        except asyncio.CancelledError:
            raise
        except Exception as err:  # the watcher broke: fall back to a bounded tick
            self._log_safely(f"watching {queue} failed ({err}); checking it every 0.5 s instead")
            while True:
                await asyncio.sleep(0.5)
                self.process_spool()

    def process_spool(self: Engine, names: Iterable[str] | None = None) -> None:
        """Serve the pending requests: round-robin across their owners, in name order within
        one owner (see `backlog`). `names`: the requests that just arrived (the watch's events);
        None (or a name "") lists the whole directory. A request that cannot be applied or
        answered for a reason outside it (a full disk, an I/O error) stays in the spool, and so
        do its owner's later ones (their order is kept): they are tried again shortly."""
        if self.closing:
            return  # an embedded engine about to stop: the next engine takes the requests
        # One scheduling pass after the batch, not one per request: each request is committed
        # and answered first, then the jobs it queued start (durable before acting still holds).
        batch = not self._scheduling
        if batch:
            self._scheduling = True
            self._schedule_again = False
        try:
            self._process_pending(names)
        finally:
            if batch:
                self._scheduling = False
                if self._schedule_again:
                    self._schedule()

    def _process_pending(self: Engine, names: Iterable[str] | None) -> None:
        backlog = self._spool_backlog
        skip = self._spool_removing.__contains__  # answered; their files are being removed
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
        taken = 0
        while True:
            if taken == SPOOL_BATCH:
                # the rest after one turn of the event loop: jobs that ended meanwhile are
                # reaped and their slots handed on, and requests that arrived meanwhile join
                # the round, while a long backlog is being answered
                self._spool_more()
                return
            item = backlog.take()
            if item is None:
                break
            name, uid = item
            taken += 1
            path = self.paths.queue / name
            try:
                self._process_request(path, uid)
            except Exception as err:
                backlog.put_back(name, uid)
                why = f"could not apply request {name} ({type(err).__name__}: {err})"
                if why != self._spool_failed:  # once, not at every retry
                    self._spool_failed = why
                    self._log_safely(
                        f"{why}; it stays in {self.paths.queue} and is tried again every "
                        f"{SPOOL_RETRY_S:.0f} s",
                        level="ERROR",
                    )
                self._retry_spool()
                return
        self._spool_failed = None

    def _refuse_over_cap(self: Engine, refused: list[tuple[str, int]]) -> None:
        """Answer requests over their owner's cap with a refusal (off the event loop), and
        log one line per burst of them."""
        backlog = self._spool_backlog
        for name, uid in refused:
            user = spool.user_name(uid)
            message = (
                f"{backlog.pending_of(uid)} requests from {user} are pending, over the limit of "
                f"{backlog.cap}; request {name[: -len(spool.SUFFIX)]} was refused: wait for them "
                "to be answered, then submit it again"
            )
            self._spool_log(("cap", uid), f"refused request {name} from {user}: {message}")
            self._answer_and_remove(self.paths.queue / name, {"error": message})

    def _spool_more(self: Engine) -> None:
        if self._spool_more_due or self.loop is None:
            return
        self._spool_more_due = True

        def more() -> None:
            self._spool_more_due = False
            self.process_spool(())

        self.loop.call_soon(more)

    def _retry_spool(self: Engine) -> None:
        if self._spool_retry is not None or self.loop is None:
            return

        def again() -> None:
            self._spool_retry = None
            self.process_spool(())

        self._spool_retry = self.loop.call_later(SPOOL_RETRY_S, again)

    def _log_safely(self: Engine, message: str, level: str = "WARNING") -> None:
        """note(), falling back to the daemon's log when the store cannot be written."""
        try:
            self.note(message, level=level)
        except Exception:
            try:
                self._out(f"det-local: {message}")
            except Exception:
                pass

    def _spool_log(self: Engine, key: tuple[str, int], line: str) -> None:
        """A rejection or refusal, logged (in the store and the daemon's log) once per burst
        from one user, then as a count (`backlog.Bursts`): a flood is not a write each."""
        bursts = self._spool_bursts
        if bursts is None:

            def summary(key: object, count: int, secs: float, last: str) -> str:
                kind, uid = cast(tuple[str, int], key)
                what = "refused" if kind == "cap" else "rejected"
                return (
                    f"{what} {count} more requests from {spool.user_name(uid)} in the last "
                    f"{secs:.0f} s (the last: {last})"
                )

            bursts = self._spool_bursts = Bursts(self._log_safely, window=SPOOL_LOG_WINDOW_S)
            self._spool_burst_summary = summary
        if bursts.event(key, line) and self._spool_burst_timer is None and self.loop is not None:
            self._spool_burst_timer = self.loop.call_later(
                SPOOL_LOG_WINDOW_S, self._flush_spool_log
            )

    def _flush_spool_log(self: Engine, force: bool = False) -> None:
        self._spool_burst_timer = None
        bursts = self._spool_bursts
        if bursts is not None and bursts.flush(self._spool_burst_summary, force) and not force:
            assert self.loop is not None
            self._spool_burst_timer = self.loop.call_later(
                SPOOL_LOG_WINDOW_S, self._flush_spool_log
            )

    def _process_request(self: Engine, path: Path, uid: int) -> None:
        try:
            req = spool.read(path)
        except SpoolError as err:
            self._reject(path, uid, str(err))
            return
        done = self.store.jobs.request_result(req.id)
        # applied before a crash: answer again from the store, do not apply twice
        answer = self._apply_and_record(req) if done is None else done
        # e.g. a full disk: OSError, and the request stays, to be answered later (from the store)
        spool.respond(self.paths, req.id, req.uid, answer)
        self._remove_request(path)

    def _remove_request(self: Engine, path: Path) -> None:
        """Remove an answered request's file off the event loop: an unlink waits for the
        filesystem (its journal, the directory's lock while the next request is being written)
        and the loop has processes to start. Until it is gone the engine skips its name; if
        the engine stops first, the next one answers it again from the store."""
        self._spool_removing.add(path.name)
        self._spool_work().put((path, None))

    def _answer_and_remove(self: Engine, path: Path, answer: dict[str, Any]) -> None:
        """Answer a request that is refused without being applied (nothing of it is kept), and
        remove it, both off the event loop. If the engine stops first, the next one sees it."""
        self._spool_removing.add(path.name)
        self._spool_answering.add(path.name)
        self._spool_work().put((path, answer))

    def _spool_work(self: Engine) -> Any:
        """The remover thread's work queue (started at the first use): (request path, answer
        to write first or None). Names done are handed back to the loop in batches."""
        import queue
        import threading

        if self._spool_remover is not None:
            return self._spool_remover
        work: queue.SimpleQueue[tuple[Path, dict[str, Any] | None]] = queue.SimpleQueue()
        loop = self.loop

        def done(names: list[str]) -> None:
            for name in names:
                self._spool_removing.discard(name)
                self._spool_answering.discard(name)

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
        self._spool_remover = work
        return work

    def _apply_and_record(self: Engine, req: Request) -> dict[str, Any]:
        """Apply the request and record its answer in one transaction: after a crash it is
        either applied and answered from the store, or not applied at all (and still in the
        spool). Scheduling passes wait for the commit, so no process starts for a change that
        could still be rolled back."""
        conn = self.store.conn
        deferring = not self._scheduling
        if deferring:
            self._scheduling = True  # _schedule() only notes that a pass is due
            self._schedule_again = False
        nested = conn.in_transaction
        conn.execute("SAVEPOINT request")
        try:
            answer = self._apply_request(req)
            self.store.jobs.record_request(req.id, answer)
            conn.execute("RELEASE request")
        except BaseException:
            # the job table's in-memory copy may hold changes undone here (or by SQLite itself,
            # when no transaction is left): it is read again from the store when next needed
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
        finally:
            if deferring:
                self._scheduling = False
        if deferring and self._schedule_again:
            self._schedule()
        return answer

    def _reject(self: Engine, path: Path, uid: int, message: str) -> None:
        """A request that cannot be read: answer the file's owner, keep nothing (not even a
        log line per request: one per burst from one user)."""
        if "vanished before it was read" in message:
            return  # withdrawn by its owner: nobody waits for an answer
        user = spool.user_name(uid)
        self._spool_log(("reject", uid), f"rejected request {path.name} from {user}: {message}")
        self._answer_and_remove(path, {"error": message})

    def _apply_request(self: Engine, req: Request) -> dict[str, Any]:
        handler = self._handlers().get(req.op)
        if handler is None:
            return {"error": f"unknown request '{req.op}' in {req.path.name}"}
        try:
            return {"value": handler(req)}
        except DetLocalError as err:
            return {"error": str(err)}
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            return {"error": f"request {req.path.name} ({req.op}) is malformed: {err!r}"}
        except Exception as err:
            if _transient(err):
                raise  # a full disk...: the request stays in the spool and is tried again
            return {"error": f"request {req.path.name} ({req.op}) failed: {err!r}"}

    def _handlers(self: Engine) -> dict[str, Callable[[Request], Any]]:
        return {
            "submit": self._req_submit,
            "pause": lambda r: self.pause(self._own_experiment(r)),
            "activate": lambda r: self.activate(self._own_experiment(r)),
            "kill": lambda r: self.kill(self._own_experiment(r)),
            "label_add": lambda r: self.set_labels(
                self._own_experiment(r), str(r.payload["label"]), None
            ),
            "label_remove": lambda r: self.set_labels(
                self._own_experiment(r), None, str(r.payload["label"])
            ),
            "set_priority": lambda r: self.set_experiment_priority(
                self._own_experiment(r), int(r.payload["priority"])
            ),
            "job_update": self._req_job_update,
            "job_update_batch": self._req_job_update_batch,
            "cmd_run": self._req_cmd_run,
            "cmd_kill": lambda r: self.kill_job(self._own_job(r, int(r.payload["job_id"]))),
            "daemon_stop": self._req_daemon_stop,
            unmanaged.OP: lambda r: unmanaged.start(self, r.payload, user=r.user, uid=r.uid),
        }

    # ------------------------------------------------------------------ ownership
    def _may_change(self: Engine, req: Request, owner: str) -> bool:
        if req.uid in (0, os.geteuid()) or req.user == owner:
            return True
        try:
            group = grp.getgrnam(self.settings.admin_group)
        except KeyError:
            return False
        if req.user in group.gr_mem:
            return True
        try:
            return pwd.getpwnam(req.user).pw_gid == group.gr_gid
        except KeyError:
            return False

    def _authorize(self: Engine, req: Request, owner: str, what: str) -> None:
        if not self._may_change(req, owner):
            raise PermissionDenied(
                f"permission denied: {what} belongs to {owner}; only its owner or a member of "
                f"the {self.settings.admin_group} group may change it"
            )

    def _own_experiment(self: Engine, req: Request) -> int:
        exp_id = int(req.payload["experiment_id"])
        rec = self.store.get_experiment(exp_id)
        self._authorize(req, rec.user, f"experiment {exp_id}")
        return exp_id

    def _own_job(self: Engine, req: Request, job_id: int) -> int:
        job = self.store.jobs.get(job_id)
        self._authorize(req, job.user, f"job {job_id}")
        return job_id

    # ------------------------------------------------------------------ handlers
    def _req_submit(self: Engine, req: Request) -> int:
        from det_local.config import parse_config
        from det_local.config.limits import check_config_value

        p = req.payload
        source = str(p.get("source", "<config>"))
        check_config_value(p["config"], source)  # its size and nesting, before it is walked
        umask = self._umask_of(req)
        cfg = parse_config(p["config"], source=source)
        return self.submit(
            cfg,
            Path(p["context"]),
            source,
            test_mode=bool(p.get("test_mode")),
            user=req.user,
            uid=req.uid,
            env={str(k): str(v) for k, v in (p.get("env") or {}).items()},
            umask=umask,
        )

    def _umask_of(self: Engine, req: Request) -> int:
        """The submitter's umask sent with a submission (user input: checked; absent, from an
        older client: 0o022)."""
        from det_local.sched.userfiles import BadUmask, check_umask

        try:
            return check_umask(req.payload.get("umask"))
        except BadUmask as err:
            self._log_safely(f"refused request {req.path.name} of {req.user}: {err}")
            raise

    def _req_job_update(self: Engine, req: Request) -> str:
        p = req.payload
        job_id = self._own_job(req, int(p["job_id"]))
        return self.update_job(
            job_id,
            priority=p.get("priority"),
            ahead_of=p.get("ahead_of"),
            behind_of=p.get("behind_of"),
        )

    def _req_job_update_batch(self: Engine, req: Request) -> list[str]:
        updates = req.payload["updates"]
        for u in updates:  # check every one before changing any
            self._own_job(req, int(u["job_id"]))
        return [
            self.update_job(
                int(u["job_id"]),
                priority=u.get("priority"),
                ahead_of=u.get("ahead_of"),
                behind_of=u.get("behind_of"),
            )
            for u in updates
        ]

    def _req_cmd_run(self: Engine, req: Request) -> int:
        p = req.payload
        argv = [str(a) for a in p["argv"]]
        env = {str(k): str(v) for k, v in (p.get("env") or {}).items()}
        return self.submit_command(
            argv=argv,
            cwd=str(p["cwd"]),
            env=env,
            slots=int(p.get("slots", 1)),
            priority=int(p.get("priority", 42)),
            user=req.user,
            uid=req.uid,
            name=p.get("name"),
            kind=str(p.get("kind", "COMMAND")),
            umask=self._umask_of(req),
        )

    def _req_daemon_stop(self: Engine, req: Request) -> str:
        if req.uid not in (0, os.geteuid()):
            raise PermissionDenied("permission denied: only root or the daemon's user may stop it")
        self.request_stop()
        return "det-local daemon stopping; running jobs keep running and are adopted at restart"

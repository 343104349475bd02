"""`det-local run` (and `cmd run -f`) with no daemon: an engine in this process for the life
of the run.

If an engine already runs on this DET_LOCAL_HOME (another `det-local run`, or the daemon), the
experiment (command) is submitted to it instead, and this process only follows its output.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from det_local.client.follow import Follower, log_ends, summary
from det_local.errors import DetLocalError
from det_local.sched.enginelock import EngineLock
from det_local.sched.run.launchplan import allowed_submitter_vars
from det_local.store.paths import Paths
from det_local.store.states import State

if TYPE_CHECKING:
    from det_local.config.experiment import ExperimentConfig

EXIT_CODES = {State.COMPLETED: 0, State.ERROR: 1, State.CANCELED: 2, State.PAUSED: 3}


Finish = Callable[[Any, int, float], tuple[str, int]]


def summarize(store: Any, exp_id: int, elapsed: float) -> tuple[str, int]:
    """The default end of a run: the summary, and the exit code for the final state."""
    code = EXIT_CODES.get(store.get_experiment(exp_id).state, 1)
    return summary(store, exp_id, elapsed), code


def test_report(paths: Paths) -> Finish:
    def finish(store: Any, exp_id: int, elapsed: float) -> tuple[str, int]:
        from det_local.client.testmode import build_report

        report = build_report(store, paths, exp_id)
        return report.format(), 0 if report.passed else 1

    return finish


def run_experiment(
    paths: Paths,
    config_path: Path,
    context_dir: Path,
    *,
    follow: bool = True,
    quiet: bool = False,
    test_mode: bool = False,
    finish: Finish | None = None,
    anywhere: bool = False,
    overrides: dict[str, Any] | None = None,
) -> int:
    """``overrides``: `--config` edits laid over the file's config before it is checked."""
    from det_local.config.overrides import load_edited

    cfg = load_edited(config_path, overrides or {})
    return run_config(
        paths,
        cfg,
        context_dir,
        f"{config_path} with the --config edits" if overrides else str(config_path),
        follow=follow,
        quiet=quiet,
        test_mode=test_mode,
        finish=finish,
        anywhere=anywhere,
    )


def run_config(
    paths: Paths,
    cfg: ExperimentConfig,
    context_dir: Path,
    source: str,
    *,
    follow: bool = True,
    quiet: bool = False,
    test_mode: bool = False,
    finish: Finish | None = None,
    anywhere: bool = False,
) -> int:
    """`run_experiment` of a config already parsed (`experiment fork`'s: another
    experiment's, edited); `source` names it in messages."""
    for line in cfg.warnings:  # one line each, before anything runs
        print(f"warning: {line}", file=sys.stderr)
    if anywhere:  # --anywhere: as resources.federate: true
        import dataclasses

        cfg = dataclasses.replace(cfg, resources=dataclasses.replace(cfg.resources, federate=True))
    context_dir = context_dir.resolve()

    # what trials take from this environment (PATH, LANG...): as a daemon would take it
    env = allowed_submitter_vars(os.environ)

    def act(engine: Any) -> int:
        return int(engine.submit(cfg, context_dir, source, test_mode=test_mode, env=env))

    def remote(p: Paths) -> int:
        from det_local.client.requester import remote_request
        from det_local.sched.run.userfiles import current_umask

        payload = {
            "config": cfg.to_dict(),
            "context": str(context_dir),
            "source": source,
            "test_mode": test_mode,
            "env": env,
            "umask": current_umask(),  # its trials run with this umask, as if run here
        }
        return int(remote_request(p, "submit", payload))

    if finish is None:
        finish = test_report(paths) if test_mode else summarize
    return drive(paths, act, remote, follow=follow, quiet=quiet, announce=True, finish=finish)


def drive(
    paths: Paths,
    act: Callable[[Any], int],
    remote: Callable[[Paths], int],
    *,
    follow: bool,
    quiet: bool = False,
    announce: bool = False,
    finish: Finish = summarize,
    resume: int | None = None,
) -> int:
    """Run `act(engine)` in an embedded engine (or `remote(paths)` against a live one), then
    follow the experiment it names until it stops; returns the exit code for its final state.

    resume: the id of the experiment `act` resumes (`experiment activate`): the output its
    trials wrote before is not shown again."""
    from det_local.client.requester import retrying

    offsets: dict[int, int] = {}

    def attempt() -> tuple[EngineLock | None, int | None]:
        lock = EngineLock(paths)
        if lock.try_acquire():
            return lock, None
        lock.release()
        if resume is not None:
            offsets.update(_log_ends(paths, resume))
        return None, remote(paths)

    # An engine that is stopping refuses new work (EngineGone): wait until it is gone, then
    # run the request in an engine here.
    lock, exp_id = retrying(paths, attempt)
    if lock is None:
        assert exp_id is not None
        if announce:
            print(f"Created experiment {exp_id}", flush=True)
        if not follow:
            return 0
        return _follow_remote(paths, exp_id, quiet, finish, offsets)
    if not follow:
        lock.release()
        raise DetLocalError(
            "--detach hands the experiment to a running det-local engine (another `det-local "
            f"run` on {paths.home}), and none is running; run without --detach"
        )
    try:
        return asyncio.run(_embedded(paths, act, quiet, announce, finish, resume))
    finally:
        lock.release()


async def _embedded(
    paths: Paths,
    act: Callable[[Any], int],
    quiet: bool,
    announce: bool,
    finish: Finish,
    resume: int | None = None,
) -> int:
    from det_local.sched.engine import Engine

    engine = Engine(paths)
    await engine.start()
    started = time.time()
    try:
        # before act: a resumed trial may write at once
        offsets = log_ends(engine.store, paths, resume) if resume is not None else {}
        exp_id = act(engine)
        if announce:
            print(f"Created experiment {exp_id}", flush=True)
        install_interrupt(engine)
        follower = Follower(engine.store, paths, exp_id, sys.stdout if not quiet else None, offsets)
        task = asyncio.create_task(follower.run(poll=0.05))
        await engine.wait_idle()
        follower.stop()
        await task
        text, code = finish(engine.store, exp_id, time.time() - started)
        if text:
            print(text, flush=True)
        return code
    finally:
        await engine.stop()


def _log_ends(paths: Paths, exp_id: int) -> dict[int, int]:
    from det_local.store.db import Store

    store = Store(paths.db, readonly=True)
    try:
        return log_ends(store, paths, exp_id)
    finally:
        store.close()


def _follow_remote(
    paths: Paths, exp_id: int, quiet: bool, finish: Finish, offsets: dict[int, int] | None = None
) -> int:
    from det_local.store.db import Store

    store = Store(paths.db, readonly=True)
    follower = Follower(store, paths, exp_id, sys.stdout if not quiet else None, offsets)
    started = time.time()

    async def go() -> None:
        await follower.run(poll=0.1, until_stopped=True)

    try:
        asyncio.run(go())
    except KeyboardInterrupt:
        print(
            f"\nstopped following; experiment {exp_id} goes on "
            f"(`det-local experiment pause {exp_id}` to pause it)",
            file=sys.stderr,
        )
        return 0
    _wait_for_checkpoint_gc(store, exp_id)
    text, code = finish(store, exp_id, time.time() - started)
    if text:
        print(text, flush=True)
    return code


def _wait_for_checkpoint_gc(store: Any, exp_id: int, timeout: float = 10.0) -> None:
    """The engine collects an ended experiment's checkpoints just after recording its end:
    wait (bounded) for that, so that the summary shows the checkpoints that are left."""
    import sqlite3

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if not store.checkpoint_gc_due(exp_id):
                return
        except sqlite3.Error:  # a database from before checkpoint GC
            return
        time.sleep(0.05)


# ---------------------------------------------------------------------------- commands
def run_command(paths: Paths, payload: dict[str, Any]) -> int:
    """`det-local cmd run -f`: queue the command and stream its output until it ends; returns
    its exit status. With no engine running, one runs in this process until the command (and
    whatever else it took on, like `det-local run`) is done."""
    from det_local.client.follow import follow_command
    from det_local.client.requester import remote_request, retrying

    def attempt() -> tuple[EngineLock | None, int | None]:
        lock = EngineLock(paths)
        if lock.try_acquire():
            return lock, None
        lock.release()
        return None, int(remote_request(paths, "cmd_run", payload))

    lock, job_id = retrying(paths, attempt)
    if lock is None:
        assert job_id is not None
        print(f"Queued command {job_id}", flush=True)
        return follow_command(paths, job_id)
    try:
        return asyncio.run(_embedded_command(paths, payload))
    finally:
        lock.release()


async def _embedded_command(paths: Paths, payload: dict[str, Any]) -> int:
    from det_local.client.follow import command_exit_status
    from det_local.sched.engine import Engine
    from det_local.sched.intake.spool import Request, user_name
    from det_local.store.logtail import LogTail
    from det_local.store.tables.jobs import ENDED

    engine = Engine(paths)
    await engine.start()
    try:
        uid = os.geteuid()
        req = Request("embedded", "cmd_run", user_name(uid), uid, payload, paths.queue / "embedded")
        answer = engine.apply_request(req)  # the checks and the errors a daemon gives
        if answer.get("error"):
            raise DetLocalError(str(answer["error"]))
        job_id = int(answer["value"])
        print(f"Queued command {job_id}", flush=True)
        leaving = _command_interrupt(engine, job_id)
        tail = LogTail(paths.command_log(job_id), lines=False)
        idle = asyncio.ensure_future(engine.wait_idle())
        try:
            while not idle.done():
                tail.pump(_to_stdout)
                if leaving() and engine.store.jobs.peek(job_id).state in ENDED and not engine.runs:
                    # interrupted: its command is gone; other jobs this engine started keep
                    # running and are adopted by the next engine, queued ones wait for it
                    engine.stop_taking_work()
                    break
                await asyncio.sleep(0.05)  # a bounded tick, as `det-local run` follows a trial
        finally:
            idle.cancel()
        tail.pump(_to_stdout)
        return command_exit_status(engine.store.jobs.get(job_id))
    finally:
        await engine.stop()


def _to_stdout(data: bytes) -> None:
    """A command's output as it is (it need not be text, nor end its lines)."""
    raw = getattr(sys.stdout, "buffer", None)
    if raw is not None:
        raw.write(data)
        raw.flush()
    else:  # a text-only stdout (an embedding program's)
        sys.stdout.write(data.decode("utf-8", "replace"))
        sys.stdout.flush()


def _command_interrupt(engine: Any, job_id: int) -> Callable[[], bool]:
    """Ctrl-C (or SIGTERM) while an embedded engine runs `cmd run -f`: the first stops the
    command (SIGTERM to its group; SIGKILL after the grace period) and pauses experiments this
    engine runs; the second kills it now. Returns whether it was interrupted."""
    import signal

    from det_local.sched.run import executor
    from det_local.store.tables.jobs import ENDED

    count = 0

    def on_signal() -> None:
        nonlocal count
        count += 1
        job = engine.store.jobs.peek(job_id)
        if engine.runs:
            engine.interrupt(count)
        if job.state in ENDED:
            return
        if count == 1:
            engine.say(f"det-local: stopping command {job_id} (Ctrl-C again to kill it at once)")
            engine.kill_job(job_id)
        elif job.pid is not None:
            engine.say(f"det-local: killing command {job_id}")
            executor.kill_group(job.pid)

    loop = asyncio.get_running_loop()
    try:
        loop.add_signal_handler(signal.SIGINT, on_signal)
        loop.add_signal_handler(signal.SIGTERM, on_signal)
    except (RuntimeError, ValueError):  # not the main thread
        pass
    return lambda: count > 0


def install_interrupt(engine: Any) -> None:
    """SIGINT/SIGTERM in embedded mode: first pause, second stop now."""
    count = 0
    import signal

    loop = asyncio.get_running_loop()

    def on_signal() -> None:
        nonlocal count
        count += 1
        engine.interrupt(count)

    try:
        loop.add_signal_handler(signal.SIGINT, on_signal)
        loop.add_signal_handler(signal.SIGTERM, on_signal)
    except (RuntimeError, ValueError):  # not the main thread (an embedding program's worker)
        pass

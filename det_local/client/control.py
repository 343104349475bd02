"""Changing experiments and jobs from the CLI: a request in the spool for the running engine
(the daemon, or another `det-local run`), or, with none running, an engine in this process."""

from __future__ import annotations

from typing import Any

from det_local.client.requester import EngineGone, remote_request, retrying
from det_local.errors import DetLocalError
from det_local.sched.enginelock import lock_free
from det_local.store.paths import Paths


def control_experiment(paths: Paths, experiment_id: int, action: str, **fields: Any) -> str:
    return retrying(paths, lambda: _control_once(paths, experiment_id, action, **fields))


def _control_once(paths: Paths, experiment_id: int, action: str, **fields: Any) -> str:
    from det_local.client.embedded import drive

    if not lock_free(paths):
        return str(remote_request(paths, action, {"experiment_id": experiment_id, **fields}))
    if action in ("activate", "continue"):
        # no engine running: run the experiment here, in the foreground, as `det-local run` does
        def act(engine: Any) -> int:
            if action == "activate":
                print(engine.activate(experiment_id), flush=True)
            else:  # `experiment continue` (sched/daytwo/cont.py)
                overrides = fields.get("overrides") or {}
                print(engine.continue_experiment(experiment_id, overrides), flush=True)
            return experiment_id

        def remote(p: Paths) -> int:
            remote_request(p, action, {"experiment_id": experiment_id, **fields})
            return experiment_id

        code = drive(paths, act, remote, follow=True, resume=experiment_id)
        if code:
            raise _Exit(code)
        return f"experiment {experiment_id} finished"
    return _offline(paths, action, {"experiment_id": experiment_id, **fields})


def control_job(paths: Paths, op: str, payload: dict[str, Any]) -> Any:
    """A job-queue request (job update, cmd kill...): the engine if one runs, else offline."""

    def once() -> Any:
        if not lock_free(paths):
            return remote_request(paths, op, payload)
        return _offline(paths, op, payload)

    return retrying(paths, once)


class _Exit(DetLocalError):
    def __init__(self, code: int) -> None:
        super().__init__("")
        self.exit_code = code


def _offline(paths: Paths, op: str, payload: dict[str, Any]) -> Any:
    """No engine is running: act as one for one request. Nothing is started or scheduled:
    with no engine there is no process to supervise."""
    import asyncio
    import os

    from det_local.sched.engine import Engine
    from det_local.sched.enginelock import EngineLock
    from det_local.sched.intake.spool import Request, user_name

    lock = EngineLock(paths)
    if not lock.try_acquire():
        lock.release()
        raise EngineGone("another det-local engine started meanwhile")

    async def go() -> Any:
        engine = Engine(paths, offline=True)
        engine.loop = asyncio.get_running_loop()
        try:
            uid = os.geteuid()
            req = Request("offline", op, user_name(uid), uid, payload, paths.queue / "offline")
            answer = engine.apply_request(req)
        finally:
            engine.store.close()
        if answer.get("error"):
            raise DetLocalError(str(answer["error"]))
        return answer.get("value")

    try:
        return asyncio.run(go())
    finally:
        lock.release()

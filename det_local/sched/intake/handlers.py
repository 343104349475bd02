"""One handler per spool request type, found by the request's ``op`` in ``HANDLERS``.

A handler gets the engine's :class:`Controls` and the request (its owner kernel-verified by
`sched/intake/spool.py`) and returns the answer's value, or raises a ``DetLocalError`` whose one
line
is the answer. Only an object's owner, root, the daemon's own user or a member of the admin
group may change it (:func:`authorize`); `sched/intake/dispatch.py` turns handlers' results and
errors
into answers.
"""

from __future__ import annotations

import grp
import os
import pwd
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from det_local.errors import DetLocalError
from det_local.sched.intake.spool import Request
from det_local.sched.queue.hardware import Inventory
from det_local.sched.settings import DaemonSettings
from det_local.store.db import Store
from det_local.store.states import JobKind

if TYPE_CHECKING:
    from det_local.config.experiment import ExperimentConfig


class PermissionDenied(DetLocalError):
    pass


class Controls(Protocol):
    """What requests may ask of the engine."""

    store: Store
    settings: DaemonSettings
    inventory: Inventory  # the slots discovered at the engine's start

    def submit(
        self,
        cfg: ExperimentConfig,
        context_src: Path,
        source: str,
        *,
        test_mode: bool = False,
        user: str | None = None,
        uid: int | None = None,
        env: dict[str, str] | None = None,
        umask: int | None = None,
    ) -> int: ...

    def pause(self, experiment_id: int) -> str: ...

    def set_drain(self, target: str, disabled: bool, user: str) -> str: ...

    def continue_experiment(self, experiment_id: int, overrides: Any) -> str: ...

    def activate(self, experiment_id: int) -> str: ...

    def kill(self, experiment_id: int) -> str: ...

    def set_labels(self, experiment_id: int, add: str | None, remove: str | None) -> str: ...

    def set_experiment_priority(self, experiment_id: int, priority: int) -> str: ...

    def update_job(
        self,
        job_id: int,
        *,
        priority: int | None = None,
        ahead_of: int | None = None,
        behind_of: int | None = None,
    ) -> str: ...

    def submit_command(
        self,
        *,
        argv: list[str],
        cwd: str,
        env: dict[str, str],
        slots: int,
        priority: int,
        user: str,
        uid: int,
        name: str | None = None,
        kind: JobKind | str = JobKind.COMMAND,
        umask: int | None = None,
        anywhere: bool = False,
        pool: str | None = None,
    ) -> int: ...

    def kill_job(self, job_id: int) -> str: ...

    def request_stop(self) -> None: ...

    def start_unmanaged(
        self, payload: dict[str, Any], *, user: str, uid: int
    ) -> dict[str, Any]: ...

    def log_safely(self, message: str, level: str = "WARNING") -> None: ...


Handler = Callable[[Controls, Request], Any]


# ---------------------------------------------------------------------- ownership
def may_change(settings: DaemonSettings, req: Request, owner: str) -> bool:
    if req.uid in (0, os.geteuid()) or req.user == owner:
        return True
    try:
        group = grp.getgrnam(settings.admin_group)
    except KeyError:
        return False
    if req.user in group.gr_mem:
        return True
    try:
        return pwd.getpwnam(req.user).pw_gid == group.gr_gid
    except KeyError:
        return False


def authorize(settings: DaemonSettings, req: Request, owner: str, what: str) -> None:
    if not may_change(settings, req, owner):
        raise PermissionDenied(
            f"permission denied: {what} belongs to {owner}; only its owner or a member of "
            f"the {settings.admin_group} group may change it"
        )


def own_experiment(c: Controls, req: Request) -> int:
    exp_id = int(req.payload["experiment_id"])
    rec = c.store.get_experiment(exp_id)
    authorize(c.settings, req, rec.user, f"experiment {exp_id}")
    return exp_id


def own_job(c: Controls, req: Request, job_id: int) -> int:
    job = c.store.jobs.get(job_id)
    authorize(c.settings, req, job.user, f"job {job_id}")
    return job_id


def umask_of(c: Controls, req: Request) -> int:
    """The submitter's umask sent with a submission (user input: checked; absent, from an
    older client: 0o022)."""
    from det_local.sched.run.userfiles import BadUmask, check_umask

    try:
        return check_umask(req.payload.get("umask"))
    except BadUmask as err:
        c.log_safely(f"refused request {req.path.name} of {req.user}: {err}")
        raise


# ---------------------------------------------------------------------- experiments
def submit(c: Controls, req: Request) -> int:
    from det_local.config import parse_config
    from det_local.config.limits import check_config_value

    p = req.payload
    source = str(p.get("source", "<config>"))
    check_config_value(p["config"], source)  # its size and nesting, before it is walked
    umask = umask_of(c, req)
    cfg = parse_config(p["config"], source=source)
    return c.submit(
        cfg,
        Path(p["context"]),
        source,
        test_mode=bool(p.get("test_mode")),
        user=req.user,
        uid=req.uid,
        env={str(k): str(v) for k, v in (p.get("env") or {}).items()},
        umask=umask,
    )


def pause(c: Controls, req: Request) -> str:
    return c.pause(own_experiment(c, req))


def activate(c: Controls, req: Request) -> str:
    return c.activate(own_experiment(c, req))


def kill(c: Controls, req: Request) -> str:
    return c.kill(own_experiment(c, req))


def label_add(c: Controls, req: Request) -> str:
    return c.set_labels(own_experiment(c, req), str(req.payload["label"]), None)


def label_remove(c: Controls, req: Request) -> str:
    return c.set_labels(own_experiment(c, req), None, str(req.payload["label"]))


def set_priority(c: Controls, req: Request) -> str:
    return c.set_experiment_priority(own_experiment(c, req), int(req.payload["priority"]))


def unmanaged(c: Controls, req: Request) -> dict[str, Any]:
    """A core_v2 process det-local did not start records an experiment
    (`sched/sessions/unmanaged.py`)."""
    return c.start_unmanaged(req.payload, user=req.user, uid=req.uid)


# ---------------------------------------------------------------------- jobs
def job_update(c: Controls, req: Request) -> str:
    p = req.payload
    job_id = own_job(c, req, int(p["job_id"]))
    return c.update_job(
        job_id,
        priority=p.get("priority"),
        ahead_of=p.get("ahead_of"),
        behind_of=p.get("behind_of"),
    )


def job_update_batch(c: Controls, req: Request) -> list[str]:
    updates = req.payload["updates"]
    for u in updates:  # check every one before changing any
        own_job(c, req, int(u["job_id"]))
    return [
        c.update_job(
            int(u["job_id"]),
            priority=u.get("priority"),
            ahead_of=u.get("ahead_of"),
            behind_of=u.get("behind_of"),
        )
        for u in updates
    ]


def _no_nul(argv: list[str], env: dict[str, str], cwd: str, name: object) -> None:
    """A NUL byte cannot be in a path, an argument or the environment of a process (the kernel
    ends the string there): refused at intake, naming the field, not found at its start."""
    fields = [("cwd", cwd), ("name", name if isinstance(name, str) else "")]
    fields += [(f"argv[{i}]", a) for i, a in enumerate(argv)]
    fields += [(f"env {k[:40]!r}", f"{k}={v}") for k, v in env.items()]
    for field, value in fields:
        if "\0" in value:
            raise DetLocalError(
                f"cmd run: {field} contains a NUL byte, which no path, argument or environment "
                "variable may hold; submit it again without it"
            )


def cmd_run(c: Controls, req: Request) -> int:
    p = req.payload
    argv = [str(a) for a in p["argv"]]
    env = {str(k): str(v) for k, v in (p.get("env") or {}).items()}
    _no_nul(argv, env, str(p["cwd"]), p.get("name"))
    idle = p.get("idle_timeout")
    if idle is not None and (
        isinstance(idle, bool) or not isinstance(idle, (int, float)) or not 0 < idle < 1e9
    ):
        raise DetLocalError(f"idle_timeout: {idle!r} is not a number of seconds > 0")
    job_id = c.submit_command(
        argv=argv,
        cwd=str(p["cwd"]),
        env=env,
        slots=int(p.get("slots", 1)),
        priority=int(p.get("priority", 42)),
        user=req.user,
        uid=req.uid,
        name=p.get("name"),
        kind=str(p.get("kind", "COMMAND")),
        umask=umask_of(c, req),
        anywhere=p.get("anywhere") is True,
        pool=str(p["pool"]) if p.get("pool") is not None else None,
    )
    if idle is not None:  # in the request's transaction (issue 30: idle reservations)
        c.store.usage.set_idle_timeout(job_id, float(idle))
    return job_id


def cmd_kill(c: Controls, req: Request) -> str:
    return c.kill_job(own_job(c, req, int(req.payload["job_id"])))


# ---------------------------------------------------------------------- the daemon
def slots(c: Controls, req: Request) -> dict[str, Any]:
    """The engine's slots and who holds them (`det-local slots`; anyone may ask)."""
    from det_local.sched.queue.inventory import engine_answer

    jobs = c.store.jobs.active()
    return engine_answer(c.inventory, jobs, c.store.usage.idle_states([j.id for j in jobs]))


def continue_(c: Controls, req: Request) -> str:
    """`experiment continue ID`: its owner (or an admin)."""
    return c.continue_experiment(own_experiment(c, req), req.payload.get("overrides") or {})


def drain(c: Controls, req: Request) -> str:
    """`slot disable|enable N`, `cluster node disable|enable NAME`: admins only (root, the
    daemon's user, the admin group)."""
    if not may_change(c.settings, req, owner=""):
        raise PermissionDenied(
            f"permission denied: only root or a member of the {c.settings.admin_group} group "
            "may disable or enable slots and nodes"
        )
    target = str(req.payload["target"])
    if not (target.startswith("slot:") and target[5:].isdigit()) and not target.startswith("node:"):
        raise DetLocalError(f"unknown drain target {target!r}: slot:N or node:NAME")
    return c.set_drain(target, bool(req.payload["disabled"]), req.user)


def daemon_stop(c: Controls, req: Request) -> str:
    if req.uid not in (0, os.geteuid()):
        raise PermissionDenied("permission denied: only root or the daemon's user may stop it")
    c.request_stop()
    return "det-local daemon stopping; running jobs keep running and are adopted at restart"


HANDLERS: dict[str, Handler] = {
    "submit": submit,
    "pause": pause,
    "activate": activate,
    "kill": kill,
    "label_add": label_add,
    "label_remove": label_remove,
    "set_priority": set_priority,
    "job_update": job_update,
    "job_update_batch": job_update_batch,
    "cmd_run": cmd_run,
    "cmd_kill": cmd_kill,
    "daemon_stop": daemon_stop,
    "drain": drain,
    "continue": continue_,
    "slots": slots,
    "unmanaged": unmanaged,
}

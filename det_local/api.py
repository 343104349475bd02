"""The Python API the CLI is a thin layer over. Reads open the store read-only; changes go to
the daemon (or, with none running, to an embedded runner started for the purpose)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from det_local.store.paths import Paths

if TYPE_CHECKING:
    from det_local.client.testmode import TestReport
    from det_local.store.db import Store  # imported when a store is opened: `cmd run` needs none


def paths() -> Paths:
    return Paths.from_env()


_SHARED: tuple[Callable[[], Store], Path] | None = None


def use_store(source: Callable[[], Store] | None, home: Paths | None = None) -> None:
    """A long-lived reader (the dashboard: web/pool.py) hands out its own read-only Stores of
    `home`: open_store() of that home returns source()'s, never closed by the caller."""
    global _SHARED
    _SHARED = None if source is None or home is None else (source, home.db)


def open_store(p: Paths | None = None) -> Store:
    """A read-only view of the store (empty when nothing has run yet)."""
    db = (p or paths()).db
    if _SHARED is not None and _SHARED[1] == db:
        return _SHARED[0]()
    from det_local.store.db import Store

    return Store(db, readonly=True)


def run(
    config_path: str | Path,
    context_dir: str | Path,
    *,
    follow: bool = True,
    quiet: bool = False,
    test_mode: bool = False,
    anywhere: bool = False,
    overrides: dict[str, Any] | None = None,
    pool: str | None = None,
) -> int:
    """Submit an experiment and, with follow=True, run it to the end; returns the exit code.

    anywhere: as `resources.federate: true` (a trial may run on an idle peer of the cluster).

    overrides: `--config` edits (`config.overrides.parse_overrides`) laid over the file's
    config before it is checked; pool: `--pool NAME`, as the edit
    `resources.resource_pool=NAME` made after them (a pool that does not exist refused here).

    test_mode: Determined's test mode (one batch, validate, checkpoint, restore in a new
    process, one more batch); prints the pass/fail report and returns 0 only if all passed."""
    from det_local.client.embedded import run_experiment

    p = paths()
    if pool is not None:
        overrides = with_pool(p, overrides or {}, pool)
    return run_experiment(
        p,
        Path(config_path),
        Path(context_dir),
        follow=follow,
        quiet=quiet,
        test_mode=test_mode,
        anywhere=anywhere,
        overrides=overrides,
    )


def with_pool(p: Paths, overrides: dict[str, Any], pool: str) -> dict[str, Any]:
    """`--pool NAME` laid over the `--config` edits, once daemon.yaml's pools (the ones the
    engine checks again at submission) say it exists."""
    from det_local.config.overrides import merge
    from det_local.pools import load_pools

    try:
        pools = load_pools(p.settings)
    except OSError:  # daemon.yaml not readable by this user: the engine's check decides
        pools = None
    if pools is not None:
        pools.check_pool(pool, "--pool")
    return merge(overrides, {"resources": {"resource_pool": pool}})


def create_experiment(
    config_path: str | Path,
    context_dir: str | Path,
    *,
    follow: bool,
    test_mode: bool = False,
    anywhere: bool = False,
    overrides: dict[str, Any] | None = None,
    pool: str | None = None,
) -> int:
    """`experiment create`: submit to the running engine and return 0 at once (the id is
    printed), or with follow=True run and follow as `run` does (an embedded engine when none
    runs); returns the exit code."""
    if not follow:
        from det_local.errors import DetLocalError
        from det_local.sched.enginelock import lock_free

        p = paths()
        if lock_free(p):
            raise DetLocalError(
                f"no det-local daemon is running for {p.home}: `det-local daemon start` "
                "first, or `det-local experiment create -f` runs the experiment in this terminal"
            )
    return run(
        config_path,
        context_dir,
        follow=follow,
        test_mode=test_mode,
        anywhere=anywhere,
        overrides=overrides,
        pool=pool,
    )


def fork_experiment(experiment_id: int, overrides: dict[str, Any], *, follow: bool) -> int:
    """`experiment fork`: a new experiment from another's config (overrides laid over it) and
    context snapshot (`client/fork.py`), submitted as `experiment create` does; the exit code."""
    from det_local.client.embedded import run_config
    from det_local.client.fork import forked_config

    p = paths()
    cfg, context, source = forked_config(p, experiment_id, overrides)
    if not follow:
        from det_local.errors import DetLocalError
        from det_local.sched.enginelock import lock_free

        if lock_free(p):
            raise DetLocalError(
                f"no det-local daemon is running for {p.home}: `det-local daemon start` "
                "first, or `det-local experiment fork -f` runs the fork in this terminal"
            )
    return run_config(p, cfg, context, source, follow=follow)


def test_experiment(
    config_path: str | Path, context_dir: str | Path, *, home: str | Path | None = None
) -> TestReport:
    """Run CONFIG in test mode with no output and return the report (what the pytest plugin
    uses). ``home`` defaults to DET_LOCAL_HOME."""
    from det_local.client.embedded import run_experiment
    from det_local.client.testmode import build_report

    p = Paths(Path(home).absolute()) if home is not None else paths()
    box: list[TestReport] = []

    def finish(store: Store, exp_id: int, elapsed: float) -> tuple[str, int]:
        box.append(build_report(store, p, exp_id))
        return "", 0

    run_experiment(
        p, Path(config_path), Path(context_dir), quiet=True, test_mode=True, finish=finish
    )
    return box[0]


def control(experiment_id: int, action: str, **fields: object) -> str:
    """pause | activate | kill | label_add | label_remove an experiment; returns a message."""
    from det_local.client.control import control_experiment

    return control_experiment(paths(), experiment_id, action, **fields)


def control_job(op: str, payload: dict[str, object]) -> Any:
    """A job-queue request (cmd_run, cmd_kill, job_update, job_update_batch)."""
    from det_local.client.control import control_job as send

    return send(paths(), op, payload)


def follow_command(job_id: int, poll: float = 0.05, p: Paths | None = None) -> int:
    """Stream a command's output until it ends; returns its exit status (1 if unknown)."""
    from det_local.client.follow import follow_command as follow

    return follow(p or paths(), job_id, poll)

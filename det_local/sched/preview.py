"""What `config check` shows: the filled-in config, the search plan (how many trials the
searcher creates: ASHA brackets and rungs, grid axes) and the first trial's launch plan."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from det_local.errors import NotSupportedYet
from det_local.launch.ports import PORT_VARS
from det_local.sched.plan import (
    allowed_submitter_vars,
    base_env,
    check_entrypoint,
    config_env_vars,
    entrypoint_argv,
    thread_env,
    trial_env,
    trial_extra,
)
from det_local.store.db import current_user
from det_local.store.paths import Paths


def preview(config_path: Path, context_dir: Path | None) -> dict[str, Any]:
    from det_local.config import load_config
    from det_local.search import make_searcher, plan
    from det_local.search.actions import Create

    cfg = load_config(config_path)
    config = cfg.to_dict()
    context = (context_dir or Path(".")).resolve()
    if context_dir is not None:
        from det_local.store.context import list_context

        list_context(context)
        check_entrypoint(cfg.entrypoint, context, str(config_path))
    try:
        searcher = make_searcher(cfg)
        argv = entrypoint_argv(
            cfg.entrypoint or "", context, slots_per_trial=int(cfg.resources.slots_per_trial)
        )
    except NotSupportedYet as err:  # valid for Determined, not runnable by this version yet
        return {"config": config, "plan": None, "not_runnable": str(err)}
    creates = [a for a in searcher.initial_actions() if isinstance(a, Create)]
    first = creates[0]
    paths = Paths.from_env()
    # the environment a launch gives: this user's allow-listed variables (as a submission
    # would send them), the config's, det-local's; never anything else of this environment
    base = base_env(allowed_submitter_vars(os.environ), os.getuid())
    env = trial_env(
        base=base,
        experiment_id=0,
        trial_id=0,
        run_id=1,
        seed=first.seed,
        hparams=first.hparams,
        config=config,
        steps_completed=0,
        latest_checkpoint=None,
        slots=[],
        socket_path=str(paths.socket),
        token="<per-run token>",
        info_dir=str(paths.trial_info_dir(0, 0, 1)),
        checkpoint_dir=str(paths.checkpoints),
        user=current_user(),
        extra=trial_extra(
            config,
            base=base,
            home=str(paths.home),
            threads=None,
            visible_devices="<the trial's slots>",
            ports={name: "<a free port>" for name in PORT_VARS},
            test_mode=False,
        )
        # on CPU slots only (the daemon's inventory decides): OMP_NUM_THREADS, the mark
        + [
            f"{item.partition('=')[0]}=<on CPU slots only: {value}>"
            for item, value in zip(
                thread_env(0, base, config_env_vars(config)),
                ("the trial's share of the cores", "1"),
                strict=False,
            )
        ],
    )
    search = plan(cfg)
    return {
        "config": config,
        "plan": {
            # how many trials the search creates in all (grid size, max_trials); `search` has
            # the searcher's plan (ASHA brackets and rungs, grid axes), `initial_trials` how
            # many it creates at once at the start (slots permitting, they start together)
            "trials": search["trials"],
            "initial_trials": len(creates),
            "search": search,
            "slots_per_trial": cfg.resources.slots_per_trial,
            "argv": argv,
            "cwd": "<snapshot of " + str(context) + ">",
            "hparams": first.hparams,
            "seed": first.seed,
            "env": env,
        },
    }

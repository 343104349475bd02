"""What `config check` shows: the filled-in config, the search plan (how many trials the
searcher creates: ASHA brackets and rungs, grid axes) and the first trial's launch plan."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from det_local.errors import NotSupportedYet
from det_local.sched.plan import check_entrypoint, config_env_vars, entrypoint_argv, trial_env
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
    env = trial_env(
        base=dict(os.environ),
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
        user="<you>",
        extra=config_env_vars(config),
    )
    delta = {k: v for k, v in env.items() if os.environ.get(k) != v}
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
            "env": delta,
        },
    }

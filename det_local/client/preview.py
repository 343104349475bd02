"""What `config check` shows: the filled-in config, the search plan (how many trials the
searcher creates: ASHA brackets and rungs, grid axes) and the first trial's launch plan, built
by the function the engine launches with (`sched/run/trialplan.py`), on this machine's slots."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from det_local.errors import NotSupportedYet
from det_local.launch.ports import PORT_VARS
from det_local.sched.run.launchplan import allowed_submitter_vars, check_entrypoint, entrypoint_argv
from det_local.store.db import current_user
from det_local.store.paths import Paths

SHOWN = {
    **{name: "<a free port>" for name in PORT_VARS},  # chosen when the trial starts
    "DET_LOCAL_TOKEN": "<per-run token>",
}


def preview(config_path: Path, context_dir: Path | None) -> dict[str, Any]:
    from det_local.client import slotview
    from det_local.config import load_config
    from det_local.sched.life.experiments import checkpoint_dir_for
    from det_local.sched.run import runas as users
    from det_local.sched.run.trialplan import TrialFacts, build_trial_plan
    from det_local.sched.run.userfiles import current_umask
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
        entrypoint_argv(
            cfg.entrypoint or "", context, slots_per_trial=int(cfg.resources.slots_per_trial)
        )
    except NotSupportedYet as err:  # valid for Determined, not runnable by this version yet
        return {
            "config": config,
            "warnings": list(cfg.warnings),
            "deprecations": list(cfg.deprecations),
            "plan": None,
            "not_runnable": str(err),
        }
    creates = [a for a in searcher.initial_actions() if isinstance(a, Create)]
    first = creates[0]
    paths = Paths.from_env()
    from det_local.pools import is_default, load_pools

    pools = load_pools(paths.settings)
    pool = cfg.resources.resource_pool
    pools.check_pool(pool)
    # this machine's slots, as the engine sees them (the running one's, else as one started
    # now would find them): the first trial on an idle machine
    inventory = slotview.current(paths).inventory
    need = int(cfg.resources.slots_per_trial)
    uid = os.getuid()
    launch = build_trial_plan(
        TrialFacts(
            experiment_id=0,
            trial_id=0,
            run_id=1,
            seed=first.seed,
            hparams=first.hparams,
            config=config,
            context=context,
            steps_completed=0,
            latest_checkpoint=None,
            # another pool's trial holds none of this machine's slots
            slots=list(range(min(need, inventory.size()))) if is_default(pool) else [],
            token="",
            user=current_user(),
            uid=uid,
            umask=current_umask(),
            checkpoint_dir=checkpoint_dir_for(paths, config),
            slots_per_trial=need,
            # the environment a launch gives: this user's allow-listed variables (as a
            # submission would send them), the config's, det-local's; nothing else of this one
            captured_env=allowed_submitter_vars(os.environ),
            identity=users.identity(uid),
        ),
        paths,
        inventory,
        shown=SHOWN,
    )
    search = plan(cfg)
    return {
        "config": config,
        "warnings": list(cfg.warnings),
        "deprecations": list(cfg.deprecations),
        "plan": {
            # how many trials the search creates in all (grid size, max_trials); `search` has
            # the searcher's plan (ASHA brackets and rungs, grid axes), `initial_trials` how
            # many it creates at once at the start (slots permitting, they start together)
            "trials": search["trials"],
            "initial_trials": len(creates),
            "search": search,
            "slots_per_trial": cfg.resources.slots_per_trial,
            "slots": launch.slots,
            "argv": launch.argv,
            "cwd": "<snapshot of " + str(context) + ">",
            "hparams": first.hparams,
            "seed": first.seed,
            "env": launch.env,
            "pool": pool or "default",
            # a Slurm pool: the batch script a run is submitted as (None: this machine)
            "batch_script": pools.batch_script(pool, launch, need),
        },
    }

"""`experiment fork ID [--config KEY=VALUE ...]` (Determined's `det experiment fork`, the CLI
twin of a dashboard's Fork): a new experiment from another's config and code.

The config is the original's as recorded, with the overrides laid over it (`--config` dotted
keys, `--config-file`), then checked as a config file is (`config.parse_config`: one-line
errors, did-you-mean for unknown fields). Hyperparameters are the user's own names, which no
schema can check: an override naming one the original does not define but close to one it
does (`hyperparameters.lrr` beside `lr`) is refused with a did-you-mean; a name close to none
adds a hyperparameter. The context is the original's snapshot, snapshotted again with the
forker's rights (a root daemon takes it as the submitter, as for any submission): the config
is in the database, which every user reads, but the code only as its files' modes say, so a
private experiment (its owner's umask 077) cannot be forked by another user.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from det_local.errors import DetLocalError
from det_local.store.paths import Paths

if TYPE_CHECKING:
    from det_local.config.experiment import ExperimentConfig


def forked_config(
    paths: Paths, experiment_id: int, overrides: dict[str, Any]
) -> tuple[ExperimentConfig, Path, str]:
    """(the fork's config, the original's context snapshot, the name messages give it)."""
    from det_local.config import parse_config
    from det_local.config.overrides import check_hyperparameter_names, merge
    from det_local.sched.sessions.unmanaged import is_unmanaged
    from det_local.store.db import Store

    store = Store(paths.db, readonly=True)
    try:
        rec = store.get_experiment(experiment_id)
    finally:
        store.close()
    if is_unmanaged(rec.config):
        raise DetLocalError(
            f"experiment {experiment_id} is unmanaged (core_v2): det-local never had its code "
            "to fork; run your script again"
        )
    context = paths.context_dir(experiment_id)
    if not context.is_dir():
        raise DetLocalError(
            f"experiment {experiment_id} has no context snapshot at {context} (deleted with "
            "the experiment); `det-local experiment create CONFIG CONTEXT` with your own code"
        )
    private = _unreadable(context)
    if private is not None:
        raise DetLocalError(
            f"cannot read experiment {experiment_id}'s context snapshot ({private}): it is "
            f"private to {rec.user} (only its owner and the admin group may fork it)"
        )
    check_hyperparameter_names(
        rec.config.get("hyperparameters"), overrides, f"experiment {experiment_id}"
    )
    source = f"experiment {experiment_id}'s config with the --config edits"
    cfg = parse_config(merge(rec.config, overrides), source=source)
    return cfg, context, source


def _unreadable(context: Path) -> str | None:
    """The first file or directory of the snapshot this user cannot read (None: all can be;
    the daemon snapshots it again as this user, which is what decides)."""
    failed: list[str] = []

    def refused(err: OSError) -> None:
        failed.append(str(err.filename))

    for top, _dirs, names in os.walk(context, onerror=refused):
        if failed:
            break
        for name in names:
            path = os.path.join(top, name)
            if not os.path.islink(path) and not os.access(path, os.R_OK):
                return path
    return failed[0] if failed else None

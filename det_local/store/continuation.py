"""`experiment continue`: an ended experiment takes a new config, and it and its trials lose
the messages, restarts and checkpoint-GC mark of their earlier end (the states move through
the store's tables, `states.TRANSITIONS`: ended -> ACTIVE)."""

from __future__ import annotations

from typing import Any

from det_local.store.sql import Db, dumps


def reopen(db: Db, experiment_id: int, config: dict[str, Any]) -> None:
    db.write(
        # checkpoint_gc NULL: collected again when it ends again
        "UPDATE experiments SET config=?, message=NULL, checkpoint_gc=NULL WHERE id=?",
        (dumps(config), experiment_id),
    )
    db.write("UPDATE trials SET message=NULL, restarts=0 WHERE experiment_id=?", (experiment_id,))

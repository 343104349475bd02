"""`slot disable|enable N` and `cluster node disable|enable NAME` (admins only).

A disabled slot finishes what runs on it; the scheduling pass places nothing new there
(`LocalInventory.disabled`). A disabled node takes no new gang shares or anywhere jobs from
peers (it advertises no free slots and refuses reserves); its own queue still runs (disable
its slots to drain it wholly). Both are kept in the store (`store/tables/drains.py`), so they hold
across daemon restarts."""

from __future__ import annotations

from typing import Protocol

from det_local.errors import DetLocalError
from det_local.sched.queue.inventory import LocalInventory
from det_local.sched.queue.jobqueue import JobQueue
from det_local.store.db import Store
from det_local.store.tables.drains import NODE, slot_target


class Draining(Protocol):
    store: Store
    slots: LocalInventory
    queue: JobQueue


def load(engine: Draining) -> None:
    """At the engine's start: the drained slots as the store keeps them."""
    engine.slots.disabled = {i for i in engine.store.drains.slots() if i < engine.slots.total()}


def set_slot(engine: Draining, index: int, disabled: bool, user: str) -> str:
    total = engine.slots.total()
    if not 0 <= index < total:
        raise DetLocalError(
            f"slot {index} does not exist: this machine has slots 0-{total - 1} "
            "(`det-local slots` lists them)"
        )
    changed = engine.store.drains.mark(slot_target(index), disabled, user)
    load(engine)
    if not disabled:
        engine.queue.schedule()  # queued work may start there now
    word = "disabled" if disabled else "enabled"
    if not changed:
        return f"slot {index} was already {word}"
    if disabled:
        return f"slot {index} disabled: what runs there finishes; nothing new is placed there"
    return f"slot {index} enabled"


def set_node(engine: Draining, name: str, me: str, disabled: bool, user: str) -> str:
    if name not in (me, "local"):
        raise DetLocalError(
            f"node {name!r} is not this machine ({me}): run `det-local cluster node "
            f"{'disable' if disabled else 'enable'} {name}` on {name} itself"
        )
    changed = engine.store.drains.mark(NODE, disabled, user)
    word = "disabled" if disabled else "enabled"
    if not changed:
        return f"node {me} was already {word}"
    if disabled:
        return (
            f"node {me} disabled: it takes no new gang shares or anywhere jobs from peers "
            "(what runs finishes; its own queue still runs)"
        )
    return f"node {me} enabled"

"""Slots as the scheduler sees them: ``(node, index)``, wherever they are.

The scheduling pass (`sched/queue/jobqueue.py`) reads slots only through :class:`SlotInventory`;
`sched/queue/policy.py` hands out the :class:`SlotId` values it is given, whatever they name. On one
machine every slot is on :data:`LOCAL_NODE` and its index is the slot number
`sched/queue/hardware.py`
discovered (a GPU, by UUID, or a CPU slot); federation adds inventories whose slots live on
other nodes, behind the same interface.

Rules of a :class:`SlotInventory`:

1. ``total()`` is how many slots the scheduler may ever hand out; a request for more is
   refused at submission (`policy.check_request`).
2. ``free(held)`` lists the slots neither held by one of our jobs (``held``) nor busy for a
   reason outside det-local (a foreign process on a GPU, when the daemon counts those), in
   ``(node, index)`` order. It says whether a slot was left out only because of a foreign
   process: nothing of ours tells when that ends, so the caller looks again later (bounded).
3. A slot id, once handed out, names the same hardware until the inventory is discovered
   again (a new engine).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from det_local.sched.queue import hardware as hardware
from det_local.store.states import JobState

LOCAL_NODE = "local"


@dataclass(frozen=True, order=True)
class SlotId:
    """One slot: the node it is on and its index there (ordered by node, then index)."""

    node: str
    index: int


@dataclass(frozen=True)
class FreeSlots:
    slots: list[SlotId]
    foreign_held: bool  # a slot is left out only because of a process det-local did not start


class SlotInventory(Protocol):
    """What the scheduling pass reads about slots (rules in the module doc)."""

    def total(self) -> int: ...

    def free(self, held: Iterable[SlotId]) -> FreeSlots: ...


class LocalInventory:
    """This machine's slots (`slots.discover`), all on LOCAL_NODE. ``our_pids`` lists the
    processes of our jobs (theirs are not foreign) and is read only when foreign GPU use
    matters (``foreign_gpus_busy`` and a GPU inventory)."""

    def __init__(
        self,
        inventory: hardware.Inventory,
        *,
        foreign_busy: bool,
        our_pids: Callable[[], list[int]],
        node: str = LOCAL_NODE,
    ) -> None:
        self.hardware = inventory
        self.node = node
        # drained slots (`slot disable`): what runs there finishes, nothing new is placed
        self.disabled: set[int] = set()
        self._foreign_busy = foreign_busy
        self._our_pids = our_pids

    def total(self) -> int:
        return self.hardware.size()

    def ids(self, indices: Iterable[int]) -> tuple[SlotId, ...]:
        return tuple(SlotId(self.node, i) for i in indices)

    def indices(self, ids: Sequence[SlotId]) -> list[int]:
        """The local slot numbers of slot ids of this node (ValueError for another node's)."""
        out = []
        for slot in ids:
            if slot.node != self.node:
                raise ValueError(f"slot {slot} is not on this node ({self.node})")
            out.append(slot.index)
        return out

    def free(self, held: Iterable[SlotId]) -> FreeSlots:
        used = {s.index for s in held if s.node == self.node}
        busy = self._foreign()
        return FreeSlots(
            [
                SlotId(self.node, s.index)
                for s in self.hardware.slots
                if s.index not in used and s.index not in busy and s.index not in self.disabled
            ],
            foreign_held=bool(busy - used),
        )

    def _foreign(self) -> set[int]:
        if not self._foreign_busy or self.hardware.source == hardware.SOURCE_CPU:
            return set()
        inv = hardware.detect_foreign(self.hardware, self._our_pids())
        return hardware.busy_foreign(inv, True)


def engine_answer(
    inventory: hardware.Inventory, jobs: Sequence[Any], idle: Any = None
) -> dict[str, Any]:
    """The engine's answer to a `slots` request: its inventory (foreign processes, memory in
    use and utilisation looked up now), who holds each slot, since when and whether idle
    (`idle`: the store's idle states), as plain values."""
    import time

    from det_local.usage.gpus import slot_jobs, with_fake_usage

    inv = with_fake_usage(hardware.read_usage(hardware.detect_foreign(inventory, our_pids(jobs))))
    held = slot_jobs(jobs, idle or {}, time.time())
    return {
        "source": inv.source,
        "note": inv.note,
        "slots": [asdict(s) for s in inv.slots],
        "holders": [[i, who] for i, who in sorted(hardware.slot_holders(jobs).items())],
        "jobs": [[i, info] for i, info in sorted(held.items())],
    }


def our_pids(jobs: Sequence[Any]) -> list[int]:
    """The pids of the jobs the engine runs (theirs are no foreign processes)."""
    return [j.pid for j in jobs if j.state == JobState.SCHEDULED and j.pid is not None]

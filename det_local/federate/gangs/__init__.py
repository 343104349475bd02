"""Trials across machines, the cluster's half (the engine's half is `sched/gangs.py`): one
shared state (`state.GangBook`: the gangs owned here, the shares of other nodes' gangs run
here) and one module per concern, each given what it needs of the others as a narrow Protocol:

- `placement.py`: owner placement: fit, reserve/ready/commit in one global order (wound-wait)
- `members.py`: a share of another node's gang run here: reserve, commit, abort, its exit
- `relay.py`: a member rank's trial frames and log lines relayed to the owner
- `ends.py`: how an owned gang ends: its ranks' exits everywhere, the verdict, lost machines
- `faults.py`: the heartbeat's watch for dead machines, and a daemon restart (recover)
- `placer.py`: `Gangs`, the `Placer` the engine calls, wiring the concerns together (a
  peer's gang message reaches its concern through `federate/messages.py`'s `GANG_HANDLERS`)

**Placement.** The owner's share of a gang is RESERVED by its own policy; the owner then ships
the context snapshot (by digest, cached) and sends `reserve` to the chosen peers. Each peer
queues a MEMBER job (its own policy, priorities and quotas apply); when that policy starts it,
its slots are RESERVED and the peer answers `ready`. Once every share is ready the owner picks
the chief's ports and sends `commit` (rendezvous: every node's address, slot counts, this
node's rank); each node spawns its ranks under torch.distributed.run. A RESERVED member holds
its slots at most `hold_s` without a commit, then goes back to the queue and tells the owner.

**No deadlock: wound-wait on one global order.** Every machine orders gangs by (priority,
submission time at the owner, owner id, job id). A RESERVED (uncommitted) share of a younger
gang that stands in front of an older gang's waiting share is released at once, and its owner
releases the whole gang and places it again later. Waits only go from younger to older.

**Fencing.** `run` is the owner's run id of the trial; it rises with every placement. A member
refuses a commit, abort or relay for a run older than the one it has.

**Faults.** A member whose owner is dead stops the owner's ranks here (SIGTERM, SIGKILL after
the grace period); an owner whose member is dead stops its own ranks and requeues the trial
from its latest checkpoint without using `max_restarts` (a separate cap). A rank that fails on a
member stops the gang's ranks everywhere (the owner ends its own and aborts the others).
"""

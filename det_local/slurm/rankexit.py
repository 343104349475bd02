"""Which node of a multi-node Slurm trial failed first, and with what code.

When one rank of a trial over several nodes fails, ``srun --kill-on-bad-exit`` stops the other
nodes' steps, and the job's exit status is srun's: the highest of its tasks' (often 143, a node
srun stopped), not the failing rank's. So each node's step (`slurm/node.py`) writes its own
exit into the run's info directory, ``slurm-rank-exit.<slurm job id>.<node rank>`` (one small
JSON object, written atomically by the run's user): the node, its node rank, its launcher's
exit status, the process rank that failed first there (its launcher's supervisor says which,
`launch/supervise.py`), when, and whether the step was stopped by a signal (srun stopping it
because another node failed).

The first failure is the earliest non-zero exit of a node that was not stopped (else the
earliest non-zero one). The batch shell exits with its code (``python -m
det_local.slurm.rankexit RC``: prints the status to exit with, and the line naming the failure
into the job's output), so Slurm's own record has it too; the launcher's settle reads the same
files to name the failure in the trial's exit message.

The files are the run's user's: read bounded (4 KiB each, at most 256 nodes), never through a
link, only regular files; a file that does not parse is ignored.
"""

from __future__ import annotations

import json
import os
import secrets
import stat
import sys
from dataclasses import asdict, dataclass

PREFIX = "slurm-rank-exit"
MAX_BYTES = 4096
MAX_NODES = 256


@dataclass(frozen=True)
class NodeExit:
    node: str  # its hostname
    node_rank: int  # SLURM_NODEID (the allocation's first host is 0)
    code: int  # its launcher's exit status (128 + N: killed by signal N)
    rank: int | None = None  # the process rank that failed first on it (its launcher's word)
    stopped: bool = False  # a signal stopped the node's step (srun, scancel)
    at: float = 0.0  # when it failed (the rank's failure, else the launcher's exit)

    def describe(self, slurm_id: int | str) -> str:
        who = f"node {self.node}" if self.rank is None else f"rank {self.rank} on node {self.node}"
        return f"{who} (node rank {self.node_rank} of Slurm job {slurm_id}) failed first"


def file_name(slurm_id: int | str, node_rank: int) -> str:
    return f"{PREFIX}.{slurm_id}.{node_rank}"


def write(info_dir: str, slurm_id: int | str, record: NodeExit) -> None:
    """Atomically (a new name, then renamed over): the batch shell and the daemon read whole
    files only. Best effort: a node that cannot write simply is not named."""
    final = os.path.join(info_dir, file_name(slurm_id, record.node_rank))
    tmp = f"{final}.{secrets.token_hex(4)}.tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        with os.fdopen(fd, "w") as f:
            json.dump(asdict(record), f)
        os.replace(tmp, final)
    except OSError:
        try:
            os.unlink(tmp)
        except OSError:
            pass


def _read(info_dir: str, name: str) -> NodeExit | None:
    try:
        fd = os.open(
            os.path.join(info_dir, name),
            os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
        )
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_BYTES:
            return None
        data = json.loads(os.read(fd, MAX_BYTES))
        node = str(data["node"])
        rank = data.get("rank")
        return NodeExit(
            node="".join(c for c in node[:64] if c.isprintable()) or "?",
            node_rank=int(data["node_rank"]),
            code=int(data["code"]),
            rank=None if rank is None else int(rank),
            stopped=bool(data.get("stopped")),
            at=float(data.get("at") or 0.0),
        )
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None
    finally:
        os.close(fd)


def read_all(info_dir: str, slurm_id: int | str, nodes: int = MAX_NODES) -> list[NodeExit]:
    """Every node's record of a job of ``nodes`` nodes, in node rank order (a node killed
    before it wrote has none)."""
    found = []
    for node_rank in range(min(max(nodes, 0), MAX_NODES)):
        record = _read(info_dir, file_name(slurm_id, node_rank))
        if record is not None and record.node_rank == node_rank:
            found.append(record)
    return found


def first_failure(records: list[NodeExit]) -> NodeExit | None:
    failed = [r for r in records if r.code != 0]
    own = [r for r in failed if not r.stopped]  # stopped ones failed because another did
    pool = own or failed
    return min(pool, key=lambda r: (r.at, r.node_rank)) if pool else None


def main(argv: list[str]) -> int:
    """``python -m det_local.slurm.rankexit RC`` in the batch shell, after srun: prints the
    status the job exits with (the first failing node's; RC when none is known) and says which
    node failed first on stderr (the job's output)."""
    rc = argv[0] if argv else "1"
    info_dir, slurm_id = os.environ.get("DET_LOCAL_INFO_DIR"), os.environ.get("SLURM_JOB_ID")
    nodes = int(os.environ.get("SLURM_JOB_NUM_NODES") or os.environ.get("SLURM_NNODES") or 0)
    first = None
    if info_dir and slurm_id and rc != "0":
        first = first_failure(read_all(info_dir, slurm_id, nodes or MAX_NODES))
    if first is None:
        print(rc)
        return 0
    code = first.code if 0 < first.code < 256 else 1
    print(f"det-local: {first.describe(slurm_id or '?')}: exited with code {code}", file=sys.stderr)
    print(code)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

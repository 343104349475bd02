"""A Slurm pool's settings: the `slurm:` mapping of a pool in daemon.yaml's `resource_pools:`.

```yaml
resource_pools:
  hpc:
    slurm:
      partition: debug                 # required: --partition
      sbatch_args: ["--time=00:10:00"] # passed through as #SBATCH lines, in this order
      account: lab                     # --account
      qos: normal                      # --qos
      gres: gpu                        # each slot is one of these: --gres=gpu:N per node
      slots_per_node: 1                # slots of a node (multi-slot trials: --nodes from it)
      signal_lead: 120                 # seconds before the time limit the trial is told to
                                       # checkpoint (--signal=B:USR1@N)
      shared_paths: [/scratch, /home]  # what the compute nodes mount (default: all of it)
      channel: {listen: 0.0.0.0:7461, advertise: login01}  # other hosts: slurm/remote.py
      stage_dir: /shared/det-local     # runs' context, log and info files (slurm/stage.py)
      submit_retry: 120                # seconds a trial's sbatch is tried again while
                                       # slurmctld is unreachable (0: never)
```
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from det_local.errors import ConfigError
from det_local.slurm.remote import Channel, parse_channel, parse_stage_dir

DEFAULT_SIGNAL_LEAD_S = 120
DEFAULT_SUBMIT_RETRY_S = 120
_KEYS = {
    "partition",
    "sbatch_args",
    "account",
    "qos",
    "gres",
    "slots_per_node",
    "signal_lead",
    "shared_paths",
    "channel",
    "stage_dir",
    "submit_retry",
}
# det-local decides these itself: a pool's sbatch_args may not set them
RESERVED_ARGS = ("--output", "-o", "--requeue", "--no-requeue", "--signal", "--array", "-a")


@dataclass(frozen=True)
class SlurmPool:
    name: str
    partition: str
    sbatch_args: tuple[str, ...] = ()
    account: str | None = None
    qos: str | None = None
    gres: str | None = None
    slots_per_node: int = 1
    signal_lead: int = DEFAULT_SIGNAL_LEAD_S
    shared_paths: tuple[str, ...] = ()  # empty: compute nodes see every path this host does
    channel: Channel | None = None  # trials report over TCP (slurm/remote.py)
    stage_dir: str | None = None  # runs' context, log and info files there (slurm/stage.py)
    submit_retry: int = DEFAULT_SUBMIT_RETRY_S  # seconds sbatch is retried (submitter.py)


def parse_slurm_pool(name: str, raw: Any, source: str) -> SlurmPool:
    """One pool's `slurm:` mapping, checked; ConfigError naming the field."""
    from det_local.suggest import check_section_keys

    where = f"resource_pools.{name}.slurm"
    if not isinstance(raw, dict):
        raise ConfigError(
            f"{where} in {source}: expected a mapping with at least 'partition', found {raw!r}"
        )
    check_section_keys(f"{where}.", raw, _KEYS, source)
    partition = raw.get("partition")
    if not isinstance(partition, str) or not partition.strip():
        raise ConfigError(
            f"{where}.partition is missing in {source}: a Slurm pool needs the partition its "
            "jobs go to, e.g. 'partition: debug' (`sinfo -s` lists them)"
        )
    args = raw.get("sbatch_args") or []
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        raise ConfigError(
            f"{where}.sbatch_args in {source}: expected a list of strings such as "
            f'["--time=01:00:00"], found {args!r}'
        )
    for arg in args:
        flag = arg.split("=", 1)[0]
        if flag in RESERVED_ARGS:
            raise ConfigError(
                f"{where}.sbatch_args in {source}: {arg!r} is det-local's to set "
                "(output, requeue, signal and arrays are part of how it runs trials); remove it"
            )
    per_node = raw.get("slots_per_node", 1)
    if isinstance(per_node, bool) or not isinstance(per_node, int) or per_node < 1:
        raise ConfigError(f"{where}.slots_per_node in {source}: expected an integer >= 1")
    lead = raw.get("signal_lead", DEFAULT_SIGNAL_LEAD_S)
    if isinstance(lead, bool) or not isinstance(lead, int) or not 0 < lead <= 65535:
        raise ConfigError(f"{where}.signal_lead in {source}: expected seconds, 1 to 65535")
    retry = raw.get("submit_retry", DEFAULT_SUBMIT_RETRY_S)
    if isinstance(retry, bool) or not isinstance(retry, int) or not 0 <= retry <= 86400:
        raise ConfigError(f"{where}.submit_retry in {source}: expected seconds, 0 to 86400")
    shared = raw.get("shared_paths") or []
    if not isinstance(shared, list) or not all(
        isinstance(p, str) and p.startswith("/") for p in shared
    ):
        raise ConfigError(
            f"{where}.shared_paths in {source}: expected a list of absolute paths, found {shared!r}"
        )
    for key in ("account", "qos", "gres"):
        value = raw.get(key)
        if value is not None and (not isinstance(value, str) or not value.strip()):
            raise ConfigError(f"{where}.{key} in {source}: expected a name, found {value!r}")
    return SlurmPool(
        name=name,
        partition=partition.strip(),
        sbatch_args=tuple(args),
        account=raw.get("account"),
        qos=raw.get("qos"),
        gres=raw.get("gres"),
        slots_per_node=per_node,
        signal_lead=lead,
        shared_paths=tuple(p.rstrip("/") or "/" for p in shared),
        channel=parse_channel(where, raw.get("channel"), source),
        stage_dir=parse_stage_dir(where, raw.get("stage_dir"), source),
        submit_retry=retry,
    )

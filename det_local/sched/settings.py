"""The daemon's own settings: DET_LOCAL_HOME/daemon.yaml (all optional).

```yaml
scheduler:
  mode: priority          # or fair_share
  preemption: true        # higher-priority work preempts (trials checkpoint, then requeue)
  preemption_timeout: 30  # seconds a trial gets to checkpoint and exit before SIGTERM/SIGKILL
  user_quota: {alice: 2}  # most slots a user may hold at once
  user_weight: {bob: 3}   # fair_share weights (default 1)
slots:
  cpu_slots: 2            # CPU slots when there is no GPU (also DET_LOCAL_CPU_SLOTS)
  foreign_gpus_busy: true # GPUs used by processes det-local did not start count as busy
admin_group: det-local-admin   # members may change anyone's jobs (root always may)
cgroups: auto             # each job in its own cgroup: auto, v2, v1, or false (off); else
                          # DET_LOCAL_CGROUPS decides (same values), else auto
federation: {port: 47800} # see det_local/federate/settings.py and docs/system-mode.md
dashboard: {port: 8080}   # the daemon runs `det-local dashboard` (det_local/web/supervisor.py)
resource_pools:           # where trials may run besides this machine (det_local/pools/)
  hpc: {slurm: {partition: debug}}
```
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from det_local.errors import ConfigError
from det_local.suggest import check_section_keys

DEFAULT_PREEMPTION_TIMEOUT = 30.0
DEFAULT_ADMIN_GROUP = "det-local-admin"


@dataclass(frozen=True)
class DaemonSettings:
    mode: str = "priority"
    preemption: bool = True
    preemption_timeout: float = DEFAULT_PREEMPTION_TIMEOUT
    user_quota: dict[str, int] = field(default_factory=dict)
    user_weight: dict[str, float] = field(default_factory=dict)
    cpu_slots: int | None = None
    foreign_gpus_busy: bool = True
    admin_group: str = DEFAULT_ADMIN_GROUP
    cgroups: str | None = None  # auto | v2 | v1 | off; None: DET_LOCAL_CGROUPS, else auto

    def cgroup_setting(self) -> str:
        """auto | v2 | v1 | off: daemon.yaml's cgroups, else DET_LOCAL_CGROUPS, else auto."""
        import os

        from det_local.sched.run.cgroups import ENV, parse_setting

        if self.cgroups is not None:
            return self.cgroups
        try:
            return parse_setting(os.environ.get(ENV), ENV)
        except ValueError as err:
            raise ConfigError(str(err)) from None


# federation and dashboard: read and checked by det_local.federate and det_local.web (sched
# imports neither)
_TOP = {
    "scheduler",
    "slots",
    "admin_group",
    "cgroups",
    "federation",
    "dashboard",
    # read and checked by det_local.usage.settings
    "system_metrics",
    "idle_policy",
    "idle_threshold",
    # read and checked by det_local.pools
    "resource_pools",
}
_SCHED = {"mode", "preemption", "preemption_timeout", "user_quota", "user_weight"}
_SLOTS = {"cpu_slots", "foreign_gpus_busy"}


def _section(raw: dict[str, Any], key: str, source: str) -> dict[str, Any]:
    value = raw.get(key) or {}
    if not isinstance(value, dict):
        raise ConfigError(f"{key} in {source}: expected a mapping, found {value!r}")
    return value


def load_settings(path: Path) -> DaemonSettings:
    """Read daemon.yaml; defaults when it does not exist; ConfigError naming the field."""
    if not path.exists():
        return DaemonSettings()
    import yaml

    from det_local.config.limits import read_settings_text

    source = str(path)
    try:
        raw = yaml.safe_load(read_settings_text(path)) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{source} is not valid YAML: {err}".replace("\n", " ")) from None
    except OSError as err:
        raise ConfigError(f"cannot read {source}: {err.strerror or err}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: expected a mapping of settings")
    check_section_keys("", raw, _TOP, source)
    sched = _section(raw, "scheduler", source)
    slots = _section(raw, "slots", source)
    check_section_keys("scheduler.", sched, _SCHED, source)
    check_section_keys("slots.", slots, _SLOTS, source)
    mode = sched.get("mode", "priority")
    if mode not in ("priority", "fair_share"):
        raise ConfigError(
            f"scheduler.mode in {source}: expected priority or fair_share, found {mode!r}"
        )
    timeout = sched.get("preemption_timeout", DEFAULT_PREEMPTION_TIMEOUT)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout < 0:
        raise ConfigError(
            f"scheduler.preemption_timeout in {source}: expected seconds >= 0, found {timeout!r}"
        )
    quota = sched.get("user_quota") or {}
    weight = sched.get("user_weight") or {}
    for name, table, kind in (("user_quota", quota, int), ("user_weight", weight, float)):
        if not isinstance(table, dict):
            raise ConfigError(f"scheduler.{name} in {source}: expected user: number pairs")
        for user, value in table.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ConfigError(
                    f"scheduler.{name}.{user} in {source}: expected a number > 0, found {value!r}"
                )
            if kind is int and int(value) != value:
                raise ConfigError(
                    f"scheduler.{name}.{user} in {source}: expected a whole number of slots"
                )
    cpu = slots.get("cpu_slots")
    if cpu is not None and (isinstance(cpu, bool) or not isinstance(cpu, int) or cpu < 1):
        raise ConfigError(f"slots.cpu_slots in {source}: expected an integer >= 1, found {cpu!r}")
    cgroups: str | None = None
    if "cgroups" in raw:
        from det_local.sched.run.cgroups import parse_setting

        try:
            cgroups = parse_setting(raw["cgroups"], f"cgroups in {source}")
        except ValueError as err:
            raise ConfigError(str(err)) from None
    return DaemonSettings(
        mode=mode,
        preemption=bool(sched.get("preemption", True)),
        preemption_timeout=float(timeout),
        user_quota={str(k): int(v) for k, v in quota.items()},
        user_weight={str(k): float(v) for k, v in weight.items()},
        cpu_slots=cpu,
        foreign_gpus_busy=bool(slots.get("foreign_gpus_busy", True)),
        admin_group=str(raw.get("admin_group", DEFAULT_ADMIN_GROUP)),
        cgroups=cgroups,
    )

"""daemon.yaml's settings for system metrics and idle reservations, and `idle_timeout` values.

```yaml
system_metrics:
  enabled: true           # false: no sampling (no system metrics, no idle detection)
  interval: 5             # seconds between samples of each running job (floor 0.1 s)
  profiling_interval: 1   # the rate for trials whose config says profiling: {enabled: true}
  keep_full: 3600         # seconds of samples kept at full rate; older: 1-minute means,
                          # after a day 10-minute means
  max_rows_per_run: 20000 # a job's samples beyond this go, oldest first
idle_threshold: 5         # a slot at or under this GPU utilisation (%) is idle
idle_policy: notify       # or stop; or per kind: {notebook: stop, shell: stop, command: notify}
```
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from det_local.errors import ConfigError

DEFAULT_INTERVAL_S = 5.0
MIN_INTERVAL_S = 0.1  # a rate above 10 samples a second is clamped (one line in the log)
DEFAULT_PROFILING_INTERVAL_S = 1.0
DEFAULT_KEEP_FULL_S = 3600.0
DEFAULT_MAX_ROWS = 20000
DEFAULT_IDLE_THRESHOLD = 5.0
# a job's process tree under this much CPU (% of one core) shows "no CPU activity"
IDLE_CPU_PCT = 2.0
NOTIFY = "notify"
STOP = "stop"
# what idles: the kinds a policy may name (trials are only ever flagged)
IDLE_KINDS = ("command", "notebook", "shell", "tensorboard")
DEFAULT_POLICY = {"command": NOTIFY, "notebook": STOP, "shell": STOP, "tensorboard": STOP}


@dataclass(frozen=True)
class UsageSettings:
    enabled: bool = True
    interval: float = DEFAULT_INTERVAL_S
    profiling_interval: float = DEFAULT_PROFILING_INTERVAL_S
    keep_full: float = DEFAULT_KEEP_FULL_S
    max_rows_per_run: int = DEFAULT_MAX_ROWS
    idle_threshold: float = DEFAULT_IDLE_THRESHOLD
    idle_policy: dict[str, str] = field(default_factory=lambda: dict(DEFAULT_POLICY))
    warnings: tuple[str, ...] = ()  # lines for the daemon's log (a clamped rate)

    def tiers(self) -> list[tuple[float, float]]:
        """(age, span) pairs for the downsampling: 1-minute means after keep_full, 10-minute
        means after a day."""
        return [(self.keep_full, 60.0), (max(self.keep_full, 86400.0), 600.0)]

    def policy(self, kind: str) -> str:
        return self.idle_policy.get(kind.lower(), NOTIFY)


def _seconds(value: Any, where: str, source: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ConfigError(f"{where} in {source}: expected seconds (e.g. 5 or 5s), found {value!r}")
    try:
        return parse_duration(value, where=f"{where} in {source}", allow_zero=False)
    except ConfigError:
        raise


def _interval(raw: Any, where: str, source: str, default: float, warnings: list[str]) -> float:
    if raw is None:
        return default
    secs = _seconds(raw, where, source)
    if secs < MIN_INTERVAL_S:
        warnings.append(
            f"{where} in {source} is {raw!r}: clamped to {MIN_INTERVAL_S:g} s, the fastest "
            "det-local samples"
        )
        return MIN_INTERVAL_S
    return secs


def load_usage_settings(path: Path) -> UsageSettings:
    """Read daemon.yaml's system_metrics, idle_threshold and idle_policy (defaults where the
    file or a field is missing); ConfigError naming the field."""
    if not path.exists():
        return UsageSettings()
    import yaml

    source = str(path)
    from det_local.config.limits import read_settings_text

    try:
        raw = yaml.safe_load(read_settings_text(path)) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{source} is not valid YAML: {err}".replace("\n", " ")) from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: expected a mapping of settings")
    sm = raw.get("system_metrics")
    if sm is None:
        sm = {}
    if sm is False:
        sm = {"enabled": False}
    if not isinstance(sm, dict):
        raise ConfigError(f"system_metrics in {source}: expected a mapping, found {sm!r}")
    allowed = {"enabled", "interval", "profiling_interval", "keep_full", "max_rows_per_run"}
    from det_local.suggest import check_section_keys

    check_section_keys("system_metrics.", sm, allowed, source)
    warnings: list[str] = []
    interval = _interval(
        sm.get("interval"), "system_metrics.interval", source, DEFAULT_INTERVAL_S, warnings
    )
    profiling = _interval(
        sm.get("profiling_interval"),
        "system_metrics.profiling_interval",
        source,
        DEFAULT_PROFILING_INTERVAL_S,
        warnings,
    )
    keep = sm.get("keep_full", DEFAULT_KEEP_FULL_S)
    keep_s = _seconds(keep, "system_metrics.keep_full", source)
    rows = sm.get("max_rows_per_run", DEFAULT_MAX_ROWS)
    if isinstance(rows, bool) or not isinstance(rows, int) or rows < 100:
        raise ConfigError(
            f"system_metrics.max_rows_per_run in {source}: expected a whole number >= 100, "
            f"found {rows!r}"
        )
    threshold = raw.get("idle_threshold", DEFAULT_IDLE_THRESHOLD)
    if (
        isinstance(threshold, bool)
        or not isinstance(threshold, (int, float))
        or not 0 <= threshold <= 100
    ):
        raise ConfigError(
            f"idle_threshold in {source}: expected a GPU utilisation in percent (0 to 100), "
            f"found {threshold!r}"
        )
    return UsageSettings(
        enabled=sm.get("enabled", True) is not False,
        interval=interval,
        profiling_interval=profiling,
        keep_full=keep_s,
        max_rows_per_run=rows,
        idle_threshold=float(threshold),
        idle_policy=_policy(raw.get("idle_policy"), source),
        warnings=tuple(warnings),
    )


def _policy(raw: Any, source: str) -> dict[str, str]:
    if raw is None:
        return dict(DEFAULT_POLICY)
    if isinstance(raw, str):
        raw = dict.fromkeys(IDLE_KINDS, raw)
    if not isinstance(raw, dict):
        raise ConfigError(
            f"idle_policy in {source}: expected notify, stop, or a mapping of kind to either "
            f"(kinds: {', '.join(IDLE_KINDS)}), found {raw!r}"
        )
    out = dict(DEFAULT_POLICY)
    for kind, value in raw.items():
        if kind not in IDLE_KINDS:
            raise ConfigError(
                f"idle_policy.{kind} in {source}: not a kind that idles; the kinds are "
                f"{', '.join(IDLE_KINDS)} (trials are only ever flagged)"
            )
        if value not in (NOTIFY, STOP):
            raise ConfigError(
                f"idle_policy.{kind} in {source}: expected notify or stop, found {value!r}"
            )
        out[str(kind)] = str(value)
    return out


_UNITS = {"": 1.0, "ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_DURATION = re.compile(r"^\s*([+-]?\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$")


def parse_duration(value: Any, *, where: str = "idle_timeout", allow_zero: bool = False) -> float:
    """`30m`, `2s`, `1h`, `90` (seconds), `1.5h` -> seconds; ConfigError naming `where` for
    anything else (0 unless allow_zero, negatives, words)."""
    text = str(value)
    m = _DURATION.match(text) if not isinstance(value, bool) else None
    if m is None:
        raise ConfigError(
            f"{where}: {text!r} is not a duration; write a number with a unit, e.g. 30m, 2h, "
            "90s (s, m, h, d; a bare number is seconds)"
        )
    secs = float(m.group(1)) * _UNITS[m.group(2) or ""]
    if secs < 0 or not math.isfinite(secs):
        raise ConfigError(
            f"{where}: {text!r} is negative; give a time after which to act, e.g. 30m"
        )
    if secs == 0 and not allow_zero:
        raise ConfigError(
            f"{where}: {text!r} is zero, which would end the job at once; give a time, e.g. "
            "30m (leave it out to never time out)"
        )
    return secs


TASK_CONFIG_KEYS = ("idle_timeout",)


def parse_task_config(items: list[str] | None) -> dict[str, float]:
    """`--config KEY=VALUE` of a command, notebook or shell (Determined's task config keys
    det-local acts on: idle_timeout) -> {"idle_timeout": seconds}."""
    out: dict[str, float] = {}
    for item in items or []:
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq:
            raise ConfigError(f"--config {item!r}: expected KEY=VALUE, e.g. idle_timeout=30m")
        if key not in TASK_CONFIG_KEYS:
            from det_local.suggest import closest  # `cmd run` without a typo need not load it

            near = closest(key, TASK_CONFIG_KEYS)
            hint = f"did you mean '{near}'?" if near else "the keys are idle_timeout"
            raise ConfigError(f"--config: unknown key '{key}'; {hint}")
        out[key] = parse_duration(value.strip(), where=f"--config {key}")
    return out

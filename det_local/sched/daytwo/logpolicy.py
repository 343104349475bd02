"""Determined 0.38's `log_policies`: regexes matched on a trial's output.

Each policy has a `name` (a label shown on the trial once its output matched: `trial
describe`, `trial list`, the JSON), a `pattern` and an optional `action`:

* `cancel_retries`: a trial that fails with a match is not restarted (ERROR at once);
* `exclude_node`: Determined would restart it on another node; on one machine det-local
  cannot, so a failure with a match is not restarted either (the config warns).

Determined's two default policies (`CUDA OOM`, `ECC Error`) label only; a policy of the same
name replaces one, and a name without a pattern turns it off. The legacy shape
`{pattern, action: {type: ...}}` (no name) is labelled by its pattern.

Bounded work: when a trial's run exits, the last SCAN_BYTES of its output are read, each line
cut to LINE_BYTES; matches are recorded in the store once (`store/tables/logpolicies.py`)."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from det_local.store.db import Store

SCAN_BYTES = 2 * 1024 * 1024
LINE_BYTES = 16 * 1024
CANCEL = "cancel_retries"
EXCLUDE = "exclude_node"
DEFAULTS = (
    ("CUDA OOM", r".*CUDA out of memory.*"),
    ("ECC Error", r".*uncorrectable ECC error encountered.*"),
)


@dataclass(frozen=True)
class LogPolicy:
    name: str
    pattern: re.Pattern[str]
    action: str  # "", cancel_retries or exclude_node


def policies(configured: list[dict[str, Any]]) -> list[LogPolicy]:
    """The experiment's policies: Determined's defaults, then the config's over them."""
    chosen: dict[str, tuple[str, str]] = {name: (pattern, "") for name, pattern in DEFAULTS}
    for item in configured:
        action = item.get("action")
        kind = action.get("type") if isinstance(action, dict) else action
        pattern = item.get("pattern")
        name = item.get("name") or pattern
        if name is None:
            continue
        if pattern is None:  # a name alone turns a default off
            chosen.pop(name, None)
            continue
        chosen[name] = (pattern, kind or "")
    out = []
    for name, (pattern, kind) in chosen.items():
        try:
            out.append(LogPolicy(name, re.compile(pattern), kind))
        except re.error:  # checked at submission (config/sections.py); an old record
            continue
    return out


def scan(path: Path, rules: list[LogPolicy]) -> list[LogPolicy]:
    """The policies the last SCAN_BYTES of the log at `path` match."""
    if not rules:
        return []
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            f.seek(max(0, size - SCAN_BYTES))
            data = f.read(SCAN_BYTES)
    except OSError:
        return []
    left = list(rules)
    found = []
    for raw in data.splitlines():
        line = raw[:LINE_BYTES].decode("utf-8", "replace")
        for rule in list(left):
            if rule.pattern.search(line):
                found.append(rule)
                left.remove(rule)
        if not left:
            break
    return found


def on_exit(
    store: Store, log: Path, trial_id: int, configured: list[dict[str, Any]]
) -> LogPolicy | None:
    """Record the policies the trial's output matched; the one whose action stops its
    restarts (cancel_retries or exclude_node), if any matched, now or in an earlier run."""
    for rule in scan(log, policies(configured)):
        store.log_policies.add(trial_id, rule.name, rule.action)
    for name, action in store.log_policies.matched(trial_id):
        if action in (CANCEL, EXCLUDE):
            return LogPolicy(name, re.compile(""), action)
    return None

"""Nothing in a config is silently ignored: each key det-local parses but does not act on
gets one warning line naming the key and what det-local does instead (config check, run)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from det_local.config import parse_config
from det_local.config.ignored import EXCLUDE_NODE, INSTEAD

BASE = {
    "name": "ign",
    "entrypoint": "python3 train.py",
    "searcher": {"name": "single", "metric": "loss"},
}
EVERYTHING = {
    **BASE,
    "bind_mounts": [{"host_path": "/data", "container_path": "/data"}],
    "resources": {"devices": ["/dev/fuse:/dev/fuse"], "shm_size": "4G"},
    "environment": {"ports": {"web": 8080}, "proxy_ports": [{"proxy_port": 8080}]},
    "integrations": {"webhooks": {"webhook_name": ["x"]}, "pachyderm": {"dataset": {}}},
    "log_policies": [
        {"name": "ecc", "pattern": ".*ECC.*", "action": "exclude_node"},
        {"name": "oom", "pattern": ".*OOM.*", "action": "cancel_retries"},
    ],
    "retention_policy": {"log_retention_days": 3},
}


def _expected(source: str) -> list[str]:
    return [f"{key} in {source}: {what}" for key, what in INSTEAD.items()] + [
        f"log_policies[0].action in {source}: {EXCLUDE_NODE}"
    ]


def test_each_ignored_key_warns_once_naming_what_det_local_does() -> None:
    cfg = parse_config(EVERYTHING, source="c.yaml")
    assert list(cfg.warnings) == _expected("c.yaml")
    # exact wording of two of them; resource_pool is acted on (the README's table quotes these)
    pooled = parse_config({**BASE, "resources": {"resource_pool": "gpus"}}, source="c.yaml")
    assert pooled.warnings == ()  # resource pools exist (a Slurm pool, or an error at submission)
    assert (
        "resources.shm_size in c.yaml: ignored: det-local runs trials without containers; "
        "trials share this machine's /dev/shm"
    ) in cfg.warnings
    assert (
        "bind_mounts in c.yaml: ignored: det-local runs trials without containers; trials see "
        "this machine's files at their own paths (use host paths in your code)"
    ) in cfg.warnings


def test_keys_det_local_acts_on_or_left_default_do_not_warn() -> None:
    cfg = parse_config(
        {
            **BASE,
            "bind_mounts": [],
            "resources": {"devices": [], "resource_pool": "gpus"},
            "environment": {"ports": {}, "proxy_ports": []},
            "integrations": {"webhooks": None},
            # implemented: labels and cancel_retries, log retention
            "log_policies": [{"name": "oom", "pattern": "OOM", "action": "cancel_retries"}],
            "retention_policy": {"log_retention_days": 3},
        },
        source="c.yaml",
    )
    assert cfg.warnings == ()


def _cli(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, DET_LOCAL_HOME=str(tmp_path / "home"))
    return subprocess.run(
        [sys.executable, "-m", "det_local.cli.main", *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )


def test_config_check_and_run_print_one_line_each(tmp_path: Path) -> None:
    import yaml

    (tmp_path / "c.yaml").write_text(yaml.safe_dump(EVERYTHING))
    (tmp_path / "train.py").write_text("print('trained')\n")
    expected = [f"warning: {line}" for line in _expected("c.yaml")]
    r = _cli(tmp_path, "config", "check", "c.yaml", ".")
    assert r.returncode == 0, r.stderr
    assert r.stderr.splitlines() == expected
    # a deprecated key det-local honours: config check says so; run does not (not ignored)
    deprecated = {**EVERYTHING, "searcher": {**BASE["searcher"], "max_length": 1}}
    (tmp_path / "d.yaml").write_text(yaml.safe_dump(deprecated))
    r = _cli(tmp_path, "config", "check", "d.yaml", ".")
    assert r.stderr.splitlines()[-1] == (
        "deprecated: searcher.max_length in d.yaml: deprecated in Determined 0.38 (still "
        "honoured); the trial decides its length, or ASHA uses time_metric/max_time"
    ), r.stderr
    r = _cli(tmp_path, "config", "check", "c.yaml", ".", "--json")
    assert json.loads(r.stdout)["warnings"] == _expected("c.yaml")
    # at submission: before the experiment's id, once
    r = _cli(tmp_path, "run", "d.yaml", ".")
    assert r.returncode == 0, r.stderr
    assert r.stderr.splitlines()[: len(expected)] == [
        e.replace("c.yaml", "d.yaml") for e in expected
    ]
    assert "deprecated" not in r.stderr, r.stderr
    assert "trained" in r.stdout

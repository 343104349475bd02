"""A Slurm pool's staged directory names (`slurm/stage.py`): keyed by the daemon's secret, so
another user of the world-writable stage_dir cannot make a run's directory first; the same at
every start of the daemon (adoption, removal); `config check` shows a placeholder and makes no
key. The run itself with a squatter on the old predictable name: tests/slurm/test_slurm_remote.py
::test_a_trial_on_a_node_without_the_state_dir_reports_over_tcp."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

from det_local.slurm import stage
from det_local.slurm.config import parse_slurm_pool
from det_local.store.paths import Paths
from det_local.store.private import PrivateFiles
from tests.support.world import Env

INFO = "/var/lib/det-local/experiments/1/trials/1/runs/1"


def key_of(home: Path) -> bytes:
    private = PrivateFiles(Paths(home))
    private.ensure()
    return stage.name_key(private.key())


def test_staged_names_are_keyed_by_the_daemons_secret(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    pool = parse_slurm_pool("hpc", {"partition": "debug", "stage_dir": str(tmp_path)}, "x")
    mine = stage.root_of(pool, INFO, key_of(tmp_path / "a"))
    assert re.fullmatch(r"det-local-[0-9a-f]{32}", mine.name), mine
    assert mine.parent == tmp_path
    # deterministic: the same daemon (a fresh read of its key, as after a restart)
    assert stage.root_of(pool, INFO, key_of(tmp_path / "a")) == mine
    # not the plain hash of the path anyone could compute
    old = f"det-local-{hashlib.sha256(INFO.encode()).hexdigest()[:16]}"
    assert stage.legacy_root_of(pool, INFO).name == old
    assert mine.name != old and not mine.name.startswith(old)
    # another home (another daemon key): another name for the same info directory
    assert stage.root_of(pool, INFO, key_of(tmp_path / "b")) != mine
    # another run of the same daemon: another name
    assert stage.root_of(pool, INFO.replace("runs/1", "runs/2"), key_of(tmp_path / "a")) != mine
    # the staging key is not the daemon key itself (it names things other users see)
    daemon_key = PrivateFiles(Paths(tmp_path / "a")).key()
    assert stage.name_key(daemon_key) != daemon_key


def test_an_adopted_run_finds_its_keyed_or_legacy_directory(tmp_path: Path) -> None:
    pool = parse_slurm_pool("hpc", {"partition": "debug", "stage_dir": str(tmp_path)}, "x")
    (tmp_path / "home").mkdir()
    key = key_of(tmp_path / "home")
    keyed, legacy = stage.root_of(pool, INFO, key), stage.legacy_root_of(pool, INFO)
    assert stage.adopted_root(pool, INFO, key) == keyed  # neither: the keyed name
    legacy.mkdir()  # a run an older det-local started, adopted after the upgrade
    assert stage.adopted_root(pool, INFO, key) == legacy
    keyed.mkdir()  # both: always the keyed one (the legacy one may be anyone's)
    assert stage.adopted_root(pool, INFO, key) == keyed


def test_config_check_shows_a_placeholder_and_makes_no_key(dl: Env, tmp_path: Path) -> None:
    stage_dir = tmp_path / "stage"
    stage_dir.mkdir()
    dl.settings(
        {"resource_pools": {"hpc": {"slurm": {"partition": "debug", "stage_dir": str(stage_dir)}}}}
    )
    cfg, ctx = dl.context("print('x')\n", {"resources": {"resource_pool": "hpc"}})
    r = dl.det("config", "check", cfg, ctx)
    assert r.rc == 0, r
    script = r.out.split("# batch script (resource pool hpc: each trial run is one Slurm job)\n")[1]
    lines = script.splitlines()
    staged = f"{stage_dir}/det-local-<keyed name>"
    assert f"#SBATCH '--output={staged}/output.log'" in lines, script
    assert f"export DET_LOCAL_INFO_DIR='{staged}/info'" in lines, script
    assert not dl.paths.daemon_key.exists()
    assert list(stage_dir.iterdir()) == []

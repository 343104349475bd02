"""`det-local run --test` and the pytest plugin, on Core API scripts (no torch: fast)."""

from __future__ import annotations

from tests.support.paths import REPO
from tests.support.trials.testmode import SCRIPT, run_pytest, script_config
from tests.support.world import Env


def test_test_mode_passes_every_step(dl: Env) -> None:
    cfg, ctx = dl.context(SCRIPT, script_config())
    r = dl.det("run", "--test", cfg, ctx)
    assert r.rc == 0, r.out + r.err
    assert "PASS  train one batch: training metrics at steps_completed=1" in r.out
    assert "PASS  validate" in r.out
    assert "PASS  checkpoint" in r.out
    assert (
        "PASS  restore the checkpoint in a new process and train one more batch: "
        "trained to steps_completed=2" in r.out
    )
    assert r.out.rstrip().endswith("Test mode: PASSED")
    exp = dl.experiment(1)
    # Determined's --test rewrite: one short trial, no restarts, hparams sampled once
    assert exp.config["max_restarts"] == 0
    assert exp.config["searcher"]["max_length"] == {"batches": 1}
    assert exp.config["hyperparameters"]["lr"]["type"] == "const"
    assert exp.description.startswith("[test-mode]")


def test_test_mode_reports_the_failing_step_with_its_traceback(dl: Env) -> None:
    cfg, ctx = dl.context(SCRIPT, script_config("validate"))
    r = dl.det("run", "--test", cfg, ctx)
    assert r.rc == 1
    assert "PASS  train one batch" in r.out
    assert "FAIL  validate: the first run reported no validation metrics" in r.out
    assert "traceback from the trial (validate)" in r.out
    assert "ValueError: validation broke" in r.out
    assert "Test mode: FAILED" in r.out


def test_test_mode_without_checkpoint(dl: Env) -> None:
    cfg, ctx = dl.context(SCRIPT, script_config("checkpoint"))
    r = dl.det("run", "--test", cfg, ctx)
    assert r.rc == 1
    assert "FAIL  checkpoint: the first run recorded no checkpoint" in r.out
    assert "not run: there was no checkpoint to restore" in r.out


def test_test_mode_restore_failure(dl: Env) -> None:
    cfg, ctx = dl.context(SCRIPT, script_config("restore"))
    r = dl.det("run", "--test", cfg, ctx)
    assert r.rc == 1
    assert "PASS  checkpoint" in r.out
    assert "FAIL  restore the checkpoint in a new process" in r.out
    assert "RuntimeError: cannot load the checkpoint" in r.out


def test_pytest_plugin_fixture_and_det_configs(dl: Env) -> None:
    good_cfg, good_ctx = dl.context(SCRIPT, script_config(), name="good")
    bad_cfg, _ = dl.context(SCRIPT, script_config("restore"), name="bad")
    suite = dl.tmp / "suite"
    suite.mkdir()
    (suite / "test_exp.py").write_text(
        "def test_good(det_local_test_mode):\n"
        f"    report = det_local_test_mode({str(good_cfg)!r}, {str(good_ctx)!r})\n"
        "    assert report.passed and report.checkpoint_path\n"
        "    assert [m['steps_completed'] for m in report.training] == [1, 2]\n"
        "    assert report.validation[0]['metrics'] == {'loss': 0.5}\n"
    )
    proc = run_pytest(suite, "--det-configs", str(good_cfg), str(bad_cfg), "--rootdir", str(suite))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "2 passed, 1 failed" in out or "1 failed, 2 passed" in out, out
    assert "det-config[" in out
    assert "FAIL  restore the checkpoint in a new process" in out
    assert "RuntimeError: cannot load the checkpoint" in out
    assert str(REPO)  # the plugin came from the installed det-local, not from a conftest

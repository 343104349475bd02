"""`run` and `experiment create` take `--config KEY=VALUE` (Determined's `det e create
--config`, dotted keys, YAML values, checked as the file is) and `--pool NAME` (issue 36): the
same YAML sent elsewhere or with other values without editing it, embedded and through the
daemon alike."""

from __future__ import annotations

import contextlib

from tests.support.trials.core import CORE, core_config
from tests.support.world import Env, one_line_error, wait_for

CPU1 = {"DET_LOCAL_FAKE_GPUS": "0", "DET_LOCAL_CPU_SLOTS": "1"}


def _ran(dl: Env, exp: int, steps: int, hparams: dict[str, object]) -> None:
    with contextlib.closing(dl.store()) as store:
        assert str(store.get_experiment(exp).state) == "COMPLETED"
        (trial,) = store.list_trials(exp)
        assert trial.hparams == hparams and trial.steps_completed == steps
        assert store.get_experiment(exp).config["hyperparameters"]["steps"]["val"] == steps
    assert f"trained {steps} steps" in dl.paths.trial_log(exp, trial.id).read_text()


def test_config_edits_reach_the_trial_embedded_and_through_the_daemon(dl: Env) -> None:
    dl.setenv(**CPU1)
    cfg, ctx = dl.context(CORE, core_config(hyperparameters={"steps": 6, "best_at": 4}))
    edits = ("--config", "hyperparameters.steps=8", "--config", "searcher.max_length=8")
    # embedded (no daemon runs); a YAML 1.2 value as the file reads it: 1e-3 is a float
    r = dl.det(
        "run", "-q", *edits, "--config", "hyperparameters.lr=1e-3", "--pool", "default", cfg, ctx
    )
    assert r.rc == 0 and r.out.startswith("Created experiment 1\n"), r
    _ran(dl, 1, 8, {"steps": 8, "best_at": 4, "lr": 0.001})
    with contextlib.closing(dl.store()) as store:
        assert store.get_experiment(1).config["resources"]["resource_pool"] == "default"

    # through the daemon: `experiment create` and `run --detach`
    dl.daemon_start()
    r = dl.det("experiment", "create", *edits, "--config", "hyperparameters.best_at=2", cfg, ctx)
    assert r.rc == 0 and r.out.strip() == "Created experiment 2", r
    r = dl.det("run", "--detach", "--config", "hyperparameters.steps=4", cfg, ctx)
    assert r.rc == 0, r
    wait_for(lambda: dl.experiment(3).state.terminal, timeout=120, what="experiment 3")
    wait_for(lambda: dl.experiment(2).state.terminal, timeout=120, what="experiment 2")
    _ran(dl, 2, 8, {"steps": 8, "best_at": 2})
    _ran(dl, 3, 4, {"steps": 4, "best_at": 4})
    # the file itself is untouched: the edits were laid over it
    assert "steps: 6" in cfg.read_text()


def test_bad_config_edits_and_pools_are_refused_in_one_line(dl: Env) -> None:
    dl.setenv(**CPU1)
    cfg, ctx = dl.context(CORE, core_config())
    for verb in (("run",), ("experiment", "create", "-f")):
        det = (*verb, cfg, ctx)
        one_line_error(
            dl.det(*det, "--config", "searcher.max_lenght=3"),
            f"{cfg} with the --config edits",
            "max_lenght",
            "did you mean 'max_length'?",
        )
        one_line_error(
            dl.det(*det, "--config", "hyperparamters.steps=3"),
            "hyperparamters",
            "did you mean 'hyperparameters'?",
        )
        one_line_error(
            dl.det(*det, "--config", "hyperparameters.stepz=3"),
            f"--config hyperparameters.stepz: {cfg} has no hyperparameters.stepz; "
            "did you mean 'hyperparameters.steps'?",
        )
        one_line_error(
            dl.det(*det, "--config", "searcher.max_length=-3"), "searcher.max_length", "-3"
        )
        one_line_error(
            dl.det(*det, "--config", "resources.slots_per_trial=two"),
            "resources.slots_per_trial",
            "'two'",
        )
        one_line_error(
            dl.det(*det, "--config", "hyperparameters.steps=[1"),
            "--config hyperparameters.steps",
            "malformed YAML",
        )
        one_line_error(
            dl.det(*det, "--config", "steps"),
            "--config 'steps': expected KEY=VALUE with a dotted key",
        )
        one_line_error(
            dl.det(*det, "--pool", "gpus"),
            "--pool: pool 'gpus' does not exist; pools: default "
            f"(add it under resource_pools: in {dl.paths.settings})",
        )
    # a pool daemon.yaml names is listed (no Slurm needed to refuse another)
    dl.settings({"resource_pools": {"hpc": {"slurm": {"partition": "debug"}}}})
    one_line_error(
        dl.det("run", "--pool", "gpu", cfg, ctx),
        "--pool: pool 'gpu' does not exist; pools: default, hpc",
    )
    # the same through a running daemon
    dl.daemon_start()
    one_line_error(
        dl.det("experiment", "create", "--pool", "gpu", cfg, ctx),
        "--pool: pool 'gpu' does not exist; pools: default, hpc",
    )
    one_line_error(
        dl.det("experiment", "create", "--config", "searcher.metrc=val", cfg, ctx),
        "metrc",
        "did you mean 'metric'?",
    )
    with contextlib.closing(dl.store()) as store:
        assert store.list_experiments() == []  # nothing was submitted

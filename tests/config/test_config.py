"""det_local.config: loading, validation messages, defaults, units, hyperparameters."""

from __future__ import annotations

import copy
import json
import random
import re
import time
from pathlib import Path
from typing import Any

import pytest

from det_local.config import (
    CategoricalHP,
    ConfigError,
    ConstHP,
    DoubleHP,
    ExperimentConfig,
    IntHP,
    Length,
    LogHP,
    NestedHP,
    load_config,
    make_test_config,
    memory_bytes,
    parse_config,
    sample_hparams,
)
from tests.support import paths

FIXTURES = paths.FIXTURES / "configs"
FIXTURE_FILES = sorted(FIXTURES.glob("*.yaml"))

BASE: dict[str, Any] = {
    "entrypoint": "python3 train.py",
    "searcher": {"name": "single", "metric": "loss"},
}


def config(**overrides: Any) -> dict[str, Any]:
    raw = copy.deepcopy(BASE)
    raw.update(overrides)
    return raw


def searcher(**fields: Any) -> dict[str, Any]:
    return {"name": "single", "metric": "loss", **fields}


def error_of(raw: Any) -> str:
    with pytest.raises(ConfigError) as info:
        parse_config(raw, "config.yaml")
    return str(info.value)


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return path


# -- the shapes Determined users have -------------------------------------------------------


def test_trainer_037_shape() -> None:
    cfg = load_config(FIXTURES / "trainer_const_037.yaml")
    assert cfg.name == "mnist_pytorch_const"
    assert cfg.searcher.name == "single"
    assert cfg.searcher.metric == "validation_loss"
    assert cfg.searcher.max_length == Length.batches(1000)
    assert cfg.searcher.max_length.to_dict() == {"batches": 1000}
    assert cfg.entrypoint == "python3 -m determined.launch.torch_distributed python3 train.py"
    assert not cfg.entrypoint_is_legacy_trial
    assert cfg.hyperparameters["learning_rate"] == ConstHP(1.0)
    # honoured, deprecated: config check says so, run does not (nothing is ignored)
    assert any("searcher.max_length" in w and "deprecated" in w for w in cfg.deprecations)


def test_legacy_trial_shape() -> None:
    cfg = load_config(FIXTURES / "legacy_trial.yaml")
    assert cfg.entrypoint == "model_def:MNistTrial"
    assert cfg.entrypoint_is_legacy_trial
    assert cfg.global_batch_size == 64
    assert cfg.min_validation_period == Length.batches(100)
    assert cfg.min_checkpoint_period == Length.epochs(1)
    assert cfg.records_per_epoch == 60000
    assert cfg.scheduling_unit == 50
    assert cfg.perform_initial_validation is True
    assert cfg.max_restarts == 0
    assert cfg.optimizations.aggregation_frequency == 2
    assert cfg.optimizations.mixed_precision == "O1"
    assert cfg.optimizations.average_training_metrics is True
    assert cfg.data == {"url": "https://example.invalid/mnist.tar.gz"}
    assert cfg.name == "Experiment (MNistTrial)"
    assert cfg.description == "mnist_pytorch_const"
    # epochs -> batches through records_per_epoch and global_batch_size
    assert cfg.searcher.max_length is not None
    assert cfg.searcher.max_length.to_batches(64, cfg.records_per_epoch) == 60000 // 64
    warned = " ".join(cfg.deprecations)
    for field in ("entrypoint", "min_validation_period", "scheduling_unit", "optimizations"):
        assert f"{field} in " in warned


def test_legacy_entrypoint_patterns() -> None:
    def legacy(entrypoint: Any) -> bool:
        return parse_config(config(entrypoint=entrypoint)).entrypoint_is_legacy_trial

    assert legacy("model_def:MNistTrial")
    assert legacy("pkg.sub.model_def:Trial_2")
    assert not legacy("python3 train.py")
    assert not legacy("python3 -m determined.launch.torch_distributed --trial model_def:T")
    assert not legacy(["model_def:MNistTrial"])


def test_core_api_038_asha() -> None:
    cfg = load_config(FIXTURES / "core_hpsearch_038.yaml")
    s = cfg.searcher
    assert (s.name, s.time_metric, s.max_time, s.max_trials) == (
        "adaptive_asha",
        "batches",
        100,
        10,
    )
    assert s.max_length is None
    assert s.max_concurrent_trials == 2
    assert (s.mode, s.divisor, s.max_rungs, s.bracket_rungs) == ("standard", 4.0, 5, ())
    assert s.stop_once is None
    assert s.asha_budget() == ("batches", 100)
    assert cfg.hyperparameters["increment_by"] == IntHP(1, 8)
    assert cfg.warnings == ()


def test_asha_037_shape() -> None:
    cfg = load_config(FIXTURES / "asha_037.yaml")
    s = cfg.searcher
    assert s.max_length == Length.batches(937)
    assert s.time_metric is None and s.max_time is None
    assert s.mode == "aggressive"
    assert s.stop_once is False
    assert s.asha_budget() == ("batches", 937)
    hps = cfg.hyperparameters
    assert hps["learning_rate"] == LogHP(-4.0, -1.0, 10.0)
    assert hps["n_filters1"] == IntHP(8, 64)
    assert hps["dropout1"] == DoubleHP(0.2, 0.8)
    assert hps["optimizer"] == CategoricalHP(["sgd", "adam"])
    assert cfg.resources.slots_per_trial == 2
    assert cfg.resources.effective_priority == 10
    storage = cfg.checkpoint_storage
    assert storage is not None and storage.type == "shared_fs"
    assert (storage.save_experiment_best, storage.save_trial_best, storage.save_trial_latest) == (
        0,
        2,
        1,
    )
    assert storage.path == "/tmp/det-checkpoints/mnist"
    assert storage.propagation == "rprivate"
    assert "searcher.stop_once" in " ".join(cfg.warnings)  # ignored by ASHA
    assert "searcher.max_length" in " ".join(cfg.deprecations)  # honoured


def test_grid_nested_and_env() -> None:
    cfg = load_config(FIXTURES / "grid_nested.yaml")
    assert cfg.entrypoint == ["python3", "train.py", "--quiet"]
    assert cfg.name == "noop-grid"
    opt = cfg.hyperparameters["optimizer"]
    assert isinstance(opt, NestedHP)
    assert opt.hps == {"lr": DoubleHP(0.001, 0.1, 3), "momentum": ConstHP(0.9)}
    assert cfg.searcher.max_concurrent_trials == 4
    assert cfg.labels == ["smoke", "grid"]
    env = cfg.environment
    assert env.environment_variables == ["OMP_NUM_THREADS=2", "NCCL_DEBUG=INFO"]
    assert env.environment_variables_by_device["cuda"] == env.environment_variables
    assert env.variables_for("cpu") == {"OMP_NUM_THREADS": "2", "NCCL_DEBUG": "INFO"}
    assert env.environment_variables_raw == ["OMP_NUM_THREADS=2", "NCCL_DEBUG=INFO"]


def test_searcher_max_length_optional_in_038_for_single_random_grid() -> None:
    for name, extra in (("single", {}), ("random", {"max_trials": 3}), ("grid", {})):
        cfg = parse_config(config(searcher={"name": name, "metric": "loss", **extra}))
        assert cfg.searcher.max_length is None
    random_cfg = parse_config(config(searcher={"name": "random", "metric": "m", "max_trials": 3}))
    assert random_cfg.searcher.max_concurrent_trials == 16


def test_async_halving_both_shapes() -> None:
    new = parse_config(
        config(
            searcher={
                "name": "async_halving",
                "metric": "loss",
                "num_rungs": 3,
                "max_trials": 8,
                "time_metric": "epochs",
                "max_time": 9,
            }
        )
    )
    assert new.searcher.asha_budget() == ("epochs", 9)
    assert new.searcher.divisor == 4.0
    old = parse_config(
        config(
            searcher={
                "name": "async_halving",
                "metric": "loss",
                "num_rungs": 3,
                "max_trials": 8,
                "max_length": {"records": 6400},
            }
        )
    )
    assert old.searcher.max_length == Length.records(6400)


# -- defaults -------------------------------------------------------------------------------


def test_defaults_filled() -> None:
    before = int(time.time())
    cfg = parse_config(copy.deepcopy(BASE))
    after = int(time.time())
    assert cfg.max_restarts == 5
    assert cfg.searcher.smaller_is_better is True
    assert cfg.scheduling_unit == 100
    assert cfg.resources.slots_per_trial == 1
    assert cfg.resources.max_slots is None
    assert cfg.resources.weight == 1.0
    assert cfg.resources.priority is None
    assert cfg.resources.effective_priority == 42
    assert cfg.resources.resource_pool == ""
    assert cfg.min_validation_period == Length.batches(0)
    assert cfg.min_checkpoint_period == Length.batches(0)
    assert cfg.checkpoint_policy == "best"
    assert cfg.perform_initial_validation is False
    assert cfg.records_per_epoch == 0
    assert cfg.checkpoint_storage is None
    assert cfg.description is None
    assert cfg.labels == [] and cfg.data == {} and cfg.hyperparameters == {}
    assert cfg.debug is False
    assert cfg.preemption_timeout is None
    assert cfg.optimizations.aggregation_frequency == 1
    assert cfg.profiling.enabled is False and cfg.profiling.sync_timings is True
    assert before <= cfg.reproducibility.experiment_seed <= after
    assert cfg.name == "Experiment (train.py)"
    assert cfg.environment.environment_variables == []
    assert cfg.warnings == ()


def test_checkpoint_storage_save_defaults() -> None:
    cfg = parse_config(config(checkpoint_storage={"type": "shared_fs", "host_path": "/data"}))
    storage = cfg.checkpoint_storage
    assert storage is not None
    assert (storage.save_experiment_best, storage.save_trial_best, storage.save_trial_latest) == (
        0,
        1,
        1,
    )
    assert storage.path == "/data"
    assert cfg.to_dict()["checkpoint_storage"] == {
        "type": "shared_fs",
        "host_path": "/data",
        "storage_path": None,
        "propagation": "rprivate",
        "save_experiment_best": 0,
        "save_trial_best": 1,
        "save_trial_latest": 1,
    }


def test_checkpoint_storage_without_type_keeps_gc_settings() -> None:
    cfg = parse_config(config(checkpoint_storage={"save_trial_latest": 3}))
    storage = cfg.checkpoint_storage
    assert storage is not None and storage.type is None and storage.path is None
    assert storage.save_trial_latest == 3
    inferred = parse_config(config(checkpoint_storage={"host_path": "/ckpt"})).checkpoint_storage
    assert inferred is not None and inferred.type == "shared_fs"


def test_checkpoint_storage_directory_and_absolute_storage_path() -> None:
    cfg = parse_config(config(checkpoint_storage={"type": "directory", "container_path": "/ck"}))
    assert cfg.checkpoint_storage is not None and cfg.checkpoint_storage.path == "/ck"
    sub = {"type": "shared_fs", "host_path": "/data", "storage_path": "/data/exp1"}
    storage = parse_config(config(checkpoint_storage=sub)).checkpoint_storage
    assert storage is not None and storage.path == "/data/exp1"


def test_null_means_default() -> None:
    cfg = parse_config(
        config(
            max_restarts=None,
            resources={"slots_per_trial": None, "priority": None},
            searcher={"name": "random", "metric": "m", "max_trials": 2, "smaller_is_better": None},
            hyperparameters=None,
            environment=None,
            min_validation_period=None,
            labels=None,
        )
    )
    assert cfg.max_restarts == 5
    assert cfg.resources.slots_per_trial == 1
    assert cfg.searcher.smaller_is_better is True
    assert cfg.hyperparameters == {} and cfg.labels == []
    assert cfg.min_validation_period == Length.batches(0)


def test_explicit_seed_and_resources() -> None:
    cfg = parse_config(
        config(
            reproducibility={"experiment_seed": 777},
            resources={"slots_per_trial": 0, "max_slots": 4, "weight": 0.5, "priority": 99},
        )
    )
    assert cfg.reproducibility.experiment_seed == 777
    r = cfg.resources
    assert (r.slots_per_trial, r.max_slots, r.weight, r.effective_priority) == (0, 4, 0.5, 99)


def test_shm_size_and_devices() -> None:
    cfg = parse_config(
        config(resources={"shm_size": "4G", "devices": ["/dev/fuse:/dev/fuse", "/dev/a:/dev/b:r"]})
    )
    assert cfg.resources.shm_size_bytes == 4 * 1024**3
    assert cfg.resources.devices == [
        {"host_path": "/dev/fuse", "container_path": "/dev/fuse", "mode": "mrw"},
        {"host_path": "/dev/a", "container_path": "/dev/b", "mode": "r"},
    ]
    assert memory_bytes("1.5Gi") == int(1.5 * 1024**3)
    assert memory_bytes("512 MB") == 512 * 1024**2
    assert memory_bytes(1000) == 1000


def test_environment_variables_map_form() -> None:
    env = {"environment_variables": {"cpu": ["A=1"], "gpu": ["A=2", "B=x=y"]}}
    cfg = parse_config(config(environment=env))
    e = cfg.environment
    assert e.environment_variables == ["A=1"]
    assert e.variables_for("cuda") == {"A": "2", "B": "x=y"}
    assert e.variables_for("rocm") == {}
    assert cfg.to_dict()["environment"]["environment_variables"] == {
        "cpu": ["A=1"],
        "cuda": ["A=2", "B=x=y"],
        "rocm": [],
    }


def test_container_settings_are_accepted_and_ignored() -> None:
    cfg = parse_config(
        config(environment={"image": "determinedai/pytorch-ngc:0.38", "force_pull_image": True})
    )
    assert cfg.environment.image == dict.fromkeys(
        ("cpu", "cuda", "rocm"), "determinedai/pytorch-ngc:0.38"
    )
    assert any("environment.image" in w and "ignored" in w for w in cfg.warnings)


def test_other_sections_accepted() -> None:
    cfg = parse_config(
        config(
            bind_mounts=[{"host_path": "/data", "container_path": "/mnt/data", "read_only": True}],
            log_policies=[{"name": "oom", "pattern": ".*OOM.*", "action": "cancel_retries"}],
            retention_policy={"log_retention_days": 30},
            workspace="lab",
            project="mnist",
            preemption_timeout=60,
            slurm={"slots_per_node": 4, "sbatch_args": ["--time=1:00:00"]},
            pbs={"pbsbatch_args": []},
            security={"kerberos": {"config_file": "/etc/krb5.conf"}},
            integrations={"pachyderm": {"dataset": {"repo": "r"}}},
            tensorboard_storage={"type": "shared_fs", "host_path": "/tmp"},
            data_layer={"type": "shared_fs"},
            profiling={"enabled": True, "begin_on_batch": 5, "end_after_batch": 10},
            debug=True,
            checkpoint_policy="all",
        )
    )
    assert cfg.bind_mounts[0].read_only is True and cfg.bind_mounts[0].propagation == "rprivate"
    assert cfg.log_policies == [{"name": "oom", "pattern": ".*OOM.*", "action": "cancel_retries"}]
    assert cfg.retention_policy == {"log_retention_days": 30}
    assert (cfg.workspace, cfg.project, cfg.preemption_timeout) == ("lab", "mnist", 60)
    assert cfg.slurm == {"slots_per_node": 4, "gpu_type": None, "sbatch_args": ["--time=1:00:00"]}
    assert cfg.profiling.end_after_batch == 10 and cfg.debug
    assert any(w.startswith("tensorboard_storage") for w in cfg.warnings)


# -- round trip -----------------------------------------------------------------------------


@pytest.mark.parametrize("path", FIXTURE_FILES, ids=lambda p: p.name)
def test_round_trip(path: Path) -> None:
    cfg = load_config(path)
    out = cfg.to_dict()
    as_json = json.loads(json.dumps(out))
    assert as_json == out
    again = parse_config(as_json)
    assert again.to_dict() == out
    assert again == cfg


def test_to_dict_shape() -> None:
    out = load_config(FIXTURES / "asha_037.yaml").to_dict()
    assert out["searcher"]["max_length"] == {"batches": 937}
    assert "num_rungs" not in out["searcher"]  # only the fields adaptive_asha takes
    assert out["hyperparameters"]["global_batch_size"] == {"type": "const", "val": 64}
    assert out["hyperparameters"]["n_filters1"] == {"type": "int", "minval": 8, "maxval": 64}
    assert out["resources"]["native_parallel"] is False
    assert out["optimizations"]["average_training_metrics"] is True
    assert out["max_restarts"] == 5
    assert isinstance(out["reproducibility"]["experiment_seed"], int)
    unitless = parse_config(config(searcher=searcher(max_length=50))).to_dict()
    assert unitless["searcher"]["max_length"] == 50


# -- units ----------------------------------------------------------------------------------


def test_length_forms() -> None:
    assert Length.records(100).to_dict() == {"records": 100}
    assert Length.unitless(7).to_dict() == 7
    assert Length.batches(5).to_batches() == 5
    assert Length.unitless(5).to_batches() == 5
    assert Length.records(1000).to_batches(64) == 15
    assert Length.records(10).to_batches(64) == 1  # at least one batch
    assert Length.records(0).to_batches(64) == 0
    assert Length.epochs(2).to_batches(64, 6400) == 200
    assert Length.epochs(3).to_batches(batches_per_epoch=10) == 30
    with pytest.raises(ConfigError, match="global_batch_size"):
        Length.records(100).to_batches()
    with pytest.raises(ConfigError, match="records_per_epoch"):
        Length.epochs(1).to_batches(64)


def test_lengths_in_config() -> None:
    cfg = parse_config(
        config(min_validation_period={"records": 0}, searcher=searcher(max_length=0))
    )
    assert cfg.min_validation_period == Length.records(0)
    assert cfg.searcher.max_length == Length.unitless(0)


# -- hyperparameter sampling ----------------------------------------------------------------


def test_sampling() -> None:
    hps = parse_config(
        config(
            hyperparameters={
                "c": [1, 2],
                "n": {"type": "int", "minval": 1, "maxval": 3},
                "d": {"type": "double", "minval": 0.5, "maxval": 1.5},
                "lr": {"type": "log", "minval": -4, "maxval": -1, "base": 10},
                "opt": {"type": "categorical", "vals": ["sgd", "adam"]},
                "nested": {"a": {"type": "int", "minval": 0, "maxval": 1}, "b": "x"},
            }
        )
    ).hyperparameters
    seen = set()
    for seed in range(200):
        s = sample_hparams(hps, random.Random(seed))
        assert list(s) == sorted(hps)
        assert s["c"] == [1, 2]
        assert 1 <= s["n"] <= 3
        seen.add(s["n"])
        assert 0.5 <= s["d"] <= 1.5
        assert 1e-4 <= s["lr"] <= 1e-1
        assert s["opt"] in ("sgd", "adam")
        assert s["nested"]["b"] == "x" and s["nested"]["a"] in (0, 1)
    assert seen == {1, 2, 3}  # both ends inclusive
    assert sample_hparams(hps, random.Random(3)) == sample_hparams(hps, random.Random(3))


def test_sampling_order_is_sorted_names() -> None:
    hps = {"b": IntHP(0, 100), "a": IntHP(0, 100)}
    rng = random.Random(1)
    first, second = rng.randint(0, 100), rng.randint(0, 100)
    assert sample_hparams(hps, random.Random(1)) == {"a": first, "b": second}


def test_const_forms() -> None:
    hps = parse_config(
        config(hyperparameters={"a": None, "b": {"type": "const", "val": None}, "c": {}})
    ).hyperparameters
    assert hps == {"a": ConstHP(None), "b": ConstHP(None), "c": NestedHP({})}


def test_int_keys_become_strings() -> None:
    cfg = parse_config(config(hyperparameters={"actions": {1: "sleep", 2: "exit"}}))
    assert sample_hparams(cfg.hyperparameters, random.Random(0)) == {
        "actions": {"1": "sleep", "2": "exit"}
    }


def test_make_test_config() -> None:
    cfg = load_config(FIXTURES / "asha_037.yaml")
    test = make_test_config(cfg, random.Random(0))
    assert test.description is not None and test.description.startswith("[test-mode] ")
    assert test.scheduling_unit == 1 and test.max_restarts == 0
    assert test.min_validation_period == Length.batches(1)
    assert test.searcher.name == "single" and test.searcher.metric == "validation_loss"
    assert test.searcher.max_length == Length.batches(1)
    assert all(isinstance(hp, ConstHP) for hp in test.hyperparameters.values())
    storage = test.checkpoint_storage
    assert storage is not None and storage.host_path == "/tmp/det-checkpoints"
    assert (storage.save_experiment_best, storage.save_trial_best, storage.save_trial_latest) == (
        0,
        0,
        0,
    )
    assert test.resources == cfg.resources


# -- errors ---------------------------------------------------------------------------------

ASHA = {"name": "adaptive_asha", "metric": "loss", "max_trials": 4}
SHARED = {"type": "shared_fs", "host_path": "/data"}

ERRORS: list[tuple[str, dict[str, Any], list[str]]] = [
    # unknown keys, at every fixed-schema level
    (
        "top-level",
        config(searchr={}),
        ["unknown field 'searchr' in config.yaml; did you mean 'searcher'?"],
    ),
    (
        "searcher key",
        config(searcher=searcher(metirc="x")),
        ["unknown field 'searcher.metirc' in config.yaml; did you mean 'metric'?"],
    ),
    (
        "resources key",
        config(resources={"slot_per_trial": 2}),
        ["unknown field 'resources.slot_per_trial'", "did you mean 'slots_per_trial'?"],
    ),
    (
        "storage key",
        config(checkpoint_storage={**SHARED, "hostpath": "/x"}),
        ["unknown field 'checkpoint_storage.hostpath'", "did you mean 'host_path'?"],
    ),
    (
        "s3 key",
        config(checkpoint_storage={"type": "s3", "bukcet": "b"}),
        ["unknown field 'checkpoint_storage.bukcet'", "did you mean 'bucket'?"],
    ),
    (
        "hp key",
        config(hyperparameters={"n": {"type": "int", "mnval": 1, "maxval": 3}}),
        ["unknown field 'hyperparameters.n.mnval'", "did you mean 'minval'?"],
    ),
    (
        "environment key",
        config(environment={"environment_variable": []}),
        ["unknown field 'environment.environment_variable'", "'environment_variables'?"],
    ),
    (
        "optimizations key",
        config(optimizations={"aggregation_freq": 2}),
        ["unknown field 'optimizations.aggregation_freq'", "'aggregation_frequency'?"],
    ),
    (
        "reproducibility key",
        config(reproducibility={"seed": 1}),
        ["unknown field 'reproducibility.seed'", "'experiment_seed'"],
    ),
    (
        "profiling key",
        config(profiling={"enable": True}),
        ["unknown field 'profiling.enable'", "did you mean 'enabled'?"],
    ),
    (
        "length key",
        config(min_validation_period={"batchs": 10}),
        ["unknown field 'min_validation_period.batchs'", "did you mean 'batches'?"],
    ),
    (
        "no close key",
        config(zzzzzz=1),
        ["unknown field 'zzzzzz' in config.yaml; remove it", "valid: "],
    ),
    # wrong types; bool is not an int
    (
        "max_trials str",
        config(searcher={"name": "random", "metric": "m", "max_trials": "ten"}),
        ["searcher.max_trials in config.yaml: expected an integer >= 1, found 'ten' (str)"],
    ),
    (
        "bool as int",
        config(max_restarts=True),
        ["max_restarts in config.yaml: expected an integer >= 0, found true (bool)"],
    ),
    (
        "float as int",
        config(resources={"slots_per_trial": 1.5}),
        ["resources.slots_per_trial", "expected an integer >= 0, found 1.5 (float)"],
    ),
    ("data", config(data=[1]), ["data in config.yaml: expected a mapping, found a list [1]"]),
    (
        "labels",
        config(labels=["a", 3]),
        ["labels[1] in config.yaml: expected a string, found 3 (int)"],
    ),
    (
        "smaller_is_better",
        config(searcher=searcher(smaller_is_better="yes")),
        ["searcher.smaller_is_better", "expected true or false, found 'yes' (str)"],
    ),
    (
        "checkpoint_policy",
        config(checkpoint_policy="latest"),
        ["checkpoint_policy", "expected one of best, all, none, found 'latest' (str)"],
    ),
    # missing required fields
    (
        "entrypoint",
        {"searcher": {"name": "single", "metric": "m"}},
        ["entrypoint is missing in config.yaml: add e.g. 'entrypoint: python3 train.py'"],
    ),
    ("entrypoint empty", config(entrypoint=""), ["entrypoint in config.yaml: must not be empty"]),
    ("entrypoint type", config(entrypoint=3), ["entrypoint in config.yaml: expected a command"]),
    ("searcher", {"entrypoint": "python3 t.py"}, ["searcher is missing in config.yaml: add e.g."]),
    (
        "searcher.name",
        config(searcher={"metric": "m"}),
        ["searcher.name is missing in config.yaml", "'name: single'"],
    ),
    (
        "searcher.metric",
        config(searcher={"name": "single"}),
        ["searcher.metric is missing in config.yaml", "'metric: validation_loss'"],
    ),
    (
        "random max_trials",
        config(searcher={"name": "random", "metric": "m"}),
        ["searcher.max_trials is missing in config.yaml", "'max_trials: 16'"],
    ),
    (
        "async_halving num_rungs",
        config(
            searcher={
                "name": "async_halving",
                "metric": "m",
                "max_trials": 2,
                "time_metric": "batches",
                "max_time": 10,
            }
        ),
        ["searcher.num_rungs is missing", "'num_rungs: 3'"],
    ),
    # lengths
    (
        "two units",
        config(searcher=searcher(max_length={"batches": 10, "epochs": 1})),
        ["searcher.max_length in config.yaml: a length has exactly one of batches, records"],
    ),
    (
        "negative length",
        config(searcher=searcher(max_length={"batches": -1})),
        ["searcher.max_length.batches in config.yaml: must be >= 1, found -1"],
    ),
    (
        "zero searcher length object",
        config(searcher=searcher(max_length={"epochs": 0})),
        ["searcher.max_length.epochs in config.yaml: must be >= 1, found 0"],
    ),
    (
        "negative bare",
        config(searcher=searcher(max_length=-5)),
        ["searcher.max_length in config.yaml: must be >= 0, found -5"],
    ),
    (
        "period negative",
        config(min_checkpoint_period={"epochs": -2}),
        ["min_checkpoint_period.epochs in config.yaml: must be >= 0, found -2"],
    ),
    (
        "period bare",
        config(min_validation_period=100),
        ["min_validation_period", "expected a length such as {batches: 1000}", "found 100 (int)"],
    ),
    (
        "async_halving bare length",
        config(
            searcher={
                "name": "async_halving",
                "metric": "m",
                "num_rungs": 2,
                "max_trials": 2,
                "max_length": 100,
            }
        ),
        ["searcher.max_length", "expected a length such as {batches: 1000}"],
    ),
    (
        "length string",
        config(searcher=searcher(max_length="1000 batches")),
        ["searcher.max_length", "found '1000 batches' (str)"],
    ),
    # searcher names
    (
        "asha alias",
        config(searcher={"name": "asha", "metric": "m"}),
        ["searcher.name", "did you mean 'async_halving' (plain ASHA) or 'adaptive_asha'?"],
    ),
    (
        "typo name",
        config(searcher={"name": "rnadom", "metric": "m"}),
        ["unknown searcher 'rnadom' (str); did you mean 'random'?"],
    ),
    (
        "custom",
        config(searcher={"name": "custom", "metric": "m"}),
        ["searcher.name", "custom searchers were removed in Determined 0.38", "use adaptive_asha"],
    ),
    (
        "adaptive",
        config(searcher={"name": "adaptive", "metric": "m"}),
        ["end of life; use adaptive_asha"],
    ),
    (
        "adaptive_simple",
        config(searcher={"name": "adaptive_simple", "metric": "m"}),
        ["'adaptive_simple' searcher reached end of life; use adaptive_asha"],
    ),
    (
        "sync_halving",
        config(searcher={"name": "sync_halving", "metric": "m"}),
        ["'sync_halving' searcher reached end of life; use async_halving"],
    ),
    (
        "field of another searcher",
        config(searcher=searcher(max_trials=5)),
        ["searcher.max_trials in config.yaml: the 'single' searcher does not take max_trials"],
    ),
    # ASHA 0.37 / 0.38 rules
    (
        "time_metric only",
        config(searcher={**ASHA, "time_metric": "batches"}),
        ["searcher.max_time is missing in config.yaml", "'max_time: 1000'"],
    ),
    (
        "max_time only",
        config(searcher={**ASHA, "max_time": 100}),
        ["searcher.time_metric is missing in config.yaml", "'time_metric: batches'"],
    ),
    (
        "neither",
        config(searcher=ASHA),
        ["searcher.max_time is missing", "time_metric and max_time", "max_length: {batches: 1000}"],
    ),
    (
        "divisor",
        config(searcher={**ASHA, "max_length": 10, "divisor": 1}),
        ["searcher.divisor in config.yaml: must be > 1, found 1"],
    ),
    (
        "mode",
        config(searcher={**ASHA, "max_length": 10, "mode": "agressive"}),
        ["searcher.mode", "found 'agressive' (str); did you mean 'aggressive'?"],
    ),
    # hyperparameters
    (
        "log base",
        config(hyperparameters={"lr": {"type": "log", "minval": -4, "maxval": -1, "base": -2}}),
        ["hyperparameters.lr.base in config.yaml: must be > 0, found -2"],
    ),
    (
        "min >= max",
        config(hyperparameters={"n": {"type": "int", "minval": 5, "maxval": 5}}),
        ["hyperparameters.n.minval in config.yaml: must be less than maxval (5), found 5"],
    ),
    (
        "int float",
        config(hyperparameters={"n": {"type": "int", "minval": 1.5, "maxval": 5}}),
        ["hyperparameters.n.minval", "expected an integer, found 1.5 (float)", "type: double"],
    ),
    (
        "double str",
        config(hyperparameters={"d": {"type": "double", "minval": "a", "maxval": 5}}),
        ["hyperparameters.d.minval in config.yaml: expected a number, found 'a' (str)"],
    ),
    (
        "categorical empty",
        config(hyperparameters={"opt": {"type": "categorical", "vals": []}}),
        ["hyperparameters.opt.vals in config.yaml: expected a non-empty list", "found a list []"],
    ),
    (
        "categorical missing",
        config(hyperparameters={"opt": {"type": "categorical"}}),
        ["hyperparameters.opt.vals is missing in config.yaml", "vals: [sgd, adam]"],
    ),
    (
        "const missing val",
        config(hyperparameters={"x": {"type": "const"}}),
        ["hyperparameters.x.val is missing"],
    ),
    (
        "bad type",
        config(hyperparameters={"lr": {"type": "float", "minval": 0, "maxval": 1}}),
        ["hyperparameters.lr.type in config.yaml", "'float' (str); did you mean 'double'?"],
    ),
    (
        "bad nested type",
        config(hyperparameters={"model": {"type": "resnet", "depth": 50}}),
        ["hyperparameters.model.type", "unknown hyperparameter type 'resnet'", "type: const"],
    ),
    (
        "grid count",
        config(
            searcher={"name": "grid", "metric": "m"},
            hyperparameters={
                "opt": {"lr": {"type": "log", "minval": -3, "maxval": -1, "base": 10}}
            },
        ),
        ["hyperparameters.opt.lr.count is missing in config.yaml", "grid", "'count: 3'"],
    ),
    (
        "count zero",
        config(hyperparameters={"n": {"type": "int", "minval": 1, "maxval": 3, "count": 0}}),
        ["hyperparameters.n.count in config.yaml: must be >= 1, found 0"],
    ),
    # resources
    (
        "slots",
        config(resources={"slots_per_trial": -1}),
        ["resources.slots_per_trial in config.yaml: must be >= 0, found -1"],
    ),
    (
        "priority",
        config(resources={"priority": 100}),
        ["resources.priority in config.yaml: must be between 1 and 99, found 100"],
    ),
    ("priority 0", config(resources={"priority": 0}), ["must be between 1 and 99, found 0"]),
    (
        "max_slots",
        config(resources={"max_slots": 0}),
        ["resources.max_slots in config.yaml: must be >= 1, found 0"],
    ),
    (
        "weight",
        config(resources={"weight": 0}),
        ["resources.weight in config.yaml: must be > 0, found 0"],
    ),
    (
        "shm_size",
        config(resources={"shm_size": "lots"}),
        ["resources.shm_size", "valid memory size", "'lots'"],
    ),
    # checkpoint storage
    (
        "relative host_path",
        config(checkpoint_storage={"type": "shared_fs", "host_path": "ckpts"}),
        ["checkpoint_storage.host_path in config.yaml: must be an absolute path, found 'ckpts'"],
    ),
    (
        "tilde host_path",
        config(checkpoint_storage={"type": "shared_fs", "host_path": "~/ckpts"}),
        ["must be an absolute path", "~ is not expanded"],
    ),
    (
        "missing host_path",
        config(checkpoint_storage={"type": "shared_fs"}),
        ["checkpoint_storage.host_path is missing in config.yaml", "host_path: /data/checkpoints"],
    ),
    (
        "storage_path escapes",
        config(checkpoint_storage={**SHARED, "storage_path": "../elsewhere"}),
        ["checkpoint_storage.storage_path", "relative directory or a subdirectory of host_path"],
    ),
    (
        "storage_path outside",
        config(checkpoint_storage={**SHARED, "storage_path": "/other/place"}),
        ["checkpoint_storage.storage_path", "found '/other/place'"],
    ),
    (
        "directory",
        config(checkpoint_storage={"type": "directory"}),
        ["checkpoint_storage.container_path is missing in config.yaml"],
    ),
    (
        "s3",
        config(checkpoint_storage={"type": "s3", "bucket": "b"}),
        ["checkpoint_storage.type 's3' is not supported by det-local yet; use shared_fs"],
    ),
    (
        "gcs",
        config(checkpoint_storage={"type": "gcs", "bucket": "b"}),
        ["checkpoint_storage.type 'gcs' is not supported by det-local yet"],
    ),
    (
        "azure",
        config(checkpoint_storage={"type": "azure", "container": "c"}),
        ["checkpoint_storage.type 'azure' is not supported"],
    ),
    (
        "storage type typo",
        config(checkpoint_storage={"type": "sharedfs", "host_path": "/x"}),
        ["checkpoint_storage.type", "did you mean 'shared_fs'?"],
    ),
    (
        "save negative",
        config(checkpoint_storage={**SHARED, "save_trial_best": -1}),
        ["checkpoint_storage.save_trial_best in config.yaml: must be >= 0, found -1"],
    ),
    # the rest
    (
        "seed",
        config(reproducibility={"experiment_seed": -1}),
        ["reproducibility.experiment_seed in config.yaml: must be >= 0, found -1"],
    ),
    (
        "aggregation_frequency",
        config(optimizations={"aggregation_frequency": 0}),
        ["optimizations.aggregation_frequency in config.yaml: must be >= 1, found 0"],
    ),
    (
        "profiling order",
        config(profiling={"begin_on_batch": 10, "end_after_batch": 5}),
        ["profiling.end_after_batch in config.yaml: must be >= begin_on_batch (10), found 5"],
    ),
    (
        "env var",
        config(environment={"environment_variables": ["NOEQUALS"]}),
        ["environment.environment_variables[0] in config.yaml: expected 'KEY=VALUE'"],
    ),
    (
        "scheduling_unit",
        config(scheduling_unit=0),
        ["scheduling_unit in config.yaml: must be >= 1, found 0"],
    ),
    (
        "bind mount",
        config(bind_mounts=[{"host_path": "data", "container_path": "/d"}]),
        ["bind_mounts[0].host_path in config.yaml: must be an absolute path"],
    ),
]


@pytest.mark.parametrize(("raw", "expected"), [e[1:] for e in ERRORS], ids=[e[0] for e in ERRORS])
def test_errors(raw: dict[str, Any], expected: list[str]) -> None:
    message = error_of(raw)
    for part in expected:
        assert part in message, f"{part!r} not in {message!r}"
    assert "\n" not in message


def test_not_a_mapping() -> None:
    assert "config in config.yaml: expected a mapping" in error_of([1, 2])


# -- files and YAML -------------------------------------------------------------------------


def test_malformed_yaml_has_line_and_column(tmp_path: Path) -> None:
    path = write(tmp_path, "entrypoint: python3 train.py\nsearcher:\n  name: single\n metric: x\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert re.search(r"config\.yaml:4:2: malformed YAML at line 4, column 2: ", message), message
    assert "fix the YAML syntax" in message
    assert "Traceback" not in message


def test_unclosed_flow_mapping(tmp_path: Path) -> None:
    path = write(tmp_path, "entrypoint: python3 t.py\nsearcher: {name: single, metric: x\n")
    with pytest.raises(ConfigError, match=r"config\.yaml:3:1: malformed YAML"):
        load_config(path)


def test_tab_indentation(tmp_path: Path) -> None:
    path = write(tmp_path, "searcher:\n\tname: single\n")
    with pytest.raises(ConfigError, match=r"config\.yaml:2:1: .*indent with spaces, not tabs"):
        load_config(path)


def test_duplicate_keys(tmp_path: Path) -> None:
    path = write(
        tmp_path, "entrypoint: a.py\nsearcher: {name: single, metric: x}\nentrypoint: b.py\n"
    )
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert "config.yaml:3:1" in message
    assert "duplicate key 'entrypoint' (first defined on line 1)" in message
    assert "remove one of them" in message


def test_merge_keys_may_be_overridden(tmp_path: Path) -> None:
    text = (
        "base: &base {name: single, metric: x, max_length: 5}\n"
        "entrypoint: python3 t.py\n"
        "searcher:\n  <<: *base\n  max_length: 10\n"
    )
    with pytest.raises(ConfigError, match="unknown field 'base'"):
        load_config(write(tmp_path, text))
    text = text.replace("base: &base", "data: &base")
    cfg = load_config(write(tmp_path, text))
    assert cfg.searcher.max_length == Length.unitless(10)


def test_yaml_12_scalars(tmp_path: Path) -> None:
    text = (
        "entrypoint: python3 t.py\n"
        "searcher: {name: single, metric: x}\n"
        "hyperparameters:\n"
        "  lr: 1e-3\n  big: 1E+5\n  flag: yes\n  on_off: on\n  t: true\n  n: 012\n"
        "  hexa: 0x1F\n  day: 2024-01-02\n  inf: .inf\n  nothing: ~\n"
    )
    hps = load_config(write(tmp_path, text)).hyperparameters
    values = {k: v.val for k, v in hps.items() if isinstance(v, ConstHP)}
    assert values["lr"] == 1e-3 and isinstance(values["lr"], float)
    assert values["big"] == 1e5
    assert values["flag"] == "yes" and values["on_off"] == "on"
    assert values["t"] is True
    assert values["n"] == 12 and values["hexa"] == 31
    assert values["day"] == "2024-01-02"
    assert values["inf"] == float("inf")
    assert values["nothing"] is None


def test_empty_file(tmp_path: Path) -> None:
    for text in ("", "# only a comment\n"):
        with pytest.raises(ConfigError, match=r"config\.yaml is empty: .*'entrypoint'"):
            load_config(write(tmp_path, text))


def test_not_a_mapping_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="expected a YAML mapping .* found a list"):
        load_config(write(tmp_path, "- entrypoint\n- searcher\n"))
    with pytest.raises(ConfigError, match="found a str"):
        load_config(write(tmp_path, "just words\n"))


def test_missing_file_and_directory(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"nope\.yaml not found .*check the path"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="is a directory"):
        load_config(tmp_path)


def test_validation_error_names_file(tmp_path: Path) -> None:
    path = write(tmp_path, "entrypoint: python3 t.py\nsearcher: {name: single, metrc: x}\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value) == (f"unknown field 'searcher.metrc' in {path}; did you mean 'metric'?")


def test_public_types() -> None:
    cfg = load_config(FIXTURES / "core_hpsearch_038.yaml")
    assert isinstance(cfg, ExperimentConfig)
    with pytest.raises(AttributeError):
        cfg.name = "x"  # type: ignore[misc]

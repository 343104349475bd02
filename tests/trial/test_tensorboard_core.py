"""TensorBoard for every trial, through the real CLI: `tensorboard start` on Core API trials
(which write no event files) gives TensorBoard event files holding every scalar they reported,
under Determined's tags; a trial's own event files are used as they are; with TensorBoard
installed its scalars API serves the curves. The event files are read back by an independent
TFRecord/protobuf reader (and by tensorboard's own EventAccumulator when it is installed)."""

from __future__ import annotations

import importlib.util
import json
import shutil
import struct
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from det_local.store.tfevents import crc32c
from tests.support.world import Env, one_line_error, wait_for

REPORTS = """
import pathlib, sys
import determined as det
from determined import core

info = det.get_cluster_info()
scale = info.trial.hparams["scale"]
with core.init() as ctx:
    for i in range(1, 6):
        ctx.train.report_training_metrics(steps_completed=i, metrics={"loss": scale / i})
    ctx.train.report_validation_metrics(
        steps_completed=5, metrics={"loss": scale / 10, "val_accuracy": 0.5 + scale, "note": "x"}
    )
    ctx.train.report_metrics("eval", 5, {"bleu": scale * 3, "flag": True})
    if info.trial.hparams.get("own"):  # a script that writes its own event files
        tb = pathlib.Path(ctx.train.get_tensorboard_path())
        tb.mkdir(parents=True, exist_ok=True)
        (tb / "events.out.tfevents.1.own").write_bytes(b"")
"""


# ---------------------------------------------------------------- an independent reader
def _crc32c_bitwise(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 & -(crc & 1))
    return crc ^ 0xFFFFFFFF


def _masked(data: bytes) -> int:
    crc = _crc32c_bitwise(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    shift = value = 0
    while True:
        byte = buf[i]
        i += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, i


def _fields(buf: bytes) -> list[tuple[int, Any]]:
    """(field number, value) of a protobuf message: varint ints, fixed64/32 as bytes."""
    out: list[tuple[int, Any]] = []
    i = 0
    while i < len(buf):
        key, i = _varint(buf, i)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, i = _varint(buf, i)
        elif wire == 1:
            value, i = buf[i : i + 8], i + 8
        elif wire == 5:
            value, i = buf[i : i + 4], i + 4
        else:
            assert wire == 2, wire
            size, i = _varint(buf, i)
            value, i = buf[i : i + size], i + size
        out.append((number, value))
    return out


def read_scalars(directory: Path) -> tuple[str, dict[str, list[tuple[int, float]]]]:
    """(file version, tag -> [(step, value)]) of the one event file in `directory`, every
    record's framing and checksums checked."""
    (path,) = directory.glob("*tfevents*")
    data = path.read_bytes()
    i = 0
    version = ""
    scalars: dict[str, list[tuple[int, float]]] = {}
    while i < len(data):
        head = data[i : i + 8]
        (size,) = struct.unpack("<Q", head)
        assert struct.unpack("<I", data[i + 8 : i + 12])[0] == _masked(head)
        body = data[i + 12 : i + 12 + size]
        assert struct.unpack("<I", data[i + 12 + size : i + 16 + size])[0] == _masked(body)
        i += 16 + size
        event = dict(_fields(body))
        assert isinstance(struct.unpack("<d", event[1])[0], float)  # wall_time
        if 3 in event:
            version = event[3].decode()
            continue
        for number, value in _fields(event[5]):
            assert number == 1
            val = dict(_fields(value))
            tag = val[1].decode()
            scalars.setdefault(tag, []).append((event[2], struct.unpack("<f", val[2])[0]))
    return version, scalars


def f32(x: float) -> float:
    return float(struct.unpack("<f", struct.pack("<f", x))[0])


# ---------------------------------------------------------------- helpers
def run_experiments(dl: Env) -> None:
    search = {"name": "grid", "metric": "loss", "max_length": 5}
    scale = {"type": "categorical", "vals": [1.0, 2.0]}
    cfg, ctx = dl.context(REPORTS, {"hyperparameters": {"scale": scale}, "searcher": search})
    assert dl.det("run", cfg, ctx).rc == 0
    own = {"scale": 3.0, "own": True}
    cfg, ctx = dl.context(REPORTS, {"hyperparameters": own}, name="own")
    assert dl.det("run", cfg, ctx).rc == 0


def stand_in_tensorboard(dl: Env) -> Path:
    """A `tensorboard` on PATH that records its arguments and serves nothing."""
    bin_dir = dl.tmp / "tb-bin"
    bin_dir.mkdir()
    argv = dl.tmp / "tb-argv"
    fake = bin_dir / "tensorboard"
    fake.write_text(f"#!/bin/sh\nprintf '%s\\n' \"$@\" > {argv}.tmp && mv {argv}.tmp {argv}\n"
                    "exec sleep 120\n")  # fmt: skip
    fake.chmod(0o755)
    dl.env["PATH"] = f"{bin_dir}:{dl.env['PATH']}"
    return argv


def logdir_spec(argv_file: Path) -> dict[str, Path]:
    (spec,) = [a for a in argv_file.read_text().split("\n") if a.startswith("--logdir_spec=")]
    return {
        name: Path(path)
        for name, path in (item.split(":", 1) for item in spec.split("=", 1)[1].split(","))
    }


def job_id(out: str) -> int:
    """The job id in `tensorboard (job N): URL`."""
    return int(out.split()[2].rstrip("):"))


def expected(scale: float) -> dict[str, list[tuple[int, float]]]:
    return {
        "Determined/loss": [(i, f32(scale / i)) for i in range(1, 6)],
        "Determined/val_loss": [(5, f32(scale / 10))],
        "Determined/val_accuracy": [(5, f32(0.5 + scale))],
        "Determined/eval_bleu": [(5, f32(scale * 3))],
    }


# ---------------------------------------------------------------- tests
def test_crc32c_matches_the_standard_check_value() -> None:
    assert crc32c(b"123456789") == _crc32c_bitwise(b"123456789") == 0xE3069283
    assert crc32c(b"") == 0


def test_tensorboard_start_writes_core_api_curves_from_the_store(dl: Env) -> None:
    run_experiments(dl)
    argv = stand_in_tensorboard(dl)
    dl.env["XDG_CACHE_HOME"] = str(dl.tmp / "cache")
    dl.daemon_start(DET_LOCAL_FAKE_GPUS="0")
    r = dl.det("tensorboard", "start", 1, 2)
    assert r.rc == 0 and r.out.startswith("tensorboard (job "), r
    job = job_id(r.out)
    wait_for(argv.exists, what="tensorboard to start")
    dirs = logdir_spec(argv)
    assert sorted(dirs) == ["trial_1", "trial_2", "trial_3"], dirs
    for trial in dl.trials(1):
        directory = dirs[f"trial_{trial.id}"]
        # in the caller's cache, not in the daemon's home
        assert directory.is_relative_to(dl.tmp / "cache") and not directory.is_relative_to(dl.home)
        version, scalars = read_scalars(directory)
        assert version == "brain.Event:2"
        assert scalars == expected(trial.hparams["scale"]), scalars  # no strings, no bools
        if importlib.util.find_spec("tensorboard") is not None:
            from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

            acc = EventAccumulator(str(directory))
            acc.Reload()
            assert {
                tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]
            } == expected(trial.hparams["scale"])
    # trial 3 wrote event files of its own: TensorBoard is shown those, nothing is written
    assert dirs["trial_3"] == dl.paths.trial_dir(2, 3)
    assert not list((dl.tmp / "cache").rglob("trial_3"))
    assert dl.det("cmd", "kill", job).rc == 0
    dl.wait_job(job)

    # a second start writes the files anew (one file per trial, never an accumulation)
    argv.unlink()
    r = dl.det("tensorboard", "start", 1)
    assert r.rc == 0, r
    wait_for(argv.exists, what="tensorboard to start again")
    again = logdir_spec(argv)
    assert again == {k: dirs[k] for k in ("trial_1", "trial_2")}
    assert read_scalars(again["trial_1"])[1] == expected(dl.trials(1)[0].hparams["scale"])
    assert dl.det("cmd", "kill", job_id(r.out)).rc == 0

    one_line_error(dl.det("tensorboard", "start", 9), "experiment 9 not found", "experiment list")


def test_no_trial_of_a_search_says_tensorboard_is_missing(dl: Env) -> None:
    if importlib.util.find_spec("tensorboard") is not None:
        pytest.skip("tensorboard is installed: the trials write event files")
    from tests.support.trials.pytorch import TRAIN, config

    search = config("pt", {"batches": 4})
    search["hyperparameters"]["lr"] = {"type": "categorical", "vals": [0.01, 0.02]}
    search["searcher"]["name"] = "grid"
    cfg, ctx = dl.context(TRAIN, search)
    r = dl.det("run", cfg, ctx)
    assert r.rc == 0, r
    assert "tensorboard" not in (r.out + r.err).lower(), r


@pytest.mark.skipif(shutil.which("tensorboard") is None, reason="tensorboard is not installed")
def test_tensorboard_serves_a_core_api_trials_curves(dl: Env) -> None:
    cfg, ctx = dl.context(REPORTS, {"hyperparameters": {"scale": 2.0}})
    assert dl.det("run", cfg, ctx).rc == 0
    dl.env["XDG_CACHE_HOME"] = str(dl.tmp / "cache")
    dl.daemon_start(DET_LOCAL_FAKE_GPUS="0")
    r = dl.det("tensorboard", "start", 1)
    assert r.rc == 0, r
    url = r.out.split()[3]
    assert url.startswith("http://127.0.0.1:"), r
    job = job_id(r.out)
    # --logdir_spec names the run after the trial (TensorBoard adds the subdirectory, ".")
    query = urllib.parse.urlencode({"tag": "Determined/loss", "run": "trial_1/."})

    def curve() -> Any:
        assert dl.job(job).state != "DONE", dl.paths.command_log(job).read_text()
        try:
            with urllib.request.urlopen(
                f"{url}data/plugin/scalars/scalars?{query}", timeout=5
            ) as f:
                return json.loads(f.read())
        except OSError:  # not serving yet (or not that run yet: 400)
            return None

    points = wait_for(curve, timeout=90, what="TensorBoard to serve trial 1's loss")
    assert [(step, value) for _, step, value in points] == expected(2.0)["Determined/loss"]
    assert dl.det("cmd", "kill", job).rc == 0

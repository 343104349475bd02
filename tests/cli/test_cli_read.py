"""The read-side commands (experiment / trial / checkpoint) run as real processes over a store
populated with the writer Store in a temporary DET_LOCAL_HOME."""

from __future__ import annotations

import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid as uuidlib
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import pytest
from typer.testing import CliRunner

from det_local.store.db import Store, current_user
from det_local.store.paths import Paths
from det_local.store.records import CheckpointRecord
from det_local.store.states import State

TIMEOUT_S = 20.0
TIME_RE = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d"


def _argv(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "det_local.cli.main", *args]


@dataclass
class World:
    home: Path
    env: dict[str, str]
    exp: int
    other_exp: int
    done_trial: int
    live_trial: int
    ck1: str
    ck2: str

    @property
    def p(self) -> Paths:
        return Paths(self.home)

    def writer(self) -> Store:
        return Store(self.p.db)

    def cli(self, *args: Any, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            _argv([str(a) for a in args]),
            env=self.env,
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
        )

    def popen(self, *args: Any) -> subprocess.Popen[str]:
        return subprocess.Popen(
            _argv([str(a) for a in args]),
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )


def _checkpoint(p: Paths, store: Store, exp: int, trial: int, steps: int, **kw: Any) -> str:
    uid = str(uuidlib.uuid4())
    d = p.checkpoints / uid
    (d / "sub").mkdir(parents=True)
    (d / "model.bin").write_bytes(b"m" * 3000)
    (d / "sub" / "opt.bin").write_bytes(b"o" * 100)
    meta = {"steps_completed": steps, "framework": "torch"}
    if kw.get("with_metadata", True):
        (d / "metadata.json").write_text(json.dumps(meta))
    resources = {"model.bin": 3000, "sub/opt.bin": 100}
    store.add_checkpoint(
        CheckpointRecord(uid, exp, trial, steps, "COMPLETED", str(d), meta, resources, time.time())
    )
    return uid


@pytest.fixture
def world(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> World:
    home = tmp_path / "home"
    monkeypatch.setenv("DET_LOCAL_HOME", str(home))
    p = Paths(home).ensure()
    store = Store(p.db)
    config = {
        "name": "mnist",
        "entrypoint": "python3 train.py",
        "searcher": {"name": "single", "metric": "val_loss", "max_length": {"batches": 100}},
        "resources": {"slots_per_trial": 2},
    }
    exp = store.create_experiment(
        name="mnist", config=config, labels=["v1", "fast"], description="first try"
    )
    other = store.create_experiment(name="theirs", config={}, user="someone-else")
    done = store.create_trial(exp, hparams={"lr": 0.1, "opt": {"name": "sgd"}}, seed=7)
    live = store.create_trial(exp, hparams={"lr": 0.01}, seed=8)
    now = time.time()
    store.add_metrics(
        done,
        1,
        [
            ("training", 10, {"loss": 0.9}, now),
            ("training", 20, {"loss": 0.5}, now),
            ("validation", 20, {"val_loss": 0.4, "accuracy": 0.875}, now),
        ],
    )
    store.set_best_validation(done, 0.4)
    ck1 = _checkpoint(p, store, exp, done, 10)
    ck2 = _checkpoint(p, store, exp, done, 20, with_metadata=False)
    store.set_trial_state(done, State.COMPLETED)
    log = p.trial_log(exp, done)
    log.parent.mkdir(parents=True)
    lines = ["starting 2 workers"] + [f"[rank={i % 2}] step {i}" for i in range(10)]
    log.write_text("".join(f"{ln}\n" for ln in lines))
    store.close()
    env = {**os.environ, "DET_LOCAL_HOME": str(home), "PYTHONUNBUFFERED": "1"}
    env.pop("DET_LOCAL_DEBUG", None)
    return World(home, env, exp, other, done, live, ck1, ck2)


def _one_line_error(r: subprocess.CompletedProcess[str], *fragments: str) -> str:
    assert r.returncode == 1, (r.returncode, r.stdout, r.stderr)
    err = r.stderr.strip()
    assert "Traceback" not in r.stderr
    assert "\n" not in err, err
    assert err.startswith("error: "), err
    for fragment in fragments:
        assert fragment in err, err
    return err


# ---------------------------------------------------------------------------- experiments
def test_experiment_list_table_shows_own_experiments_unless_all(world: World) -> None:
    r = world.cli("experiment", "list")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    headers = ["ID", "Name", "State", "Progress", "Labels", "User", "Started", "Ended"]
    assert [c.strip() for c in lines[0].split("|")] == headers
    rows = [[c.strip() for c in ln.split("|")] for ln in lines[2:]]
    assert len(rows) == 1
    assert rows[0][:6] == [str(world.exp), "mnist", "ACTIVE", "0.0%", "fast,v1", current_user()]
    assert re.fullmatch(TIME_RE, rows[0][6])
    assert "theirs" not in r.stdout

    r = world.cli("experiment", "list", "--all")
    assert r.returncode == 0, r.stderr
    assert "theirs" in r.stdout and "someone-else" in r.stdout


def test_experiment_list_json(world: World) -> None:
    r = world.cli("experiment", "list", "--all", "--json")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert [e["id"] for e in data] == [world.exp, world.other_exp]
    first = data[0]
    for key in ("id", "name", "state", "user", "labels", "progress", "created_at", "ended_at"):
        assert key in first
    assert first["name"] == "mnist" and first["state"] == "ACTIVE"
    assert first["labels"] == ["fast", "v1"]
    # each experiment's own config, as `experiment describe --json` gives it
    assert first["config"]["searcher"] == {
        "name": "single",
        "metric": "val_loss",
        "max_length": {"batches": 100},
    }
    assert first["config"]["resources"] == {"slots_per_trial": 2}
    assert data[1]["config"] == {}
    described = json.loads(world.cli("experiment", "describe", world.exp, "--json").stdout)
    assert first["config"] == described["experiment"]["config"]


def test_experiment_describe(world: World) -> None:
    r = world.cli("experiment", "describe", world.exp)
    assert r.returncode == 0, r.stderr
    # at the default 100 columns the trials table drops its Checkpoint column (the checkpoints
    # are listed below it) and cuts the latest metrics; COLUMNS=200 shows them whole
    assert max(len(ln) for ln in r.stdout.splitlines()) <= 100
    assert "Checkpoint" not in r.stdout.split("Checkpoints:")[0]
    world.env["COLUMNS"] = "200"
    r = world.cli("experiment", "describe", world.exp)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert f"Experiment {world.exp}: mnist" in out
    assert "first try" in out
    assert "single (metric val_loss, smaller is better; max_length 100 batches)" in out
    assert "python3 train.py" in out
    assert re.search(r"Slots/trial:\s+2", out)
    trials = out.split("Trials (best first):")[1].split("Checkpoints:")[0]
    done_row = next(ln for ln in trials.splitlines() if ln.startswith(f"{world.done_trial} "))
    cells = [c.strip() for c in done_row.split("|")]
    assert cells[:5] == [str(world.done_trial), "COMPLETED", "20", "0", "0.4"]
    assert "val_loss=0.4" in cells[5] and "accuracy=0.875" in cells[5]
    assert cells[7] == world.ck2  # after the hyperparameters column
    ckpts = out.split("Checkpoints:")[1]
    assert world.ck1 in ckpts and world.ck2 in ckpts


def test_experiment_describe_json(world: World) -> None:
    r = world.cli("experiment", "describe", world.exp, "--json")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert set(data) == {"experiment", "trials", "checkpoints"}
    assert data["experiment"]["id"] == world.exp
    assert data["experiment"]["config"]["searcher"]["name"] == "single"
    assert [t["id"] for t in data["trials"]] == [world.done_trial, world.live_trial]
    assert [c["uuid"] for c in data["checkpoints"]] == [world.ck1, world.ck2]


def test_control_commands_parse_their_arguments(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only the argument parsing: what control() does is the daemon's business."""
    import det_local.api
    from det_local.cli import experiment

    calls: list[tuple[int, str, dict[str, object]]] = []

    def fake_control(experiment_id: int, action: str, **fields: object) -> str:
        calls.append((experiment_id, action, fields))
        return f"experiment {experiment_id}: {action} requested"

    monkeypatch.setattr(det_local.api, "control", fake_control)
    runner = CliRunner()
    for args, want in [
        (["pause", "3"], (3, "pause", {})),
        (["activate", "3"], (3, "activate", {})),
        (["kill", "4"], (4, "kill", {})),
        (["label", "add", "5", "best"], (5, "label_add", {"label": "best"})),
        (["label", "remove", "5", "best"], (5, "label_remove", {"label": "best"})),
    ]:
        res = runner.invoke(experiment.app, args)
        assert res.exit_code == 0, res.output
        assert calls[-1] == want
        assert res.stdout.strip() == f"experiment {want[0]}: {want[1]} requested"
    assert runner.invoke(experiment.app, ["pause", "not-a-number"]).exit_code == 2
    assert runner.invoke(experiment.app, ["label", "add", "5"]).exit_code == 2
    help_text = runner.invoke(experiment.app, ["label", "add", "--help"]).stdout
    assert "EXPERIMENT_ID" in help_text and "LABEL" in help_text


# ---------------------------------------------------------------------------- trials
def test_trial_list(world: World) -> None:
    r = world.cli("trial", "list", world.exp)
    assert r.returncode == 0, r.stderr
    assert "lr=0.1 opt.name=sgd" in r.stdout
    assert "COMPLETED" in r.stdout and "ACTIVE" in r.stdout
    r = world.cli("trial", "list", world.exp, "--json")
    data = json.loads(r.stdout)
    assert [t["id"] for t in data] == [world.done_trial, world.live_trial]
    assert data[0]["hparams"] == {"lr": 0.1, "opt": {"name": "sgd"}}
    assert data[0]["state"] == "COMPLETED"


def test_trial_describe(world: World) -> None:
    r = world.cli("trial", "describe", world.done_trial)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert f"Trial {world.done_trial} of experiment {world.exp}" in out
    assert "opt.name: sgd" in out
    assert "Latest training metrics (steps 20" in out and "loss: 0.5" in out
    assert "accuracy: 0.875" in out
    assert world.ck1 in out and world.ck2 in out

    r = world.cli("trial", "describe", world.live_trial)
    assert "Latest validation metrics: (none yet)" in r.stdout


def test_trial_describe_json(world: World) -> None:
    r = world.cli("trial", "describe", world.done_trial, "--json")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert set(data) == {"trial", "slurm_job", "log_policies", "checkpoints", "metrics"}
    assert data["slurm_job"] is None  # ran on this machine's slots, not in a Slurm pool
    assert data["log_policies"] == []  # none matched its output
    assert data["trial"]["id"] == world.done_trial
    assert data["trial"]["latest_checkpoint"] == world.ck2
    assert data["metrics"]["training"]["metrics"] == {"loss": 0.5}
    assert data["metrics"]["training"]["steps_completed"] == 20
    assert data["metrics"]["validation"]["metrics"]["accuracy"] == 0.875
    assert [c["uuid"] for c in data["checkpoints"]] == [world.ck1, world.ck2]

    data = json.loads(world.cli("trial", "describe", world.live_trial, "--json").stdout)
    assert data["metrics"] == {"training": None, "validation": None}
    assert data["checkpoints"] == []


def test_trial_logs(world: World) -> None:
    r = world.cli("trial", "logs", world.done_trial)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "starting 2 workers" and len(lines) == 11

    r = world.cli("trial", "logs", world.done_trial, "--rank", "1")
    assert r.stdout.splitlines() == [f"[rank=1] step {i}" for i in (1, 3, 5, 7, 9)]

    r = world.cli("trial", "logs", world.done_trial, "--tail", "3")
    assert r.stdout.splitlines() == [f"[rank={i % 2}] step {i}" for i in (7, 8, 9)]

    r = world.cli("trial", "logs", world.done_trial, "--rank", "0", "--tail", "2")
    assert r.stdout.splitlines() == ["[rank=0] step 6", "[rank=0] step 8"]

    r = world.cli("trial", "logs", world.done_trial, "--tail", "50")
    assert len(r.stdout.splitlines()) == 11

    # no log yet: nothing, and success
    r = world.cli("trial", "logs", world.live_trial)
    assert (r.returncode, r.stdout, r.stderr) == (0, "", "")


def test_trial_logs_tail_over_many_blocks(world: World) -> None:
    log = world.p.trial_log(world.exp, world.done_trial)
    with log.open("a") as f:
        for i in range(20000):
            f.write(f"[rank={i % 3}] {'x' * 40} {i}\n")
        f.write("[rank=2] unterminated")
    r = world.cli("trial", "logs", world.done_trial, "--rank", "2", "--tail", "3")
    assert r.stdout.splitlines() == [
        f"[rank=2] {'x' * 40} 19994",
        f"[rank=2] {'x' * 40} 19997",
        "[rank=2] unterminated",
    ]


class _Lines:
    """Reads a process's stdout on a thread so that tests can wait for lines with a bound."""

    def __init__(self, stream: IO[str]) -> None:
        self.q: queue.Queue[str | None] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._pump, args=(stream,), daemon=True).start()

    def _pump(self, stream: IO[str]) -> None:
        for line in stream:
            self.q.put(line.rstrip("\n"))
        self.q.put(None)

    def wait_for(self, wanted: str) -> None:
        deadline = time.monotonic() + TIMEOUT_S
        while wanted not in self.seen:
            left = deadline - time.monotonic()
            assert left > 0, f"{wanted!r} not printed; got {self.seen}"
            try:
                line = self.q.get(timeout=left)
            except queue.Empty:
                continue
            assert line is not None, f"output ended before {wanted!r}; got {self.seen}"
            self.seen.append(line)

    def rest(self) -> list[str]:
        while (line := self.q.get(timeout=TIMEOUT_S)) is not None:
            self.seen.append(line)
        return self.seen


def _finish(proc: subprocess.Popen[str]) -> tuple[int, str]:
    try:
        rc = proc.wait(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    assert proc.stderr is not None
    return rc, proc.stderr.read()


@pytest.mark.parametrize("rank", [None, 1])
def test_trial_logs_follow_until_completed(world: World, rank: int | None) -> None:
    log = world.p.trial_log(world.exp, world.live_trial)
    args = ["trial", "logs", world.live_trial, "-f"] + ([] if rank is None else ["--rank", rank])
    proc = world.popen(*args)
    assert proc.stdout is not None
    out = _Lines(proc.stdout)
    try:
        # The log does not exist yet: follow waits for it.
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("a") as f:
            f.write("[rank=0] a1\n[rank=1] b1\n")
        out.wait_for("[rank=1] b1")
        with log.open("a") as f:  # a line that arrives in two pieces
            f.write("[rank=0] a2\n[rank=1] b")
            f.flush()
            f.write("2\n")
        out.wait_for("[rank=1] b2")
        with log.open("a") as f:
            f.write("[rank=0] a3\n[rank=1] last\n")
        store = world.writer()
        store.set_trial_state(world.live_trial, State.COMPLETED)
        store.close()
        rc, err = _finish(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert (rc, err) == (0, "")
    lines = out.rest()
    everything = ["[rank=0] a1", "[rank=1] b1", "[rank=0] a2", "[rank=1] b2", "[rank=0] a3"]
    everything.append("[rank=1] last")
    assert lines == [ln for ln in everything if rank is None or ln.startswith(f"[rank={rank}] ")]


def test_trial_logs_follow_stops_when_paused_and_on_ctrl_c(world: World) -> None:
    log = world.p.trial_log(world.exp, world.live_trial)
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("[rank=0] one\n")

    proc = world.popen("trial", "logs", world.live_trial, "--follow", "--tail", "1")
    assert proc.stdout is not None
    out = _Lines(proc.stdout)
    out.wait_for("[rank=0] one")
    proc.send_signal(signal.SIGINT)
    assert _finish(proc) == (0, "")

    proc = world.popen("trial", "logs", world.live_trial, "-f")
    assert proc.stdout is not None
    out = _Lines(proc.stdout)
    out.wait_for("[rank=0] one")
    with log.open("a") as f:
        f.write("[rank=0] two\n")
    out.wait_for("[rank=0] two")
    store = world.writer()
    store.set_trial_state(world.live_trial, State.PAUSED)
    store.close()
    assert _finish(proc) == (0, "")
    assert out.rest() == ["[rank=0] one", "[rank=0] two"]


# ---------------------------------------------------------------------------- checkpoints
def test_checkpoint_list(world: World) -> None:
    r = world.cli("checkpoint", "list", world.exp)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert [c.strip() for c in lines[0].split("|")] == [
        "UUID",
        "Trial",
        "Steps",
        "State",
        "Size",
        "Created",
    ]
    row = [c.strip() for c in lines[2].split("|")]
    assert row[:5] == [world.ck1, str(world.done_trial), "10", "COMPLETED", "3.0 KiB"]
    assert re.fullmatch(TIME_RE, row[5])
    assert world.ck2 in lines[3]

    data = json.loads(world.cli("checkpoint", "list", world.exp, "--json").stdout)
    assert [c["uuid"] for c in data] == [world.ck1, world.ck2]
    assert {"uuid", "trial_id", "steps_completed", "state", "resources", "metadata"} <= set(data[0])

    r = world.cli("checkpoint", "list", world.exp, "--trial", world.live_trial, "--json")
    assert json.loads(r.stdout) == []


def test_checkpoint_describe(world: World) -> None:
    r = world.cli("checkpoint", "describe", world.ck1)
    assert r.returncode == 0, r.stderr
    assert f"Checkpoint {world.ck1}" in r.stdout
    assert "framework: torch" in r.stdout
    assert re.search(r"sub/opt.bin\s+\|\s+100 B", r.stdout)
    data = json.loads(world.cli("checkpoint", "describe", world.ck1, "--json").stdout)
    assert data["uuid"] == world.ck1
    assert data["metadata"]["framework"] == "torch"
    assert data["resources"] == {"model.bin": 3000, "sub/opt.bin": 100}


def test_checkpoint_download(world: World, tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    r = world.cli("checkpoint", "download", world.ck1, cwd=work)
    assert r.returncode == 0, r.stderr
    dest = work / "checkpoints" / world.ck1
    assert r.stdout.strip() == str(dest)
    assert (dest / "model.bin").read_bytes() == b"m" * 3000
    assert (dest / "sub" / "opt.bin").read_bytes() == b"o" * 100
    assert json.loads((dest / "metadata.json").read_text())["framework"] == "torch"

    # metadata.json present: already downloaded, nothing copied again
    (dest / "model.bin").unlink()
    r = world.cli("checkpoint", "download", world.ck1, cwd=work)
    assert (r.returncode, r.stdout.strip()) == (0, str(dest))
    assert not (dest / "model.bin").exists()

    # -o, and a checkpoint directory without metadata.json gets one from the record
    r = world.cli("checkpoint", "download", world.ck2, "-o", "mine", cwd=work)
    assert (r.returncode, r.stdout.strip()) == (0, str(work / "mine")), r.stderr
    assert json.loads((work / "mine" / "metadata.json").read_text()) == {
        "framework": "torch",
        "steps_completed": 20,
    }
    assert (work / "mine" / "model.bin").exists()


def test_checkpoint_download_of_vanished_or_deleted_files(world: World, tmp_path: Path) -> None:
    store = world.writer()
    src = Path(store.get_checkpoint(world.ck2).path)
    shutil.rmtree(src)
    r = world.cli("checkpoint", "download", world.ck2, "-o", tmp_path / "x")
    err = _one_line_error(
        r, f"checkpoint {world.ck2} of trial {world.done_trial}: its files at {src} are gone"
    )
    assert f"det-local checkpoint list {world.exp}" in err
    assert not (tmp_path / "x" / "metadata.json").exists()

    store.mark_checkpoint_deleted(world.ck1)
    store.close()
    r = world.cli("checkpoint", "download", world.ck1, "-o", tmp_path / "y")
    _one_line_error(r, f"checkpoint {world.ck1}", "DELETED")


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["experiment", "describe", "999"], "experiment 999 not found"),
        (["trial", "describe", "999"], "trial 999 not found"),
        (["trial", "logs", "999"], "trial 999 not found"),
        (["trial", "list", "999"], "experiment 999 not found"),
        (["checkpoint", "list", "999"], "experiment 999 not found"),
        (["checkpoint", "describe", "nope"], "checkpoint nope not found"),
        (["checkpoint", "download", "nope"], "checkpoint nope not found"),
    ],
)
def test_unknown_ids_are_one_line_errors(world: World, args: list[str], fragment: str) -> None:
    _one_line_error(world.cli(*args), fragment)


def test_checkpoint_list_rejects_a_trial_of_another_experiment(world: World) -> None:
    _one_line_error(
        world.cli("checkpoint", "list", world.other_exp, "--trial", world.done_trial),
        f"trial {world.done_trial} is not part of experiment {world.other_exp}",
    )

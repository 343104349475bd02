"""The PyTorch Trial API and DeepSpeed across two machines: each machine a real `det-local daemon`
in its own network namespace with one CPU slot (tests/federation/netns/test_federation_gang.py's
harness), a trial of 2 slots whose ranks run one on each.

What is checked: rank 0 runs on the owner's namespace and rank 1 on the member's (each rank
records its network namespace), the owner's trial log has both ranks, and the final weights in
the last checkpoint (shared_fs, a directory both machines see) equal those of the same
experiment with 2 ranks on one machine (embedded `det-local run` with 2 CPU slots). Paused
mid-training, every rank on both machines is gone; activated, the trial goes on from its
checkpoint and ends with the weights of the uninterrupted run.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support import paths
from tests.support.fednet import Net, Node, cli, namespaces, sweep
from tests.support.gangnet import (
    db,
    exp_state,
    ns_pids,
    pytestmark,  # noqa: F401  (root, iproute2; slow)
    submit,
    trial_log,
    two_nodes,
    wait_end,
)
from tests.support.reach import python_reachable
from tests.support.world import wait_for

FIXTURES = paths.FIXTURES
BATCHES = 12  # 1.5 epochs of 8 batches
LEGACY = "model_def:FedTrial"
TRAINER = "python3 -m determined.launch.torch_distributed python3 model_def.py"
DS_LEGACY = "python3 -m determined.launch.deepspeed --trial model_def:LinearDS"
DS_CONFIG = {
    "train_batch_size": 8,  # 2 micro-batches x 2 steps x 2 ranks
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 2,
    "optimizer": {"type": "SGD", "params": {"lr": 0.05}},
}


def experiment(
    tmp: Path,
    name: str,
    entrypoint: str,
    *,
    deepspeed: bool = False,
    ckpt_every: int | None = None,
    report_every: int | None = None,
    **hparams: Any,
) -> tuple[Path, Path]:
    """A 2-slot experiment in tmp/name: the fixture trial, seeded, BATCHES batches, its
    checkpoints in tmp/shared (shared_fs: the namespaces share the host's filesystem)."""
    ctx = tmp / name
    ctx.mkdir(parents=True)
    if deepspeed:
        (ctx / "model_def.py").write_text((FIXTURES / "ds_model_def.py").read_text())
        (ctx / "ds_config.json").write_text(json.dumps(DS_CONFIG))
        hparams = {"deepspeed_config": "ds_config.json", "batches": BATCHES, **hparams}
        metric = "val_loss"
    else:
        (ctx / "model_def.py").write_text((FIXTURES / "fed_trial.py").read_text())
        hparams = {"global_batch_size": 32, "batches": BATCHES, **hparams}
        metric = "validation_loss"
    shared = tmp / "shared"
    shared.mkdir(exist_ok=True)
    shared.chmod(0o777)  # the ranks run as the submitting account (never root across machines)
    cfg: dict[str, Any] = {
        "name": name,
        "entrypoint": entrypoint,
        "hyperparameters": hparams,
        "resources": {"slots_per_trial": 2},
        "reproducibility": {"experiment_seed": 7},
        "searcher": {
            "name": "single",
            "metric": metric,
            "smaller_is_better": True,
            "max_length": {"batches": BATCHES},
        },
        "checkpoint_storage": {"type": "shared_fs", "host_path": str(shared)},
        "max_restarts": 0,
    }
    # the legacy harness reads these from the config, the Trainer script from its hparams
    if ckpt_every:
        cfg["min_checkpoint_period"] = {"batches": ckpt_every}
        cfg["hyperparameters"]["ckpt_every"] = ckpt_every
    if report_every:  # with several ranks, preemption is checked at these boundaries only
        cfg["scheduling_unit"] = report_every
        cfg["hyperparameters"]["report_every"] = report_every
    path = tmp / f"{name}.yaml"
    path.write_text(json.dumps(cfg))
    return path, ctx


def last_checkpoint(home: Path, exp_id: int) -> tuple[int, Path]:
    """(steps_completed, path) of the experiment's latest checkpoint that is still there."""
    with db_at(home) as conn:
        row = conn.execute(
            "SELECT steps_completed, path FROM checkpoints WHERE experiment_id=?"
            " AND state='COMPLETED' ORDER BY steps_completed DESC LIMIT 1",
            (exp_id,),
        ).fetchone()
    assert row is not None, f"experiment {exp_id} has no checkpoint"
    return int(row[0]), Path(row[1])


def checkpoint_steps(home: Path, exp_id: int) -> list[int]:
    with db_at(home) as conn:
        rows = conn.execute(
            "SELECT steps_completed FROM checkpoints WHERE experiment_id=? ORDER BY 1", (exp_id,)
        ).fetchall()
    return [int(r[0]) for r in rows]


def member_jobs(node: Node) -> list[tuple[str, ...]]:
    with db(node) as conn:
        return [tuple(r) for r in conn.execute("SELECT state FROM jobs")]


def db_at(home: Path) -> sqlite3.Connection:
    return sqlite3.connect(f"file:{home / 'det-local.db'}?mode=ro", uri=True)


def weights(home: Path, exp_id: int, *, deepspeed: bool = False) -> dict[str, torch.Tensor]:
    """The model's weights in the experiment's last checkpoint (trained all BATCHES)."""
    steps, path = last_checkpoint(home, exp_id)
    assert steps == BATCHES, (steps, path)
    if deepspeed:
        states = torch.load(path / "model0" / "mp_rank_00_model_states.pt", weights_only=False)
        return dict(states["module"])
    (model,) = torch.load(path / "state_dict.pth", weights_only=False)["models_state_dict"]
    return {k.removeprefix("module."): v for k, v in model.items()}


def assert_same_weights(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys() and got
    for name, value in got.items():
        torch.testing.assert_close(value, want[name], rtol=1e-5, atol=1e-6, msg=name)


def one_machine(tmp: Path, entrypoint: str, *, deepspeed: bool = False) -> dict[str, Any]:
    """The same experiment with its 2 ranks on one machine: `det-local run` (embedded) with 2
    CPU slots, in the root namespace (its ranks meet on 127.0.0.1)."""
    cfg, ctx = experiment(tmp, "one-machine", entrypoint, deepspeed=deepspeed)
    home = tmp / "home-one-machine"
    res = cli(
        home,
        "run",
        str(cfg),
        str(ctx),
        timeout=300,
        user="root",  # one machine, embedded: no peer involved
        DET_LOCAL_CPU_SLOTS="2",
        DET_LOCAL_MDNS="0",
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return weights(home, 1, deepspeed=deepspeed)


def writable(tmp: Path) -> Path:
    """Where the ranks (the submitting account, not root) write what the tests read."""
    out = tmp / "out"
    out.mkdir(exist_ok=True)
    out.chmod(0o1777)
    return out


@pytest.fixture
def machines(tmp_path: Path, accounts: None) -> Iterator[tuple[Node, Node]]:
    """Two machines of one cluster, one CPU slot each: n1 (the owner here) and n2."""
    sweep()
    with Net(tmp_path) as net, python_reachable(on_blocked=pytest.skip):
        yield two_nodes(net)
    assert not [ns for ns in namespaces() if ns.startswith(net.prefix)]


@pytest.fixture(scope="module")
def pytorch_reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """FedTrial's final weights with 2 ranks on one machine (shared by the tests below)."""
    return one_machine(tmp_path_factory.mktemp("reference"), LEGACY)


def records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def netns_inode(node: Node) -> int:
    return os.stat(f"/run/netns/{node.ns}").st_ino


def assert_ranks_on_both_nodes(rows: list[dict[str, Any]], n1: Node, n2: Node) -> None:
    """Rank 0 ran in the owner's namespace as node rank 0, rank 1 in the member's as 1."""
    where = {(r["rank"], r["node_rank"], r["netns"]) for r in rows}
    assert where == {(0, "0", netns_inode(n1)), (1, "1", netns_inode(n2))}, where


def trial_processes(node: Node) -> list[int]:
    """Processes in the node's namespace other than its daemon (ranks, launchers, wrappers)."""
    assert node.proc is not None
    return [p for p in ns_pids(node) if p != node.proc.pid]


def test_pytorch_trial_across_two_machines_learns_what_one_machine_learns(
    machines: tuple[Node, Node], tmp_path: Path, pytorch_reference: dict[str, torch.Tensor]
) -> None:
    n1, n2 = machines
    for name, entrypoint in (("legacy", LEGACY), ("trainer", TRAINER)):
        record = writable(tmp_path) / f"{name}.jsonl"
        exp_id = submit(n1, *experiment(tmp_path, name, entrypoint, record=str(record)))
        assert wait_end(n1, n2, exp_id, timeout=120) == "COMPLETED", trial_log(n1, exp_id)
        rows = records(record)
        assert_ranks_on_both_nodes(rows, n1, n2)
        for rank in (0, 1):
            assert [r["batch"] for r in rows if r["rank"] == rank] == list(range(BATCHES))
        log = trial_log(n1, exp_id)
        assert "[rank=0]" in log and "[rank=1]" in log, log[-3000:]
        assert_same_weights(weights(n1.home, exp_id), pytorch_reference)
    with db(n2) as conn:
        rows = conn.execute("SELECT kind, state, exit_code FROM jobs").fetchall()
    assert rows == [("MEMBER", "DONE", 0)] * 2, rows


@pytest.mark.parametrize("entrypoint", [LEGACY, TRAINER], ids=["legacy", "trainer"])
def test_pytorch_trial_pauses_and_resumes_across_two_machines(
    machines: tuple[Node, Node],
    tmp_path: Path,
    pytorch_reference: dict[str, torch.Tensor],
    entrypoint: str,
) -> None:
    n1, n2 = machines
    record, marker = writable(tmp_path) / "paused.jsonl", writable(tmp_path) / "holding"
    cfg, ctx = experiment(
        tmp_path,
        "paused",
        entrypoint,
        ckpt_every=4,
        report_every=2,
        record=str(record),
        hold_at=10,
        marker=str(marker),
    )
    exp_id = submit(n1, cfg, ctx)
    wait_for(marker.exists, timeout=90, what="the ranks to hold at batch 10")
    wait_for(  # paused after a checkpoint
        lambda: checkpoint_steps(n1.home, exp_id) == [4, 8], timeout=30, what="checkpoint 8"
    )
    res = n1.cli("experiment", "pause", str(exp_id))
    assert res.returncode == 0, res.stderr
    wait_for(lambda: exp_state(n1, exp_id) == "PAUSED", timeout=40, what="paused")
    # every rank on both machines is gone; the member's share ended
    wait_for(
        lambda: not trial_processes(n1) and not trial_processes(n2),
        timeout=30,
        what="no trial process on either machine",
    )
    wait_for(lambda: member_jobs(n2) == [("DONE",)], timeout=30, what="the member's share done")
    assert checkpoint_steps(n1.home, exp_id) == [4, 8, 10]  # the preemption's checkpoint

    res = n1.cli("experiment", "activate", str(exp_id))
    assert res.returncode == 0, res.stderr
    assert wait_end(n1, n2, exp_id, timeout=120) == "COMPLETED"
    rows = records(record)
    assert_ranks_on_both_nodes(rows, n1, n2)
    for rank in (0, 1):
        mine = [r for r in rows if r["rank"] == rank]
        # each batch trained once: the second run went on from the checkpoint, not from 0
        assert [r["batch"] for r in mine] == list(range(BATCHES))
        assert [r["run"] for r in mine] == ["1"] * 10 + ["2"] * 2
    with db(n1) as conn:
        restarts = conn.execute("SELECT restarts FROM trials").fetchone()[0]
    assert restarts == 0
    assert_same_weights(weights(n1.home, exp_id), pytorch_reference)


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs deepspeed")
def test_deepspeed_trial_across_two_machines_learns_what_one_machine_learns(
    machines: tuple[Node, Node], tmp_path: Path
) -> None:
    n1, n2 = machines
    reference = one_machine(tmp_path / "reference", DS_LEGACY, deepspeed=True)
    record = writable(tmp_path) / "ds.jsonl"
    cfg, ctx = experiment(tmp_path, "ds", DS_LEGACY, deepspeed=True, record=str(record))
    exp_id = submit(n1, cfg, ctx)
    assert wait_end(n1, n2, exp_id, timeout=150) == "COMPLETED", trial_log(n1, exp_id)
    rows = records(record)
    assert_ranks_on_both_nodes(rows, n1, n2)
    for rank in (0, 1):  # gradient_accumulation_steps train_batch() calls a batch
        mine = [r["batch"] for r in rows if r["rank"] == rank]
        assert mine == [b for b in range(BATCHES) for _ in (0, 1)], mine
    log = trial_log(n1, exp_id)
    assert "[rank=0]" in log and "[rank=1]" in log, log[-3000:]
    assert_same_weights(weights(n1.home, exp_id, deepspeed=True), reference)

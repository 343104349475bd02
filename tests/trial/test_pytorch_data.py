"""The PyTorch API's building blocks, without a training loop: Batch/Epoch schedules, the
DataLoader and its samplers (skip / repeat / shard arithmetic, seeded shuffles), reducers and
the metric conversions."""

from __future__ import annotations

import math
import sys
from typing import Any

import pytest
import torch

from det_local.trial import pytorch
from det_local.trial.pytorch import samplers
from det_local.trial.pytorch._errors import InvalidTrialError
from det_local.trial.pytorch._metrics import MetricsBuffer, average_batches, first_nan, to_host
from det_local.trial.pytorch._reducer import (
    Reducer,
    ReducerContext,
    evaluation_reducers,
    reduce_validation,
    simple_reduce,
)
from det_local.trial.pytorch._units import from_searcher_max_length


class Indexes(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Record i is the tensor [i]."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([i])


def batches(loader: Any, n: int | None = None) -> list[list[int]]:
    out = []
    for i, b in enumerate(loader):
        if n is not None and i == n:
            break
        out.append(b.reshape(-1).tolist())
    return out


# ---------------------------------------------------------------------------- units
def test_batch_and_epoch_periods_and_schedules() -> None:
    every5 = pytorch.Batch(5)
    assert [s for s in range(0, 21) if every5.should_stop(s)] == [5, 10, 15, 20]
    schedule = pytorch.Batch([5, 30, 45])
    assert [s for s in range(1, 60) if schedule.should_stop(s)] == [5, 30, 45]
    assert all(pytorch.Batch(0).should_stop(s) for s in range(5))  # < 1 means always
    assert all(pytorch.Epoch(-1).should_stop(s) for s in range(5))
    assert [e for e in range(1, 7) if pytorch.Epoch(2).should_stop(e)] == [2, 4, 6]
    assert pytorch.Epoch((1, 3)).should_stop(3) and not pytorch.Epoch((1, 3)).should_stop(2)
    assert pytorch.Batch(3) == pytorch.Batch(3) != pytorch.Epoch(3)
    assert repr(pytorch.Epoch(2)) == "Epoch(2)"


def test_searcher_max_length_conversions() -> None:
    assert from_searcher_max_length({"batches": 7}, None) == pytorch.Batch(7)
    assert from_searcher_max_length({"epochs": 2}, None) == pytorch.Epoch(2)
    assert from_searcher_max_length({"records": 100}, 32) == pytorch.Batch(3)
    assert from_searcher_max_length({"records": 10}, 32) == pytorch.Batch(1)  # at least one
    assert from_searcher_max_length(12, None) == pytorch.Batch(12)
    assert from_searcher_max_length(None, None) is None
    with pytest.raises(InvalidTrialError, match="needs the global_batch_size hyperparameter"):
        from_searcher_max_length({"records": 100}, None)
    with pytest.raises(InvalidTrialError, match=r"expected \{batches: N\}"):
        from_searcher_max_length({"minutes": 3}, None)


# ---------------------------------------------------------------------------- DataLoader
def test_data_loader_keeps_torchs_contract() -> None:
    loader = pytorch.DataLoader(Indexes(10), batch_size=4)
    assert len(loader) == 3
    assert batches(loader) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert len(pytorch.DataLoader(Indexes(10), batch_size=4, drop_last=True)) == 2
    custom = torch.utils.data.BatchSampler(torch.utils.data.SequentialSampler(range(6)), 3, False)
    assert batches(pytorch.DataLoader(Indexes(6), batch_sampler=custom)) == [[0, 1, 2], [3, 4, 5]]

    class Stream(torch.utils.data.IterableDataset):  # type: ignore[type-arg]
        def __iter__(self) -> Any:
            return iter(range(3))

    with pytest.raises(InvalidTrialError, match="IterableDataset"):
        pytorch.DataLoader(Stream())
    with pytest.raises(InvalidTrialError, match="batch_size=None"):
        pytorch.DataLoader(Indexes(3), batch_size=None)
    with pytest.raises(ValueError, match="mutually exclusive"):
        pytorch.DataLoader(Indexes(3), shuffle=True, sampler=range(3))
    with pytest.raises(ValueError, match="batch_sampler option is mutually exclusive"):
        pytorch.DataLoader(Indexes(3), batch_size=2, batch_sampler=custom)
    with pytest.raises(ValueError, match="persistent_workers"):
        pytorch.DataLoader(Indexes(3), persistent_workers=True)


def test_get_data_loader_repeat_skip_and_shard_arithmetic() -> None:
    loader = pytorch.DataLoader(Indexes(10), batch_size=2)  # 5 batches: 0..4
    # repeat: the batch stream goes on past the epoch
    assert batches(loader.get_data_loader(repeat=True), 7) == [
        [0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [0, 1], [2, 3],
    ]  # fmt: skip
    # skip counts batches after repeating, so skipping past an epoch wraps around once
    assert batches(loader.get_data_loader(repeat=True, skip=6), 3) == [[2, 3], [4, 5], [6, 7]]
    # shard: every num_replicas-th batch from rank; lower ranks get the remainder
    r0 = loader.get_data_loader(num_replicas=2, rank=0)
    r1 = loader.get_data_loader(num_replicas=2, rank=1)
    assert (len(r0), len(r1)) == (3, 2)
    assert batches(r0) == [[0, 1], [4, 5], [8, 9]] and batches(r1) == [[2, 3], [6, 7]]
    # shard then skip: the skip counts this rank's (global) steps
    r1_skip = loader.get_data_loader(repeat=True, skip=2, num_replicas=2, rank=1)
    assert batches(r1_skip, 3) == [[0, 1], [4, 5], [8, 9]]
    # a repeated loader's len is one epoch (what epoch boundaries are counted from)
    assert len(loader.get_data_loader(repeat=True, skip=3)) == 5


def test_shuffle_is_seeded_so_a_resume_continues_on_the_same_batches() -> None:
    torch.manual_seed(7)
    a = pytorch.DataLoader(Indexes(12), batch_size=3, shuffle=True)
    torch.manual_seed(7)
    b = pytorch.DataLoader(Indexes(12), batch_size=3, shuffle=True)
    straight = batches(a.get_data_loader(repeat=True), 10)
    resumed = batches(b.get_data_loader(repeat=True, skip=6), 4)
    assert resumed == straight[6:]
    assert sorted(sum(straight[:4], [])) == list(range(12))  # each epoch is a permutation
    assert straight[:4] != straight[4:8]  # ... and a different one each epoch
    assert straight[:4] != [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]]
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    c = pytorch.DataLoader(Indexes(12), batch_size=3, shuffle=True, generator=g1)
    d = pytorch.DataLoader(Indexes(12), batch_size=3, shuffle=True, generator=g2)
    assert batches(c) == batches(d)


def test_samplers() -> None:
    seq = list(range(7))
    assert list(samplers.DistributedSampler(seq, num_workers=3, rank=1)) == [1, 4]
    assert len(samplers.DistributedSampler(seq, num_workers=3, rank=0)) == 3
    assert len(samplers.DistributedSampler(seq, num_workers=3, rank=2)) == 2
    assert list(samplers.SkipSampler(seq, 5)) == [5, 6] and len(samplers.SkipSampler(seq, 5)) == 7
    assert list(samplers.SkipSampler(seq, 50)) == []
    rep = iter(samplers.RepeatSampler([1, 2]))
    assert [next(rep) for _ in range(5)] == [1, 2, 1, 2, 1]
    assert list(samplers.RepeatBatchSampler([])) == []  # an empty epoch does not spin forever
    s1 = samplers.ReproducibleShuffleSampler(seq, seed=11)
    s2 = samplers.ReproducibleShuffleSampler(seq, seed=11)
    assert [list(s1) for _ in range(3)] == [list(s2) for _ in range(3)]
    bs = samplers.ReproducibleShuffleBatchSampler([[0, 1], [2, 3], [4]], seed=1)
    assert sorted(map(tuple, bs)) == [(0, 1), (2, 3), (4,)] and len(bs) == 3
    with pytest.raises(ValueError, match="rank must be in"):
        samplers.DistributedBatchSampler([[0]], num_workers=2, rank=2)


def test_data_length_and_to_device() -> None:
    t = torch.zeros(5, 3)
    assert pytorch.data_length(t) == 5
    assert pytorch.data_length({"x": t, "y": torch.zeros(5)}) == 5
    assert pytorch.data_length((t, t)) == 5
    with pytest.raises(InvalidTrialError, match="get_batch_length"):
        pytorch.data_length(object())
    moved = pytorch.to_device({"a": [t, (t, 3)], "s": "text"}, torch.device("cpu"))
    assert moved["a"][0] is t and moved["a"][1][1] == 3 and moved["s"] == "text"


# ---------------------------------------------------------------------------- reducers
def test_simple_reducers() -> None:
    assert simple_reduce(Reducer.AVG, [1.0, 2.0, 6.0]) == 3.0
    assert simple_reduce(Reducer.SUM, [1, 2, 3]) == 6 and isinstance(
        simple_reduce(Reducer.SUM, [1, 2, 3]), int
    )
    assert simple_reduce(Reducer.MAX, [[1.0, 9.0], [3.0, 4.0]]) == 9.0  # arrays flattened
    assert simple_reduce(Reducer.MIN, [2.5, -1.0]) == -1.0
    assert simple_reduce(Reducer.AVG, [1.0, 4.0], [1, 3]) == 3.25  # weighted by batch counts
    with pytest.raises(InvalidTrialError, match="cannot reduce metric values of type str"):
        simple_reduce(Reducer.AVG, ["a"])


class _FakeDist:
    """Two slots: this process plays rank 0 and `other` is what rank 1 gathered."""

    size = 2
    rank = 0

    def __init__(self, other: Any) -> None:
        self.other = other

    def gather(self, x: Any) -> list[Any]:
        return [x, self.other]

    def allgather(self, x: Any) -> list[Any]:
        return [x, self.other]


def test_validation_metrics_are_reduced_across_slots_weighted_by_batches() -> None:
    mine = [{"loss": 1.0, "hits": 2}]  # one batch
    theirs = ({"loss": 4.0, "hits": 9}, 3)  # rank 1: mean 4.0 over three batches, sum 9
    reducers = {"loss": Reducer.AVG, "hits": Reducer.SUM}
    assert reduce_validation(_FakeDist(theirs), mine, reducers) == {"loss": 3.25, "hits": 11}
    assert evaluation_reducers(Reducer.MAX, ["a", "b"], "T") == {
        "a": Reducer.MAX,
        "b": Reducer.MAX,
    }
    with pytest.raises(InvalidTrialError, match=r"T.evaluation_reducer\(\) returned reducers"):
        evaluation_reducers({"a": Reducer.SUM}, ["a", "b"], "T")


class PairSum(pytorch.MetricReducer):
    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.total = 0

    def update(self, v: int) -> None:
        self.total += v

    def per_slot_reduce(self) -> int:
        return self.total

    def cross_slot_reduce(self, per_slot: list[int]) -> dict[str, int]:
        return {"total": sum(per_slot), "slots": len(per_slot)}


def test_wrap_reducer_custom_and_function_across_slots() -> None:
    # rank 1 contributes [10 for PairSum, [5, 6] for the function reducer]
    ctx = ReducerContext(_FakeDist([10, [5, 6]]).allgather)
    pair = ctx.wrap_reducer(PairSum())
    seen: list[Any] = []
    fn = ctx.wrap_reducer(lambda values: seen.append(values) or sum(values), name="sum_fn")
    pair.update(1)
    fn.update(1)
    fn.update(2)
    fn.update(3)
    assert ctx.reduce_metrics(for_training=True) == {"total": 11, "slots": 2, "sum_fn": 17}
    assert seen == [[1, 5, 2, 6, 3]]  # interleaved: undoes the sharding of batches
    ctx.reset_reducers()
    assert pair.total == 0 and fn.values == []
    with pytest.raises(InvalidTrialError, match="same PairSum object twice"):
        ctx.wrap_reducer(pair)
    bad = ReducerContext()
    bad.wrap_reducer(PairSum(), name="oops")
    with pytest.raises(InvalidTrialError, match="wrapped with a name but returned a dict"):
        bad.reduce_metrics(for_training=False)
    nameless = ReducerContext()
    nameless.wrap_reducer(lambda values: 3.0)
    with pytest.raises(InvalidTrialError, match="wrapped without a name but returned a float"):
        nameless.reduce_metrics(for_training=True)
    only_val = ReducerContext()
    only_val.wrap_reducer(lambda v: 1, name="x", for_training=False)
    assert only_val.reduce_metrics(for_training=True) == {}
    assert only_val.reduce_metrics(for_training=False) == {"x": 1}


# ---------------------------------------------------------------------------- metric values
def test_metrics_buffer_moves_tensors_to_the_host_once() -> None:
    buf = MetricsBuffer()
    loss = torch.tensor(0.5, requires_grad=True) * 2
    buf.add(3, {"loss": loss, "vec": torch.tensor([1.0, 3.0]), "n": torch.tensor(4), "f": 0.25})
    buf.add(4, {"loss": torch.tensor(float("nan")), "vec": torch.tensor([5.0, 7.0]), "n": 6})
    idxs, rows = buf.drain()
    assert idxs == [3, 4] and len(buf) == 0
    assert rows[0] == {"loss": 1.0, "vec": [1.0, 3.0], "n": 4, "f": 0.25}
    assert isinstance(rows[0]["n"], int)
    avg = average_batches(rows)
    assert math.isnan(avg["loss"]) and avg["vec"] == 4.0 and avg["n"] == 5.0 and avg["f"] == 0.25
    assert first_nan(idxs, rows, "loss") == 4
    assert first_nan(idxs[:1], rows[:1], "loss") == -1
    assert to_host([{"s": "text", "none": None}]) == [{"s": "text", "none": None}]


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))

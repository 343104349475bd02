"""Samplers that make a data stream reproducible: repeat, shard, skip, seeded shuffle.

``pytorch.DataLoader.get_data_loader()`` chains them for training as
RepeatBatchSampler -> DistributedBatchSampler -> SkipBatchSampler, so a trial resumed at batch
``k`` replays the index stream from the start and skips the ``k`` batches it already trained
(index arithmetic only; no data is loaded for a skipped batch). A seeded shuffle
(ReproducibleShuffleSampler) therefore continues mid-epoch on exactly the same batches.

Shuffle before you skip or repeat: a shuffle over a repeated (infinite) sampler never ends, and
a skip applied before the shuffle changes which records are shuffled.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sized
from typing import Any

import torch.utils.data


def _len(sampler: Any) -> int:
    if not isinstance(sampler, Sized):
        raise TypeError(f"{type(sampler).__name__} has no len()")
    return len(sampler)


class RepeatSampler(torch.utils.data.Sampler):  # type: ignore[type-arg]
    """Iterates over ``sampler`` forever; len() is one pass."""

    def __init__(self, sampler: Any) -> None:
        self._sampler = sampler

    def __len__(self) -> int:
        return _len(self._sampler)

    def __iter__(self) -> Iterator[Any]:
        while True:
            yield from self._sampler


class RepeatBatchSampler(torch.utils.data.BatchSampler):
    """Yields the batches of ``batch_sampler`` forever; len() is one pass (one epoch)."""

    def __init__(self, batch_sampler: Any) -> None:
        self.batch_sampler = batch_sampler

    def __len__(self) -> int:
        return _len(self.batch_sampler)

    def __iter__(self) -> Iterator[Any]:
        while True:
            empty = True
            for batch in self.batch_sampler:
                empty = False
                yield batch
            if empty:  # an empty epoch would otherwise spin forever
                return


def _check_shard(num_workers: int, rank: int) -> None:
    if num_workers < 1:
        raise ValueError(f"num_workers must be at least 1, found {num_workers}")
    if not 0 <= rank < num_workers:
        raise ValueError(f"rank must be in [0, {num_workers}), found {rank}")


class DistributedSampler(torch.utils.data.Sampler):  # type: ignore[type-arg]
    """Every ``num_workers``-th item of ``sampler``, starting at ``rank`` (a building block: unlike
    torch's DistributedSampler it neither shuffles nor pads)."""

    def __init__(self, sampler: Any, num_workers: int, rank: int) -> None:
        _check_shard(num_workers, rank)
        self._sampler = sampler
        self._num_workers = num_workers
        self._rank = rank

    def __len__(self) -> int:
        n = _len(self._sampler)
        return n // self._num_workers + int(n % self._num_workers > self._rank)

    def __iter__(self) -> Iterator[Any]:
        for i, item in enumerate(self._sampler):
            if i % self._num_workers == self._rank:
                yield item


class DistributedBatchSampler(torch.utils.data.BatchSampler):
    """Every ``num_workers``-th batch of ``batch_sampler``, starting at ``rank``.

    Over a finite sampler whose length is not a multiple of ``num_workers`` the lower ranks get
    one batch more; training repeats its sampler first, so only validation sees that."""

    def __init__(self, batch_sampler: Any, num_workers: int, rank: int) -> None:
        _check_shard(num_workers, rank)
        self.batch_sampler = batch_sampler
        self.num_workers = num_workers
        self.rank = rank

    def __len__(self) -> int:
        n = _len(self.batch_sampler)
        return n // self.num_workers + int(n % self.num_workers > self.rank)

    def __iter__(self) -> Iterator[Any]:
        for i, batch in enumerate(self.batch_sampler):
            if i % self.num_workers == self.rank:
                yield batch


class SkipSampler(torch.utils.data.Sampler):  # type: ignore[type-arg]
    """Skips the first ``skip`` items of ``sampler``. Prefer SkipBatchSampler: training resumes
    by batches, and records per batch need not be constant."""

    def __init__(self, sampler: Any, skip: int) -> None:
        self._sampler = sampler
        self._skip = skip

    def __len__(self) -> int:
        return _len(self._sampler)

    def __iter__(self) -> Iterator[Any]:
        it = iter(self._sampler)
        for _ in range(self._skip):
            if next(it, _END) is _END:
                return
        yield from it


class SkipBatchSampler(torch.utils.data.BatchSampler):
    """Skips the first ``skip`` batches of ``batch_sampler`` (the ones a resumed trial already
    trained). len() stays the length of the underlying sampler: it is applied after repeating,
    so the skip happens once, not every epoch."""

    def __init__(self, batch_sampler: Any, skip: int) -> None:
        self.batch_sampler = batch_sampler
        self.skip = skip

    def __len__(self) -> int:
        return _len(self.batch_sampler)

    def __iter__(self) -> Iterator[Any]:
        it = iter(self.batch_sampler)
        for _ in range(self.skip):
            if next(it, _END) is _END:
                return
        yield from it


_END = object()


class _SeededShuffle:
    """A shuffle whose n-th pass depends only on the seed and n: the state is a seeded RNG
    advanced once per pass (numpy's RandomState when numpy is installed, as Determined's)."""

    def __init__(self, seed: int) -> None:
        self.seed = int(seed)
        try:
            import numpy as np

            self._np_rng: Any = np.random.RandomState(self.seed % 2**32)
            self._py_rng: random.Random | None = None
        except ImportError:  # pragma: no cover - numpy comes with most torch installs
            self._np_rng = None
            self._py_rng = random.Random(self.seed)

    def shuffled(self, items: list[Any]) -> list[Any]:
        if self._np_rng is not None:
            self._np_rng.shuffle(items)
        else:
            assert self._py_rng is not None
            self._py_rng.shuffle(items)
        return items


class ReproducibleShuffleSampler(torch.utils.data.Sampler):  # type: ignore[type-arg]
    """Shuffles each pass over ``sampler`` with a RNG seeded by ``seed``: the same seed gives the
    same sequence of epochs, so a resumed trial (which replays and skips) sees the same batches."""

    def __init__(self, sampler: Any, seed: int) -> None:
        self._sampler = sampler
        self._shuffle = _SeededShuffle(seed)

    @property
    def seed(self) -> int:
        return self._shuffle.seed

    def _reseed(self, seed: int) -> None:
        """Start over from `seed` (before the first pass: the loop restores a checkpoint's)."""
        self._shuffle = _SeededShuffle(seed)

    def __iter__(self) -> Iterator[Any]:
        return iter(self._shuffle.shuffled(list(self._sampler)))

    def __len__(self) -> int:
        return _len(self._sampler)


class ReproducibleShuffleBatchSampler(torch.utils.data.BatchSampler):
    """Shuffles the order of the batches of ``batch_sampler`` (batch contents stay the same; prefer
    ReproducibleShuffleSampler, which varies them)."""

    def __init__(self, batch_sampler: Any, seed: int) -> None:
        self._batch_sampler = batch_sampler
        self._shuffle = _SeededShuffle(seed)

    def __iter__(self) -> Iterator[Any]:
        return iter(self._shuffle.shuffled(list(self._batch_sampler)))

    def __len__(self) -> int:
        return _len(self._batch_sampler)


__all__ = [
    "DistributedBatchSampler",
    "DistributedSampler",
    "RepeatBatchSampler",
    "RepeatSampler",
    "ReproducibleShuffleBatchSampler",
    "ReproducibleShuffleSampler",
    "SkipBatchSampler",
    "SkipSampler",
]

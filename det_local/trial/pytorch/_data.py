"""pytorch.DataLoader: torch's DataLoader contract, built late so Determined can repeat, shard and
skip its batches; plus data_length() and to_device()."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Union

import torch
from torch.utils import data
from torch.utils.data._utils import collate

from det_local.trial.pytorch import samplers
from det_local.trial.pytorch._errors import InvalidTrialError

logger = logging.getLogger("determined.pytorch")

TorchData = Union[dict[str, torch.Tensor], Sequence[torch.Tensor], torch.Tensor]


def dataset_repro_error(
    method: str,
    loader: Any,
    trial_name: str,
    disable: str = "context.experimental.disable_dataset_reproducibility_checks()",
) -> InvalidTrialError:
    return InvalidTrialError(
        f"{trial_name}.{method}() returned a {type(loader).__name__}, not a "
        "determined.pytorch.DataLoader, so a resumed trial cannot continue on the same batches; "
        f"return pytorch.DataLoader(...) (same arguments as torch's), or call {disable} in "
        "__init__ to take charge of shuffling, sharding and skipping yourself"
    )


def _seed_from(generator: torch.Generator | None) -> int:
    """A shuffle seed drawn from `generator`, or from torch's global RNG (which det-local seeds
    with the trial seed in pytorch.init()), at DataLoader construction."""
    draw = torch.empty((), dtype=torch.int64).random_(generator=generator)
    return int(draw.item()) % 2**32


class DataLoader:
    """Same arguments and checks as ``torch.utils.data.DataLoader``; the torch loader is made by
    ``get_data_loader()`` (Determined calls it with repeat/skip/shard for training).

    ``shuffle=True`` shuffles with a seeded ReproducibleShuffleSampler (seed drawn at
    construction from ``generator`` or torch's global RNG) instead of a RandomSampler, so the
    order of every epoch is a function of the seed and a resumed trial sees the same batches.
    IterableDatasets are refused: they cannot be skipped or sharded reproducibly."""

    def __init__(
        self,
        dataset: data.Dataset,  # type: ignore[type-arg]
        batch_size: int | None = 1,
        shuffle: bool = False,
        sampler: Any = None,
        batch_sampler: Any = None,
        num_workers: int = 0,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        pin_memory: bool = False,
        drop_last: bool = False,
        timeout: float = 0,
        worker_init_fn: Callable[[int], None] | None = None,
        multiprocessing_context: Any = None,
        generator: torch.Generator | None = None,
        *,
        prefetch_factor: int | None = None,
        persistent_workers: bool = False,
    ) -> None:
        if isinstance(dataset, data.IterableDataset):
            raise InvalidTrialError(
                f"pytorch.DataLoader got an IterableDataset ({type(dataset).__name__}), which "
                "cannot be skipped or sharded reproducibly; use a map-style Dataset, or return a "
                "torch.utils.data.DataLoader and call "
                "context.experimental.disable_dataset_reproducibility_checks()"
            )
        if batch_sampler is None and batch_size is None:
            raise InvalidTrialError(
                "pytorch.DataLoader(batch_size=None) without a batch_sampler is not supported; "
                "give a batch_size or a batch_sampler"
            )
        if num_workers < 0:
            raise ValueError(
                "num_workers option should be non-negative; use num_workers=0 to disable "
                "multiprocessing."
            )
        if timeout < 0:
            raise ValueError("timeout option should be non-negative")
        if num_workers == 0 and prefetch_factor is not None:
            raise ValueError(
                "prefetch_factor option could only be specified in multiprocessing. let "
                "num_workers > 0 to enable multiprocessing."
            )
        if prefetch_factor is not None and prefetch_factor < 0:
            raise ValueError("prefetch_factor option should be non-negative")
        if persistent_workers and num_workers == 0:
            raise ValueError("persistent_workers option needs num_workers > 0")
        if sampler is not None and shuffle:
            raise ValueError("sampler option is mutually exclusive with shuffle")
        if batch_sampler is not None:
            if batch_size != 1 or shuffle or sampler is not None or drop_last:
                raise ValueError(
                    "batch_sampler option is mutually exclusive with batch_size, shuffle, "
                    "sampler, and drop_last"
                )
            batch_size = None
            drop_last = False

        if sampler is None:
            sequential = data.SequentialSampler(dataset)  # type: ignore[arg-type]
            sampler = (
                samplers.ReproducibleShuffleSampler(sequential, _seed_from(generator))
                if shuffle
                else sequential
            )
        if batch_sampler is None:
            assert batch_size is not None
            batch_sampler = data.BatchSampler(sampler, batch_size, drop_last)

        self.dataset = dataset
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.sampler = sampler
        self.batch_sampler = batch_sampler
        self.num_workers = num_workers
        self.collate_fn = collate_fn or collate.default_collate
        self.pin_memory = pin_memory
        self.drop_last = drop_last
        self.timeout = timeout
        self.worker_init_fn = worker_init_fn
        self.multiprocessing_context = multiprocessing_context
        self.generator = generator
        self.prefetch_factor = prefetch_factor
        self.persistent_workers = persistent_workers

    def get_data_loader(
        self, repeat: bool = False, skip: int = 0, num_replicas: int = 1, rank: int = 0
    ) -> data.DataLoader:  # type: ignore[type-arg]
        """A torch DataLoader over this loader's batches: repeated forever if ``repeat``, every
        ``num_replicas``-th batch from ``rank``, the first ``skip`` (sharded) batches skipped."""
        batch_sampler = adapt_batch_sampler(
            self.batch_sampler, repeat=repeat, skip=skip, num_replicas=num_replicas, rank=rank
        )
        return data.DataLoader(
            self.dataset,
            batch_sampler=batch_sampler,
            num_workers=self.num_workers,
            collate_fn=self.collate_fn,
            pin_memory=self.pin_memory,
            timeout=self.timeout,
            worker_init_fn=self.worker_init_fn,
            multiprocessing_context=self.multiprocessing_context,
            generator=self.generator,
            prefetch_factor=self.prefetch_factor,
            persistent_workers=self.persistent_workers,
        )

    def __iter__(self) -> Iterator[Any]:
        """One pass, for using the loader outside Determined."""
        return iter(self.get_data_loader())

    def __len__(self) -> int:
        return len(self.batch_sampler)


def adapt_batch_sampler(
    batch_sampler: Any, repeat: bool = False, skip: int = 0, num_replicas: int = 1, rank: int = 0
) -> Any:
    """Repeat, then shard, then skip (the skip counts this rank's batches, i.e. global steps)."""
    if repeat:
        batch_sampler = samplers.RepeatBatchSampler(batch_sampler)
    if num_replicas > 1:
        batch_sampler = samplers.DistributedBatchSampler(batch_sampler, num_replicas, rank)
    if skip > 0:
        batch_sampler = samplers.SkipBatchSampler(batch_sampler, skip)
    return batch_sampler


def _np() -> Any:
    try:
        import numpy

        return numpy
    except ImportError:  # pragma: no cover
        return None


def data_length(data: Any) -> int:
    """Records in a batch: the length of its first tensor/array (dicts, lists, tuples searched
    in order)."""
    np = _np()
    if isinstance(data, torch.Tensor) or (np is not None and isinstance(data, np.ndarray)):
        return len(data)
    if isinstance(data, (dict, list, tuple)):
        if len(data) == 0:
            raise InvalidTrialError(
                f"a batch that is an empty {type(data).__name__} has no length; override "
                "get_batch_length(batch) in your trial"
            )
        first = next(iter(data.values())) if isinstance(data, dict) else data[0]
        return len(first)
    raise InvalidTrialError(
        f"cannot tell the length of a batch of type {type(data).__name__}; override "
        "get_batch_length(batch) in your trial"
    )


def to_device(data: Any, device: torch.device, warned_types: set[type] | None = None) -> Any:
    """Move tensors (and numpy arrays, as tensors) in nested dicts/lists/tuples to ``device``.

    Host-to-GPU copies are issued non_blocking (safe for that direction), so moving a batch does
    not wait for the GPU."""
    if isinstance(data, torch.Tensor):  # the common case first, and no copy when in place
        if data.device == device:
            return data
        non_blocking = device.type == "cuda" and data.device.type == "cpu"
        return data.to(device, non_blocking=non_blocking)
    if type(data) in (tuple, list) and all(
        type(v) is torch.Tensor and v.device == device for v in data
    ):
        return data  # a batch of tensors already there (the common CPU case): nothing to move
    if warned_types is None:
        warned_types = set()
    if isinstance(data, dict):
        return {k: to_device(v, device, warned_types) for k, v in data.items()}
    if isinstance(data, list):
        return [to_device(v, device, warned_types) for v in data]
    if isinstance(data, tuple):
        if hasattr(data, "_fields"):  # namedtuple
            return type(data)(*(to_device(v, device, warned_types) for v in data))
        return tuple(to_device(v, device, warned_types) for v in data)
    if data is None or isinstance(data, (bool, int, float, str, bytes)):
        return data  # plain values need no moving
    np = _np()
    if np is not None and isinstance(data, np.ndarray):
        if data.dtype.kind in "fciub":
            return to_device(torch.from_numpy(data), device, warned_types)
    elif hasattr(data, "to") and callable(data.to):
        return data.to(device)
    if type(data) not in warned_types:
        warned_types.add(type(data))
        logger.warning(f"Was not able to move data item of type '{type(data).__name__}' to device.")
    return data

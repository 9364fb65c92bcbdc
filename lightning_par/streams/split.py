"""Installing the data-parallel split of an iterable dataset in a user's `DataLoader` (the strategies call it from
``process_dataloader``): the whole-stream split (`lightning_par.streams.dataset`) or, for a source with shards of
known length, the shard-by-shard one (`lightning_par.streams.shards`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional

import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset

from lightning_par.streams.counted import CountedShardStream, counted_shards_of
from lightning_par.streams.dataset import DataParallelStream
from lightning_par.streams.shards import ShardedStream, shards_of


def split_over_data_parallel(
    dataloader: object,
    rank: int,
    size: int,
    epoch_fn: Optional[Callable[[], int]] = None,
    agree_group: Optional[dist.ProcessGroup] = None,
) -> Optional[DataParallelStream]:
    """Give a loader over an iterable dataset this data-parallel rank's share of it, in place.

    Args:
        dataloader: the loader.
        rank, size: this rank's data-parallel rank, and the data-parallel size.
        epoch_fn: the epoch of a pass that starts now.
        agree_group: the data-parallel group, when the caller runs `streams.counted.agree_on_the_end` every
            training step (a Trainer's training loader): then a Hugging Face streaming dataset with at least
            ``size`` shards is read shard by shard (`CountedShardStream`); otherwise it is read whole.

    Returns:
        the `DataParallelStream` now read by the loader (also when it was installed before), or ``None`` for a loader
        that is not a `DataLoader` over an `IterableDataset`.

    Raises:
        ValueError: the loader already started an iterator, or has persistent workers (they would keep the first
            epoch's copy of the stream).
    """
    if not isinstance(dataloader, DataLoader) or not isinstance(dataloader.dataset, IterableDataset):
        return None
    if isinstance(dataloader.dataset, DataParallelStream):
        return dataloader.dataset
    if getattr(dataloader, "_iterator", None) is not None:
        raise ValueError(
            "a DataLoader over an iterable dataset was iterated before the strategy could split it over the "
            "data-parallel ranks (its persistent workers hold the whole dataset); create the loader in the "
            "LightningModule's or DataModule's *_dataloader hook, or set persistent_workers=False"
        )
    if dataloader.persistent_workers and dataloader.num_workers > 0:
        raise ValueError(
            "a DataLoader over an iterable dataset with persistent_workers=True: its workers keep their copy of the "
            "stream from the first epoch, so later epochs could not be told their epoch (a source's set_epoch "
            "reshuffle, and where a resumed epoch starts); set persistent_workers=False for iterable datasets "
            "(a stream's workers start once per epoch)"
        )
    source, batch = dataloader.dataset, dataloader.batch_size or 1
    shards, counted = shards_of(source), counted_shards_of(source)
    stream: DataParallelStream
    if shards is not None:
        stream = ShardedStream(source, shards, rank, size, batch, epoch_fn, dataloader.num_workers)
    elif counted is not None and agree_group is not None and counted.count >= size:
        stream = CountedShardStream(source, counted, rank, size, batch, epoch_fn, agree_group)
    else:
        stream = DataParallelStream(source, rank, size, batch, epoch_fn)
    # DataLoader refuses a new `dataset` after __init__ because its sampler was built from the old one; an iterable
    # dataset's sampler (`_InfiniteConstantSampler`) does not depend on it, so the swap is sound. Rebuilding the loader
    # instead would lose a DataLoader subclass and any attribute set on it.
    object.__setattr__(dataloader, "dataset", stream)
    return stream

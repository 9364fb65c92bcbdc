"""Sharded streams: each data-parallel rank (and each loader worker) reads only its own shards.

`lightning_par.streams.dataset.DataParallelStream` reads the whole stream on every rank. A source that says how
many samples each of its shards holds can do better: ``litdata.StreamingDataset`` (its chunks) or any iterable
dataset with the `ShardedSource` methods. Such a source is wrapped in `ShardedStream` instead.

**The plan of a pass.** The shards' samples, in shard order, are one sequence. It is cut into ``dp x W`` contiguous
ranges of equal length (``W``: the loader's workers, at least 1), each a whole number of batches: range
``r x W + w`` is read by worker ``w`` of data-parallel rank ``r``, so a rank reads about ``1/dp`` of the data (the
shards inside its ranges, and the shard it shares at each end of a range). What is left over, fewer than
``dp x W x b`` samples, is the pass's tail: not trained on in this pass, like a ``drop_last`` batch. Every rank
computes the same plan from the lengths, so no collective is needed and all ranks run the same number of steps.
Step ``k`` of rank ``r`` trains on worker ``k mod W``'s next batch: the global batch is ``b`` samples from each of
the ``dp`` ranks' ranges, not ``dp x b`` consecutive samples as in the whole-stream order; the order depends on
``dp`` and ``W``.

**The position** saved in a checkpoint is, for every range, the part not yet read, and the tail. A resume with the
same ``dp``, ``W`` and batch continues every range where it stopped: exactly the uninterrupted run's batches. With
another layout, the unread parts and the tail are joined and cut again for the new one: no sample is read twice
and none is skipped, but the later batches group them differently.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Optional, Protocol, runtime_checkable

import torch
from torch.utils.data import get_worker_info

from lightning_par.streams.dataset import DataParallelStream

Piece = tuple[int, int, int]  # (shard, first sample, end): samples [first, end) of a shard


@runtime_checkable
class ShardedSource(Protocol):
    """What an iterable dataset defines to be read shard by shard (docs/data.md has an example over Parquet files).

    ``shard_lengths()`` must return the same list on every rank and in every worker for one epoch (a source with
    ``set_epoch`` is told the epoch first, and may reorder its shards by it); it is asked at the start of every pass
    and at every checkpoint, so keep it cheap. ``read_shard(i, start)`` yields the samples of shard ``i`` from its
    ``start``-th on.
    """

    def shard_lengths(self) -> Sequence[int]: ...

    def read_shard(self, index: int, start: int) -> Iterator[Any]: ...


class LitdataShards:
    """``litdata.StreamingDataset`` as a `ShardedSource`: its chunks are the shards.

    Samples are read by index (``dataset[i]``), which downloads (or copies) only the chunks read into the dataset's
    ``cache_dir``: litdata's local cache, bounded by its ``max_cache_size``. With ``shuffle=True`` the chunk order is
    permuted per epoch (seeded by the dataset's ``seed`` + epoch); samples inside a chunk keep their order.
    """

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset
        self.epoch = 0
        # litdata's chunk intervals (subsampling applied): the index of a chunk's first sample is the sum before it.
        self._lengths = [int(end) - int(start) for start, end in dataset.region_of_interest]
        self._offsets = [0, *itertools.accumulate(self._lengths)]

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _order(self) -> list[int]:
        if not getattr(self.dataset, "shuffle", False):
            return list(range(len(self._lengths)))
        generator = torch.Generator().manual_seed(int(self.dataset.seed) + self.epoch)
        return torch.randperm(len(self._lengths), generator=generator).tolist()

    def shard_lengths(self) -> list[int]:
        return [self._lengths[i] for i in self._order()]

    def read_shard(self, index: int, start: int) -> Iterator[Any]:
        chunk = self._order()[index]
        first = self._offsets[chunk]
        for i in range(first + start, first + self._lengths[chunk]):
            yield self.dataset[i]


def shards_of(source: Any) -> Optional[Any]:
    """The `ShardedSource` reading ``source`` shard by shard, or ``None`` when it has no shards of known length."""
    if isinstance(source, ShardedSource):
        return source
    module = type(source).__module__ or ""
    if module.startswith("litdata.") and hasattr(source, "region_of_interest"):
        return LitdataShards(source)
    return None


def _cut(pieces: Sequence[Piece], parts: int, batch: int) -> tuple[list[list[Piece]], list[Piece]]:
    """Cut the sequence of ``pieces`` into ``parts`` ranges of equal length, a multiple of ``batch``; and the rest."""
    total = sum(end - first for _, first, end in pieces)
    quota = total // parts // batch * batch
    ranges: list[list[Piece]] = []
    rest = list(pieces)
    for _ in range(parts):
        taken, rest = _split(rest, quota)
        ranges.append(taken)
    return ranges, rest


def _split(pieces: Sequence[Piece], count: int) -> tuple[list[Piece], list[Piece]]:
    """(the first ``count`` samples of ``pieces``, the others), as pieces."""
    head: list[Piece] = []
    for i, (shard, first, end) in enumerate(pieces):
        if count <= 0:
            return head, list(pieces[i:])
        take = min(count, end - first)
        head.append((shard, first, first + take))
        count -= take
        if first + take < end:
            return head, [(shard, first + take, end), *pieces[i + 1 :]]
    return head, []


class ShardedStream(DataParallelStream):
    """This data-parallel rank's ranges of a sharded source (module docstring: plan, position).

    Args:
        source: the user's iterable dataset.
        shards: `shards_of(source)`.
        rank, size, batch_size, epoch_fn: as `DataParallelStream`.
        workers: the loader's ``num_workers``.
    """

    read_as = "sharded"
    layout_names = ("data-parallel ranks", "loader workers", "per batch")

    def __init__(self, source: Any, shards: Any, rank: int, size: int, batch_size: int,
                 epoch_fn: Optional[Callable[[], int]] = None, workers: int = 0) -> None:  # fmt: skip
        super().__init__(source, rank, size, batch_size, epoch_fn)
        self.shards = shards
        self.workers = max(1, workers)

    @property
    def layout(self) -> list[int]:
        return [self.size, self.workers, self.batch_size]

    def _lengths(self, epoch: int) -> list[int]:
        set_epoch = getattr(self.shards, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)
        return [int(n) for n in self.shards.shard_lengths()]

    def plan(self, epoch: int) -> tuple[list[list[Piece]], list[Piece], int]:
        """(ranges: ``dp x W``, rank-major, each worker's in the order its batches come; the tail; the samples of
        the pass already consumed before the plan starts) of the pass of ``epoch``."""
        lengths = self._lengths(epoch)
        saved = self._resume
        if saved is None or saved["epoch"] != epoch:
            pieces = [(i, 0, n) for i, n in enumerate(lengths) if n > 0]
            ranges, tail = _cut(pieces, self.size * self.workers, self.batch_size)
            return ranges, tail, 0
        if saved["shards"] != len(lengths):
            raise ValueError(
                f"the checkpoint's stream had {saved['shards']} shards and this run's has {len(lengths)}: resume "
                "with the dataset the checkpoint was trained on, or train from the weights only"
            )
        slots = [[tuple(p) for p in r] for r in saved["ranges"]]
        tail = [tuple(p) for p in saved["tail"]]
        if saved["layout"] == self.layout:  # every range continues where it stopped
            return slots, tail, saved["samples"]  # type: ignore[return-value]
        ranges, rest = _cut([p for r in slots for p in r] + tail, self.size * self.workers, self.batch_size)
        return ranges, rest, saved["samples"]  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Any]:
        epoch, _ = self._begin_pass()
        ranges, _, _ = self.plan(epoch)
        if not any(ranges):
            raise ValueError(
                f"the sharded dataset holds too few samples for one batch of {self.batch_size} on each of "
                f"{self.size} data-parallel ranks x {self.workers} loader workers; give it more samples, or lower "
                "the loader's batch_size or num_workers"
            )
        worker = get_worker_info()
        if worker is not None and worker.num_workers != self.workers:
            raise RuntimeError(f"planned for {self.workers} loader workers, running in {worker.num_workers}")
        mine = ranges[self.rank * self.workers + (worker.id if worker is not None else 0)]
        for shard, first, end in mine:
            read = first
            for sample in itertools.islice(self.shards.read_shard(shard, first), end - first):
                read += 1
                yield sample
            if read < end:
                raise ValueError(
                    f"shard {shard} of the stream yielded {read} samples, but shard_lengths() said at least {end}: "
                    "make shard_lengths() count the samples read_shard() yields"
                )

    def position(self, batches: int, complete: bool) -> dict[str, Any]:
        """The unread part of every range after ``batches`` batches of the current pass (all ranks alike)."""
        epoch = self._epoch_of_position()
        state: dict[str, Any] = {"stream": True, "sharded": True, "epoch": epoch, "complete": complete,
                                 "samples": batches * self.global_batch, "global_batch": self.global_batch,
                                 "layout": self.layout}  # fmt: skip
        lengths = self._lengths(epoch)
        state["shards"] = len(lengths)
        if complete:
            return {**state, "ranges": [], "tail": []}
        ranges, tail, before = self.plan(epoch)
        done = batches - before // self.global_batch  # batches of this plan
        unread: list[list[Piece]] = []
        workers = self.workers
        for rank in range(self.size):
            rank_ranges = ranges[rank * workers : (rank + 1) * workers]
            read = [done // workers + (w < done % workers) for w in range(workers)]
            rest = [_split(r, n * self.batch_size)[1] for r, n in zip(rank_ranges, read)]
            unread.extend(rest[(done + j) % workers] for j in range(workers))  # the next batch's worker first
        return {**state, "ranges": [[list(p) for p in r] for r in unread], "tail": [list(p) for p in tail]}

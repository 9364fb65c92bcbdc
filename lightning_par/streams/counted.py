"""Shard-by-shard reading of a stream whose shards' lengths are unknown until read: Hugging Face `datasets` in
streaming mode (``load_dataset(..., streaming=True)``), which knows its shards (``n_shards``: files, or parts of
them) but not how many samples each holds.

**The plan.** The shards, in order, are cut into ``dp`` contiguous groups by count: data-parallel rank ``r`` reads
the shards ``[r x S / dp, (r + 1) x S / dp)`` one after the other and nothing else (about 1/dp of the data). Its
batches are that sequence's consecutive samples; with ``W`` loader workers, worker ``w`` takes batches ``w, w + W,
...`` of it (each worker reads the rank's shards; the loader takes the batches in turn, so the order is the same).
A worker's last samples that do not fill a batch are not trained on.

**The end of a pass.** The ranks' groups hold different numbers of samples, unknown in advance, and every rank must
run the same number of steps (a rank that stopped early would leave the others waiting in a collective). So each
training step, the data-parallel ranks agree whether any of them has just read its last batch (one all-reduce of
one number over the data-parallel group: `agree_on_the_end`); if one has, the pass ends after this step on every
rank. What the other ranks had not read is the pass's tail, as with ``drop_last``.

**The position.** As a worker finishes a shard it records the shard's length in a tensor shared with the main
process, so the main process can say, from the batches the loop consumed, how far into which shard each rank is.
A checkpoint holds every rank's unread shards (the first from its offset), gathered over the data-parallel group.
A resume with the same data-parallel size and batch continues each rank's shards where they stopped: exactly the
uninterrupted run's batches. With another layout the unread shards are grouped again for the new ranks: no sample
is read twice or skipped. The samples of a partly read shard are skipped by reading them again.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.utils.data import get_worker_info

from lightning_par.streams.dataset import DataParallelStream, _whole

Piece = tuple[int, int]  # (shard, first sample): the shard from that sample to its end


class HFShards:
    """A Hugging Face streaming dataset's shards: shard ``i`` is ``dataset.shard(n_shards, i, contiguous=True)``."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset
        self.count = int(dataset.n_shards)

    def set_epoch(self, epoch: int) -> None:
        self.dataset.set_epoch(epoch)

    def read_shard(self, index: int, start: int) -> Iterator[Any]:
        part = self.dataset.shard(num_shards=self.count, index=index, contiguous=True)
        return itertools.islice(_whole(part), start, None)  # read as one process: no second split over workers


def counted_shards_of(source: Any) -> Optional[HFShards]:
    """`HFShards` for a Hugging Face streaming dataset, else ``None``."""
    module = type(source).__module__ or ""
    if module.startswith("datasets.") and hasattr(source, "n_shards") and callable(getattr(source, "shard", None)):
        return HFShards(source)
    return None


def _groups(pieces: list[Piece], parts: int) -> list[list[Piece]]:
    """``pieces`` cut into ``parts`` contiguous groups whose sizes differ by at most one."""
    return [pieces[k * len(pieces) // parts : (k + 1) * len(pieces) // parts] for k in range(parts)]


class CountedShardStream(DataParallelStream):
    """This data-parallel rank's shards of a source with shards of unknown length (module docstring).

    Args:
        source: the user's iterable dataset.
        shards: `counted_shards_of(source)`.
        rank, size, batch_size, epoch_fn: as `DataParallelStream`.
        group: the data-parallel process group (the position gathers every rank's unread shards over it).
    """

    read_as = "counted"
    layout_names = ("data-parallel ranks", "per batch")
    agree_on_the_end = True  # the strategy's per-step agreement on the end of a pass (module docstring)

    def __init__(
        self,
        source: Any,
        shards: HFShards,
        rank: int,
        size: int,
        batch_size: int,
        epoch_fn: Optional[Callable[[], int]] = None,
        group: Optional[dist.ProcessGroup] = None,
    ) -> None:
        super().__init__(source, rank, size, batch_size, epoch_fn)
        self.shards, self.group = shards, group
        # Each shard's length once a reader finished it (-1: not yet), shared with the loader's workers.
        self.lengths = torch.full((shards.count,), -1, dtype=torch.int64).share_memory_()

    @property
    def layout(self) -> list[int]:
        return [self.size, self.batch_size]

    def plan(self, epoch: int) -> tuple[list[list[Piece]], int]:
        """(every rank's pieces, samples of the pass consumed before the plan starts) for the pass of ``epoch``."""
        saved = self._resume
        if saved is None or saved["epoch"] != epoch:
            return _groups([(i, 0) for i in range(self.shards.count)], self.size), 0
        if saved["shards"] != self.shards.count:
            raise ValueError(
                f"the checkpoint's stream had {saved['shards']} shards and this run's has {self.shards.count}: "
                "resume with the dataset the checkpoint was trained on, or train from the weights only"
            )
        ranks = [[(int(s), int(f)) for s, f in pieces] for pieces in saved["ranks"]]
        if saved["layout"] != self.layout:
            ranks = _groups([p for pieces in ranks for p in pieces], self.size)
        return ranks, saved["samples"]

    def __iter__(self) -> Iterator[Any]:
        epoch, _ = self._begin_pass()
        ranks, _ = self.plan(epoch)
        worker = get_worker_info()
        workers, worker_id = (worker.num_workers, worker.id) if worker is not None else (1, 0)
        batch, index = self.batch_size, 0
        samples = self._read(ranks[self.rank])
        while True:
            group = list(itertools.islice(samples, batch))
            if len(group) < batch:
                return  # a batch the rank's shards end inside: not trained on
            if index % workers == worker_id:
                yield from group
            index += 1

    def _read(self, pieces: list[Piece]) -> Iterator[Any]:
        for shard, first in pieces:
            read = first
            for sample in self.shards.read_shard(shard, first):
                read += 1
                yield sample
            self.lengths[shard] = read  # before any sample of the next shard reaches the main process

    def _unread(self, pieces: list[Piece], consumed: int) -> list[Piece]:
        """``pieces`` less their first ``consumed`` samples (every shard they pass was read to its end, so its
        length is known)."""
        for i, (shard, first) in enumerate(pieces):
            length = int(self.lengths[shard])
            if length < 0 or consumed < length - first:
                return [(shard, first + consumed), *pieces[i + 1 :]]
            consumed -= length - first
        return []

    def position(self, batches: int, complete: bool) -> dict[str, Any]:
        """Every rank's unread shards after ``batches`` batches of the pass (a collective over the data-parallel
        group: every rank saves)."""
        epoch = self._epoch_of_position()
        state: dict[str, Any] = {"stream": True, "counted": True, "epoch": epoch, "complete": complete,
                                 "samples": batches * self.global_batch, "global_batch": self.global_batch,
                                 "layout": self.layout, "shards": self.shards.count}  # fmt: skip
        if complete:
            return {**state, "ranks": []}
        ranks, before = self.plan(epoch)
        mine = self._unread(ranks[self.rank], (batches - before // self.global_batch) * self.batch_size)
        gathered: list[Any] = [[list(p) for p in mine]]
        if self.size > 1:
            assert self.group is not None, "the ranks' unread shards are gathered over the data-parallel group"
            gathered = [None] * self.size
            dist.all_gather_object(gathered, [list(p) for p in mine], group=self.group)
        return {**state, "ranks": gathered}


def agree_on_the_end(last: bool, group: dist.ProcessGroup, device: torch.device) -> bool:
    """Whether any data-parallel rank has just read its last batch of the pass (`last`: this rank's)."""
    flag = torch.tensor([1.0 if last else 0.0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return bool(flag.item())

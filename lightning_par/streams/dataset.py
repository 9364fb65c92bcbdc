"""Iterable (streaming) datasets over the data-parallel ranks, with a position that resumes exactly.

A map-style dataset is split by the `DistributedSampler` Lightning inserts; an `IterableDataset` has no sampler, so
under a plain Lightning strategy every rank would train on every sample. The strategies wrap the dataset of each
loader over an iterable dataset in `DataParallelStream` (`split_over_data_parallel`), which takes one share of it per
data-parallel rank (`lightning_par.streams.split`; a source with shards of known length is read shard by
shard instead: `lightning_par.streams.shards`). Tensor, context and pipeline ranks of one replica have the
same data-parallel rank, so they read the same samples.

**The order.** One pass (epoch) reads the source from its start, in the order it yields. Its samples form global
batches of ``G = dp x b`` consecutive samples (``b``: the loader's batch size); rank ``r`` takes the samples
``r, r + dp, ...`` of each (the `DistributedSampler`'s stride). A global batch that the stream ends inside is
dropped on every rank, so all ranks run the same number of steps (a rank that ran one step more would wait in a
collective for the others). With DataLoader workers, worker ``w`` of ``W`` produces the global batches ``w, w + W,
...``; the loader takes batches from the workers in turn, which is the same order. A step's global batch is thus
the same set of samples whatever the data-parallel size and the number of workers, as on one device.

**The position** saved in a checkpoint is the pass (epoch) and the number of samples of it consumed by all ranks
together. A resume skips that many samples of the source and goes on, on any data-parallel size: with the same
global batch, every later step sees the same samples as the uninterrupted run.

**What it costs.** Every rank (and every worker) reads the whole stream and keeps its share: right for any source,
including generators and `datasets` in streaming mode; the reading and decoding of the samples other ranks keep is
spent on every rank (a source with shards of known length avoids it: `lightning_par.streams.shards`). A
resume reads the skipped samples again. If the source yields ``set_epoch``, it is called with each pass's epoch
(`datasets` reshuffles with it)."""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Callable, Iterator
from typing import Any, Optional

from torch.utils.data import IterableDataset, get_worker_info

from lightning_par import _compat
from lightning_par.checkpoint.resume_state import resume_point


class DataParallelStream(IterableDataset):
    """This data-parallel rank's share of an iterable dataset (module docstring: order, position, cost).

    Args:
        source: the user's iterable dataset.
        rank: this rank's data-parallel rank.
        size: the data-parallel size.
        batch_size: samples per batch on each rank (the loader's ``batch_size``; 1 when the loader does not batch).
        epoch_fn: the epoch of a pass that starts now (the trainer's ``current_epoch``), or ``None``.
    """

    read_as = "whole"  # how the stream is read: "whole" here; the shard-by-shard subclasses say theirs
    layout_names: tuple[str, ...] = ()  # what a shard-by-shard subclass's saved plan depends on (its `layout`)

    def __init__(
        self, source: Any, rank: int, size: int, batch_size: int, epoch_fn: Optional[Callable[[], int]] = None
    ) -> None:
        self.source = source
        self.rank, self.size, self.batch_size = rank, size, batch_size
        self._epoch_fn = epoch_fn
        self.epoch = -1  # of the pass in progress; -1 before the first
        self._start: Optional[tuple[int, int]] = None  # (epoch, samples of all ranks to skip) of the next pass
        self._resume: Optional[dict[str, Any]] = None  # shard by shard: the loaded position, for its epoch's pass

    @property
    def global_batch(self) -> int:
        """Samples of one step over all data-parallel ranks."""
        return self.size * self.batch_size

    def __getstate__(self) -> dict[str, Any]:
        # A spawned worker gets a pickled copy: the epoch callable (it reads the trainer) becomes its value now,
        # when the loader's iterator (and so the pass) starts.
        state = dict(self.__dict__)
        fn = state.pop("_epoch_fn")
        state["_epoch_fn"] = None
        state["_epoch_now"] = fn() if fn is not None else max(self.epoch, 0)
        return state

    def _next_epoch(self) -> int:
        if self._epoch_fn is not None:
            return self._epoch_fn()
        return getattr(self, "_epoch_now", max(self.epoch, 0))

    def start_at(self, epoch: int, samples: int) -> None:
        """Make the next pass the one of ``epoch``, without its first ``samples`` samples (of all ranks)."""
        self._start = (epoch, samples)

    def _begin_pass(self) -> tuple[int, Optional[Any]]:
        """(epoch, the resumed start or ``None``) of a pass that starts now, with the source told its epoch.

        With loader workers this runs in each worker's copy (forked or pickled when the loader's iterator starts),
        not in the main process, whose copy keeps the loaded start, so it applies only to the pass
        of its epoch (a later epoch starts at its beginning), and `position` counts from the trainer's batches."""
        epoch, start = self._next_epoch(), self._start
        if self._epoch_fn is None and start is not None:  # no trainer to say the epoch: the loaded one, once
            epoch, self._start = start[0], None
        elif start is not None and start[0] != epoch:
            start = None
        if get_worker_info() is None:  # the main process reads it: the loaded start is used up
            self._start = None
        self.epoch = epoch
        set_epoch = getattr(self.source, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)
        return epoch, start

    def __iter__(self) -> Iterator[Any]:
        _, start = self._begin_pass()
        skip = start[1] if start is not None else 0
        worker = get_worker_info()
        workers, worker_id = (worker.num_workers, worker.id) if worker is not None else (1, 0)
        stream = itertools.islice(_whole(self.source), skip, None)
        batch = self.global_batch
        index = 0
        while True:
            group = list(itertools.islice(stream, batch))
            if len(group) < batch:
                if index == 0 and skip == 0:
                    raise ValueError(
                        f"the iterable dataset yielded {len(group)} samples in its pass, fewer than one global batch "
                        f"of {batch} ({self.size} data-parallel ranks x {self.batch_size} per rank), so no rank can "
                        "take a batch; give it at least one global batch of samples, or lower the loader's batch_size"
                    )
                return  # the stream ended inside this global batch: no rank takes it
            if index % workers == worker_id:
                yield from group[self.rank :: self.size]
            index += 1

    def position(self, batches: int, complete: bool) -> dict[str, Any]:
        """The state to save after ``batches`` batches of the current pass (this rank's, all ranks alike).

        Args:
            batches: batches of this pass consumed by the training loop (those of the run before a resume included).
            complete: the pass is over (the next one starts a new epoch).
        """
        epoch, samples = self._epoch_of_position(), batches * self.global_batch
        return {"stream": True, "epoch": epoch, "samples": samples, "complete": complete,
                "global_batch": self.global_batch}  # fmt: skip

    def resume_from(self, state: dict[str, Any]) -> None:
        """Continue after the position `position` saved: the next unseen sample, or the next epoch's first."""
        if not state.get("stream"):
            raise ValueError(
                "the checkpoint's training data position is a map-style dataset's and this run's training loader "
                "streams an iterable dataset; resume with the dataset the checkpoint was trained on, or train from "
                "the weights only (load them in the model and start a new fit)"
            )
        saved = "sharded" if state.get("sharded") else "counted" if state.get("counted") else "whole"
        if saved != self.read_as and not state["complete"]:
            raise ValueError(
                f"the checkpoint's stream position was saved while the stream was read {_READ_AS[saved]}, and this "
                f"run reads it {_READ_AS[self.read_as]} (docs/data.md), so the position does not apply mid-pass. "
                "Resume with the dataset and layout the checkpoint was trained with (a Hugging Face streaming "
                "dataset is read shard by shard when it has at least as many shards as data-parallel ranks: give "
                "it more files for an elastic job), from a checkpoint saved at an epoch's end, or from the weights "
                "only"
            )
        if self.read_as == "whole" and state["global_batch"] != self.global_batch:
            warnings.warn(
                f"the global batch changed from {state['global_batch']} to {self.global_batch} samples: the stream "
                f"resumes after the {state['samples']} samples already trained on, but later steps group the "
                "samples differently from the uninterrupted run",
                stacklevel=2,
            )
        elif self.read_as != "whole" and not state["complete"]:  # the shard-by-shard plans continue from it
            if state["layout"] != self.layout:
                warnings.warn(
                    f"the stream was saved by {_layout(state['layout'], self.layout_names)} and resumes on "
                    f"{_layout(self.layout, self.layout_names)}: the unread samples are planned again for the new "
                    "layout (none read twice or skipped), so later steps group them differently from the "
                    "uninterrupted run",
                    stacklevel=2,
                )
            self._resume = state
        self.start_at(*resume_point(state))

    @property
    def layout(self) -> list[int]:
        """The values of `layout_names` (none for the whole-stream split)."""
        return []

    def _epoch_of_position(self) -> int:
        # The trainer's epoch: with loader workers, this (main process) copy never iterates, so its `epoch` is stale.
        if self._epoch_fn is not None:
            return self._epoch_fn()
        if self.epoch < 0 and self._start is not None:  # resumed, and the pass has not started
            return self._start[0]
        return max(self.epoch, 0)


def _layout(values: list[int], names: tuple[str, ...]) -> str:
    return " x ".join(f"{v} {n}" for v, n in zip(values, names))


_READ_AS = {
    "whole": "whole by every rank",
    "sharded": "shard by shard with known lengths (streams.shards)",
    "counted": "shard by shard with lengths learnt while reading (stream_counted)",
}


def _whole(source: Any) -> Iterator[Any]:
    """The source's samples as one process reads them: it does not see the loader worker it runs in (a source that
    splits itself over workers, as `datasets` does, would otherwise hand each worker a part and this module would
    split that part again)."""
    iterator = None
    while True:
        with _compat.hidden_worker_info():
            if iterator is None:
                iterator = iter(source)
            try:
                item = next(iterator)
            except StopIteration:
                return
        yield item

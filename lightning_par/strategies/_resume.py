"""The strategy's side of deterministic resume: what to save and what was loaded, read off the trainer's loops.

The mechanisms (the resumable sampler, RNG states, the per-rank file) are in `lightning_par.checkpoint.resume_state`;
this is the part that knows where Lightning keeps the training loaders and the batch progress, so it lives with the
Lightning glue.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

import torch

from lightning_par import _compat
from lightning_par.checkpoint.dcp import rank_file
from lightning_par.checkpoint.reader import CheckpointError
from lightning_par.checkpoint.resume_state import (
    KEY,
    ResumableSampler,
    install,
    read_rank_state,
    rng_state,
    set_rng_state,
)
from lightning_par.streams.dataset import DataParallelStream

# Lightning warns on a mid-epoch resume unless the loader implements its `_Stateful` protocol; a loader whose
# position `ResumableSampler` restored is resumable, so that one message is silenced once a position was restored.
_NOT_RESUMABLE = r"You're resuming from a checkpoint that ended before the epoch ended"


class ResumeState:
    """The strategy's side of deterministic resume: what to save, and what was loaded for the next ``fit``."""

    def __init__(self) -> None:
        self._positions: list[Optional[dict[str, Any]]] = []  # loaded; one per training loader, in Lightning's order
        self._installed = 0  # training loaders processed since the positions were loaded
        self._rank_state: Optional[dict[str, Any]] = None  # loaded; restored at on_train_start
        self._same_world = False  # the loaded checkpoint was written by as many ranks as run now

    def install(self, dataloader: object, epoch_fn: Callable[[], int]) -> None:
        """Make a training loader resumable (`install`; a `DataParallelStream` is already) and give it the loaded
        position, if any."""
        dataset = getattr(dataloader, "dataset", None)
        resumable = dataset if isinstance(dataset, DataParallelStream) else install(dataloader, epoch_fn)
        index, self._installed = self._installed, self._installed + 1
        state = self._positions[index] if index < len(self._positions) else None
        if resumable is not None and state is not None:
            if isinstance(resumable, ResumableSampler) and state.get("stream"):
                raise CheckpointError(
                    "the checkpoint's training data position is an iterable dataset's and this run's training "
                    "loader reads a map-style dataset; resume with the dataset the checkpoint was trained on"
                )
            resumable.resume_from(state)
            warnings.filterwarnings("ignore", message=_NOT_RESUMABLE)

    def checkpoint_state(self, trainer: Any, world_size: int) -> dict[str, Any]:
        """The global (rank-independent) part, saved in Lightning's checkpoint dict under `KEY`.

        Args:
            trainer: the Trainer, or ``None`` outside one (then no data position is saved).
            world_size: the number of ranks, each of which saves its own `rank_file`.
        """
        positions: list[Optional[dict[str, Any]]] = []
        loaders = _train_loaders(trainer)
        if loaders:
            progress = trainer.fit_loop.epoch_loop.batch_progress.current
            complete = progress.ready >= trainer.num_training_batches
            for dl in loaders:
                batches = getattr(dl, "batch_sampler", None)
                sampler = getattr(batches, "sampler", None)
                dataset = getattr(dl, "dataset", None)
                if isinstance(dataset, DataParallelStream):
                    # No length: the pass is over when the loop's fetcher saw the stream end.
                    last = trainer.fit_loop.epoch_loop.batch_progress.is_last_batch
                    positions.append(dataset.position(progress.ready, complete or last))
                    continue
                positions.append(
                    sampler.position(progress.ready, batches.batch_size, complete)  # type: ignore[union-attr]
                    if isinstance(sampler, ResumableSampler)
                    else None
                )
        return {"world_size": world_size, "data": positions}

    def loaded(self, path: Path, meta: dict[str, Any], rank: int, world_size: int) -> None:
        """Keep what a checkpoint holds for resuming ``fit``: data positions, and this rank's RNG states.

        Args:
            path: the checkpoint folder.
            meta: its non-tensor part (Lightning's checkpoint dict).
            rank: this process's global rank.
            world_size: the number of ranks now.
        """
        state = meta.get(KEY)
        self._positions, self._installed, self._rank_state = [], 0, None
        if not isinstance(state, dict):
            warnings.warn(
                f"checkpoint {path} holds no data position or RNG states (written by an older lightning_par): a "
                "mid-epoch resume starts the epoch's data again, and random ops draw differently",
                stacklevel=2,
            )
            return
        self._positions = list(state.get("data", []))
        saved_world = int(state["world_size"])
        self._same_world = saved_world == world_size
        self._rank_state = read_rank_state(path, rank % saved_world)
        if self._rank_state is None:
            raise CheckpointError(
                f"checkpoint {path}: {rank_file(rank % saved_world)} is missing (one per writing rank); copy the "
                "whole folder again"
            )
        if saved_world != world_size and rank == 0:
            warnings.warn(
                f"checkpoint {path} was written by {saved_world} ranks and is resumed on {world_size}: RNG streams "
                f"are per rank and cannot be resharded, so rank r continues the stream of rank r % {saved_world}; "
                "random ops (dropout) draw differently from an uninterrupted run (each rank also holds other "
                "samples now). The data order carries over exactly (docs/checkpointing.md)",
                stacklevel=2,
            )

    def own(self, key: str) -> Any:
        """An entry of this rank's loaded file that only this rank can use (PowerSGD's error): ``None`` when the
        checkpoint has none, or was written by another number of ranks (rank r then reads rank r % saved's)."""
        return self._rank_state.get(key) if self._rank_state is not None and self._same_world else None

    def rank_state(self, trainer: Any, device: torch.device) -> dict[str, Any]:
        """This rank's part, saved by every rank as `rank_file`: its RNG states and its training loaders'
        generators (which seed their worker processes)."""
        return {"rng": rng_state(device), "loader_generators": [_generator(dl) for dl in _train_loaders(trainer)]}

    def restore_rng(self, trainer: Any, device: torch.device) -> None:
        """Restore the loaded RNG states (once; at ``on_train_start``, just before the first resumed step)."""
        state, self._rank_state = self._rank_state, None
        positions, self._positions, self._installed = self._positions, [], 0
        if state is None:
            return
        loaders = _train_loaders(trainer)
        if loaders and positions and positions[0] is not None and not positions[0]["complete"]:
            _rescale_progress(trainer, positions[0]["samples"], _samples_per_batch(loaders[0]))
        set_rng_state(state["rng"], device)
        for dl, saved in zip(_train_loaders(trainer), state.get("loader_generators", [])):
            generator = getattr(dl, "generator", None)
            if isinstance(generator, torch.Generator) and saved is not None:
                generator.set_state(saved)


def _train_loaders(trainer: Any) -> list[object]:
    loader = _compat.combined_loader(trainer) if trainer is not None else None
    return list(loader.flattened) if loader is not None else []


def _generator(dataloader: object) -> Optional[torch.Tensor]:
    generator = getattr(dataloader, "generator", None)
    return generator.get_state() if isinstance(generator, torch.Generator) else None


def _samples_per_batch(dataloader: object) -> Optional[int]:
    """Samples one batch of a training loader takes over all data-parallel ranks (``None``: not ours to say)."""
    dataset = getattr(dataloader, "dataset", None)
    if isinstance(dataset, DataParallelStream):
        return dataset.global_batch
    batches = getattr(dataloader, "batch_sampler", None)
    sampler = getattr(batches, "sampler", None)
    if isinstance(sampler, ResumableSampler):
        return int(batches.batch_size) * sampler.inner.num_replicas  # type: ignore[union-attr]
    return None


def _rescale_progress(trainer: Any, samples: int, per_batch: Optional[int]) -> None:
    """After a mid-epoch resume where one batch takes another number of samples than before (another data-parallel
    size or per-rank batch, the accumulation raised or lowered to keep the global batch: an elastic restart), count
    Lightning's restored batch progress in the new batches: the epoch's position is the samples already consumed.

    Raises:
        CheckpointError: those samples are not a whole number of the new batches.
    """
    progress = trainer.fit_loop.epoch_loop.batch_progress
    if per_batch is None or progress.current.ready * per_batch == samples:
        return  # the same batches as the run that saved
    if samples % per_batch:
        raise CheckpointError(
            f"the checkpoint was saved {samples} samples into the epoch, which is not a whole number of this run's "
            f"batches of {per_batch} samples (per-rank batch x data-parallel ranks); resume with a per-rank batch "
            f"and data-parallel size whose product divides {samples}, or from a checkpoint saved at an epoch's end"
        )
    ready = samples // per_batch
    current, total = progress.current, progress.total
    names = ("ready", "started", "processed", "completed")
    # Keep each counter's distance to `ready` (a save in on_train_batch_end has completed = ready - 1).
    old = {name: getattr(current, name) for name in names}
    for name in names:
        new = ready - (old["ready"] - old[name])
        setattr(total, name, getattr(total, name) - old[name] + new)
        setattr(current, name, new)

"""Deterministic resume: the training data position and every rank's RNG states, saved and restored.

What an uninterrupted run would do next depends on three things besides the model and optimizer state:

- **Which samples come next.** Lightning shuffles a distributed training loader with a `DistributedSampler` whose
  order is a function of (seed, epoch) only, but on resume it restarts a plain `DataLoader` at the start of the
  epoch (so a mid-epoch resume trains on the epoch's first batches again), and from an epoch-end checkpoint of a
  ``max_steps`` run it first re-enters the finished epoch (a pass that trains nothing when validation ran at its
  end, one batch when none did: docs/checkpointing.md), which its ``set_epoch`` argument counts, so the next epoch
  is shuffled with seed + epoch + 1. `ResumableSampler` replaces the sampler inside the loader's `BatchSampler`:
  the same `DistributedSampler` order, for the epoch ``trainer.current_epoch`` (which does not count that pass),
  and the first pass after a resume skips the samples already consumed.
- **The random numbers.** Dropout and anything else random draw from the global torch (and CUDA) generator;
  Python's `random` and NumPy may be used by user code. Each rank's generators are saved (ranks may differ: user
  code may seed per rank) and restored on the same rank at ``on_train_start``, just before the first step. A
  DataLoader also draws its workers' base seed each time an epoch's iterator is created, and a resumed run creates
  its first iterator before or after that point depending on where the checkpoint was taken, so `install` gives
  training loaders a generator of their own for that draw, saved and restored with the rest.
- The rest (loops, LR schedulers, grad scaler) is Lightning's own checkpoint state.

Why not Lightning's own protocol for a resumable loader (a ``state_dict`` / ``load_state_dict`` on the loader,
stored under ``loops`` in rank 0's checkpoint): the loader is the user's `DataLoader`, which has neither, and a
loader state stored there makes plain Lightning refuse the consolidated checkpoint ("0 stateful loaders, but found
1 states"). The position is stored under `KEY` instead, which plain Lightning ignores, and the RNG states, which
differ per rank, in one small file per rank.

**Another world size.** The data position is stored as the number of samples of the epoch's order consumed by all
data-parallel ranks together, so it carries over to any data-parallel size that divides it: with the same global
batch, the union of the ranks' batches at every step is the same set of samples as in the uninterrupted run. RNG
streams cannot be resharded (a rank's stream has no meaning on a layout where it sees other samples): rank ``r``
of the new layout continues the stream of rank ``r % old_world_size``, with a warning. Under Lightning's
``seed_everything`` every rank starts from the same seed and draws the same amount per step, so all ranks' streams
are equal and every new rank continues it; random ops still draw differently than the uninterrupted run, since
each rank now holds other samples.
"""

from __future__ import annotations

import itertools
import random
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Optional

import torch
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, Sampler

from lightning_par import _compat
from lightning_par.checkpoint.dcp import rank_file
from lightning_par.checkpoint.reader import CheckpointError

KEY = "lightning_par"  # top-level key of Lightning's checkpoint dict (rank 0's meta.pt) for our resume state


# ---- data position ----------------------------------------------------------------------------------------------
class ResumableSampler(Sampler[int]):
    """A `DistributedSampler`'s order, for the trainer's epoch, that can start a pass part-way through.

    Args:
        inner: the sampler Lightning inserted (or the user's); its (seed, epoch, rank, num_replicas) define the order.
        epoch_fn: the epoch of a pass that starts now (``trainer.current_epoch``), read when the pass starts.
    """

    def __init__(self, inner: DistributedSampler, epoch_fn: Callable[[], int]) -> None:
        self.inner = inner
        self._epoch_fn = epoch_fn
        self.epoch = -1  # of the pass in progress; -1 before the first
        self._start: Optional[tuple[int, int]] = None  # (epoch, per-rank samples to skip) of the next pass

    def __len__(self) -> int:
        # The whole epoch, also for a pass that skips: Lightning counts batch indices from its restored progress.
        return len(self.inner)

    def set_epoch(self, epoch: int) -> None:
        """Ignored: Lightning's argument counts the finished epoch it re-enters after an epoch-end resume (module)."""

    def start_at(self, epoch: int, samples: int) -> None:
        """Make the next pass the one of ``epoch``, without its first ``samples`` samples (over all replicas).

        Raises:
            ValueError: ``samples`` does not divide over this sampler's replicas.
        """
        replicas = self.inner.num_replicas
        if samples % replicas:
            raise ValueError(
                f"the checkpoint was saved after {samples} samples of epoch {epoch}, which do not divide over "
                f"{replicas} data-parallel ranks; resume on a data-parallel size that divides {samples} (keep the "
                "global batch a multiple of it), or from a checkpoint saved at an epoch's end"
            )
        self._start = (epoch, samples // replicas)

    def __iter__(self) -> Iterator[int]:
        # A generator: the pass (and its epoch) is fixed when the first index is drawn, not when DataLoader.__iter__
        # runs: Lightning creates the first iterator of a resumed fit before it re-enters a finished epoch, if it does.
        if self._start is not None:
            (epoch, skip), self._start = self._start, None
        else:
            epoch, skip = self._epoch_fn(), 0
        self.epoch = epoch
        self.inner.set_epoch(epoch)
        yield from itertools.islice(iter(self.inner), skip, None)

    def position(self, batches: int, batch_size: int, complete: bool) -> dict[str, Any]:
        """The state to save after ``batches`` batches of ``batch_size`` samples per rank of the current pass.

        Args:
            batches: batches of this pass consumed by the training loop (skipped ones included).
            batch_size: samples per batch on each rank.
            complete: the pass is over (the next one starts a new epoch).
        """
        inner = self.inner
        if self._start is not None:  # resumed, and the pass has not started: still the loaded position
            epoch, samples, complete = self._start[0], self._start[1] * inner.num_replicas, False
        else:
            epoch = self.epoch if self.epoch >= 0 else self._epoch_fn()
            samples = batches * batch_size * inner.num_replicas
        return {
            "epoch": epoch,
            "samples": samples,
            "complete": complete,
            "seed": inner.seed,
            "shuffle": inner.shuffle,
            "dataset_len": len(inner.dataset),  # type: ignore[arg-type]
        }

    def resume_from(self, state: dict[str, Any]) -> None:
        """Continue after the position `position` saved: the next unseen sample, or the next epoch's first."""
        inner = self.inner
        now = {"seed": inner.seed, "shuffle": inner.shuffle, "dataset_len": len(inner.dataset)}  # type: ignore[arg-type]
        changed = {k: (state[k], v) for k, v in now.items() if state[k] != v}
        if changed:
            diff = ", ".join(f"{k} {a} -> {b}" for k, (a, b) in changed.items())
            warnings.warn(
                f"the training data order differs from the checkpoint's ({diff}): resuming at the same position of "
                "the new order, so the samples differ from an uninterrupted run's",
                stacklevel=2,
            )
        self.start_at(*resume_point(state))


def resume_point(state: dict[str, Any]) -> tuple[int, int]:
    """(epoch, samples of it already consumed) where a saved data position resumes: the next unseen sample, or
    the next epoch's first when the saved pass was complete. Shared by `ResumableSampler` and
    `lightning_par.streams.dataset.DataParallelStream`, whose positions have the same keys."""
    return (state["epoch"] + 1, 0) if state["complete"] else (state["epoch"], state["samples"])


def install(dataloader: object, epoch_fn: Callable[[], int]) -> Optional[ResumableSampler]:
    """Swap a training loader's `DistributedSampler` for a `ResumableSampler` in place, where that is sound.

    Only a `DataLoader` whose torch `BatchSampler` draws from a plain `DistributedSampler` (what Lightning inserts
    for a sequential or random sampler) qualifies: its order depends only on (seed, epoch). A loader with its own
    batch sampler, a wrapped custom sampler, an iterable dataset, or one with Lightning's ``state_dict`` /
    ``load_state_dict`` protocol is left as it is (it resumes as under Lightning).

    Args:
        dataloader: a training loader after Lightning inserted its sampler.
        epoch_fn: see `ResumableSampler`.

    Returns:
        the installed sampler, or ``None``.
    """
    if not isinstance(dataloader, DataLoader) or isinstance(dataloader, _compat.stateful_protocol()):
        return None  # a stateful loader (torchdata's StatefulDataLoader) is restored by Lightning itself
    batches = dataloader.batch_sampler
    if type(batches) is not BatchSampler or type(batches.sampler) is not DistributedSampler:
        return None
    sampler = ResumableSampler(batches.sampler, epoch_fn)
    # BatchSampler.sampler is a plain attribute (DataLoader forbids replacing its own sampler after __init__);
    # `dataloader.sampler` stays the inner sampler, so code that reads it still sees a DistributedSampler.
    batches.sampler = sampler
    if dataloader.generator is None:
        # Each DataLoader iterator draws its workers' base seed from `generator`, else from the global torch RNG.
        # A resumed run creates its first iterator at another point relative to the restored RNG state than the
        # uninterrupted run did (before it for a mid-epoch checkpoint, after it for one at an epoch's end, and
        # Lightning's loops decide which), so that draw must not come from the global stream. Seeded from it once
        # here, which both runs do alike before anything is restored.
        seed = int(torch.randint(0, 2**62, (), dtype=torch.int64))
        dataloader.generator = torch.Generator().manual_seed(seed)
    return sampler


# ---- RNG states -------------------------------------------------------------------------------------------------
def rng_state(device: torch.device) -> dict[str, Any]:
    """This process's generators: torch CPU, the device's CUDA generator, Python's `random`, NumPy's global one.

    Only types that ``torch.load(weights_only=True)`` accepts (tensors, numbers, strings, tuples, dicts).
    """
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": (version, torch.tensor(internal), gauss)}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy comes with Lightning
        return state
    name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    state["numpy"] = (
        str(name),
        torch.from_numpy(np.asarray(keys, dtype=np.int64)),
        int(pos),
        int(has_gauss),
        float(cached),
    )
    return state


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    """Restore what `rng_state` returned (a CUDA state only onto a CUDA device)."""
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(int(x) for x in internal.tolist()), gauss))
    if "cuda" in state and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)
    if "numpy" in state:
        import numpy as np

        name, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((name, keys.numpy().astype("uint32"), pos, has_gauss, cached))


def read_rank_state(path: Path, rank: int) -> Optional[dict[str, Any]]:
    """``rank``'s own state in the checkpoint folder ``path``, or ``None`` when it has none (an older checkpoint).

    Raises:
        CheckpointError: the file exists but is corrupt, or holds objects that are not plain data.
    """
    file = path / rank_file(rank)
    if not file.is_file():
        return None
    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except Exception as err:
        raise CheckpointError(
            f"checkpoint {path}: {file.name} is corrupt or truncated, or holds objects that would run code "
            f"({type(err).__name__}: {err}); copy the whole folder again"
        ) from err

"""PowerSGD gradient compression for the data-parallel all-reduce of ZeRO stages 0 and 1.

The algorithm is torch's (`torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook`; Vogels et al., "PowerSGD:
Practical Low-Rank Gradient Compression for Distributed Optimization", NeurIPS 2019, arXiv 1905.13727): each
gradient matrix M (a parameter's gradient viewed as ``shape[0] x rest``) plus the error left by the last step's
compression is approximated by ``P Q^T`` of rank r, with ``P = M Q`` all-reduced and orthonormalised and
``Q = M^T P`` all-reduced and averaged (one step of subspace iteration, Q warm-started from the last step); the
difference between M and the approximation is this rank's error, added to the next step's gradient (error
feedback). Tensors that would not shrink (vectors, small matrices: ``(n + m) r`` not well below ``n m``) are
all-reduced exactly, and so is every gradient during the first ``start`` optimizer steps.

torch ships the algorithm as a DDP communication hook over a ``GradBucket``; this engine has buckets of its own, so
`PowerSGD.all_reduce` hands the hook an object with the four methods it reads (`_Bucket`). The hook's state
(error feedback, the warm-started P and Q) is per rank and per bucket; checkpoints keep it in each rank's own file
(`PowerSGD.state_dict`, `restore`), so a resume continues the uninterrupted run (docs/strategies.md, "Gradient
compression (PowerSGD)").

Each bucket is compressed and reduced to the end before the next starts (`all_reduce` blocks): the hook's later
collectives are issued from the completion callbacks of its first, and two buckets' callbacks racing on one
process group could order their collectives differently on different ranks.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Iterable, Sequence
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd

POWERSGD = "powersgd"  # the key of a rank's PowerSGD state in its own checkpoint file

# torch's default: a matrix is compressed only where (n + m) r is less than half of n m.
MIN_COMPRESSION_RATE = 2.0


@dataclasses.dataclass(frozen=True)
class PowerSGDSettings:
    """What `ParallelStrategy(grad_compression="powersgd", ...)` sets.

    Args:
        rank: the rank r of each gradient's approximation (torch's ``matrix_approximation_rank``); traffic per
            compressed ``n x m`` gradient falls from ``n m`` to ``(n + m) r`` elements.
        start: optimizer steps all-reduced exactly before compression starts (torch's ``start_powerSGD_iter``;
            at least 2, error feedback needs it). Exact reduction first lets the early, large gradients through;
            torch's default is 1,000.
    """

    rank: int = 1
    start: int = 1000


def compresses(shape: Sequence[int], rank: int) -> bool:
    """Whether PowerSGD approximates a gradient of this shape (torch's rule, `_should_compress`): viewed as
    ``shape[0] x rest``, its factors at rank ``min(n, m, rank)`` take less than half its elements."""
    n = shape[0] if len(shape) else 1
    m = math.prod(shape[1:]) if len(shape) > 1 else 1
    r = min(n, m, rank)
    return (n + m) * r * MIN_COMPRESSION_RATE < n * m


def compressed_numel(shapes: Sequence[Sequence[int]], rank: int) -> int:
    """Elements all-reduced per step for gradients of these shapes once compression runs: ``(n + m) r`` for each
    compressed matrix (P, then Q), ``n m`` for the others."""
    total = 0
    for shape in shapes:
        n = shape[0] if len(shape) else 1
        m = math.prod(shape[1:]) if len(shape) > 1 else 1
        total += (n + m) * min(n, m, rank) if compresses(shape, rank) else n * m
    return total


class _Bucket:
    """The part of ``torch.distributed.GradBucket`` that torch's PowerSGD hook reads."""

    def __init__(self, index: int, flat: torch.Tensor, shapes: Sequence[torch.Size]) -> None:
        self._index, self._flat = index, flat
        sizes = [math.prod(s) for s in shapes]
        self._grads = [t.view(s) for t, s in zip(torch.split(flat, sizes), shapes)]

    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        return self._flat

    def gradients(self) -> list[torch.Tensor]:
        return self._grads

    def is_last(self) -> bool:
        # The step count advances once per optimizer step, in `PowerSGD.step_done`, not per bucket.
        return False


class PowerSGD:
    """PowerSGD over one data-parallel process group, with error feedback and warm start.

    Args:
        group: the data-parallel group the gradients are averaged over.
        settings: rank and start step.
        seed: the seed of the random starting Q's (the same on every rank, so the projections agree).
        exact: parameters whose mean is always exact (a pipeline's copies of one weight on several stages: each
            stage compresses with a state of its own, which would set the copies apart).
    """

    def __init__(self, group: dist.ProcessGroup, settings: PowerSGDSettings, seed: int = 0,
                 exact: Iterable[torch.Tensor] = ()) -> None:  # fmt: skip
        self.settings, self.group = settings, group
        self.exact = set(exact)
        self.state = torch_powersgd.PowerSGDState(
            process_group=group,
            matrix_approximation_rank=settings.rank,
            start_powerSGD_iter=settings.start,
            min_compression_rate=MIN_COMPRESSION_RATE,
            use_error_feedback=True,
            warm_start=True,
            random_seed=seed,
        )

    def all_reduce(self, index: int, flat: torch.Tensor, shapes: Sequence[torch.Size]) -> torch.Tensor:
        """The data-parallel mean of bucket ``index``'s gradients (``flat``: their concatenation, overwritten),
        compressed once past the start; blocks until it is complete.

        Args:
            index: the bucket's index, the same every step (its error and warm start are kept under it).
            flat: this rank's gradients of the bucket, concatenated.
            shapes: the shapes of the gradients in ``flat``, in order.
        """
        return torch_powersgd.powerSGD_hook(self.state, _Bucket(index, flat, shapes)).wait()  # type: ignore[arg-type]

    def reduce(self, index: int, flat: torch.Tensor, bucket: Any, sharded: bool, world: int) -> tuple[Any, Any, Any]:
        """A ZeRO 0-1 bucket's reduction (`lightning_par.parallel.zero.replicated`), complete: ``(work, bucket,
        out)`` as the engine keeps one in flight, ``out`` the full mean (stage 0) or, with ``sharded`` (stage 1),
        this rank's rows of it as the bucket lays them out (what the exact path's reduce-scatter leaves); the
        parameters' full gradients are then freed."""
        data = bucket.data  # the gradients' shapes, in bucket order
        exact = [p in self.exact for p in bucket.params]
        if any(exact):
            mean = self._with_exact(index, flat, data, exact)
        else:
            mean = self.all_reduce(index, flat, [d.shape for d in data])
        if sharded:
            full = [t.view_as(d) for t, d in zip(torch.split(mean, [d.numel() for d in data]), data)]
            # A copy of this rank's row: a view would keep the whole packed buffer alive behind the masters' grads.
            mean = bucket.pack(full, world, mean.dtype)[bucket.rank].clone()
            for p in bucket.params:
                p.grad = None
        done: torch.futures.Future[None] = torch.futures.Future()
        done.set_result(None)
        return done, bucket, mean

    def _with_exact(self, index: int, flat: torch.Tensor, data: Sequence[torch.Tensor], exact: list[bool]) -> Any:
        """`all_reduce` of the bucket's other gradients, and the exact mean of those flagged ``exact``."""
        parts = torch.split(flat, [d.numel() for d in data])
        plain = torch.cat([t for t, e in zip(parts, exact) if e])
        dist.all_reduce(plain, group=self.group)
        plain.div_(self.group.size())
        rest = [(t, d.shape) for t, d, e in zip(parts, data, exact) if not e]
        # The hook's state for this bucket covers the others alone, the same every step.
        squeezed = self.all_reduce(index, torch.cat([t for t, _ in rest]), [s for _, s in rest]) if rest else plain
        means = iter(torch.split(plain, [t.numel() for t, e in zip(parts, exact) if e]))
        approximations = iter(torch.split(squeezed, [t.numel() for t, _ in rest]))
        return torch.cat([next(means) if e else next(approximations) for e in exact])

    def step_done(self) -> None:
        """One optimizer step's gradients are reduced: count it (the exact start, the Q draws)."""
        self.state.iter += 1

    # ---- checkpoints: this rank's own state, in its per-rank file (`lightning_par.strategies._checkpointing`) ----
    def state_dict(self) -> dict[str, Any]:
        """This rank's state, as plain data on the CPU: the step count, the seed generator of the Q draws, and per
        bucket its error and its P and Q (a full gradient's size and the factors)."""
        name, keys, pos, has_gauss, gauss = self.state.rng.get_state(legacy=True)  # type: ignore[misc]
        keys = np.asarray(keys)
        tensors = {kind: {str(b): t.detach().cpu().clone() for b, t in memory.items()}
                   for kind, memory in (("error", self.state.error_dict), ("p", self.state.p_memory_dict),
                                        ("q", self.state.q_memory_dict))}  # fmt: skip
        rng = {"name": name, "keys": torch.from_numpy(keys.astype("int64")), "pos": int(pos),
               "has_gauss": int(has_gauss), "gauss": float(gauss)}  # fmt: skip
        return {"iter": int(self.state.iter), "rank": self.settings.rank, "rng": rng, **tensors}

    def load_state_dict(self, saved: dict[str, Any], sizes: Sequence[int], device: torch.device) -> None:
        """Continue from `state_dict`'s ``saved``.

        Args:
            saved: what `state_dict` returned on this rank.
            sizes: the elements of each of this run's buckets, to check that the saved errors fit them.
            device: where the gradients are.

        Raises:
            ValueError: the state is of another rank r or bucket layout (it cannot be used as it is).
        """
        if saved["rank"] != self.settings.rank:
            raise ValueError(f"it was saved at compression_rank={saved['rank']}, not {self.settings.rank}")
        for b, error in saved["error"].items():
            if int(b) >= len(sizes) or error.numel() != sizes[int(b)]:
                raise ValueError("its buckets differ from this run's (another model, or bucket_cap_mb)")
        self.state.iter = int(saved["iter"])
        rng = saved["rng"]
        self.state.rng.set_state((rng["name"], rng["keys"].numpy().astype("uint32"), rng["pos"], rng["has_gauss"],
                                  rng["gauss"]))  # fmt: skip
        for kind, memory in (("error", self.state.error_dict), ("p", self.state.p_memory_dict),
                             ("q", self.state.q_memory_dict)):  # fmt: skip
            memory.clear()
            memory.update({int(b): t.to(device) for b, t in saved[kind].items()})


def restore(zero: Any, saved: Optional[dict[str, Any]], path: Any) -> None:
    """Resume ``zero``'s PowerSGD (if it runs one) from this rank's ``saved`` state of checkpoint ``path``.

    A checkpoint without it (saved without compression, or by another number of ranks, whose errors belong to other
    ranks), or with a state of another rank r or bucket layout, starts the compression afresh, with a warning: zero
    error, new Q draws, ``compression_start`` exact steps, so the run continues differently from an uninterrupted one.
    """
    compression: Optional[PowerSGD] = getattr(zero, "compression", None)
    if compression is None:
        return
    why = "it holds none for this rank (saved without grad_compression, or by another number of ranks)"
    if saved is not None:
        try:
            sizes = [sum(d.numel() for d in bucket.data) for bucket in zero.buckets]
            compression.load_state_dict(saved, sizes, zero.buckets[0].data[0].device)
            return
        except ValueError as err:
            why = str(err)
    if not dist.is_initialized() or dist.get_rank() == 0:
        warnings.warn(
            f"checkpoint {path}: PowerSGD's state (each rank's error, the warm-started factors) is not resumed: "
            f"{why}. Compression starts afresh (zero error, {compression.settings.start} exact steps first), so the "
            "run continues differently from an uninterrupted one",
            stacklevel=2,
        )

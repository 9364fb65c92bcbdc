"""Whole-parameter ZeRO-1/2 for optimizers that are not element-wise (Adafactor, Muon, an unknown class).

Row slices of a weight give such an optimizer another update than the whole weight (Adafactor factors its second
moments over rows and columns, Muon orthogonalizes each matrix). Here, as torch's ``ZeroRedundancyOptimizer`` does,
each rank of ``dp_shard`` owns a set of whole parameters: it keeps optimizer state for them only and steps them with
their whole averaged gradient; the updated weights come back from their owners. Per bucket (one collective, as the
row layout): rank j's segment of the packed buffer holds the parameters rank j owns, padded to the longest segment,
so one reduce-scatter hands each owner its gradients (stage 2 then frees the full ones, as with rows) and one
all-gather returns the weights. The padding is the price: a bucket whose owners' bytes differ moves ``world x`` its
longest segment instead of its size, worst for a bucket of one large weight (raise ``bucket_cap_mb`` to mix more
weights per bucket). Owners are chosen per bucket, greedily by size, so every rank computes the same assignment
and each bucket's segments (and so its padding) stay balanced; ties go to the rank that owns least overall.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from lightning_par.parallel.grad_norm import _REPLICA, mark_sharded
from lightning_par.utils.dtensors import local_data


def assign_owners(numels: Sequence[int], world: int, load: list[int]) -> list[int]:
    """Owner rank of each parameter of one bucket: largest first, each to the rank with the least bytes so far.

    Args:
        numels: element counts of the bucket's parameters, in bucket order.
        world: ranks of the ``dp_shard`` group.
        load: elements each rank owns over earlier buckets; updated in place.

    Returns:
        one rank per parameter, the same on every rank (sorting breaks ties by position, ranks by load then index).
    """
    here = [0] * world
    owners = [0] * len(numels)
    for i in sorted(range(len(numels)), key=lambda i: (-numels[i], i)):
        rank = min(range(world), key=lambda r: (here[r], load[r], r))
        owners[i] = rank
        here[rank] += numels[i]
        load[rank] += numels[i]
    return owners


class WholeBucket:
    """Parameters reduced with one collective; rank j's segment holds the whole parameters rank j owns.

    The interface of `zero.buckets.Bucket`: ``mine`` are the parameters whose (whole) shard this rank steps, in
    the order ``shard_views`` returns their views.
    """

    def __init__(self, params: list[nn.Parameter], data: list[torch.Tensor], world: int, rank: int, load: list[int]):
        self.params = params
        self.data = data
        self.rank = rank
        self.owners = assign_owners([d.numel() for d in data], world, load)
        self.offsets: list[int] = []  # within its owner's segment
        used = [0] * world
        for d, owner in zip(data, self.owners):
            self.offsets.append(used[owner])
            used[owner] += d.numel()
        self.shard_numel = max(used)
        self.mine = [p for p, owner in zip(params, self.owners) if owner == rank]
        self.ready = 0
        self.launched = False

    def pack(self, tensors: Iterable[Optional[torch.Tensor]], world: int, dtype: torch.dtype) -> torch.Tensor:
        """Lay out whole tensors in their owners' segments: [rank 0's | rank 1's | ...], zero padded."""
        buf = torch.zeros(world, self.shard_numel, dtype=dtype, device=self.data[0].device)
        for t, owner, off in zip(tensors, self.owners, self.offsets):
            if t is not None:  # an unused parameter contributes a zero gradient
                buf[owner, off : off + t.numel()].copy_(t.reshape(-1))
        return buf

    def shard_views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Views of this rank's parameters inside its segment (``shard_numel`` elements)."""
        return [
            flat[off : off + d.numel()].view(d.shape)
            for d, owner, off in zip(self.data, self.owners, self.offsets)
            if owner == self.rank
        ]

    def unpack(self, recv: torch.Tensor) -> None:
        """Copy every other owner's updated parameters out of the all-gathered ``(world, shard_numel)`` buffer."""
        for d, owner, off in zip(self.data, self.owners, self.offsets):
            if owner != self.rank:  # this rank's own were updated in place (its masters are views of them)
                d.view(-1).copy_(recv[owner, off : off + d.numel()])


def whole_buckets(buckets: Sequence[object], world: int, rank: int) -> list[WholeBucket]:
    """The same grouping of parameters into buckets (and so the same collectives' order), owned whole."""
    load = [0] * world
    return [WholeBucket(b.params, b.data, world, rank, load) for b in buckets]  # type: ignore[attr-defined]


def check_not_tp_sharded(optimizer_name: str, stage: int, split: Sequence[str]) -> None:
    """Refuse the whole-parameter layout over tensor-parallel shards: a tp-sharded weight is itself a slice.

    Args:
        optimizer_name: the optimizer's class name.
        stage: the ZeRO stage.
        split: names of the parameters that are tensor-parallel shards (non-replicated DTensors).

    Raises:
        ValueError: ``split`` is not empty, naming the fix.
    """
    if split:
        more = f" (and {len(split) - 1} more)" if len(split) > 1 else ""
        raise ValueError(
            f"{optimizer_name} under zero_stage={stage} with tensor parallelism: {optimizer_name} is not known to be "
            f"element-wise, and {split[0]}{more} is a tensor-parallel shard, itself a slice of its weight, so no "
            f"rank can step it whole. Use tp=1 (e.g. strategy='zero{stage}' or 'pipe_zero1'), or "
            f"declare `{optimizer_name}.lightning_par_elementwise = True` if its update of each element depends on "
            "that element alone"
        )


def whole_masters(
    buckets: Sequence[WholeBucket], rows: dict[nn.Parameter, nn.Parameter], group: dist.ProcessGroup
) -> dict[nn.Parameter, nn.Parameter]:
    """The masters of the parameters this rank owns: the whole parameters' storage (the update writes into it).

    Args:
        buckets: the whole-parameter buckets.
        rows: the row-slice masters they replace (their marks, a tied copy's replica mark, carry over).
        group: ``dp_shard``: the global gradient norm sums the owners' squares over it.
    """
    masters = {}
    for bucket in buckets:
        for p in bucket.mine:
            master = nn.Parameter(local_data(p))
            mark_sharded(master, (group,))
            if getattr(rows.get(p), _REPLICA, False):  # the last stage's copy of a tied weight (pipelines)
                setattr(master, _REPLICA, True)
            masters[p] = master
    return masters


def note(optimizer: torch.optim.Optimizer, stage: int, world: int, buckets: Sequence[WholeBucket]) -> str:
    """The start-up line saying which layout steps the optimizer and what a rank holds."""
    total = max(sum(d.numel() for b in buckets for d in b.data), 1)
    mine = sum(d.numel() for b in buckets for d, o in zip(b.data, b.owners) if o == b.rank)
    packed = sum(b.shard_numel * world for b in buckets)
    grads = (
        "gradients of its own parameters only (the others' are freed once reduced)"
        if stage == 2
        else ("full gradients until the step")
    )
    return (
        f"zero_stage={stage}: {type(optimizer).__name__} is not known to be element-wise, so each of the {world} "
        f"dp_shard ranks steps the whole parameters it owns (this rank: {mine / total:.0%} of the elements) and holds "
        f"their optimizer state only, and {grads}; each reduction packs {packed / total:.2f} x the parameters' "
        "elements (padding where owners' bytes in a bucket differ)"
    )

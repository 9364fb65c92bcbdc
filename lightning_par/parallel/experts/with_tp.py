"""Expert parallelism inside a tensor-parallel group (tp x ep): who computes which token of an expert.

Under tensor parallelism without sequence parallelism every rank of a tp group holds the same tokens at an MoE
layer (the layer is kept whole by the tp plan, so its router, capacity and balancing statistics run on every
token of the data-parallel batch, as on one process). Two ways to run the experts, both around the ep exchange
of `experts.dispatch.ExpertDispatch` (the ep group is the data-parallel ranks with this rank's tp index):

- ``etp = 1`` (*token split*, `TokenSplit`): each tp rank takes its ``1/tp`` of the layer's dispatched rows before
  the ep exchange and the outputs are all-gathered over tp after it, so each token is computed once, not tp times
  (Megatron-Core's MoE layer with ``expert_tensor_parallel_size=1`` does the same). Autograd pair: the split's
  backward all-gathers the rows' gradients over tp, the gather's backward keeps this rank's rows (the layer's
  output is replicated over tp, so every tp rank holds the same full gradient). An expert's gradient on a rank
  then covers this tp rank's share of the tokens: expert gradients are summed over tp too.
- ``etp = tp`` (*expert tensor parallel*, `ExpertShard`): each expert's up / gate projections are column-split
  and its down projection row-split over tp (Megatron-LM, arXiv 1909.08053), tokens replicated over tp: the rows
  entering the experts pass Megatron's ``f`` (identity forward, all-reduce of the gradient over tp) and the
  partial outputs its ``g`` (all-reduce forward, identity backward). Expert gradients are then per-slice, summed
  over ``edp`` only.

The split is exact: the rows are a fixed partition of the layer's rows (``1/tp`` of each expert's rows per tp rank,
computed from the per-expert counts, equal on every tp rank), and a row's expert output does not depend on which
rank computes it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor


def share(counts: Any, rank: int, size: int) -> Any:
    """Rows of each expert that tp rank ``rank`` of ``size`` takes (an int, or a tensor of them, elementwise)."""
    return counts * (rank + 1) // size - counts * rank // size


def _pieces(counts: Tensor, size: int, host: list[int]) -> list[Tensor]:
    """Row indices of each tp rank's share: ``1/size`` of every expert's rows (``counts[e]`` rows per expert,
    expert-major), so every rank sends each expert about the same number of rows (a contiguous cut of the whole
    list would send the first experts' rows from tp rank 0 only, and load their ep rank alone). ``host``: the same
    counts on the host, which size every piece, so no step here waits for the device."""
    starts = counts.cumsum(0) - counts
    out = []
    for r in range(size):
        lo, hi = counts * r // size, counts * (r + 1) // size
        n = sum(share(c, r, size) for c in host)
        first = torch.repeat_interleave(starts + lo, hi - lo, output_size=n)
        # within each expert's run, 0, 1, 2, ...: position minus the run's first position
        runs = torch.repeat_interleave((hi - lo).cumsum(0) - (hi - lo), hi - lo, output_size=n)
        out.append(first + torch.arange(n, device=counts.device) - runs)
    return out


def _gather_rows(x: Tensor, pieces: list[Tensor], n: int, group: dist.ProcessGroup) -> Tensor:
    """Every tp rank's rows (rank ``r`` holds rows ``pieces[r]`` of ``n``), all-gathered into ``[n, ...]``; padded
    to one size (gloo's all-gather needs equal sizes)."""
    pad = max(len(p) for p in pieces)
    parts = [x.new_empty((pad, *x.shape[1:])) for _ in pieces]
    dist.all_gather(parts, torch.cat([x, x.new_zeros((pad - x.shape[0], *x.shape[1:]))]).contiguous(), group=group)
    rows = torch.cat([part[: len(p)] for part, p in zip(parts, pieces)])
    return x.new_empty((n, *x.shape[1:])).index_copy_(0, torch.cat(pieces), rows)


class _SplitRows(torch.autograd.Function):
    """Keep this tp rank's rows of a tp-replicated tensor; backward: all-gather the rows' gradients over tp."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, pieces: list[Tensor], group: dist.ProcessGroup) -> Tensor:
        ctx.group, ctx.pieces, ctx.n = group, pieces, x.shape[0]
        return x[pieces[dist.get_rank(group)]]

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        return _gather_rows(grad.contiguous(), ctx.pieces, ctx.n, ctx.group), None, None


class _GatherRows(torch.autograd.Function):
    """All-gather every tp rank's rows into the replicated whole; backward: keep this rank's rows' gradient."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, pieces: list[Tensor], n: int, group: dist.ProcessGroup) -> Tensor:
        ctx.mine = pieces[dist.get_rank(group)]
        return _gather_rows(x.detach(), pieces, n, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        return grad[ctx.mine].contiguous(), None, None, None


class _CopyToTP(torch.autograd.Function):
    """Megatron's ``f``: identity forward; the gradient is all-reduced over tp (each rank saw a slice's share)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """Megatron's ``g``: the partial outputs of the split experts all-reduced over tp; identity backward."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


class TokenSplit:
    """``etp = 1``: each tp rank runs its ``1/tp`` of a layer's dispatched rows (grouped by expert).

    Args:
        group: the tensor-parallel group.
    """

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self._splits: list[tuple[list[Tensor], int]] = []  # a stack, as the dispatch's routes: recomputation re-enters

    def split(self, x: Tensor, counts: Tensor, host: list[int]) -> tuple[Tensor, list[int]]:
        """This tp rank's rows of ``x`` (``counts[e]`` rows per expert, expert-major; ``host``: the same counts on
        the host) and their counts per expert."""
        # From the counts alone: the same on every tp rank.
        pieces = _pieces(counts, dist.get_world_size(self.group), host)
        self._splits.append((pieces, x.shape[0]))
        out: Tensor = _SplitRows.apply(x, pieces, self.group)
        return out, self.share(host)

    def share(self, counts: list[int]) -> list[int]:
        """This tp rank's rows of each expert, for ``counts`` rows per expert (`split`'s rule)."""
        size, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        return [share(c, rank, size) for c in counts]

    def gather(self, out: Tensor) -> Tensor:
        """Every tp rank's outputs, in the order of the rows given to `split`."""
        pieces, n = self._splits.pop()
        whole: Tensor = _GatherRows.apply(out, pieces, n, self.group)
        return whole


class ExpertShard:
    """``etp = tp``: the experts' hidden width is split over tp; rows replicated, partial outputs summed.

    Args:
        group: the tensor-parallel group.
    """

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group

    def enter(self, rows: Tensor) -> Tensor:
        """The rows entering this rank's slice of the experts (``f``)."""
        out: Tensor = _CopyToTP.apply(rows, self.group)
        return out

    def leave(self, out: Tensor) -> Tensor:
        """The experts' outputs summed over the slices (``g``)."""
        whole: Tensor = _ReduceFromTP.apply(out, self.group)
        return whole

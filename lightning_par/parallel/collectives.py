"""Differentiable collectives shared by more than one technique.

`all_to_all` exchanges rows with split sizes, which may be uneven and zero (gloo's ``all_to_all_single`` takes
them): expert parallelism's token dispatch (expert_dispatch.py) and Ulysses context parallelism's heads <->
sequence exchange (cp_ulysses.py).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with split sizes; its gradient is the same exchange with the splits swapped."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, out_splits: list[int], in_splits: list[int], group: dist.ProcessGroup) -> Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Optional[Tensor], None, None, None]:
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


def all_to_all(x: Tensor, out_splits: list[int], in_splits: list[int], group: dist.ProcessGroup) -> Tensor:
    """Differentiable all-to-all of rows: ``in_splits[j]`` rows of ``x`` go to rank ``j``; ``out_splits[j]``
    rows arrive from rank ``j``, in rank order.

    Args:
        x: ``[sum(in_splits), ...]``.
        out_splits: rows received from each rank of ``group``.
        in_splits: rows sent to each rank of ``group``.
        group: the ranks exchanging (every one of them must call this, even with zero rows).
    """
    out: Tensor = _AllToAll.apply(x, out_splits, in_splits, group)
    return out

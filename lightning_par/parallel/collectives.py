"""Collectives shared by more than one technique.

`reduce_scatter_single` is torch's flat reduce-scatter, except on gloo, whose own all-reduces the whole buffer.

`all_to_all` exchanges rows with split sizes, which may be uneven and zero (gloo's ``all_to_all_single`` takes
them): expert parallelism's token dispatch (expert_dispatch.py) and Ulysses context parallelism's heads <->
sequence exchange (cp_ulysses.py).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_par import _compat


class _SumOnWait:
    """The work of a reduce-scatter made of an all-to-all: waiting sums the ``world`` received rows into the output."""

    def __init__(self, work: Any, rows: Tensor, out: Tensor) -> None:
        self.work, self.rows, self.out = work, rows, out

    def wait(self) -> bool:
        self.work.wait()
        torch.sum(self.rows, dim=0, out=self.out)
        return True


def reduce_scatter_single(output: Tensor, input: Tensor, group: Optional[dist.ProcessGroup] = None,
                          async_op: bool = False) -> Any:  # fmt: skip
    """Sum ``input`` (``world x len(output)`` elements, rank j's part j-th) over ``group`` and keep this rank's part.

    gloo's reduce-scatter clones the input, all-reduces all of it and copies one part out (ProcessGroupGloo's
    ``reduce_scatter_tensor_coalesced``): 2(n-1)/n of the input on the wire instead of (n-1)/n, which made ZeRO 1-2
    send half again what DDP sends there. On gloo this is an all-to-all of the parts (each rank receives every
    rank's part j = its own) and a local sum in rank order: the optimal (n-1)/n. Other backends: torch's own.
    Returns the work with ``async_op`` (its ``wait`` also does the sum), else ``None``.
    """
    if dist.get_backend(group) != "gloo":
        return _compat.reduce_scatter_single(output, input, group=group, async_op=async_op)
    rows = torch.empty_like(input)
    work = _SumOnWait(dist.all_to_all_single(rows, input, group=group, async_op=True),
                      rows.view(dist.get_world_size(group), -1), output)  # fmt: skip
    if async_op:
        return work
    work.wait()
    return None


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

"""The token exchange of expert parallelism: a differentiable all-to-all of rows and the dispatch / combine pair
around one experts module's call (`ExpertDispatch`).

Per MoE layer and step, four all-to-alls of the dispatched rows: dispatch and combine in forward, and their
transposes in backward, each moving the ``(n-1)/n`` of this rank's kept assignments that belong to other ranks
(plus a tiny all-to-all of the per-expert counts). Splits are uneven and may be zero (gloo's ``all_to_all_single``
takes split sizes). Shared by the layer-sharding driver (`expert_parallel`) and the adapters for MoE layers we did
not write (`moe_stacked`, `moe_module_list`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_par.parallel.expert_tp import ExpertShard, TokenSplit


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


@dataclasses.dataclass
class _Route:
    """How one forward's rows were exchanged, for the combine that follows it."""

    send: list[int]  # rows sent to each ep rank
    recv: list[int]  # rows received from each ep rank
    to_local: Tensor  # permutation: received rows (source-major) -> grouped by local expert


class ExpertDispatch:
    """Forward hooks on an `Experts` module that turn its single-device call into the expert-parallel one.

    The pre-hook receives ``(x grouped by all E experts, counts[E])``, sends each ep rank the rows of its experts,
    and hands the module ``(rows grouped by its E/ep experts, counts[E/ep])``; the post-hook sends the outputs
    back, in the order the caller gave them. Under tensor parallelism ``tp`` says who computes what in the tp group
    (`expert_tp`): each tp rank its share of the rows (`TokenSplit`), or every row on its slice of the experts
    (`ExpertShard`).
    """

    def __init__(
        self, group: dist.ProcessGroup, ep: int, n_local: int, tp: Union[TokenSplit, ExpertShard, None] = None
    ) -> None:
        self.group, self.ep, self.n_local, self.tp = group, ep, n_local, tp
        self.route: list[_Route] = []  # a stack: activation checkpointing may re-enter before the combine

    def dispatch(self, module: nn.Module, args: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        x, counts = args
        counts = counts.to(torch.int64)
        if isinstance(self.tp, TokenSplit):
            x, counts = self.tp.split(x, counts)  # before the exchange: each tp rank sends only its share
        recv_counts = torch.empty_like(counts)
        # recv_counts[j * n_local + e] = rows rank j sends to my local expert e
        dist.all_to_all_single(recv_counts, counts, group=self.group)
        send = counts.view(self.ep, self.n_local).sum(1).tolist()
        by_source = recv_counts.view(self.ep, self.n_local)
        recv = by_source.sum(1).tolist()
        rows = all_to_all(x, recv, send, self.group)
        # Received rows are source-major ([from rank 0: e0.., e1..], [from rank 1: ...]); experts need them
        # expert-major. The permutation sorts a (local expert) label per row, stably, keeping sources in order.
        label = torch.repeat_interleave(
            torch.arange(self.n_local, device=x.device).repeat(self.ep), by_source.reshape(-1)
        )
        to_local = label.argsort(stable=True)
        self.route.append(_Route(send, recv, to_local))
        rows = rows[to_local]
        if isinstance(self.tp, ExpertShard):
            rows = self.tp.enter(rows)
        return rows, by_source.sum(0)

    def combine(self, module: nn.Module, args: Any, out: Tensor) -> Tensor:
        if isinstance(self.tp, ExpertShard):
            out = self.tp.leave(out)  # the slices' partial sums, before the rows travel back
        route = self.route.pop()
        back = torch.empty_like(out).index_copy_(0, route.to_local, out)  # expert-major -> source-major
        back = all_to_all(back, route.send, route.recv, self.group)
        return self.tp.gather(back) if isinstance(self.tp, TokenSplit) else back

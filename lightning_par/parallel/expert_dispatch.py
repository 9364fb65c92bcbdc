"""The token exchange of expert parallelism: a differentiable all-to-all of rows and the dispatch / combine pair
around one experts module's call (`ExpertDispatch`).

Per MoE layer and step, four all-to-alls of the dispatched rows: dispatch and combine in forward, and their
transposes in backward, each moving the ``(n-1)/n`` of this rank's kept assignments that belong to other ranks
(plus a tiny all-to-all of the per-expert counts). Splits are uneven and may be zero (`collectives.all_to_all`).
Shared by the layer-sharding driver (`expert_parallel`) and the adapters for MoE layers we did not write
(`moe_stacked`, `moe_module_list`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Union

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_par.parallel.collectives import all_to_all
from lightning_par.parallel.expert_tp import ExpertShard, TokenSplit


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

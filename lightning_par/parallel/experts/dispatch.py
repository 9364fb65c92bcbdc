"""The token exchange of expert parallelism: a differentiable all-to-all of rows and the dispatch / combine pair
around one experts module's call (`ExpertDispatch`).

Per MoE layer and step, four all-to-alls of the dispatched rows: dispatch and combine in forward, and their
transposes in backward, each moving the ``(n-1)/n`` of this rank's kept assignments that belong to other ranks
(plus a tiny all-to-all of the per-expert counts). Splits are uneven and may be zero (`collectives.all_to_all`).
Shared by the layer-sharding driver (`experts.apply`) and the adapters for MoE layers we did not write
(`experts.stacked`, `experts.module_list`).

Host syncs. ``all_to_all_single`` with uneven splits takes its split sizes on the host, so each layer's dispatch
copies the counts (sent and received, in one tensor) to the host once, and waits for the device there; every size
after it (the splits, each local expert's rows, the tp shares) comes from that one copy
(tests/test_moe_syncs.py counts it). Capacity-padded routing (fixed splits) would remove it, at the cost of sending
the padding.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Union

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_par.parallel.collectives import all_to_all
from lightning_par.parallel.experts.with_tp import ExpertShard, TokenSplit, share


def expert_index(counts: list[int], device: torch.device) -> Tensor:
    """The expert of each row of rows grouped by expert (``counts[e]`` rows of expert ``e``), from host counts: an
    asynchronous host -> device copy and a sized `repeat_interleave`, so nothing waits for the device.

    Args:
        counts: rows per expert.
        device: where the rows are.
    """
    repeats = torch.tensor(counts, dtype=torch.int64).to(device, non_blocking=True)
    return torch.repeat_interleave(torch.arange(len(counts), device=device), repeats, output_size=sum(counts))


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
    (`experts.with_tp`): each tp rank its share of the rows (`TokenSplit`), or every row on its slice of the experts
    (`ExpertShard`).
    """

    def __init__(
        self, group: dist.ProcessGroup, ep: int, n_local: int, tp: Union[TokenSplit, ExpertShard, None] = None
    ) -> None:
        self.group, self.ep, self.n_local, self.tp = group, ep, n_local, tp
        self.route: list[_Route] = []  # a stack: activation checkpointing may re-enter before the combine

    def dispatch(self, module: nn.Module, args: tuple[Tensor, Tensor]) -> tuple[Tensor, list[int]]:
        """Send each ep rank the rows of its experts; returns the rows grouped by local expert and their counts.

        Args:
            module: the experts module (unused: the signature of a forward pre-hook).
            args: ``x`` grouped by all ``E`` experts, and ``counts[E]`` rows per expert (a device tensor).

        Returns:
            the rows of this rank's ``E/ep`` experts, expert-major, and the rows per local expert, on the host.
        """
        x, counts = args
        counts = counts.to(torch.int64)
        recv_counts = torch.empty_like(counts)
        # recv_counts[j * n_local + e] = rows rank j routes to my local expert e
        dist.all_to_all_single(recv_counts, counts, group=self.group)
        host = torch.cat([counts, recv_counts]).tolist()  # the layer's one device -> host copy (module docstring)
        sent, got = host[: len(host) // 2], host[len(host) // 2 :]
        if isinstance(self.tp, TokenSplit):
            # Each tp rank sends only its share; senders share the same tp rank, so what arrives is their share too.
            x, sent = self.tp.split(x, counts, sent)
            got = self.tp.share(got)
            recv_counts = share(recv_counts, dist.get_rank(self.tp.group), dist.get_world_size(self.tp.group))
        n = self.n_local
        send = [sum(sent[j * n : (j + 1) * n]) for j in range(self.ep)]
        recv = [sum(got[j * n : (j + 1) * n]) for j in range(self.ep)]
        rows = all_to_all(x, recv, send, self.group)
        # Received rows are source-major ([from rank 0: e0.., e1..], [from rank 1: ...]); experts need them
        # expert-major. The permutation sorts a (local expert) label per row, stably, keeping sources in order.
        label = torch.repeat_interleave(
            torch.arange(n, device=x.device).repeat(self.ep), recv_counts, output_size=sum(recv)
        )  # output_size: no device sync to size it
        to_local = label.argsort(stable=True)
        self.route.append(_Route(send, recv, to_local))
        rows = rows[to_local]
        if isinstance(self.tp, ExpertShard):
            rows = self.tp.enter(rows)
        return rows, [sum(got[j * n + e] for j in range(self.ep)) for e in range(n)]

    def combine(self, module: nn.Module, args: Any, out: Tensor) -> Tensor:
        """Send the experts' outputs back to the ranks that routed the rows, in the order they gave them."""
        if isinstance(self.tp, ExpertShard):
            out = self.tp.leave(out)  # the slices' partial sums, before the rows travel back
        route = self.route.pop()
        back = torch.empty_like(out).index_copy_(0, route.to_local, out)  # expert-major -> source-major
        back = all_to_all(back, route.send, route.recv, self.group)
        return self.tp.gather(back) if isinstance(self.tp, TokenSplit) else back

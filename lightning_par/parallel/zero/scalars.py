"""Parameters with no dimension under ZeRO: a learned temperature (CLIP's ``logit_scale``), a gate
``nn.Parameter(torch.tensor(0.0))``.

ZeRO shards along dim 0, and a 0-dim tensor has none: FSDP2 refuses it ("fully_shard doesn't support scalar
parameters"), and the ZeRO 0-2 engine's buckets are rows of weights. Sharding a 4-byte value would save nothing, so
such a parameter stays whole on every rank, in the optimizer as it is (FSDP2's ``ignored_params``, the engine's
excluded parameters), and its gradient is averaged here over the data-parallel ranks once per optimizer step, as
the others' are. A rank where it took no part in the graph counts as a zero, and a gradient that no rank produced
stays ``None``, as in one process (an optimizer then skips it).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from lightning_par.utils import dtensors


def scalar_params(module: nn.Module, exclude: Sequence[nn.Parameter] = ()) -> list[tuple[str, nn.Parameter]]:
    """The trainable 0-dim parameters of ``module`` (each once, under its first name), except ``exclude``."""
    skip = {id(p) for p in exclude}
    return [(n, p) for n, p in module.named_parameters() if p.dim() == 0 and p.requires_grad and id(p) not in skip]


class ScalarGrads:
    """Averages the gradients of 0-dim parameters over the data-parallel ranks.

    Args:
        named: the parameters, by name (`scalar_params`).
        groups: the groups to sum over, one after another (``dp_replicate`` and ``dp_shard``, which holds ``cp``
            under context parallelism; ``dp_shard`` alone under local SGD, whose replicas train apart).
        size: the number of ranks summed (the divisor).
    """

    def __init__(self, named: Sequence[tuple[str, nn.Parameter]], groups: Sequence[dist.ProcessGroup], size: int):
        self.named = list(named)
        self.groups = [g for g in groups if dist.get_world_size(g) > 1]
        self.size = size

    def reduce(self) -> None:
        """Average every gradient over the groups (collective over each group); call once per optimizer step, after
        the last backward of an accumulation."""
        if not self.named or not self.groups:
            return
        params = [p for _, p in self.named]
        device = params[0].device
        # A block tensor parallelism distributes may hold one as a replicated DTensor: its local value is the whole.
        grads = [dtensors.local(p.grad) if p.grad is not None else None for p in params]
        values = torch.stack([g.detach().float().reshape(()) if g is not None else torch.zeros((), device=device)
                              for g in grads])  # fmt: skip
        present = torch.tensor([p.grad is not None for p in params], dtype=torch.float32, device=device)
        flat = torch.cat([values, present])
        for group in self.groups:
            dist.all_reduce(flat, group=group)
        n = len(params)
        for p, g, value, seen in zip(params, grads, flat[:n], flat[n:].tolist()):
            if seen == 0:
                continue  # no rank used it: no gradient, as in one process
            mean = value / self.size
            if g is None:
                p.grad = dtensors.like(mean.to(p.dtype), p)  # a DTensor parameter's gradient in its layout
            else:
                g.copy_(mean)

"""Global gradient norm and clipping over sharded and replicated gradients.

A gradient is a DTensor, a plain tensor marked as a shard (`mark_sharded`), or a plain replicated tensor. A
sharded gradient's local squared norm is summed over the groups it is sharded over and counted once over those
it is replicated on, so the result equals the single-process norm up to float summation order.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

from lightning_par.utils import dtensors

# Attribute set on plain tensors that hold one shard of a larger parameter (ZeRO 1-2 masters): the groups they are
# sharded over. (An attribute, not a WeakKeyDictionary: that compares tensors with `==`.) Every other plain
# tensor is taken as replicated.
_SHARD_GROUPS = "_lp_shard_groups"
# Attribute set on a parameter that is a copy of one another rank also holds and counts (the last pipeline stage's
# copy of a tied embedding): its gradient is left out of the norm, which counts the weight once.
_REPLICA = "_lp_norm_replica"


def mark_sharded(param: torch.Tensor, groups: tuple[dist.ProcessGroup, ...]) -> None:
    """Declare that the plain tensor ``param`` (and its gradient) is one shard over ``groups``.

    Args:
        param: a parameter holding this rank's slice of a larger parameter.
        groups: the process groups whose ranks hold the other slices.
    """
    setattr(param, _SHARD_GROUPS, groups)


def mark_replica(param: torch.Tensor) -> None:
    """Declare that ``param`` copies a parameter another rank holds and counts (a tied weight's second copy): the
    global gradient norm leaves its gradient out.

    Args:
        param: the copy (a parameter, or the ZeRO master built from it).
    """
    setattr(param, _REPLICA, True)


def copy_marks(src: torch.Tensor, dst: torch.Tensor) -> None:
    """Carry `mark_replica` over from a parameter to a tensor that stands in for it in the optimizer."""
    if getattr(src, _REPLICA, False):
        setattr(dst, _REPLICA, True)


def global_grad_norm(params: Iterable[torch.Tensor], sum_groups: Sequence[dist.ProcessGroup] = ()) -> torch.Tensor:
    """L2 norm of all gradients of ``params`` across every shard (a replicated fp32 scalar on every rank).

    Args:
        params: parameters (plain or DTensor) whose ``.grad`` may be ``None``.
        sum_groups: groups whose ranks hold different parameters altogether (pipeline stages): the squared norm
            is summed over them last. Every rank of such a group must call this, even one without gradients.
    """
    sums: dict[tuple[dist.ProcessGroup, ...], torch.Tensor] = {}
    device = None
    for p in params:
        g = p.grad
        if g is None or getattr(p, _REPLICA, False):
            continue
        groups: tuple[dist.ProcessGroup, ...] = getattr(p, _SHARD_GROUPS, ())
        if isinstance(g, DTensor):
            if any(pl.is_partial() for pl in g.placements):
                # Unreduced (a replicated parameter used on sequence shards): reduce first, its norm is of the sum.
                g = g.redistribute(g.device_mesh, [Replicate() if pl.is_partial() else pl for pl in g.placements])
            mesh = g.device_mesh
            groups = tuple(mesh.get_group(i) for i, pl in enumerate(g.placements) if not isinstance(pl, Replicate))
        local = dtensors.local(g).detach().float()
        device = local.device
        sq = local.pow(2).sum()
        sums[groups] = sums[groups] + sq if groups in sums else sq
    if device is None and not sum_groups:
        return torch.zeros(())
    total = torch.zeros((), device=device)
    # Same parameters on every rank -> same keys in the same (insertion) order -> matching collectives.
    for groups, sq in sums.items():
        for group in groups:
            dist.all_reduce(sq, group=group)
        total += sq
    for group in sum_groups:
        dist.all_reduce(total, group=group)
    return total.sqrt()


@torch.no_grad()
def clip_grad_norm(
    params: Iterable[torch.Tensor], max_norm: float, sum_groups: Sequence[dist.ProcessGroup] = ()
) -> torch.Tensor:
    """Scale all gradients so their global norm is at most ``max_norm``, as ``torch.nn.utils.clip_grad_norm_``.

    Args:
        params: parameters whose gradients are clipped in place.
        max_norm: the largest allowed global L2 norm.
        sum_groups: see `global_grad_norm`.

    Returns:
        the global norm before clipping.
    """
    params = list(params)
    norm = global_grad_norm(params, sum_groups)
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for p in params:
        if p.grad is not None:
            dtensors.local(p.grad).mul_(coef.to(p.grad.dtype))
    return norm

"""Which positions of a sequence each context-parallel rank holds: the load-balanced layout for causal attention.

The sequence is cut into ``2 * cp`` chunks and rank ``r`` holds chunks ``r`` and ``2 * cp - 1 - r``: under a causal
mask the work of a query grows with its position, so pairing an early chunk with a late one gives every rank the
same work (the layout of Megatron-LM's context parallelism and of torch's ``_HeadTailLoadBalancer``). Shared by the
two attention modes: ``"allgather"`` (context/apply.py) and ``"ulysses"`` (context/ulysses.py).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from torch import Tensor


@dataclasses.dataclass(frozen=True)
class Layout:
    """Which positions of a length-``length`` sequence each cp rank holds.

    Args:
        length: the whole sequence's length.
        local: global positions this rank holds, in its local order (chunk ``r``, then chunk ``2 * cp - 1 - r``).
        sizes: every cp rank's local length (they differ by at most one when ``2 * cp`` does not divide it).
        order: for each global position, its row in the gathered message (ranks' chunks padded to ``max(sizes)``).
        rank_major: every rank's positions, rank after rank, unpadded (what an all-to-all with split sizes
            ``sizes`` delivers).
        rank_major_row: for each global position, its row in ``rank_major`` (the inverse permutation).
    """

    length: int
    local: Tensor
    sizes: tuple[int, ...]
    order: Tensor
    rank_major: Tensor
    rank_major_row: Tensor


def layout(length: int, cp: int, rank: int, device: Optional[torch.device] = None) -> Layout:
    """The load-balanced layout of a sequence over ``cp`` ranks (``2 * cp`` chunks, ``torch.tensor_split`` sizes).

    Args:
        length: sequence length, at least ``2 * cp``.
        cp: context-parallel degree.
        rank: this rank's index in its cp group.
        device: where the index tensors live.
    """
    chunks = torch.arange(length, device=device).tensor_split(2 * cp)
    held = [torch.cat([chunks[r], chunks[2 * cp - 1 - r]]) for r in range(cp)]
    width = max(len(h) for h in held)
    order = torch.empty(length, dtype=torch.long, device=device)
    for r, h in enumerate(held):
        order[h] = r * width + torch.arange(len(h), device=device)
    rank_major = torch.cat(held)
    return Layout(length, held[rank], tuple(len(h) for h in held), order, rank_major, torch.argsort(rank_major))

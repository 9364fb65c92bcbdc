"""Ulysses attention for context parallelism (``cp_mode="ulysses"``): trade the sequence split for a head split.

DeepSpeed-Ulysses (Jacobs et al., arXiv 2309.14509): around each attention call an all-to-all turns this rank's
queries, keys and values for its positions and every head into every position for ``1/cp`` of the heads; attention
then runs unchanged on the whole sequence (the model's own causal flag or mask, no global-position mask to build),
and a last all-to-all turns the output back. Per layer and forward a rank sends and receives ``(cp-1)/cp`` of its
local q, k, v and output: ``(cp-1)/cp^2`` of the whole sequence's four tensors, which falls as cp grows, against
``2 (cp-1)/cp`` of the whole K and V for the all-gather (and ring) modes, which grows towards twice K. Autograd keeps
the local-size tensors only (the head-split inputs of attention are as large as the local ones), so no recompute
is needed for activation memory to fall by cp. The cost: the heads a rank computes must divide by cp (after tensor
parallelism), and an all-to-all wants a fast all-to-all network (within a node); across nodes the all-gather mode
moves less per link.

The sequence arrives in the load-balanced layout (context/layout.py); the all-to-all delivers every rank's positions
rank after rank, and one index put them in sequence order (and back). Uneven lengths need no padding: the
all-to-all takes each rank's size.
"""

from __future__ import annotations

from typing import Any, Optional

import torch.nn.functional as F
from torch import Tensor

from lightning_par.parallel.collectives import all_to_all
from lightning_par.parallel.context.layout import Layout

_HEADS = -3  # scaled_dot_product_attention's (batch, heads, sequence, features)


def ulysses_attention(
    lay: Layout,
    group: Any,
    rank: int,
    block: str,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Optional[Tensor] = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
) -> Tensor:
    """``scaled_dot_product_attention`` on this rank's positions of every head, computed as every position of
    ``1/cp`` of the heads.

    Args:
        lay: the layout of the forward in progress.
        group: the cp process group; ``rank`` this rank's index in it.
        block: the trunk block's name (for messages).
        q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa: the call's arguments; ``attn_mask`` over
            the whole sequence (``[..., length, length]``: context parallelism leaves masks whole in this mode).
    """
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise NotImplementedError(
            f"{block} calls scaled_dot_product_attention on {q.dim()}-D queries; cp_mode='ulysses' splits the head "
            "dimension of (batch, heads, sequence, features) tensors; use cp_mode='allgather'"
        )
    cp, heads, kv_heads = len(lay.sizes), q.shape[_HEADS], k.shape[_HEADS]
    if heads % cp:
        divisors = [d for d in range(2, heads + 1) if heads % d == 0]
        raise NotImplementedError(
            f"{block}: cp_mode='ulysses' splits attention heads over cp, but cp={cp} does not divide the {heads} query "
            f"heads this rank computes (after tensor parallelism); choose cp in {divisors}, or cp_mode='allgather'"
        )
    if kv_heads % cp:
        # Fewer key/value heads than cp (grouped or multi-query attention): each head group needs the key/value
        # heads its queries read, so they travel repeated to one per query head (DeepSpeed-Ulysses does the same).
        if heads % kv_heads:
            raise NotImplementedError(
                f"{block}: {heads} query heads are not a multiple of {kv_heads} key/value heads; use "
                "cp_mode='allgather'"
            )
        k, v = (t.repeat_interleave(heads // kv_heads, dim=_HEADS) for t in (k, v))
    mask = attn_mask
    if mask is not None:
        if tuple(mask.shape[-2:]) != (lay.length, lay.length):
            raise NotImplementedError(
                f"{block} passes an attention mask of shape {tuple(mask.shape)}, built inside the block from its "
                f"local length, not over the {lay.length} positions; build the mask before the trunk, or use "
                "is_causal=True"
            )
        if mask.dim() == 4 and mask.shape[_HEADS] == heads and heads > 1:  # one mask per head: this rank's heads
            mask = mask.narrow(_HEADS, rank * (heads // cp), heads // cp)
    q, k, v = (_to_sequence(t, lay, group) for t in (q, k, v))
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa
    )
    return _to_heads(out, lay, group)


def _to_sequence(x: Tensor, lay: Layout, group: Any) -> Tensor:
    # (B, H, n, D), this rank's n positions -> (B, H/cp, length, D), head group `rank`, in sequence order.
    cp, (b, h, n, d) = len(lay.sizes), x.shape
    rows = x.reshape(b, cp, h // cp, n, d).permute(1, 3, 0, 2, 4).reshape(cp * n, b, h // cp, d)
    got = all_to_all(rows, list(lay.sizes), [n] * cp, group)  # every rank's positions, rank after rank
    return got.index_select(0, lay.rank_major_row).permute(1, 2, 0, 3)


def _to_heads(y: Tensor, lay: Layout, group: Any) -> Tensor:
    # (B, H/cp, length, D) -> (B, H, n, D): each rank gets its positions back, of every head group.
    cp, (b, g, _, d), n = len(lay.sizes), y.shape, len(lay.local)
    rows = y.permute(2, 0, 1, 3).index_select(0, lay.rank_major)  # positions grouped by the rank holding them
    got = all_to_all(rows, [n] * cp, list(lay.sizes), group)  # from rank j: head group j of this rank's positions
    return got.reshape(cp, n, b, g, d).permute(2, 0, 3, 1, 4).reshape(b, cp * g, n, d)

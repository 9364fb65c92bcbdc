"""A user LM whose first block makes a relative position bias from a table of one column per head (T5's pattern,
written plainly) and hands it to every later block with the hidden state. Nothing here knows about the strategies.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from _tp_mixed_models import AlternatingLM
from torch import Tensor, nn


class _Attention(nn.Module):
    def __init__(self, dim: int, n_heads: int, max_distance: Optional[int]) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.q, self.k, self.v = nn.Linear(dim, dim), nn.Linear(dim, dim, bias=False), nn.Linear(dim, dim)
        self.out = nn.Linear(dim, dim)
        # Only the first block's attention owns the table (2 * max_distance - 1 distances, one column per head).
        self.max_distance = max_distance
        self.rel = nn.Embedding(2 * max_distance - 1, n_heads) if max_distance else None

    def bias(self, t: int, device: torch.device) -> Tensor:
        assert self.rel is not None and self.max_distance is not None
        pos = torch.arange(t, device=device)
        distance = (pos[None, :] - pos[:, None]).clamp(-self.max_distance + 1, self.max_distance - 1)
        return self.rel(distance + self.max_distance - 1).permute(2, 0, 1).unsqueeze(0)  # [1, heads, t, t]

    def forward(self, x: Tensor, bias: Optional[Tensor]) -> tuple[Tensor, Tensor]:
        b, t, _ = x.shape
        if bias is None:
            bias = self.bias(t, x.device)
        q, k, v = (p(x).view(b, t, self.n_heads, -1).transpose(1, 2) for p in (self.q, self.k, self.v))
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=bias.masked_fill(~causal, float("-inf")))
        return self.out(y.transpose(1, 2).reshape(b, t, -1)), bias


class Block(nn.Module):
    def __init__(self, dim: int, n_heads: int, max_distance: Optional[int]) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = _Attention(dim, n_heads, max_distance)
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: Tensor, bias: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
        a, bias = self.attn(self.ln1(x), bias)
        x = x + a
        return x + self.down(F.gelu(self.up(self.ln2(x)))), bias


class RelBiasLM(AlternatingLM):
    """Causal LM over bytes, 3 blocks; the bias the first block makes is reused by the others (the embedding, head,
    loss and optimizer are `AlternatingLM`'s)."""

    def __init__(self, dim: int = 32, n_heads: int = 4, n_blocks: int = 3) -> None:
        super().__init__(kinds=())
        self.blocks = nn.ModuleList(Block(dim, n_heads, 8 if i == 0 else None) for i in range(n_blocks))

    def forward(self, idx: Tensor) -> Tensor:
        h, bias = self.emb(idx), None
        for block in self.blocks:
            h, bias = block(h, bias)
        return self.head(self.norm(h))

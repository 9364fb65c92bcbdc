"""A plain user model whose blocks alternate two structures, as x-transformers lays out its layers: one block class
holding either a pre-norm attention or a pre-norm feed-forward (with ``inner=True`` the norm lives inside the
attention / feed-forward module, before its projections, as in RoBERTa-PreLayerNorm). Nothing here knows about the
strategies."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn


class _Attention(nn.Module):
    def __init__(self, dim: int, n_heads: int, norm: nn.Module) -> None:
        super().__init__()
        self.n_heads, self.norm = n_heads, norm
        # No key bias: it shifts every logit of a query alike, so its gradient is zero up to rounding.
        self.q, self.k, self.v = nn.Linear(dim, dim), nn.Linear(dim, dim, bias=False), nn.Linear(dim, dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        b, t, _ = x.shape
        x = self.norm(x)
        q, k, v = (p(x).view(b, t, self.n_heads, -1).transpose(1, 2) for p in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, -1))


class _FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int, norm: nn.Module) -> None:
        super().__init__()
        self.norm, self.up, self.down = norm, nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.down(F.gelu(self.up(self.norm(x))))


class Layer(nn.Module):
    """``kind`` "attn" or "ff": the same class, two structures."""

    def __init__(self, kind: str, dim: int = 32, n_heads: int = 4, inner: bool = False) -> None:
        super().__init__()
        self.norm: nn.Module = nn.Identity() if inner else nn.LayerNorm(dim)
        norm = nn.LayerNorm(dim) if inner else nn.Identity()
        self.fn: nn.Module = _Attention(dim, n_heads, norm) if kind == "attn" else _FeedForward(dim, 4 * dim, norm)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.fn(self.norm(x))


class AlternatingLM(L.LightningModule):
    """Causal LM over bytes: attention, feed-forward, attention, feed-forward."""

    def __init__(self, kinds: tuple[str, ...] = ("attn", "ff", "attn", "ff"), inner: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(256, 32)
        self.layers = nn.ModuleList(Layer(k, inner=inner) for k in kinds)
        self.norm = nn.LayerNorm(32)
        self.head = nn.Linear(32, 256)

    def forward(self, idx: Tensor) -> Tensor:
        h = self.emb(idx)
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h))

    def _loss(self, x: Tensor, y: Tensor) -> Tensor:
        return F.cross_entropy(self(x).flatten(0, 1), y.flatten())

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss = self._loss(*batch)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.5, momentum=0.9)


class _PostNormAttention(nn.Module):
    """Attention whose module ends with its own residual add and norm (BERT/ALBERT post-norm, written in one
    module, as users do)."""

    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.q, self.k, self.v = nn.Linear(dim, dim), nn.Linear(dim, dim, bias=False), nn.Linear(dim, dim)
        self.out, self.norm = nn.Linear(dim, dim), nn.LayerNorm(dim)

    def forward(self, x: Tensor) -> Tensor:
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, self.n_heads, -1).transpose(1, 2) for p in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, -1)
        return self.norm(x + self.out(y))


class PostNormBlock(nn.Module):
    def __init__(self, dim: int = 32, n_heads: int = 4) -> None:
        super().__init__()
        self.attn = _PostNormAttention(dim, n_heads)
        self.mlp = _FeedForward(dim, 4 * dim, nn.Identity())
        self.norm = nn.LayerNorm(dim)

    def forward(self, x: Tensor) -> Tensor:
        x = self.attn(x)
        return self.norm(x + self.mlp(x))


class PostNormLM(AlternatingLM):
    """Causal LM over bytes whose attention modules hold their residual add and post-norm."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(PostNormBlock() for _ in range(2))

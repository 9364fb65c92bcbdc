"""Llama-style decoder: RMSNorm, rotary positions, grouped-query attention, SwiGLU feed-forward.

Module names follow Meta's reference implementation (`layers.0.attention.wq`, `feed_forward.w1`, ...) because
tensor-parallel plans and pipeline cuts are inferred from them.
"""

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ._lm import CausalLM


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned scale (no mean subtraction, no bias).

    Args:
        dim: Size of the normalized last dimension.
        eps: Added to the mean square for stability.
    """

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: Tensor) -> Tensor:
        # Statistics in fp32: a bf16 mean of squares loses the small-magnitude features.
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def _rope_table(seq_len: int, head_dim: int, theta: float, device: Any = None) -> Tensor:
    """Rotary angles as a (seq_len, head_dim // 2, 2) fp32 table of [cos, sin] (RoFormer, arXiv 2104.09864)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    return torch.stack([angles.cos(), angles.sin()], dim=-1)


def _apply_rope(x: Tensor, rope: Tensor) -> Tensor:
    # Rotates consecutive pairs (x[2i], x[2i+1]) like Meta's complex-number version; math in fp32 because bf16
    # angles at large positions are off by whole radians.
    B, T, H, D = x.shape
    xf = x.float().view(B, T, H, D // 2, 2)
    cos, sin = rope[None, :T, None, :, 0], rope[None, :T, None, :, 1]
    x0, x1 = xf[..., 0], xf[..., 1]
    return torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1).flatten(3).type_as(x)


class Attention(nn.Module):
    """Causal grouped-query attention: `n_heads` query heads share `n_kv_heads` key/value heads.

    Args:
        dim: Model width.
        n_heads: Query heads; must divide `dim`.
        n_kv_heads: Key/value heads; must divide `n_heads`.
    """

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int) -> None:
        super().__init__()
        if dim % n_heads:
            raise ValueError(f"n_heads={n_heads} does not divide dim={dim}; pick dim a multiple of n_heads")
        if n_heads % n_kv_heads:
            raise ValueError(f"n_kv_heads={n_kv_heads} does not divide n_heads={n_heads}; pick a divisor of n_heads")
        self.head_dim = dim // n_heads
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)

    def forward(self, x: Tensor, rope: Tensor) -> Tensor:
        B, T, _ = x.shape
        # Head counts come from tensor shapes: under tensor parallelism each rank holds n_heads/tp query heads
        # and n_kv_heads/tp key/value heads, and the ratio between them is unchanged.
        q = _apply_rope(self.wq(x).view(B, T, -1, self.head_dim), rope)
        k = _apply_rope(self.wk(x).view(B, T, -1, self.head_dim), rope)
        v = self.wv(x).view(B, T, -1, self.head_dim)
        n_rep = q.shape[2] // k.shape[2]
        if n_rep > 1:
            # Materializes n_rep copies of k and v (Meta's repeat_kv); query head i reads kv head i // n_rep.
            k, v = k.repeat_interleave(n_rep, dim=2), v.repeat_interleave(n_rep, dim=2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


class FeedForward(nn.Module):
    """SwiGLU feed-forward `w2(silu(w1 x) * w3 x)` (Shazeer, arXiv 2002.05202).

    Args:
        dim: Model width.
        hidden: Inner width (about 8/3 * dim keeps the parameter count of a 4x GELU MLP).
    """

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """Pre-norm block: `h = x + attention(attention_norm(x))`, then `h + feed_forward(ffn_norm(h))`.

    Args:
        dim: Model width.
        n_heads: Query heads.
        n_kv_heads: Key/value heads.
        ffn_hidden: SwiGLU inner width.
        norm_eps: RMSNorm epsilon.
    """

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, ffn_hidden: int, norm_eps: float) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(dim, norm_eps)
        self.attention = Attention(dim, n_heads, n_kv_heads)
        self.ffn_norm = RMSNorm(dim, norm_eps)
        self.feed_forward = FeedForward(dim, ffn_hidden)

    def forward(self, x: Tensor, rope: Tensor) -> Tensor:
        h = x + self.attention(self.attention_norm(x), rope)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(CausalLM):
    """Llama-style causal language model.

    Args:
        vocab_size: Number of token ids (256 for the bundled byte-level data).
        max_seq_len: Maximum sequence length (rows of the rotary table).
        dim: Model width.
        n_layers: Number of transformer blocks.
        n_heads: Query heads; must divide `dim`, and `dim // n_heads` must be even for rotary pairs.
        n_kv_heads: Key/value heads; must divide `n_heads`. Fewer heads shrink the KV projections (and a KV cache)
            by `n_heads / n_kv_heads`; tensor parallelism needs tp to divide `n_kv_heads`.
        ffn_hidden: SwiGLU inner width.
        norm_eps: RMSNorm epsilon.
        rope_theta: Rotary base; larger values give slower-rotating, longer-range frequencies.
        lr: Peak AdamW learning rate.
        weight_decay: AdamW weight decay for parameters with `dim() >= 2`.
        warmup_steps: Linear-warmup optimizer steps.
        max_steps: 0 keeps `lr` constant after warmup; otherwise cosine decay to `0.1 * lr` at `max_steps`.
        betas: AdamW betas.
    """

    rope: Tensor

    def __init__(
        self,
        vocab_size: int = 256,
        max_seq_len: int = 64,
        dim: int = 64,
        n_layers: int = 2,
        n_heads: int = 4,
        n_kv_heads: int = 2,
        ffn_hidden: int = 172,
        norm_eps: float = 1e-5,
        rope_theta: float = 10000.0,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        warmup_steps: int = 0,
        max_steps: int = 0,
        betas: tuple[float, float] = (0.9, 0.95),
    ) -> None:
        super().__init__(vocab_size, lr, weight_decay, warmup_steps, max_steps, betas)
        self.save_hyperparameters()
        if dim % n_heads or (dim // n_heads) % 2:
            raise ValueError(
                f"dim={dim} must be n_heads={n_heads} times an even head_dim for rotary pairs; pick dim = 2*k*n_heads"
            )
        self.n_layers = n_layers
        self.hidden_size = dim
        self.seq_len = max_seq_len
        self.head_dim = dim // n_heads
        self.rope_theta = rope_theta
        self.tok_embeddings = nn.Embedding(vocab_size, dim)
        self.layers = nn.ModuleList(
            TransformerBlock(dim, n_heads, n_kv_heads, ffn_hidden, norm_eps) for _ in range(n_layers)
        )
        self.norm = RMSNorm(dim, norm_eps)
        self.output = nn.Linear(dim, vocab_size, bias=False)
        # One table on the root, passed to every block: blocks own no positional state, so pipeline stages and
        # FSDP units need no copy. Non-persistent: it is recomputed, never checkpointed.
        self.register_buffer("rope", _rope_table(max_seq_len, self.head_dim, rope_theta), persistent=False)
        self.init_weights()

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> "Llama":
        super()._apply(fn, recurse)
        # Every .to()/.half()/to_empty() passes through here: rebuilding keeps the table fp32 under bf16-true
        # precision and gives it real values after meta-device materialization. Costs max_seq_len * head_dim flops.
        self.rope = _rope_table(self.seq_len, self.head_dim, self.rope_theta, device=self.rope.device)
        return self

    @torch.no_grad()
    def init_weights(self) -> None:
        """Re-initialize all parameters (normal 0.02; output projections of residual branches scaled by depth).

        Called by `__init__`; call it again after materializing a model built on the meta device, since
        `reset_parameters` of the torch layers would give their default (Kaiming) init instead.
        """
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            elif isinstance(module, RMSNorm):
                module.reset_parameters()
        # GPT-2 style 1/sqrt(2 * n_layers) on wo and w2, the two writes into the residual stream per block.
        for name, param in self.named_parameters():
            if name.endswith(("attention.wo.weight", "feed_forward.w2.weight")):
                nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * self.n_layers))

    def forward(self, tokens: Tensor) -> Tensor:
        """Next-token logits.

        Args:
            tokens: Token ids of shape (B, T) with T <= max_seq_len.

        Returns:
            Logits of shape (B, T, vocab_size).
        """
        T = tokens.shape[1]
        if T > self.seq_len:
            raise ValueError(f"sequence length {T} exceeds max_seq_len={self.seq_len}; raise max_seq_len or crop")
        h = self.tok_embeddings(tokens)
        rope = self.rope[:T]
        for layer in self.layers:
            h = layer(h, rope)
        return self.output(self.norm(h))

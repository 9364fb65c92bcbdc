"""nanoGPT-style decoder (GPT-2 layout: learned positions, LayerNorm, GELU MLP, fused qkv).

Module names follow nanoGPT (`transformer.h.0.attn.c_attn`, ...) because tensor-parallel plans and pipeline cuts
are inferred from them; renaming a module changes those plans and checkpoint keys.
"""

import math
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ._lm import CausalLM


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with a fused qkv projection.

    Args:
        n_embd: Model width.
        n_head: Number of heads; must divide `n_embd`.
        dropout: Dropout on the attention weights and on the output projection.
        bias: Whether the projections carry a bias.
    """

    def __init__(self, n_embd: int, n_head: int, dropout: float, bias: bool) -> None:
        super().__init__()
        if n_embd % n_head:
            raise ValueError(f"n_head={n_head} does not divide n_embd={n_embd}; pick n_embd a multiple of n_head")
        self.head_dim = n_embd // n_head
        self.dropout = dropout
        self.c_attn = nn.Linear(n_embd, 3 * n_embd, bias=bias)
        self.c_proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        B, T, _ = x.shape
        # Heads and widths come from tensor shapes, not from n_head: under tensor parallelism c_attn holds only
        # this rank's heads, laid out [q | k | v] locally.
        q, k, v = (t.view(B, T, -1, self.head_dim).transpose(1, 2) for t in self.c_attn(x).chunk(3, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).reshape(B, T, -1)))


class MLP(nn.Module):
    """GELU feed-forward with a 4x hidden width.

    Args:
        n_embd: Model width.
        dropout: Dropout after the down projection.
        bias: Whether the projections carry a bias.
    """

    def __init__(self, n_embd: int, dropout: float, bias: bool) -> None:
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd, bias=bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * n_embd, n_embd, bias=bias)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """Pre-norm transformer block: `x + attn(ln_1(x))`, then `x + mlp(ln_2(x))`.

    Args:
        n_embd: Model width.
        n_head: Number of attention heads.
        dropout: Dropout probability.
        bias: Whether linear and LayerNorm layers carry a bias.
    """

    def __init__(self, n_embd: int, n_head: int, dropout: float, bias: bool) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd, bias=bias)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout, bias)
        self.ln_2 = nn.LayerNorm(n_embd, bias=bias)
        self.mlp = MLP(n_embd, dropout, bias)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(CausalLM):
    """GPT-2-style causal language model (nanoGPT layout).

    Args:
        vocab_size: Number of token ids (256 for the bundled byte-level data).
        block_size: Maximum sequence length (size of the learned position table).
        n_layer: Number of transformer blocks.
        n_head: Attention heads per block; must divide `n_embd`.
        n_embd: Model width.
        dropout: Dropout probability for embeddings, attention and residual branches.
        bias: Whether linear and LayerNorm layers carry a bias.
        tie_weights: Share the token-embedding matrix with `lm_head` (GPT-2 does; saves `vocab_size * n_embd`
            parameters but couples the first and last pipeline stages).
        lr: Peak AdamW learning rate.
        weight_decay: AdamW weight decay for parameters with `dim() >= 2`.
        warmup_steps: Linear-warmup optimizer steps.
        max_steps: 0 keeps `lr` constant after warmup; otherwise cosine decay to `0.1 * lr` at `max_steps`.
        betas: AdamW betas.
    """

    def __init__(
        self,
        vocab_size: int = 256,
        block_size: int = 64,
        n_layer: int = 2,
        n_head: int = 4,
        n_embd: int = 64,
        dropout: float = 0.0,
        bias: bool = True,
        tie_weights: bool = False,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        warmup_steps: int = 0,
        max_steps: int = 0,
        betas: tuple[float, float] = (0.9, 0.95),
    ) -> None:
        super().__init__(vocab_size, lr, weight_decay, warmup_steps, max_steps, betas)
        self.save_hyperparameters()
        self.n_layers = n_layer
        self.hidden_size = n_embd
        self.seq_len = block_size
        wte = nn.Embedding(vocab_size, n_embd)
        self.transformer = nn.ModuleDict(
            {
                "wte": wte,
                "wpe": nn.Embedding(block_size, n_embd),
                "drop": nn.Dropout(dropout),
                "h": nn.ModuleList(Block(n_embd, n_head, dropout, bias) for _ in range(n_layer)),
                "ln_f": nn.LayerNorm(n_embd, bias=bias),
            }
        )
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        if tie_weights:
            wte.weight = self.lm_head.weight
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """Re-initialize all parameters with the GPT-2 scheme.

        Called by `__init__`; call it again after materializing a model built on the meta device, since
        `reset_parameters` of the torch layers would give their default (Kaiming) init instead.
        """
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
                if isinstance(module, nn.Linear) and module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.LayerNorm):
                module.reset_parameters()
        # GPT-2: residual-branch outputs scaled by 1/sqrt(2 * n_layer) so the residual stream's variance does not
        # grow with depth (two branches per block).
        for name, param in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * self.n_layers))

    def forward(self, idx: Tensor) -> Tensor:
        """Next-token logits.

        Args:
            idx: Token ids of shape (B, T) with T <= block_size.

        Returns:
            Logits of shape (B, T, vocab_size).
        """
        T = idx.shape[1]
        if T > self.seq_len:
            raise ValueError(f"sequence length {T} exceeds block_size={self.seq_len}; raise block_size or crop")
        tr = self.transformer
        pos = torch.arange(T, device=idx.device)
        x = tr["drop"](tr["wte"](idx) + tr["wpe"](pos))
        for block in cast(nn.ModuleList, tr["h"]):
            x = block(x)
        return self.lm_head(tr["ln_f"](x))

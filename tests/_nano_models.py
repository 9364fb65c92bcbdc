"""nanoGPT as users copy it (Karpathy's ``model.py``, written again here, the same structure and code shape): its
attention reads the width from its input (``B, T, C = x.size()``), splits the fused ``c_attn`` by ``n_embd`` and
views ``(B, T, C)``; the embedding and head are tied. Tensor parallelism cannot give such code its heads' slices
(`lightning_par.parallel.tensor.full_width` runs it on gathered outputs instead).
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from _families import _CausalLM
from torch import Tensor, nn


@dataclasses.dataclass
class NanoConfig:
    block_size: int = 32
    vocab_size: int = 256
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 32
    dropout: float = 0.0
    bias: bool = True


class CausalSelfAttention(nn.Module):
    def __init__(self, config: NanoConfig, flash: bool, qk_norm: bool = False) -> None:
        super().__init__()
        assert config.n_embd % config.n_head == 0
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.attn_dropout = nn.Dropout(config.dropout)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head, self.n_embd, self.dropout, self.flash = config.n_head, config.n_embd, config.dropout, flash
        size = config.block_size
        if not flash:  # the causal mask as a buffer, sliced to the input's length
            self.register_buffer("bias", torch.tril(torch.ones(size, size)).view(1, 1, size, size))
        # A per-head q/k norm (as in OLMo or Qwen3) on the same code: the case tp still refuses.
        head = config.n_embd // config.n_head
        self.q_norm = nn.LayerNorm(head) if qk_norm else nn.Identity()
        self.k_norm = nn.LayerNorm(head) if qk_norm else nn.Identity()

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = self.k_norm(k.view(B, T, self.n_head, C // self.n_head)).transpose(1, 2)
        q = self.q_norm(q.view(B, T, self.n_head, C // self.n_head)).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        if self.flash:
            drop = self.dropout if self.training else 0
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=drop, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
            att = self.attn_dropout(F.softmax(att, dim=-1))
            y = att @ v
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config: NanoConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, config: NanoConfig, flash: bool, qk_norm: bool) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config, flash, qk_norm)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(_CausalLM):
    """nanoGPT's ``GPT``: token and position embeddings, the blocks, a final LayerNorm, a head tied to the
    embedding. ``flash=False`` takes its manual attention with the causal-mask buffer."""

    def __init__(self, flash: bool = True, qk_norm: bool = False) -> None:
        super().__init__()
        config = NanoConfig()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([Block(config, flash, qk_norm) for _ in range(config.n_layer)]),
            ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
        ))  # fmt: skip
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying

    def forward(self, idx: Tensor) -> Tensor:  # type: ignore[override]
        t = idx.size(1)
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))

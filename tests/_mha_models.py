"""User models built on torch's own ``nn.MultiheadAttention`` (packed ``in_proj_weight``, called through
``F.multi_head_attention_forward``), for the tensor-parallel tests: a causal ``nn.TransformerEncoder`` in torch's
default sequence-first layout with a float mask and the ``is_causal`` hint, and user blocks that call the attention
directly with a boolean mask and use the head-averaged attention weights it returns."""

from __future__ import annotations

import torch
from _job_models import _TinyLM
from torch import Tensor, nn


class CausalEncoderLM(_TinyLM):
    """``nn.TransformerEncoder`` as a causal LM: sequence-first (``batch_first=False``), pre-norm, GELU."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(256, 32)
        layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, activation="gelu", norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(32, 256)

    def forward(self, x: Tensor) -> Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1], device=x.device)
        h = self.encoder(self.emb(x).transpose(0, 1), mask=mask, is_causal=True)
        return self.head(h.transpose(0, 1))


class _Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, 4, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.ReLU(), nn.Linear(2 * d, d))  # a region: sequence parallel

    def forward(self, x: Tensor, causal: Tensor | None = None) -> Tensor:
        h = self.ln1(x)
        if causal is None:  # sized from the block's input: under sequence parallelism, this rank's part of it
            n = x.shape[1]
            causal = torch.ones(n, n, dtype=torch.bool, device=x.device).triu(1)  # True: not allowed
        out, weights = self.attn(h, h, h, attn_mask=causal)  # need_weights defaults to True: averaged over heads
        x = x + out + weights[..., :1]  # how much each token attends to the first one, broadcast over the width
        return x + self.mlp(self.ln2(x))


class UserMHALM(_TinyLM):
    """A user's GPT whose blocks call ``nn.MultiheadAttention`` themselves, with a causal mask made once from the
    tokens (or, ``mask_in_block``, by each block from its input's length)."""

    def __init__(self, mask_in_block: bool = False) -> None:
        super().__init__()
        self.mask_in_block = mask_in_block
        self.emb = nn.Embedding(256, 32)
        self.blocks = nn.ModuleList(_Block(32) for _ in range(2))
        self.head = nn.Linear(32, 256)

    def forward(self, x: Tensor) -> Tensor:
        h, n = self.emb(x), x.shape[1]
        causal = None if self.mask_in_block else torch.ones(n, n, dtype=torch.bool, device=x.device).triu(1)
        for block in self.blocks:
            h = block(h, causal)
        return self.head(h)


class CrossDecoderLM(_TinyLM):
    """``nn.TransformerDecoder``: causal self-attention, then cross-attention to a memory every block reads (here the
    embeddings through a small encoder Linear), batch-first."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(256, 32)
        self.enc = nn.Linear(32, 32)
        layer = nn.TransformerDecoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
        self.decoder = nn.TransformerDecoder(layer, num_layers=2)
        self.head = nn.Linear(32, 256)

    def forward(self, x: Tensor) -> Tensor:
        h = self.emb(x)
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1], device=x.device)
        return self.head(self.decoder(h, torch.tanh(self.enc(h)), tgt_mask=mask, tgt_is_causal=True))

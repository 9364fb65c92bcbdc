"""User LightningModules around model families lightning_par did not write, for the tensor-parallel tests.

Plain user code: nothing here knows about the strategies. Every model is built from a tiny config (nothing is
downloaded). SGD + momentum: parameter updates are linear in the gradients, so parameters are compared to 1e-5.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn


class _LM(L.LightningModule):
    """Next-token loss over byte tokens; subclasses build ``self.model`` and return its logits from ``forward``."""

    def _loss(self, batch: Any) -> Tensor:
        x, y = batch
        return F.cross_entropy(self(x).flatten(0, 1).float(), y.flatten())

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), sync_dist=True)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.5, momentum=0.9)


class HFGPT2(_LM):
    """``GPT2LMHeadModel``: Conv1D projections (weight ``[in, out]``), a fused ``c_attn``, tied embedding/head."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=256, n_positions=64, resid_pdrop=0.0,
                            embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="eager")  # fmt: skip
        self.model = GPT2LMHeadModel(config)

    def forward(self, x: Tensor) -> Tensor:
        return self.model(input_ids=x).logits


class LitGPTLlama(_LM):
    """litgpt's ``GPT`` with a Llama-3.2 config: one fused grouped-query ``qkv`` (4 query, 2 key/value heads),
    head counts read from a config object all layers share."""

    def __init__(self) -> None:
        super().__init__()
        import litgpt

        config = litgpt.Config.from_name(
            "Llama-3.2-1B", n_layer=2, n_embd=32, n_head=4, n_query_groups=2, intermediate_size=64,
            padded_vocab_size=256, block_size=64, head_size=8,
        )  # fmt: skip
        self.model = litgpt.GPT(config)

    def forward(self, x: Tensor) -> Tensor:
        return self.model(x)


class HFBert(_LM):
    """``BertForMaskedLM`` trained on next-byte prediction (post-norm blocks, bidirectional attention)."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import BertConfig, BertForMaskedLM

        config = BertConfig(vocab_size=256, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                            intermediate_size=64, max_position_embeddings=64, hidden_dropout_prob=0.0,
                            attention_probs_dropout_prob=0.0)  # fmt: skip
        self.model = BertForMaskedLM(config)

    def forward(self, x: Tensor) -> Tensor:
        return self.model(input_ids=x).logits


class HFViT(L.LightningModule):
    """``ViTForImageClassification`` on 16x16 images made from the byte batches: 16 patches + a class token = 17
    tokens, which tp=2 does not divide."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import ViTConfig, ViTForImageClassification

        config = ViTConfig(image_size=16, patch_size=4, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                           intermediate_size=64, num_labels=10)  # fmt: skip
        self.model = ViTForImageClassification(config)
        self.example_input_array = torch.zeros(1, 3, 16, 16)  # Lightning's convention, for the model summary

    def forward(self, pixels: Tensor) -> Tensor:
        return self.model(pixel_values=pixels).logits

    def _loss(self, batch: Any) -> Tensor:
        x, y = batch  # (B, 32) bytes: 3 x 16 x 16 pixels from the tokens, a label from the last one
        pixels = (x.float() / 255.0).repeat(1, 24)[:, : 3 * 16 * 16].view(-1, 3, 16, 16)
        return F.cross_entropy(self(pixels), y[:, -1] % 10)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), sync_dist=True)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.5, momentum=0.9)


class NanoAttn(nn.Module):
    """nanoGPT's attention, sizing its split and view from the input width C = x.size(-1)."""

    def __init__(self, e: int = 32, n_head: int = 4) -> None:
        super().__init__()
        self.n_head = n_head
        self.c_attn, self.c_proj = nn.Linear(e, 3 * e), nn.Linear(e, e)

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, -1).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C))


class NanoBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln_1, self.attn, self.ln_2 = nn.LayerNorm(32), NanoAttn(), nn.LayerNorm(32)
        self.fc, self.proj = nn.Linear(32, 64), nn.Linear(64, 32)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.proj(F.gelu(self.fc(self.ln_2(x))))


class NanoLM(_LM):
    """A nanoGPT-style LM (its attention sizes a split by the input width): tp must refuse it before training."""

    def __init__(self) -> None:
        super().__init__()
        self.wte, self.head = nn.Embedding(256, 32), nn.Linear(32, 256)
        self.h = nn.ModuleList([NanoBlock() for _ in range(2)])

    def forward(self, idx: Tensor) -> Tensor:  # type: ignore[override]
        x = self.wte(idx)
        for block in self.h:
            x = block(x)
        return self.head(x)


class GroupedAttn(nn.Module):
    """Older litgpt's fused qkv, laid out group by group: per k/v head, its q heads, then its k, then its v."""

    def __init__(self, e: int = 32, n_head: int = 4, n_query_groups: int = 2) -> None:
        super().__init__()
        self.n_head, self.n_query_groups, self.head_size = n_head, n_query_groups, e // n_head
        self.attn = nn.Linear(e, (n_head + 2 * n_query_groups) * self.head_size)
        self.proj = nn.Linear(e, e)

    def forward(self, x: Tensor) -> Tensor:
        B, T, _ = x.size()
        per = self.n_head // self.n_query_groups
        qkv = self.attn(x).view(B, T, self.n_query_groups, per + 2, self.head_size)
        q, k, v = qkv.split((per, 1, 1), dim=-2)
        q = q.reshape(B, T, -1, self.head_size).transpose(1, 2)
        k, v = (t.expand(B, T, self.n_query_groups, per, self.head_size).reshape(B, T, -1, self.head_size)
                .transpose(1, 2) for t in (k, v))  # fmt: skip
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, -1))


class GroupedBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm_1, self.attn, self.norm_2 = nn.LayerNorm(32), GroupedAttn(), nn.LayerNorm(32)
        self.fc, self.proj = nn.Linear(32, 64), nn.Linear(64, 32)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.norm_1(x))
        return x + self.proj(F.gelu(self.fc(self.norm_2(x))))


class GroupedLM(_LM):
    """An LM whose grouped-query qkv is interleaved per k/v group (older litgpt, GPT-NeoX style)."""

    def __init__(self) -> None:
        super().__init__()
        self.wte, self.head = nn.Embedding(256, 32), nn.Linear(32, 256)
        self.h = nn.ModuleList([GroupedBlock() for _ in range(2)])

    def forward(self, idx: Tensor) -> Tensor:  # type: ignore[override]
        x = self.wte(idx)
        for block in self.h:
            x = block(x)
        return self.head(x)

"""LightningModules around model families lightning_par did not write, as a user would write them.

Plain user code: nothing here knows about the strategies. Each family is one self-contained class named after its
family (the tests register them in `_job_models.MODELS` with lazy imports); models are built from tiny configs, nothing
is downloaded. Every class trains with SGD + momentum, whose update is linear in the gradient, so parameters can be
compared to 1e-5 across layouts. Batches are the byte-text pairs ``(x, y)`` of `lightning_par.data`.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn


class _CausalLM(L.LightningModule):
    """Next-token loss over ``self(x)``'s logits; what every causal-LM family below shares."""

    lr = 0.1

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
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


class LitGPTPythia(_CausalLM):
    """litgpt's ``GPT`` with a Pythia config (parallel residual, LayerNorm, partial rotary). litgpt registers
    ``lm_head`` before ``transformer`` (embedding, blocks, final norm)."""

    def __init__(self) -> None:
        super().__init__()
        import litgpt

        config = litgpt.Config.from_name("pythia-14m", n_layer=4, n_embd=32, n_head=4, padded_vocab_size=256,
                                         block_size=64)  # fmt: skip
        self.model = litgpt.GPT(config)

    def forward(self, idx: Tensor) -> Tensor:
        return self.model(idx)


class XTransformersDecoder(_CausalLM):
    """x-transformers' ``TransformerWrapper`` around a ``Decoder`` (lucidrains' library): its layer lists hold
    ``None`` where an optional per-layer module is off, and each depth is an attention and a feed-forward entry."""

    def __init__(self) -> None:
        super().__init__()
        from x_transformers import Decoder, TransformerWrapper

        self.model = TransformerWrapper(num_tokens=256, max_seq_len=64,
                                        attn_layers=Decoder(dim=32, depth=2, heads=4))  # fmt: skip

    def forward(self, idx: Tensor) -> Tensor:
        return self.model(idx)


class LitGPTLlama(_CausalLM):
    """litgpt's ``GPT`` with a Llama 3.2 config (GQA, RMSNorm, SwiGLU, rotary)."""

    def __init__(self) -> None:
        super().__init__()
        import litgpt

        config = litgpt.Config.from_name(
            "Llama-3.2-1B",
            n_layer=4,
            n_embd=32,
            n_head=4,
            n_query_groups=2,
            intermediate_size=64,
            padded_vocab_size=256,
            block_size=64,
            head_size=8,
        )
        self.model = litgpt.GPT(config)

    def forward(self, idx: Tensor) -> Tensor:
        return self.model(idx)


class HFGPT2(_CausalLM):
    """Hugging Face ``GPT2LMHeadModel``: Conv1D projections, the head tied to the token embedding."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(vocab_size=256, n_positions=64, n_embd=32, n_layer=4, n_head=4, resid_pdrop=0.0,
                            embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="eager")  # fmt: skip
        self.model = GPT2LMHeadModel(config)

    def forward(self, idx: Tensor) -> Tensor:
        return self.model(input_ids=idx).logits


class HFQwen2Tied(_CausalLM):
    """Hugging Face ``Qwen2ForCausalLM`` with ``tie_word_embeddings=True`` (qkv biases, GQA)."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import Qwen2Config, Qwen2ForCausalLM

        config = Qwen2Config(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                             tie_word_embeddings=True, attn_implementation="eager")  # fmt: skip
        self.model = Qwen2ForCausalLM(config)

    def forward(self, idx: Tensor) -> Tensor:
        return self.model(input_ids=idx).logits


class HFBert(_CausalLM):
    """Hugging Face ``BertForMaskedLM``, an encoder (post-norm blocks, bidirectional attention), trained on
    next-byte prediction; its q/k/v and output projection live in sibling modules."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import BertConfig, BertForMaskedLM

        config = BertConfig(vocab_size=256, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
                            intermediate_size=64, max_position_embeddings=64, hidden_dropout_prob=0.0,
                            attention_probs_dropout_prob=0.0)  # fmt: skip
        self.model = BertForMaskedLM(config)

    def forward(self, idx: Tensor) -> Tensor:
        return self.model(input_ids=idx).logits


class HFAlbert(_CausalLM):
    """Hugging Face ``AlbertForMaskedLM``: one layer's weights shared by every depth (``num_hidden_layers`` calls of
    one ``AlbertLayer``), a factorised embedding (``embedding_size`` < ``hidden_size``)."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import AlbertConfig, AlbertForMaskedLM

        config = AlbertConfig(vocab_size=256, embedding_size=16, hidden_size=32, num_hidden_layers=4,
                              num_attention_heads=4, intermediate_size=64, max_position_embeddings=64,
                              hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                              classifier_dropout_prob=0.0)  # fmt: skip
        self.model = AlbertForMaskedLM(config)

    def forward(self, idx: Tensor) -> Tensor:
        return self.model(input_ids=idx).logits


class HFViT(L.LightningModule):
    """Hugging Face ``ViTForImageClassification``: each byte-text pair ``(x, y)`` read as a 1 x 8 x 8 image, the
    class the first byte's high nibble."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import ViTConfig, ViTForImageClassification

        config = ViTConfig(image_size=8, patch_size=2, num_channels=1, hidden_size=32, num_hidden_layers=4,
                           num_attention_heads=4, intermediate_size=64, num_labels=16, hidden_dropout_prob=0.0,
                           attention_probs_dropout_prob=0.0, attn_implementation="eager")  # fmt: skip
        self.model = ViTForImageClassification(config)
        self.example_input_array = torch.zeros(1, 1, 8, 8)

    def forward(self, pixels: Tensor) -> Tensor:
        return self.model(pixel_values=pixels).logits

    def _loss(self, batch: Any) -> Tensor:
        x, y = batch
        pixels = torch.cat([x, y], dim=1).float().div(255.0).view(-1, 1, 8, 8)
        return F.cross_entropy(self(pixels), x[:, 0] // 16)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), sync_dist=True)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class HFConvNext(HFViT):
    """Hugging Face ``ConvNextForImageClassification`` on the same 1 x 8 x 8 images: its blocks compute channels-last
    and return a permuted view (the first pipeline crash of the any-model issue)."""

    def __init__(self) -> None:
        L.LightningModule.__init__(self)
        from transformers import ConvNextConfig, ConvNextForImageClassification

        config = ConvNextConfig(num_channels=1, patch_size=2, num_stages=2, hidden_sizes=[16, 32], depths=[1, 4],
                                num_labels=16, drop_path_rate=0.0)  # fmt: skip
        self.model = ConvNextForImageClassification(config)
        self.example_input_array = torch.zeros(1, 1, 8, 8)


class HFSwin(HFViT):
    """Hugging Face ``SwinForImageClassification`` on 1 x 8 x 8 images: a hierarchical vision transformer whose
    stages merge patches, changing the sequence length and the width between blocks."""

    def __init__(self) -> None:
        L.LightningModule.__init__(self)
        from transformers import SwinConfig, SwinForImageClassification

        config = SwinConfig(image_size=8, patch_size=1, num_channels=1, embed_dim=16, depths=[2, 2], num_heads=[2, 4],
                            window_size=4, mlp_ratio=2.0, num_labels=16, drop_path_rate=0.0, hidden_dropout_prob=0.0,
                            attention_probs_dropout_prob=0.0)  # fmt: skip
        self.model = SwinForImageClassification(config)
        self.example_input_array = torch.zeros(1, 1, 8, 8)


# ---- user-style attention variants (code as users write it) ------------------------------------------


class HFPhi3(_CausalLM):
    """Hugging Face ``Phi3ForCausalLM``: one fused ``qkv_proj`` (GQA, sliced by width) and one fused ``gate_up_proj``
    (``chunk(2)`` into gate and up)."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import Phi3Config, Phi3ForCausalLM

        config = Phi3Config(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                            pad_token_id=0, eos_token_id=1, bos_token_id=1, attn_implementation="eager")  # fmt: skip
        self.model = Phi3ForCausalLM(config)

    def forward(self, idx: Tensor) -> Tensor:
        return self.model(input_ids=idx).logits


class HFT5(_CausalLM):
    """Hugging Face ``T5ForConditionalGeneration``: an encoder and a decoder stack; the decoder reads the encoder's
    output (cross-attention) and each stack's first block computes the relative position bias the others reuse.
    The task: the encoder reads the bytes, the decoder predicts each next byte from the ones before it."""

    def __init__(self, layers: int = 2) -> None:
        super().__init__()
        from transformers import T5Config, T5ForConditionalGeneration

        config = T5Config(vocab_size=256, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=layers,
                          num_heads=4, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0,
                          relative_attention_num_buckets=8)  # fmt: skip
        self.model = T5ForConditionalGeneration(config)

    def forward(self, idx: Tensor) -> Tensor:
        return self.model(input_ids=idx, decoder_input_ids=idx).logits


class HFBart(_CausalLM):
    """Hugging Face ``BartForConditionalGeneration``: an encoder and a decoder stack (learned positions, post-norm,
    a tied embedding); every decoder layer's cross-attention reads the encoder's output."""

    def __init__(self, layers: int = 2) -> None:
        super().__init__()
        from transformers import BartConfig, BartForConditionalGeneration

        config = BartConfig(vocab_size=256, d_model=32, encoder_layers=2, decoder_layers=layers,
                            encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                            decoder_ffn_dim=64, max_position_embeddings=64, dropout=0.0, attention_dropout=0.0,
                            activation_dropout=0.0, pad_token_id=1, bos_token_id=0, eos_token_id=2,
                            decoder_start_token_id=2, forced_eos_token_id=None)  # fmt: skip
        self.model = BartForConditionalGeneration(config)

    def forward(self, idx: Tensor) -> Tensor:
        return self.model(input_ids=idx, decoder_input_ids=idx).logits


class HFFalconMQA(_CausalLM):
    """Hugging Face ``FalconForCausalLM``, multi-query: one fused ``query_key_value`` of 4 query heads then one key and
    one value head, viewed as ``(B, T, n_heads + 2, head_dim)``; parallel attention and MLP."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import FalconConfig, FalconForCausalLM

        config = FalconConfig(vocab_size=256, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                              multi_query=True, new_decoder_architecture=False, parallel_attn=True, bias=False,
                              attn_implementation="eager", hidden_dropout=0.0, attention_dropout=0.0)  # fmt: skip
        self.model = FalconForCausalLM(config)

    def forward(self, idx: Tensor) -> Tensor:
        return self.model(input_ids=idx).logits


class HFLlamaMQA(_CausalLM):
    """Hugging Face ``LlamaForCausalLM`` with one key/value head for its 4 query heads (``num_key_value_groups``
    4: each rank's query heads read the one head, repeated)."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=64,
                             attn_implementation="eager")  # fmt: skip
        self.model = LlamaForCausalLM(config)

    def forward(self, idx: Tensor) -> Tensor:
        return self.model(input_ids=idx).logits


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


class _UserBlock(nn.Module):
    """Pre-norm attention and GELU MLP, each added to the residual stream, around a given attention."""

    def __init__(self, attn: type[nn.Module]) -> None:
        super().__init__()
        self.ln_1, self.attn, self.ln_2 = nn.LayerNorm(32), attn(), nn.LayerNorm(32)
        self.fc, self.proj = nn.Linear(32, 64), nn.Linear(64, 32)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.proj(F.gelu(self.fc(self.ln_2(x))))


class _BlocksLM(_CausalLM):
    """Embedding, two `_UserBlock`s around the given attention, head: the frame of the user-style models below."""

    def __init__(self, attn: type[nn.Module]) -> None:
        super().__init__()
        self.wte, self.head = nn.Embedding(256, 32), nn.Linear(32, 256)
        self.h = nn.ModuleList([_UserBlock(attn) for _ in range(2)])

    def forward(self, idx: Tensor) -> Tensor:  # type: ignore[override]
        x = self.wte(idx)
        for block in self.h:
            x = block(x)
        return self.head(x)


class NanoLM(_BlocksLM):
    """A nanoGPT-style LM (its attention sizes a split by the input width): tp must refuse it before training."""

    def __init__(self) -> None:
        super().__init__(NanoAttn)


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


class MQAAttn(nn.Module):
    """Multi-query attention as users write it: 4 query heads, one key/value head in its own projections."""

    def __init__(self, e: int = 32, n_head: int = 4) -> None:
        super().__init__()
        self.n_head, self.head_dim = n_head, e // n_head
        self.q, self.k, self.v = nn.Linear(e, e), nn.Linear(e, self.head_dim), nn.Linear(e, self.head_dim)
        self.proj = nn.Linear(e, e)

    def forward(self, x: Tensor) -> Tensor:
        B, T, _ = x.size()
        q = self.q(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        k, v = (p(x).view(B, T, 1, self.head_dim).transpose(1, 2) for p in (self.k, self.v))
        y = F.scaled_dot_product_attention(q, k.expand_as(q), v.expand_as(q), is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, self.n_head * self.head_dim))


class MQALM(_BlocksLM):
    """A user LM with multi-query attention (`MQAAttn`): fewer key/value heads than tp ranks."""

    def __init__(self) -> None:
        super().__init__(MQAAttn)


class GroupedLM(_BlocksLM):
    """An LM whose grouped-query qkv is interleaved per k/v group (older litgpt, GPT-NeoX style)."""

    def __init__(self) -> None:
        super().__init__(GroupedAttn)


class _GluBlock(nn.Module):
    """Pre-norm block whose MLP is one fused ``[gate | up]`` Linear, chunked in two: SiLU(gate) * up."""

    def __init__(self) -> None:
        super().__init__()
        self.ln_1, self.attn, self.ln_2 = nn.LayerNorm(32), GroupedAttn(), nn.LayerNorm(32)
        self.gate_up, self.down = nn.Linear(32, 128), nn.Linear(64, 32)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        gate, up = self.gate_up(self.ln_2(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class GluLM(_CausalLM):
    """A user LM with fused GLU MLPs (`_GluBlock`)."""

    def __init__(self) -> None:
        super().__init__()
        self.wte, self.head = nn.Embedding(256, 32), nn.Linear(32, 256)
        self.h = nn.ModuleList([_GluBlock() for _ in range(2)])

    def forward(self, idx: Tensor) -> Tensor:
        x = self.wte(idx)
        for block in self.h:
            x = block(x)
        return self.head(x)


class _Merge(nn.Module):
    """A residual MLP, then each two neighbouring tokens merged into one token of width ``out`` (patch merging)."""

    def __init__(self, width: int, out: int) -> None:
        super().__init__()
        self.norm, self.fc, self.proj = nn.LayerNorm(width), nn.Linear(width, 2 * width), nn.Linear(2 * width, width)
        self.merge = nn.Linear(2 * width, out)

    def forward(self, x: Tensor, length: int) -> tuple[Tensor, int]:
        x = x + self.proj(F.gelu(self.fc(self.norm(x))))
        return self.merge(x.reshape(x.shape[0], length // 2, -1)), length // 2


class PyramidLM(_CausalLM):
    """A hierarchical model as users write one: four `_Merge` blocks halve the sequence and widen the tokens
    (8 -> 16 -> 16 -> 32 -> 32), each returning the new length, which the loop hands to the next block."""

    def __init__(self, example: bool = True) -> None:
        super().__init__()
        self.wte, self.head = nn.Embedding(256, 8), nn.Linear(32, 256)
        self.blocks = nn.ModuleList([_Merge(a, b) for a, b in ((8, 16), (16, 16), (16, 32), (32, 32))])
        if example:  # 16 tokens or more: 4 merges (the pipeline's default probe of 8 tokens fails at the last)
            self.example_input_array = torch.zeros(1, 32, dtype=torch.long)

    def forward(self, idx: Tensor) -> Tensor:
        x, length = self.wte(idx), idx.shape[1]
        for block in self.blocks:
            x, length = block(x, length)
        return self.head(x)

    def _loss(self, batch: Any) -> Tensor:
        x, y = batch
        logits = self(x)  # one token per 16 inputs: predict the byte after each group's last
        return F.cross_entropy(logits.flatten(0, 1), y[:, 15::16].flatten())

"""LightningModules around mixture-of-experts models lightning_par did not write: Hugging Face transformers 5
families built from tiny configs (no download), and one user-style MoE whose experts are an ``nn.ModuleList``.

Plain user code: nothing here knows about the strategies. Each Hugging Face model is built with
``output_router_logits=True``, so its own loss includes its router's load-balancing term (``outputs.loss`` is
cross-entropy plus ``router_aux_loss_coef * aux_loss``), as a user fine-tuning it would train. SGD + momentum:
updates linear in the gradients, so parameters can be compared tightly against one process.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn

_TINY = dict(vocab_size=256, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=64, attn_implementation="eager", output_router_logits=True,
             router_aux_loss_coef=0.1)  # fmt: skip


class _HFMoELM(L.LightningModule):
    """``<Family>ForCausalLM(config)`` on byte tokens; the loss is the model's own (with its aux term)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, idx: Tensor) -> Any:
        # Hugging Face shifts the labels itself: labels = the input predicts each next byte.
        return self.model(input_ids=idx, labels=idx)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        out = self(batch[0])
        # output_router_logits: the router's loss is part of out.loss
        assert (out.aux_loss is not None) == self.model.config.output_router_logits
        self.log("train_loss", out.loss, sync_dist=True)
        return out.loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        out = self(batch[0])
        self.log("val_loss", out.loss, sync_dist=True)
        if out.aux_loss is not None:  # apart too: a wrong aux term hides in the total at 1e-6
            self.log("val_aux", out.aux_loss, sync_dist=True)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.5, momentum=0.9)


class HFQwen2MoE(_HFMoELM):
    """Qwen2-MoE: a shared expert with a sigmoid gate next to the routed experts."""

    def __init__(self, layers: int = 2, router_logits: bool = True) -> None:
        from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

        tiny = {**_TINY, "num_hidden_layers": layers, "output_router_logits": router_logits}
        config = Qwen2MoeConfig(**tiny, intermediate_size=48, moe_intermediate_size=24, num_experts=4,
                                num_experts_per_tok=2, shared_expert_intermediate_size=40)  # fmt: skip
        super().__init__(Qwen2MoeForCausalLM(config))


class HFQwen3MoE(_HFMoELM):
    """Qwen3-MoE: routed experts only, normalised top-k weights."""

    def __init__(self, layers: int = 2) -> None:
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

        tiny = {**_TINY, "num_hidden_layers": layers}
        config = Qwen3MoeConfig(**tiny, intermediate_size=48, moe_intermediate_size=24, num_experts=4,
                                num_experts_per_tok=2, head_dim=8)  # fmt: skip
        super().__init__(Qwen3MoeForCausalLM(config))


class HFMixtralAux(_HFMoELM):
    """Mixtral with its load-balancing loss in ``outputs.loss`` (``output_router_logits=True``)."""

    def __init__(self, layers: int = 2) -> None:
        from transformers import MixtralConfig, MixtralForCausalLM

        config = MixtralConfig(**{**_TINY, "num_hidden_layers": layers}, intermediate_size=48, num_local_experts=4,
                               num_experts_per_tok=2)  # fmt: skip
        super().__init__(MixtralForCausalLM(config))


class HFOlmoe(_HFMoELM):
    """OLMoE: routed experts, q/k norms."""

    def __init__(self, layers: int = 2) -> None:
        from transformers import OlmoeConfig, OlmoeForCausalLM

        config = OlmoeConfig(**{**_TINY, "num_hidden_layers": layers}, intermediate_size=24, num_experts=4,
                             num_experts_per_tok=2)  # fmt: skip
        super().__init__(OlmoeForCausalLM(config))


class HFDeepseekV3(_HFMoELM):
    """DeepSeek-V3: layer 0 dense, layer 1 MoE with a shared expert and grouped top-k routing (2 groups of 2
    experts, 1 group kept per token) on sigmoid scores plus ``e_score_correction_bias``. Its causal-LM loss has no
    aux term (auxiliary-loss-free balancing)."""

    def __init__(self, layers: int = 2, q_lora_rank: int | None = None) -> None:
        from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

        # Multi-head latent attention: as many key/value heads as query heads.
        tiny = {**_TINY, "output_router_logits": False, "num_key_value_heads": 4, "num_hidden_layers": layers}
        config = DeepseekV3Config(**tiny, intermediate_size=48, moe_intermediate_size=24, n_routed_experts=4,
                                  num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1,
                                  n_shared_experts=1, q_lora_rank=q_lora_rank, kv_lora_rank=16, qk_rope_head_dim=8,
                                  qk_nope_head_dim=8, v_head_dim=8, rope_scaling=None)  # fmt: skip
        model = DeepseekV3ForCausalLM(config)
        with torch.no_grad():  # a non-zero correction bias, so choosing (biased) and weighting (unbiased) differ
            for layer in model.model.layers[1:]:
                layer.mlp.gate.e_score_correction_bias.copy_(torch.tensor([0.05, -0.05, 0.02, 0.0]))
        super().__init__(model)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss = self(batch[0]).loss
        self.log("train_loss", loss, sync_dist=True)
        return loss


class HFGptOss(_HFMoELM):
    """GPT-OSS: router with a bias, softmax over the top-k logits, experts with biases and an interleaved, clamped
    gate_up projection."""

    def __init__(self, **overrides: Any) -> None:
        from transformers import GptOssConfig, GptOssForCausalLM

        config = GptOssConfig(**_TINY, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2, head_dim=8,
                              layer_types=["full_attention", "full_attention"], **overrides)  # fmt: skip
        model = GptOssForCausalLM(config)
        with torch.no_grad():  # the biases start at zero (empty on init): make them count
            for name, p in model.named_parameters():
                if name.endswith("bias") and "mlp" in name:
                    p.normal_(0.0, 0.02)
        super().__init__(model)


class HFLlama4(_HFMoELM):
    """Llama-4 (text): a sigmoid router whose top-1 scores weight the input of a dense routed layout (every token
    repeated to every expert, ``[E*T, d]``, scaled by its score: zero where not chosen), stacked experts that take
    only that input, and a shared expert."""

    def __init__(self) -> None:
        from transformers import Llama4ForCausalLM, Llama4TextConfig

        tiny = {**_TINY, "output_router_logits": False}
        config = Llama4TextConfig(**tiny, intermediate_size=24, intermediate_size_mlp=48, num_local_experts=4,
                                  num_experts_per_tok=1, head_dim=8, interleave_moe_layer_step=1,
                                  use_qk_norm=False, no_rope_layers=[1, 1], attention_chunk_size=64)  # fmt: skip
        super().__init__(Llama4ForCausalLM(config))


class _ExpertMLP(nn.Module):
    def __init__(self, d: int, f: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(d, f), nn.Linear(f, d)

    def forward(self, x: Tensor) -> Tensor:
        return self.down(F.gelu(self.up(x)))


class _UserMoE(nn.Module):
    """Top-k softmax router over an ``nn.ModuleList`` of MLP experts, written as a user would (skipping idle
    experts)."""

    def __init__(self, d: int, f: int, n_experts: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.router = nn.Linear(d, n_experts, bias=False)
        self.experts = nn.ModuleList(_ExpertMLP(d, f) for _ in range(n_experts))

    def forward(self, x: Tensor) -> Tensor:
        flat = x.reshape(-1, x.shape[-1])
        probs = self.router(flat).softmax(-1)
        weights, chosen = probs.topk(self.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            token, slot = torch.where(chosen == e)
            if token.numel() == 0:
                continue
            out.index_add_(0, token, (expert(flat[token]) * weights[token, slot, None]).to(out.dtype))
        return out.view_as(x)


class _UserBlock(nn.Module):
    def __init__(self, d: int, uneven: bool = False) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, 4, batch_first=True)
        self.moe = _UserMoE(d, 48, n_experts=4, top_k=2)
        if uneven:  # experts of two widths: not "E experts of one shape"
            self.moe.experts[0] = _ExpertMLP(d, 64)

    def forward(self, x: Tensor) -> Tensor:
        h = self.norm1(x)
        mask = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool, device=x.device).triu(1)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.moe(self.norm2(x))


class UserMoEList(L.LightningModule):
    """A small causal LM with the user's own MoE blocks (experts in an ``nn.ModuleList``)."""

    def __init__(self, uneven: bool = False, layers: int = 2) -> None:
        super().__init__()
        self.emb = nn.Embedding(256, 32)
        self.blocks = nn.ModuleList(_UserBlock(32, uneven) for _ in range(layers))
        self.head = nn.Linear(32, 256)

    def forward(self, idx: Tensor) -> Tensor:
        h = self.emb(idx)
        for block in self.blocks:
            h = block(h)
        return self.head(h)

    def _loss(self, x: Tensor, y: Tensor) -> Tensor:
        return F.cross_entropy(self(x).flatten(0, 1), y.flatten())

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss = self._loss(*batch)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self._loss(*batch), sync_dist=True)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.5, momentum=0.9)


class HFMixtralSdpaAux(_HFMoELM):
    """Mixtral on its SDPA attention path (context parallelism needs SDPA), with its load-balancing term in the
    loss (``output_router_logits=True``): the cp x ep tests' Hugging Face model."""

    def __init__(self, layers: int = 2) -> None:
        from transformers import MixtralConfig, MixtralForCausalLM

        tiny = {**_TINY, "attn_implementation": "sdpa", "num_hidden_layers": layers}
        config = MixtralConfig(**tiny, intermediate_size=48, num_local_experts=4, num_experts_per_tok=2)
        super().__init__(MixtralForCausalLM(config))


class HFDbrx(_HFMoELM):
    """DBRX: experts stored flat (``experts.mlp.w1`` / ``v1`` / ``w2`` ``[E * f, d]``, viewed per expert in its
    forward), a router module around its Linear, experts called with ``[B, T, d]`` hidden states, fused ``Wqkv`` with
    clipping, aux loss. Its config nests attention and FFN settings, which the zoo's shrinking rule does not reach."""

    def __init__(self, layers: int = 2, aux: bool = False) -> None:
        from transformers import DbrxConfig, DbrxForCausalLM

        config = DbrxConfig(
            d_model=32, n_heads=4, n_layers=layers, max_seq_len=64, vocab_size=256, output_router_logits=aux,
            router_aux_loss_coef=0.1, attn_config={"kv_n_heads": 2, "clip_qkv": 8.0, "rope_theta": 10000.0},
            ffn_config={"ffn_hidden_size": 48, "moe_num_experts": 4, "moe_top_k": 2},
        )  # fmt: skip  (clip_qkv=None fails inside transformers 5.25's DbrxAttention)
        config._attn_implementation = "eager"
        super().__init__(DbrxForCausalLM(config))

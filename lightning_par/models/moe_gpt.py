"""GPT with mixture-of-experts feed-forward layers (Switch / GShard style): the GPT of `gpt.py` with each block's
MLP replaced by `lightning_par.nn.MoE`.

Plain single-device Lightning code; the ``moe`` strategies shard its experts without changes to it. The only
MoE-specific training code is adding the layers' auxiliary losses to the loss and logging routing statistics.
"""

from typing import Any, Optional, cast

import torch
from torch import Tensor, nn

from lightning_par.nn import MoE, moe_loss

from ._lm import Batch
from .gpt import GPT, CausalSelfAttention


class MoEBlock(nn.Module):
    """Pre-norm transformer block whose feed-forward is a mixture of experts.

    Args:
        n_embd: Model width.
        n_head: Number of attention heads.
        moe: The MoE feed-forward layer.
        dropout: Dropout probability.
        bias: Whether linear and LayerNorm layers carry a bias.
    """

    def __init__(self, n_embd: int, n_head: int, moe: MoE, dropout: float, bias: bool) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd, bias=bias)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout, bias)
        self.ln_2 = nn.LayerNorm(n_embd, bias=bias)
        self.moe = moe

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.moe(self.ln_2(x))


class MoEGPT(GPT):
    """GPT-2-style causal language model with an MoE feed-forward layer in every block.

    Args:
        vocab_size, block_size, n_layer, n_head, n_embd, dropout, bias, lr, weight_decay, warmup_steps, max_steps,
            betas: as `GPT`.
        n_experts: Experts per MoE layer.
        top_k: Experts per token.
        capacity_factor: Expert capacity factor (tokens beyond capacity are dropped); ``None`` is dropless.
        expert_hidden: Hidden width of each expert (default ``4 * n_embd``, the dense GPT's MLP width).
        aux_loss_coef: Weight of the load-balancing loss.
        z_loss_coef: Weight of the router z-loss.
        router_jitter: Multiplicative router-input noise in training.
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
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        warmup_steps: int = 0,
        max_steps: int = 0,
        betas: tuple[float, float] = (0.9, 0.95),
        n_experts: int = 4,
        top_k: int = 2,
        capacity_factor: Optional[float] = None,
        expert_hidden: Optional[int] = None,
        aux_loss_coef: float = 0.01,
        z_loss_coef: float = 0.001,
        router_jitter: float = 0.0,
    ) -> None:
        super().__init__(vocab_size, block_size, n_layer, n_head, n_embd, dropout, bias, False, lr, weight_decay,
                         warmup_steps, max_steps, betas)  # fmt: skip
        self.save_hyperparameters()
        hidden = expert_hidden or 4 * n_embd

        def moe() -> MoE:
            return MoE(n_embd, hidden, n_experts, top_k, capacity_factor, aux_loss_coef=aux_loss_coef,
                       z_loss_coef=z_loss_coef, router_jitter=router_jitter)  # fmt: skip

        blocks = [MoEBlock(n_embd, n_head, moe(), dropout, bias) for _ in range(n_layer)]
        self.transformer["h"] = nn.ModuleList(blocks)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """GPT-2 init for the dense layers; experts like the dense MLP (std 0.02, output scaled by depth)."""
        super().init_weights()
        for name, p in self.named_parameters():
            if name.endswith("experts.w1"):
                nn.init.normal_(p, mean=0.0, std=0.02)
            elif name.endswith("experts.w2"):
                nn.init.normal_(p, mean=0.0, std=0.02 / (2 * self.n_layers) ** 0.5)

    def _moe_layers(self) -> list[MoE]:
        return [cast(MoEBlock, b).moe for b in cast(nn.ModuleList, self.transformer["h"])]

    def training_step(self, batch: Batch, batch_idx: int) -> Tensor:
        x, y = batch
        ce = self._loss(self(x), y)
        aux = moe_loss(self).to(ce.device)
        loss = ce + aux
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        self.log("train_ce", ce, sync_dist=True)
        self.log("moe/aux_loss", aux.detach(), sync_dist=True)
        self._log_routing()
        return loss

    def _log_routing(self) -> None:
        # Counts are already summed over every data-parallel rank by the layer, so no sync is needed; logged as
        # tensors, not floats, so that no step waits to copy them to the host (the logger reads them when it writes).
        dropped = []
        for i, moe in enumerate(self._moe_layers()):
            counts = moe.stats["tokens_per_expert"]
            for e in range(len(counts)):
                self.log(f"moe/layer{i}/tokens_expert{e}", counts[e])
            dropped.append(moe.stats["dropped_fraction"])
        self.log("moe/dropped_fraction", torch.stack(dropped).mean())

    def routing_stats(self) -> dict[str, Any]:
        """The last forward's per-layer routing statistics (tokens per expert, fraction dropped)."""
        return {f"layer{i}": dict(moe.stats) for i, moe in enumerate(self._moe_layers())}

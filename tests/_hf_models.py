"""A LightningModule wrapping a Hugging Face Llama built from a config: a model lightning_par did not write.

Plain user code: nothing here knows about the strategies. No weights are downloaded (the model is initialised
from the config), so this runs offline.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor


def _llama(layers: int, attn: str = "eager") -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, attn_implementation=attn,
    )  # fmt: skip
    return LlamaForCausalLM(config)


class HFLlama(L.LightningModule):
    """``LlamaForCausalLM`` (GQA: 4 query heads, 2 key/value heads; SwiGLU; RMSNorm; rotary) on byte tokens."""

    def __init__(self, lr: float = 3e-3, layers: int = 2, attn: str = "eager") -> None:
        super().__init__()
        self.model = _llama(layers, attn)
        self.lr = lr

    def forward(self, idx: Tensor) -> Tensor:
        return self.model(input_ids=idx).logits

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x).flatten(0, 1).float(), y.flatten())
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x).flatten(0, 1).float(), y.flatten()), sync_dist=True)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


class HFQwen3(HFLlama):
    """``Qwen3ForCausalLM``: a per-head RMSNorm on each query and key head (``q_norm`` / ``k_norm`` over head_dim),
    GQA (4 query heads, 2 key/value heads), untied; SGD + momentum, so parameters compare at 1e-5."""

    def __init__(self, layers: int = 2) -> None:
        from transformers import Qwen3Config, Qwen3ForCausalLM

        L.LightningModule.__init__(self)
        config = Qwen3Config(
            vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=64, attn_implementation="eager",
            tie_word_embeddings=False,
        )  # fmt: skip
        self.model = Qwen3ForCausalLM(config)
        with torch.no_grad():  # the norms' weights start at one: make each head's entries count differently
            for name, p in self.model.named_parameters():
                if name.endswith(("q_norm.weight", "k_norm.weight")):
                    p.uniform_(0.5, 1.5)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.5, momentum=0.9)


class HFLlamaDeferred(HFLlama):
    """`HFLlama` built in ``configure_model()``, Lightning's hook for models too large for one device (lightning_par
    builds it on the meta device there), trained with SGD + momentum (parameters compared at 1e-5)."""

    def __init__(self) -> None:
        L.LightningModule.__init__(self)
        self.lr = 0.5

    def configure_model(self) -> None:
        if hasattr(self, "model"):  # Lightning calls the hook again for each fit / validate
            return
        self.model = _llama(2)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


class HFLlamaConfigured(HFLlama):
    """`HFLlama` whose Hugging Face model is built in ``configure_model()`` (Lightning's hook for large models), not
    in ``__init__``: the strategy's context decides where its tensors go."""

    def __init__(self, lr: float = 3e-3, layers: int = 2) -> None:
        L.LightningModule.__init__(self)
        self.lr, self.layers = lr, layers
        self.model: Any = None

    def configure_model(self) -> None:
        if self.model is not None:  # Lightning calls the hook again for validate / test after fit
            return
        self.model = _llama(self.layers)

"""Low-rank adapters (LoRA, Hu et al., arXiv 2106.09685) as users add them, for the tp tests: a user's own wrapper
(a frozen ``nn.Linear`` plus two small trainable ones) and peft's ``get_peft_model`` on Hugging Face Llama. B is
initialised random, not zero, so that the adapters' gradients reach both of them from the first step."""

from __future__ import annotations

from typing import Any

import torch
from _families_moe import HFMixtralAux
from _hf_models import HFLlama
from _tp_mixed_models import AlternatingLM
from torch import Tensor, nn


class LoRA(nn.Module):
    """``base(x) + b(a(x)) * alpha / r`` with ``base`` frozen."""

    def __init__(self, base: nn.Linear, r: int = 4, alpha: float = 8.0) -> None:
        super().__init__()
        self.base, self.scale = base.requires_grad_(False), alpha / r
        self.a, self.b = nn.Linear(base.in_features, r, bias=False), nn.Linear(r, base.out_features, bias=False)
        nn.init.normal_(self.b.weight, std=0.1)

    def forward(self, x: Tensor) -> Tensor:
        return self.base(x) + self.b(self.a(x)) * self.scale


def add_lora(model: nn.Module, targets: tuple[str, ...]) -> nn.Module:
    """Wrap every Linear named one of ``targets`` in `LoRA`; everything else is frozen but the adapters."""
    model.requires_grad_(False)
    for mod in list(model.modules()):
        for name, child in list(mod.named_children()):
            if isinstance(child, nn.Linear) and name in targets:
                setattr(mod, name, LoRA(child))
    return model


class UserLoRALM(AlternatingLM):
    """`AlternatingLM` (attention and feed-forward layers) with LoRA on q, k, v, out, up and down."""

    def __init__(self) -> None:
        super().__init__()
        add_lora(self, ("q", "k", "v", "out", "up", "down"))


def peft_lora(model: nn.Module, targets: list[str], dora: bool = False) -> Any:
    """``peft.get_peft_model`` with LoRA r 4 (B random: ``init_lora_weights=False``) on the Linears ``targets``."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False, use_dora=dora,
                        target_modules=targets)  # fmt: skip
    return get_peft_model(model, config)


class _TokenDrop(nn.Module):
    """A dropout of fixed tokens (every third position zeroed, the rest scaled by 3 / 2): not ``nn.Identity``, so peft's
    DoRA recomputes the base on its output, as under real dropout, while every layout draws the same mask (a real
    dropout's mask depends on each rank's random state)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor, Replicate

        keep = (torch.arange(x.shape[-2], device=x.device) % 3 != 1).to(x.dtype)[:, None] * 1.5
        if isinstance(x, DTensor):  # under tp, a region's input arrives replicated (as nn.Dropout's would)
            keep = DTensor.from_local(keep, x.device_mesh, [Replicate()], run_check=False)
        return x * keep


class PeftLlama(HFLlama):
    """Hugging Face Llama wrapped by ``peft.get_peft_model``: LoRA (r 4) on every attention and MLP projection, or on
    ``targets``; ``attn="sdpa"`` for context parallelism; ``drop``: a fixed-token dropout on the adapters' input
    (`_TokenDrop`)."""

    def __init__(self, dora: bool = False, attn: str = "eager", drop: bool = False,
                 targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                             "down_proj")) -> None:  # fmt: skip
        super().__init__(attn=attn)
        targets = list(targets)
        self.model: Any = peft_lora(self.model, targets, dora)
        for m in self.model.modules() if drop else ():
            if isinstance(getattr(m, "lora_dropout", None), nn.ModuleDict):
                m.lora_dropout["default"] = _TokenDrop()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.1, momentum=0.9)


class QLoRALlama(HFLlama):
    """QLoRA (Dettmers et al., arXiv 2305.14314) as torchtune builds it: Hugging Face Llama (width 256, 4 heads with
    their own key/value heads, MLP 512) with each projection's weight stored in 4-bit NF4 (torchao's ``NF4Tensor``,
    frozen) and peft's LoRA (r 4, B random) on every projection, trained in fp32 with SGD. The widths make every
    projection an even number of torchao's double-quantised groups (64 values a scale, 256 scales a group: 16,384
    values), which its FSDP2 split over 2 ranks needs."""

    def __init__(self) -> None:
        super().__init__()
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
                             attn_implementation="eager")  # fmt: skip
        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        self.model: Any = peft_lora(LlamaForCausalLM(config), targets)
        for m in self.model.modules():
            base = getattr(m, "base_layer", None)
            if isinstance(base, nn.Linear):
                base.weight = nn.Parameter(to_nf4(base.weight.detach()), requires_grad=False)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.1, momentum=0.9)


def peft_phi3(dora: bool = False) -> Any:
    """Hugging Face Phi-3 (fused ``qkv_proj`` and ``gate_up_proj``) with peft's LoRA (or DoRA) on every projection."""
    from _families import HFPhi3

    model = HFPhi3()
    model.model = peft_lora(model.model, ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"], dora=dora)
    return model


class PeftMixtralExperts(HFMixtralAux):
    """Hugging Face Mixtral with peft's LoRA on its stacked expert weights (``target_parameters``: one low-rank pair
    per stacked tensor, ``r`` rows of ``lora_A`` and columns of ``lora_B`` per expert) and on the attention."""

    def __init__(self) -> None:
        super().__init__()
        from peft import LoraConfig, get_peft_model

        config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False,
                            target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                            target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])  # fmt: skip
        self.model = get_peft_model(self.model, config)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.5, momentum=0.9)


class PeftMixtral(HFMixtralAux):
    """Hugging Face Mixtral (stacked experts, its load-balancing loss) with peft's LoRA on the attention: the
    experts and router stay frozen, sharded over the expert-parallel ranks as ever."""

    def __init__(self) -> None:
        super().__init__()
        self.model = peft_lora(self.model, ["q_proj", "k_proj", "v_proj", "o_proj"])

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.5, momentum=0.9)


class PeftLlamaMeta(PeftLlama):
    """`PeftLlama` built in ``configure_model()`` (on the meta device under lightning_par's strategies), LoRA
    initialised as peft does (``init_lora_weights=True``: B zero), so the adapted model starts as its base."""

    def __init__(self) -> None:
        HFLlama.__init__(self)
        self.model = None  # built in configure_model

    def configure_model(self) -> None:
        if self.model is not None:
            return
        from _hf_models import _llama
        from peft import LoraConfig, get_peft_model

        config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "down_proj"])
        self.model = get_peft_model(_llama(2), config)


class HFLlamaSGD(HFLlama):
    """`HFLlama` with the adapted models' SGD (lr 0.1, momentum 0.9), for comparing their first steps."""

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

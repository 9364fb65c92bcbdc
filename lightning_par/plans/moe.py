"""Find the mixture-of-experts layers of a model, of the kinds expert parallelism knows how to shard.

Recognised kinds:
- ``lightning_par``: `lightning_par.nn.MoE` (stacked expert weights in ``.experts``).
- ``hf_mixtral``: Hugging Face ``MixtralSparseMoeBlock`` (``.gate`` router, ``.experts`` a ``MixtralExperts`` with
  stacked ``gate_up_proj`` / ``down_proj``), recognised by structure so transformers need not be imported here.

A kind is described by where its stacked expert weights live and how its token group is set, so adding an
adapter for another implementation is one entry here.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch.distributed as dist
from torch import nn

from lightning_par.nn.moe import MoE


@dataclasses.dataclass(frozen=True)
class MoELayer:
    """One MoE layer found in a model.

    Args:
        name: qualified module name.
        kind: which implementation (``"lightning_par"`` or ``"hf_mixtral"``).
        module: the MoE module.
        experts: the module whose parameters are the experts stacked along dim 0, and whose call takes rows
            grouped by expert and the per-expert counts (the call expert parallelism intercepts).
        n_experts: number of experts.
        top_k: experts per token.
    """

    name: str
    kind: str
    module: nn.Module
    experts: nn.Module
    n_experts: int
    top_k: int

    def set_token_group(self, group: Optional[dist.ProcessGroup]) -> None:
        """Make capacity and the balancing statistics span ``group``'s tokens."""
        if isinstance(self.module, MoE):
            self.module.token_group = group


def find_moe_layers(model: nn.Module) -> list[MoELayer]:
    """Every recognised MoE layer of ``model``, in module order.

    Args:
        model: any module; it is only inspected.
    """
    found = []
    for name, m in model.named_modules():
        if isinstance(m, MoE):
            found.append(MoELayer(name, "lightning_par", m, m.experts, m.n_experts, m.top_k))
        elif _is_mixtral_block(m):
            experts = m.get_submodule("experts")
            found.append(MoELayer(name, "hf_mixtral", m, experts, int(experts.num_experts), int(m.top_k)))  # type: ignore[arg-type]
    return found


def _is_mixtral_block(m: nn.Module) -> bool:
    experts = getattr(m, "experts", None)
    return (
        type(m).__name__ == "MixtralSparseMoeBlock"
        and isinstance(experts, nn.Module)
        and hasattr(m, "gate")
        and all(getattr(getattr(experts, w, None), "dim", lambda: 0)() == 3 for w in ("gate_up_proj", "down_proj"))
    )

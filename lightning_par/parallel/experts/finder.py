"""Find the mixture-of-experts layers of a model, of the kinds expert parallelism knows how to shard.

Recognised kinds:
- ``lightning_par``: `lightning_par.nn.MoE` (stacked expert weights in ``.experts``).
- ``stacked``: a block with a router ``[E, d]`` and an experts module of stacked ``[E, ...]`` weights called as
  ``experts(hidden [N, d], top_k_index [N, k], top_k_weights [N, k])`` (Hugging Face transformers 5 MoE families).
- ``module_list``: a block with a router ``[E, d]`` and an ``nn.ModuleList`` of ``E`` identical MLP experts.

The last two are recognised by structure (`experts.structure`), never by class name, so transformers need not be
imported here. `unrecognised_experts` lists what looks like experts but matches neither, for the refusal that
expert parallelism gives before training.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch.distributed as dist
from torch import nn

from lightning_par.nn.moe import MoE
from lightning_par.parallel.experts.structure import EXPECTED, describe, match_block


@dataclasses.dataclass(frozen=True)
class MoELayer:
    """One MoE layer found in a model.

    Args:
        name: qualified module name.
        kind: which implementation (``"lightning_par"``, ``"stacked"`` or ``"module_list"``).
        module: the MoE module.
        experts: the experts container (stacked weights along dim 0, or the ``nn.ModuleList``).
        n_experts: number of experts.
        top_k: experts per token (``0`` where the block states none).
        router: the router module (``None``: our MoE, or a router parameter of the block itself).
    """

    name: str
    kind: str
    module: nn.Module
    experts: nn.Module
    n_experts: int
    top_k: int
    router: Optional[nn.Module] = None

    def set_token_group(self, group: Optional[dist.ProcessGroup], cp_group: Optional[dist.ProcessGroup] = None) -> None:
        """Make capacity and the balancing statistics span ``group``'s tokens (our layer; the others get their
        router statistics gathered by `lightning_par.parallel.experts.router_stats`); ``cp_group``: the ranks holding
        chunks of the same samples, over which our layer's per-sample means are taken."""
        if isinstance(self.module, MoE):
            self.module.token_group = group
            self.module.sample_group = cp_group


def find_moe_layers(model: nn.Module) -> list[MoELayer]:
    """Every recognised MoE layer of ``model``, in module order (a layer's own submodules are not searched).

    Args:
        model: any module; it is only inspected.
    """
    found: list[MoELayer] = []
    for name, m in model.named_modules():
        if any(_within(name, x.name) for x in found):
            continue
        if isinstance(m, MoE):
            if next(m.parameters(), None) is None:  # a pipeline's meta copy of another stage's layer: none here
                continue
            found.append(MoELayer(name, "lightning_par", m, m.experts, m.n_experts, m.top_k))
            continue
        s = match_block(m)
        if s is not None:
            router = m.get_submodule(s.router) if s.router else None
            experts = m.get_submodule(s.experts)
            found.append(MoELayer(name, s.layout, m, experts, s.n_experts, s.top_k, router))
    return found


def unrecognised_experts(model: nn.Module, layers: Optional[list[MoELayer]] = None) -> list[str]:
    """Modules named like experts (``*expert*``, not shared experts) outside every recognised layer, each with
    what its parent holds and what was expected, for the error expert parallelism raises.

    Args:
        model: the model.
        layers: its recognised layers (found again when omitted).
    """
    layers = find_moe_layers(model) if layers is None else layers
    covered = [x.name for x in layers]
    out = []
    for name, m in model.named_modules():
        leaf = name.rsplit(".", 1)[-1].lower()
        if "expert" not in leaf or "shared" in leaf or any(_within(name, c) for c in covered):
            continue
        if next(m.parameters(), None) is None:  # nothing to shard here (a pipeline's meta copy of another stage's)
            continue
        parent_name = name.rsplit(".", 1)[0] if "." in name else ""
        parent = model.get_submodule(parent_name)
        covered.append(name)  # report the outermost experts module only
        where = parent_name or type(model).__name__
        out.append(f"{where} ({type(parent).__name__}: {describe(parent)}; expected {EXPECTED})")
    return out


def _within(name: str, outer: str) -> bool:
    return not outer or name == outer or name.startswith(f"{outer}.")

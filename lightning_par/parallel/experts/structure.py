"""Recognise mixture-of-experts blocks by structure, for models we did not write.

A block is a module with two children (or a child and a parameter of its own):

- a **router**: a module whose own ``weight`` is ``[E, d]`` (an ``nn.Linear(d, E)``, or a Hugging Face
  ``*TopKRouter``), a module whose only parameter is such a weight (DBRX's router around its Linear), or a
  parameter ``[E, d]`` of the block itself;
- an **experts container** holding ``E`` experts of one shape, either
  - *stacked*: a module whose own parameters are all indexed by expert on dim 0 (``[E, ...]``), at least one of
    them 3-D (Hugging Face transformers 5: Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V3, GPT-OSS; called as
    ``experts(hidden [N, d], top_k_index [N, k], top_k_weights [N, k])``), or
  - a *module list*: an ``nn.ModuleList`` of ``E`` MLPs with identical parameter shapes, every parameterised
    piece Linear-like (a 2-D weight, optional 1-D bias), few enough (at most 4) that a stack of decoder layers
    never looks like one, or
  - *flat*: 2 to 4 weights at any depth of the container, all ``[E * f, d]`` (Hugging Face DBRX), each expert a
    block of ``f`` consecutive rows; sharded and called as stacked experts.

Shared experts (Qwen2-MoE ``shared_expert``, DeepSeek-V3 ``shared_experts``) are plain MLPs next to the router:
they are not part of the experts container and stay replicated, as dense MLPs do.

Nothing here imports transformers or touches process groups: this is introspection only.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from torch import nn

# Where implementations keep the number of experts each token goes to (block, then router, then experts).
TOP_K_ATTRS = ("top_k", "num_experts_per_tok", "topk", "k", "moe_top_k", "num_selected_experts")
_NOT_EXPERTS = (
    nn.ModuleList,
    nn.Conv1d,
    nn.Conv2d,
    nn.Conv3d,
    nn.ConvTranspose1d,
    nn.ConvTranspose2d,
    nn.ConvTranspose3d,
)
_MAX_EXPERT_PIECES = 4  # up / gate / down (+ one spare): more is a decoder block, not an MLP expert

EXPECTED = (
    "a router (a module with weight [E, d], e.g. nn.Linear(d, E), or a parameter [E, d] of the block) next to an "
    "experts container of E experts of one shape: stacked weights [E, ...] (at least one 3-D) in one module, or an "
    "nn.ModuleList of E identical MLPs (Linear layers only)"
)


@dataclasses.dataclass(frozen=True)
class ExpertsStructure:
    """The parts of one recognised MoE block.

    Args:
        router: qualified name of the router inside the block (``""``: a parameter of the block itself).
        experts: attribute name of the experts container inside the block.
        layout: ``"stacked"`` or ``"module_list"``.
        n_experts: ``E``.
        top_k: experts per token, ``0`` where no attribute states it.
        d_model: the width the router reads.
    """

    router: str
    experts: str
    layout: str
    n_experts: int
    top_k: int
    d_model: int


def stacked_experts_size(m: nn.Module) -> Optional[int]:
    """``E`` if every own parameter of ``m`` is indexed by expert on dim 0 and one of them is 3-D, else ``None``."""
    if isinstance(m, _NOT_EXPERTS):
        return None
    params = list(m.parameters(recurse=False))
    if not params or not any(p.dim() == 3 for p in params) or any(p.dim() < 2 for p in params):
        return None
    sizes = {int(p.shape[0]) for p in params}
    return sizes.pop() if len(sizes) == 1 and min(sizes) >= 2 else None


def flat_expert_rows(m: nn.Module) -> Optional[int]:
    """``R`` if every parameter of ``m`` (at any depth, at most `_MAX_EXPERT_PIECES`) is 2-D with ``R`` rows: experts
    stored flat, each expert a block of ``R / E`` consecutive rows (Hugging Face DBRX's ``mlp.w1`` / ``v1`` / ``w2``
    ``[E * f, d]``, viewed as ``[E, f, d]`` in its forward); ``E`` comes from the router next to it."""
    if isinstance(m, _NOT_EXPERTS):
        return None
    params = list(m.parameters())
    if len(params) < 2 or len(params) > _MAX_EXPERT_PIECES or any(p.dim() != 2 for p in params):
        return None
    rows = {int(p.shape[0]) for p in params}
    return rows.pop() if len(rows) == 1 else None


def _is_mlp(m: nn.Module) -> bool:
    pieces = [c for c in m.modules() if any(True for _ in c.parameters(recurse=False))]
    if not pieces or len(pieces) > _MAX_EXPERT_PIECES or any(isinstance(c, nn.ModuleList) for c in m.modules()):
        return False
    for c in pieces:
        own = dict(c.named_parameters(recurse=False))
        if set(own) - {"weight", "bias"} or own.get("weight") is None or own["weight"].dim() != 2:
            return False
        if "bias" in own and own["bias"].dim() != 1:
            return False
    return True


def module_list_experts_size(m: nn.Module) -> Optional[int]:
    """``E`` if ``m`` is an ``nn.ModuleList`` of at least 2 MLPs of one type and identical parameter shapes."""
    # A ModuleList may hold None (x-transformers keeps optional per-layer modules that way): not experts.
    if not isinstance(m, nn.ModuleList) or len(m) < 2 or any(e is None for e in m):
        return None
    first = next(iter(m))
    shapes = [(n, p.shape) for n, p in first.named_parameters()]
    for e in m:
        if type(e) is not type(first) or [(n, p.shape) for n, p in e.named_parameters()] != shapes:
            return None
    return len(m) if all(_is_mlp(e) for e in m) else None


def _router_candidates(block: nn.Module, experts: str) -> list[tuple[str, int, int]]:
    """``(name, E, d)`` for every ``[E, d]`` router weight among the block's own parameters and its children."""
    out = [("", int(p.shape[0]), int(p.shape[1])) for p in block.parameters(recurse=False) if p.dim() == 2]
    for name, child in block.named_children():
        w = getattr(child, "weight", None)
        if w is None and len(own := list(child.parameters())) == 1:
            w = own[0]  # a router module wrapping its Linear (DBRX's router.layer)
        if name != experts and isinstance(w, nn.Parameter) and w.dim() == 2:
            out.append((name, int(w.shape[0]), int(w.shape[1])))
    return out


def _top_k(*modules: nn.Module) -> int:
    for m in modules:
        for attr in TOP_K_ATTRS:
            v = getattr(m, attr, None)
            if isinstance(v, int) and not isinstance(v, bool) and v >= 1:
                return v
    return 0


def adapted_base(m: nn.Module) -> Optional[nn.Module]:
    """The module a parameter adapter wraps, else ``None``: a module whose children are a ``base_layer`` and adapter
    containers only (``ModuleDict`` / ``ParameterDict``), peft's ``ParamWrapper`` around stacked expert weights
    (LoRA with ``target_parameters``), whose forward calls the base with the adapted weights."""
    children = dict(m.named_children())
    base = children.pop("base_layer", None)
    if base is None or not all(isinstance(c, (nn.ModuleDict, nn.ParameterDict)) for c in children.values()):
        return None
    return base


def match_block(block: nn.Module) -> Optional[ExpertsStructure]:
    """The router and experts of ``block`` if it is an MoE block of a recognised structure, else ``None``. Experts
    inside parameter adapters (`adapted_base`) are found inside them: ``experts`` is then their path
    (``experts.base_layer.base_layer``)."""
    for outer, child in block.named_children():
        name = outer
        while (base := adapted_base(child)) is not None:
            name, child = f"{name}.base_layer", base
        layout, n = "stacked", stacked_experts_size(child)
        if n is None:
            layout, n = "module_list", module_list_experts_size(child)
        rows = flat_expert_rows(child) if n is None else None
        if n is None and rows is None:
            continue
        widths = _expert_widths(child)
        for router, e, d in _router_candidates(block, outer):
            if rows is not None and 2 <= e < rows and rows % e == 0 and d in widths:
                n, layout = e, "stacked"  # flat rows: sharded and called as stacked experts, R / E rows each
            if e == n and d in widths:
                parts = [block] + ([block.get_submodule(router)] if router else []) + [child]
                return ExpertsStructure(router, name, layout, n, _top_k(*parts), d)
    return None


def _expert_widths(experts: nn.Module) -> set[int]:
    """Every size appearing in the experts' weights (per expert): the model width is one of them."""
    if isinstance(experts, nn.ModuleList):
        return {s for p in next(iter(experts)).parameters() for s in p.shape}
    return {s for p in experts.parameters() for s in p.shape[1:]}


def describe(block: nn.Module) -> str:
    """What a block that looks like MoE but is not recognised holds (for the refusal message)."""
    parts = []
    for name, child in block.named_children():
        shapes = ", ".join(f"{n} {list(p.shape)}" for n, p in child.named_parameters(recurse=False))
        kind = f"ModuleList of {len(child)}" if isinstance(child, nn.ModuleList) else type(child).__name__
        parts.append(f"{name}: {kind}" + (f" ({shapes})" if shapes else ""))
    own = ", ".join(f"{n} {list(p.shape)}" for n, p in block.named_parameters(recurse=False))
    return "; ".join(parts + ([f"own parameters: {own}"] if own else []))

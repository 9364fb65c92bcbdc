"""The parameter count that model FLOPs are computed from: what a token passes through, on the whole model.

Model FLOPs per token are ``6 N + 12 L H T`` (PaLM, arXiv 2204.02311, appendix B) with N the parameters a token's
matmuls use. That is a property of the model, not of the layout: counted on the whole model before any pipeline cut,
tensor slicing or expert sharding, it is the same number under every strategy. Two things are left out of N:

- embedding tables (a lookup is no matmul; a head tied to the embedding is left out with it, as is usual);
- the experts a token does not visit: an MoE layer with ``n_experts`` experts and ``top_k`` per token counts
  ``top_k / n_experts`` of its experts' parameters (its router and shared experts in full). A layer whose ``top_k``
  is unknown (0) counts all its experts.
"""

from __future__ import annotations

from torch import nn

from lightning_par.parallel.experts.finder import find_moe_layers


def active_param_count(model: nn.Module) -> int:
    """Non-embedding parameters a token's computation uses (``numel``: works on meta and sharded DTensors alike).

    Args:
        model: the whole model, before it is laid out (after, a pipeline stage or an expert shard would count
            only what this rank holds).
    """
    embedding = {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
    seen: set[int] = set()
    total = 0
    for p in model.parameters():  # shared (tied) parameters once
        if id(p) not in embedding and id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
    for layer in find_moe_layers(model):
        if layer.top_k <= 0 or layer.n_experts <= 0:
            continue
        experts = sum(p.numel() for p in layer.experts.parameters() if id(p) not in embedding)
        total -= experts - experts * layer.top_k // layer.n_experts
    return total

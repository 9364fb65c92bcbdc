"""Mixture-of-experts and expert parallelism: the finder that recognises MoE layers by structure (`finder`,
`structure`), the sharding (`apply`, `stacked`, `module_list`), token dispatch (`dispatch`), experts inside a tp group
(`with_tp`) and router statistics (`router_stats`)."""

from lightning_par.parallel.experts.apply import apply_expert_parallel
from lightning_par.parallel.experts.finder import MoELayer, find_moe_layers

__all__ = ["MoELayer", "apply_expert_parallel", "find_moe_layers"]

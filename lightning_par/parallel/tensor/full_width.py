"""Regions whose code sizes its tensors from the full width: kept split, run on gathered activations.

nanoGPT, the most copied user GPT, writes ``B, T, C = x.size()``, ``q, k, v = self.c_attn(x).split(C, dim=2)`` and
``y.view(B, T, C)``: sizes read from the input, which tensor parallelism does not change, not from a head count it
can rewrite. Split by heads, that code fails (`check.check_local_shapes` finds it on block 0 before training). The
fallback keeps the region's weights split (each rank holds and multiplies ``1/tp`` of every projection) and gives
the code between its projections the exact tensors the whole projections compute:

- each input projection's output is gathered over tp back to the whole projection's output, its columns in the
  model's order (a fused ``[q | k | v]`` split part by part is put back part by part); backward keeps this rank's
  columns of the gradient, which is the same on every rank (Megatron's "gather" operator, Shoeybi et al., arXiv
  1909.08053);
- the code between the projections then runs as written, on all heads, on every rank (the same values everywhere);
- the output projection, split by rows, takes this rank's columns of its input; backward gathers the gradient's
  columns (Megatron's "scatter" operator).

Exact for any code between the projections, since that code never sees a split tensor. What it costs against a
region tp can split by heads (`benchmarks/bench_tp_full_width.py`): per forward an all-gather of the input
projections' output (``3 x`` the hidden width per token for an attention), per backward one of the output
projection's input gradient, and the code between the projections (the attention itself) computed on every rank.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_par.parallel.tensor.adapters import find_adapters
from lightning_par.parallel.tensor.kv_heads import kv_replicas
from lightning_par.parallel.tensor.plan_types import HeadInfo, MLPInfo, TPPlan

_INPUT = ("colwise", "colwise_fused")


class _GatherColumns(torch.autograd.Function):
    """Forward: this rank's columns of a column-split output -> the whole output, parts in the model's order.
    Backward: this rank's columns of the (replicated) gradient."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, group: dist.ProcessGroup, parts: int) -> torch.Tensor:
        tp, rank = dist.get_world_size(group), dist.get_rank(group)
        ctx.meta = (parts, tp, rank)
        pieces = [torch.empty_like(local) for _ in range(tp)]
        dist.all_gather(pieces, local.contiguous(), group=group)
        w = local.shape[-1] // parts
        # Rank r holds [part 0's r-th chunk | part 1's r-th chunk | ...] (`_StridedShard` for parts > 1).
        return torch.cat([pieces[r][..., p * w : (p + 1) * w] for p in range(parts) for r in range(tp)], dim=-1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, None, None]:
        parts, tp, rank = ctx.meta
        w = grad.shape[-1] // (parts * tp)
        mine = [grad[..., (p * tp + rank) * w : (p * tp + rank + 1) * w] for p in range(parts)]
        return torch.cat(mine, dim=-1).contiguous(), None, None


class _TakeColumns(torch.autograd.Function):
    """Forward: this rank's columns of a whole (replicated) input to a row-split projection. Backward: the
    gradient's columns gathered from every rank."""

    @staticmethod
    def forward(ctx: Any, full: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        tp, rank = dist.get_world_size(group), dist.get_rank(group)
        ctx.group = group
        w = full.shape[-1] // tp
        return full[..., rank * w : (rank + 1) * w].clone(memory_format=torch.contiguous_format)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, None]:
        tp = dist.get_world_size(ctx.group)
        pieces = [torch.empty_like(grad) for _ in range(tp)]
        dist.all_gather(pieces, grad.contiguous(), group=ctx.group)
        return torch.cat(pieces, dim=-1), None


def fallback_for(plan: TPPlan, module: str, tp: int, block: nn.Module) -> Optional[str]:
    """The attention or MLP (its key in ``plan.heads`` / ``plan.mlps``) holding ``module`` (a pattern) that can run
    on gathered activations, or ``None``: its projections ``nn.Linear``s of ``block`` (one of the plan's blocks;
    torch's split styles hand on their local output), the input ones split by columns (whole or fused equal parts),
    the output one by rows, and nothing else of it split with the heads (per-head norms or parameters, a latent,
    key/value heads replicated over ranks), which would need the heads split."""
    infos: list[tuple[str, HeadInfo | MLPInfo]] = [*plan.heads.items(), *plan.mlps.items()]
    holding = [(k, i) for k, i in infos if module == (i.region or k) or module.startswith((i.region or k) + ".")]
    if not holding:
        return None
    key, info = max(holding, key=lambda ki: len(ki[1].region or ki[0]))
    styles = [plan.styles.get(p) for p in info.projections]
    if styles[-1] != "rowwise" or any(s not in _INPUT for s in styles[:-1]) or key in plan.gathered:
        return None
    if any(len(set(w)) > 1 for w in info.fused_split.values()):
        return None  # fused parts of unequal widths: split by our own affine style, not covered here
    prefix = f"{plan.trunk}.*" if plan.trunk else "*"
    rels = [p[len(prefix) + 1 :] for p in info.projections]
    if not all(type(block.get_submodule(r)) is nn.Linear for r in rels):
        return None  # Conv1D, torch's packed nn.MultiheadAttention: their own split styles
    if any(r in find_adapters(block) for r in rels):
        return None  # a low-rank adapter adds its own split output to the projection's
    if isinstance(info, HeadInfo) and (
        info.head_params or info.head_tables or info.latent or kv_replicas(info, tp) > 1
    ):
        return None
    region = info.region or key
    inside = [k for k, s in plan.styles.items() if k.startswith(region + ".") and s in ("head_norm", "colwise_norm")]
    return None if inside else key


def as_whole(plan: TPPlan) -> TPPlan:
    """``plan`` with its gathered regions' projections kept whole: what the code between them sees, for the checks
    that run rank copies of block 0 and for the head counts (a gathered region's code keeps the global ones)."""
    if not plan.gathered:
        return plan
    infos: dict[str, HeadInfo | MLPInfo] = {**plan.heads, **plan.mlps}
    whole = {p for key in plan.gathered for p in infos[key].projections}
    return dataclasses.replace(plan, styles={k: "replicate" if k in whole else s for k, s in plan.styles.items()})


def apply_full_width(block: nn.Module, plan: TPPlan, prefix: str, mesh: DeviceMesh) -> None:
    """Gather the outputs of each gathered region's input projections and split its output projection's input,
    in ``block`` (after the DTensor styles: the gather sees their local output, the split comes before theirs)."""
    group = mesh.get_group()
    infos: dict[str, HeadInfo | MLPInfo] = {**plan.heads, **plan.mlps}
    for key in plan.gathered:
        *ins, out = infos[key].projections
        for name in ins:
            parts = len(infos[key].fused_split.get(name, (0,)))
            block.get_submodule(name[len(prefix) + 1 :]).register_forward_hook(
                lambda _m, _a, y, parts=parts: _GatherColumns.apply(y, group, parts)
            )
        block.get_submodule(out[len(prefix) + 1 :]).register_forward_pre_hook(
            lambda _m, args: (_TakeColumns.apply(args[0], group), *args[1:]), prepend=True
        )

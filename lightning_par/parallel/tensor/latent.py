"""Tensor parallelism for multi-head latent attention (DeepSeek-V2, arXiv 2405.04434; DeepSeek-V3): the low-rank
projections stay whole on every rank, the projections reading them are split by heads.

MLA projects the hidden state to a narrow latent (``kv_a_proj_with_mqa``: ``kv_lora_rank`` plus a rotary key part
shared by all heads; ``q_a_proj`` when ``q_lora_rank`` is set), normalises it, and expands it per head
(``kv_b_proj``, ``q_b_proj``). The latent is not head-structured, so every rank computes all of it (cheap: it is
narrower than the hidden width) and splits only the expansion. Inside the attention each rank's code then reads
the latent for its own heads, so the latent's gradient on a rank is that rank's share: the whole latent path runs
as replicated DTensors whose gradients come back ``Partial``, exactly like the column-split projections' input:

- a latent projection or norm gets ``Replicate`` DTensor parameters (their ``Partial`` gradients are summed over tp
  like `SequenceParallel` norms': `zero.buckets.settle_grad` under ZeRO 0-2, FSDP2's reduction under ZeRO-3); its
  input is the region's replicated DTensor (or the latent, see below), its output is handed on as the local tensor
  whose gradient is declared ``Partial``;
- the projections reading a latent (and the latent norms) see their plain input as a replicated DTensor through
  `_AsReplicated`, whose backward hands the ``Partial`` gradient on unreduced (torch's ``DTensor.from_local`` would
  all-reduce it there, then again at the region's input: counted tp times).
One all-reduce per region backward, at the region's input, as for any other attention.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, distribute_module

from lightning_par.parallel.tensor.heads import _params_as
from lightning_par.parallel.tensor.plan_types import TPPlan


class _AsReplicated(torch.autograd.Function):
    """A plain tensor, equal on every tp rank, as a ``Replicate`` DTensor; backward: this rank's share of the
    gradient (``Partial``), not reduced."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, mesh: DeviceMesh) -> DTensor:
        ctx.mesh = mesh
        return DTensor.from_local(x, mesh, [Replicate()], run_check=False)

    @staticmethod
    def backward(ctx: Any, grad: Any) -> tuple[Any, None]:
        if not isinstance(grad, DTensor):
            return grad, None
        local = grad.to_local()
        if not grad.placements[0].is_partial() and ctx.mesh.get_local_rank() != 0:
            # A replicated gradient (whole on every rank): rank 0's share is all of it, exactly.
            local = torch.zeros_like(local)
        return local, None


def _replicated_input(mod: nn.Module, args: tuple[Any, ...], mesh: DeviceMesh) -> tuple[Any, ...]:
    x, *rest = args
    if isinstance(x, torch.Tensor) and not isinstance(x, DTensor):
        x = _AsReplicated.apply(x, mesh)
    return (x, *rest)


def _partial_output(mod: nn.Module, out: Any, mesh: DeviceMesh) -> Any:
    return out.to_local(grad_placements=[Partial()]) if isinstance(out, DTensor) else out


def apply_latents(block: nn.Module, plan: TPPlan, prefix: str, mesh: DeviceMesh) -> None:
    """Keep each split latent attention's latent projections and norms whole (replicated DTensors) in ``block``,
    and feed the latent to the column-split projections reading it without a second gradient reduction."""
    for head in plan.heads.values():
        if not head.latent or not any(plan.styles.get(p) == "colwise" for p in head.projections):
            continue  # kept whole by a tp_plan: the attention runs as written
        for pattern in head.latent:
            mod = block.get_submodule(pattern[len(prefix) + 1 :])
            distribute_module(mod, mesh, _params_as(Replicate()), cast(Any, _replicated_input), _partial_output)
        for pattern in head.latent_readers:
            reader = block.get_submodule(pattern[len(prefix) + 1 :])
            # Before ColwiseParallel's own input hook, which would wrap (and later all-reduce) a plain input.
            reader.register_forward_pre_hook(lambda m, args: _replicated_input(m, args, mesh), prepend=True)

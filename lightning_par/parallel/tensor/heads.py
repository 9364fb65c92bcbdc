"""Tensor parallelism for what an attention holds besides its head-split projections: q/k norms, per-head
parameters, and the latent of multi-head latent attention. Each is a DTensor layout on the module's own code, so
the model is not rewritten.

- ``head_norm`` (Qwen3's ``q_norm`` / ``k_norm``, a norm over ``head_dim`` applied to each head of a column-split
  projection): every rank normalises its own heads, which is already exact; but the norm's weight is shared by all
  heads, so its gradient on one rank covers only that rank's heads. The weight becomes a ``Replicate`` DTensor and
  the input a DTensor sharded along a non-normalised dim: autograd then yields a ``Partial`` gradient, which is
  summed over tp before anything reads it (`zero.buckets.settle_grad` under ZeRO 0-2, FSDP2's reduction under
  ZeRO-3), exactly as for torch's ``SequenceParallel`` norms.
- ``colwise_norm`` (OLMoE's, OLMo2's ``q_norm`` over the whole ``n_heads * head_dim`` output): each rank holds a
  slice of the width, so the weight is sharded like the projection's output (``Shard(0)``) and the input is
  ``Shard(-1)``: DTensor reduces the mean of squares over tp (one all-reduce of a (batch, seq, 1) tensor forward,
  one backward) and the output is handed back as this rank's slice.
- per-head parameters (GPT-OSS's attention ``sinks``, one entry per query head): ``Shard(0)`` DTensors, so each rank
  holds its heads' entries and checkpoints keep the whole tensor; around the attention's forward the module sees
  the local tensor (its code mixes it with local activations), and the gradient flows back to the shard.

Multi-head latent attention (DeepSeek-V2, arXiv 2405.04434; DeepSeek-V3): the low-rank projections stay whole on
every rank, the projections reading them are split by heads (`apply_latents`). MLA projects the hidden state to a
narrow latent (``kv_a_proj_with_mqa``: ``kv_lora_rank`` plus a rotary key part shared by all heads; ``q_a_proj``
when ``q_lora_rank`` is set), normalises it, and expands it per head (``kv_b_proj``, ``q_b_proj``). The latent is
not head-structured, so every rank computes all of it (cheap: it is narrower than the hidden width) and splits only
the expansion. Inside the attention each rank's code then reads the latent for its own heads, so the latent's
gradient on a rank is that rank's share: the whole latent path runs as replicated DTensors whose gradients come
back ``Partial``, exactly like the column-split projections' input:

- a latent projection or norm gets ``Replicate`` DTensor parameters (their ``Partial`` gradients are summed over tp
  like `SequenceParallel` norms'); its input is the region's replicated DTensor (or the latent, see below), its
  output is handed on as the local tensor whose gradient is declared ``Partial``;
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
from torch.distributed.tensor import (
    DTensor,
    Partial,
    Placement,
    Replicate,
    Shard,
    distribute_module,
    distribute_tensor,
)

from lightning_par import _compat
from lightning_par.parallel.tensor.plan_types import TPPlan
from lightning_par.utils import dtensors


def _params_as(placement: Placement) -> Any:
    def partition(name: str, mod: nn.Module, mesh: DeviceMesh) -> None:
        for pname, p in list(mod.named_parameters(recurse=False)):
            if not isinstance(p, DTensor):
                mod.register_parameter(pname, nn.Parameter(distribute_tensor(p, mesh, [placement]), p.requires_grad))

    return partition


def apply_head_norm(norm: nn.Module, mesh: DeviceMesh) -> None:
    """Make a per-head norm's parameters replicated DTensors whose gradients are summed over ``mesh`` (tp)."""

    def inputs(mod: nn.Module, args: tuple[Any, ...], mesh: DeviceMesh) -> tuple[Any, ...]:
        x, *rest = args
        # Any dim but the normalised last one: the norm acts row by row, so rows split over ranks stay exact, and
        # the weight's gradient (a sum over rows) comes out Partial.
        return (DTensor.from_local(x, mesh, [Shard(x.dim() - 2)], run_check=False), *rest)

    distribute_module(norm, mesh, _params_as(Replicate()), cast(Any, inputs), local_output)  # its hint says None: wrong


def apply_colwise_norm(norm: nn.Module, mesh: DeviceMesh) -> None:
    """Split a norm over the whole output of a column-split projection: weight ``Shard(0)``, statistics over tp."""

    def inputs(mod: nn.Module, args: tuple[Any, ...], mesh: DeviceMesh) -> tuple[Any, ...]:
        x, *rest = args
        return (DTensor.from_local(x, mesh, [Shard(x.dim() - 1)], run_check=False), *rest)

    def outputs(mod: nn.Module, out: Any, mesh: DeviceMesh) -> Any:
        if not isinstance(out, DTensor):
            return out
        # A norm whose op DTensor computes on the gathered width (F.layer_norm) returns it replicated: keep this
        # rank's slice, as the column-split projection would have handed on.
        return out.redistribute(mesh, [Shard(out.dim() - 1)]).to_local()

    distribute_module(norm, mesh, _params_as(Shard(0)), cast(Any, inputs), outputs)


def local_output(mod: nn.Module, out: Any, mesh: DeviceMesh) -> Any:
    """An output hook for `distribute_module`: this rank's local tensor, in whatever layout the module left it."""
    return dtensors.local(out)


def apply_head_params(attn: nn.Module, names: tuple[str, ...], mesh: DeviceMesh) -> None:
    """Shard the attention's own per-head parameters ``names`` along dim 0 over ``mesh`` (tp), with the heads.

    The stored parameter stays a ``Shard(0)`` DTensor (its full shape and name, for checkpoints and ZeRO); while the
    attention runs, its attribute is the differentiable local view, swapped back when the forward ends (also on an
    error). Under FSDP2 the swap sees the unsharded parameter FSDP2 set for the block's forward, and restores it.
    """
    for name in names:
        p = getattr(attn, name)
        attn.register_parameter(name, nn.Parameter(distribute_tensor(p.detach(), mesh, [Shard(0)]), p.requires_grad))
    held: list[dict[str, Any]] = []

    def swap_in(mod: nn.Module, args: Any) -> None:
        params: dict[str, Any] = _compat.module_parameters(mod)
        saved = {n: t for n in names if isinstance(t := params[n], DTensor)}
        for n, t in saved.items():
            params[n] = t.to_local()  # a view in the autograd graph, not a Parameter: gradients reach the shard
        held.append(saved)

    def swap_out(mod: nn.Module, args: Any, out: Any) -> None:
        if held:
            params: dict[str, Any] = _compat.module_parameters(mod)
            params.update(held.pop())

    attn.register_forward_pre_hook(swap_in)
    attn.register_forward_hook(swap_out, always_call=True)


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

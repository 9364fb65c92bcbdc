"""Tensor parallelism for what an attention holds per head besides its projections: q/k norms and per-head
parameters. Each is a DTensor layout on the module's own code, so the model is not rewritten.

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
"""

from __future__ import annotations

from typing import Any, cast

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_module, distribute_tensor

from lightning_par import _compat
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

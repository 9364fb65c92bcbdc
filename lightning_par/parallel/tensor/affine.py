"""Column / row splits of projections torch's DTensor styles do not take: affine modules that are not
``nn.Linear`` (Hugging Face's ``Conv1D``, weight ``[in, out]``) and fused projections of unequal parts
(grouped-query ``[q | k | v]``).

torch's ``ColwiseParallel`` / ``RowwiseParallel`` accept only ``nn.Linear`` / ``nn.Embedding``. Here a projection's
parameters become DTensors under their original names and full shapes (so checkpoints and ``full_tensor`` see the
model's own layout), and its forward becomes the affine map it was probed to be
(`lightning_par.parallel.tensor.plan_affine`),
computed like torch's styles compute a Linear:

- column split: the output dim is sharded (dim 1 of an ``[in, out]`` weight, dim 0 of an ``[out, in]`` one); the
  input is a replicated DTensor, so the input gradient is reduced once per region (Megatron's ``f``);
- fused equal parts ``[q | k | v]``: ``_StridedShard`` on the output dim, each rank holding its slice of every part;
- fused unequal parts (``q`` of n_heads heads, ``k`` and ``v`` of n_kv_heads): no DTensor placement describes "this
  rank's slice of each part", so the parameter is stored as a plain ``Shard`` of the output dim (exactly the model's
  layout) and each forward all-gathers it over tp and keeps this rank's rows of each part (backward: a
  reduce-scatter of the gradient). Cost: one all-gather + one reduce-scatter of that weight per step, as ZeRO-3
  pays for it; the activations cost what any column split costs;
- row split: the input dim is sharded, the bias replicated and added once, to the reduced output.
"""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_tensor

from lightning_par import _compat
from lightning_par.parallel.tensor.kv_heads import part_rows

_SEQ = 1


class _GatherParts(torch.autograd.Function):
    """Rows ``idx`` of the tp-gathered tensor: forward all-gathers dim 0, backward reduce-scatters the gradient."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, idx: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group, ctx.rows = group, local.shape[0]
        ctx.save_for_backward(idx)
        full = local.new_empty((local.shape[0] * dist.get_world_size(group), *local.shape[1:]))
        _compat.all_gather_single(full, local.contiguous(), group=group)
        return full.index_select(0, idx)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (idx,) = ctx.saved_tensors
        n = dist.get_world_size(ctx.group)
        full = grad.new_zeros((ctx.rows * n, *grad.shape[1:])).index_copy_(0, idx, grad)
        out = grad.new_empty((ctx.rows, *grad.shape[1:]))
        _compat.reduce_scatter_single(out, full, op=dist.ReduceOp.SUM, group=ctx.group)
        return out, None, None


def _distribute(module: nn.Module, name: str, mesh: DeviceMesh, placement: Placement) -> None:
    p = getattr(module, name)
    module.register_parameter(name, nn.Parameter(distribute_tensor(p, mesh, [placement]), p.requires_grad))


def apply_affine(
    module: nn.Module,
    mesh: DeviceMesh,
    style: str,
    *,
    transposed: bool,
    parts: tuple[int, ...] | None = None,
    rows: torch.Tensor | None = None,
    sequence_parallel: bool = False,
) -> None:
    """Split one projection over the 1-D tp ``mesh`` in place: its parameters become DTensors, its forward the
    equivalent DTensor computation.

    Args:
        module: a leaf with ``weight`` (2-D) and optional ``bias`` whose forward is ``x @ W + b`` (``transposed``)
            or ``F.linear(x, W, b)``.
        style: ``"colwise"``, ``"colwise_fused"`` (with ``parts``) or ``"rowwise"``.
        parts: widths of the fused output's parts, in order (each divisible by tp).
        rows: the rows of the full output this rank computes, when they are not its slice of each part (key/value
            heads replicated over ranks: `kv_heads.part_rows`); the weight is then gathered for them.
        sequence_parallel: the row split's output is reduce-scattered along the sequence instead of all-reduced.
    """
    out_dim, in_dim = (1, 0) if transposed else (0, 1)
    has_bias = getattr(module, "bias", None) is not None
    tp, rank = mesh.size(), mesh.get_local_rank()
    gather: torch.Tensor | None = None
    if style == "rowwise":
        _distribute(module, "weight", mesh, Shard(in_dim))
        if has_bias:
            _distribute(module, "bias", mesh, Replicate())
    else:
        equal = rows is None and (parts is None or len(set(parts)) == 1)
        sf = len(parts) if parts is not None and len(parts) > 1 and equal else 1
        for name, dim in (("weight", out_dim), ("bias", 0)):
            if name == "weight" or has_bias:
                _distribute(module, name, mesh, _compat.StridedShard(dim, split_factor=sf) if sf > 1 else Shard(dim))
        if not equal:
            assert parts is not None or rows is not None
            gather = rows if rows is not None else part_rows(parts or (), (False,) * len(parts or ()), tp, 1, rank)
    group = mesh.get_group()

    def local(t: Any, dim: int) -> torch.Tensor:
        x = t.to_local()
        if gather is None:
            return x
        return _GatherParts.apply(x.movedim(dim, 0), gather, group).movedim(0, dim)  # type: ignore[no-any-return]

    def colwise(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, mesh, [Replicate()], run_check=False)
        # This rank's columns as a Shard of the output dim: what it holds (strided or gathered) is this rank's
        # slice of each part, laid out as the local forward expects it.
        p: Any = self  # weight and bias are DTensors now
        if rows is not None:
            # Replicated k/v heads: the rows are no Shard of anything, so the product is local; the ranks sharing a
            # head each send back a share of the input's gradient (Partial), summed once at the region's input.
            w_local, b_local = local(p.weight, out_dim), local(p.bias, 0) if has_bias else None
            x_local = x.to_local(grad_placements=[Partial()])
            return F.linear(x_local, w_local.t() if transposed else w_local, b_local)
        w = DTensor.from_local(local(p.weight, out_dim), mesh, [Shard(out_dim)], run_check=False)
        b = DTensor.from_local(local(p.bias, 0), mesh, [Shard(0)], run_check=False) if has_bias else None
        y: Any = F.linear(x, w.t() if transposed else w, b)
        return y.to_local()  # type: ignore[no-any-return]

    def rowwise(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, mesh, [Shard(-1)], run_check=False)
        p: Any = self
        y: Any = F.linear(x, p.weight.t() if transposed else p.weight)
        y = y.redistribute(mesh, [Shard(_SEQ) if sequence_parallel else Replicate()])
        # The bias once, on the reduced output (inside the matmul DTensor would add bias / tp on every rank).
        return (y + p.bias if has_bias else y).to_local()  # type: ignore[no-any-return]

    module.forward = types.MethodType(rowwise if style == "rowwise" else colwise, module)  # type: ignore[method-assign]

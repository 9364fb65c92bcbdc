"""Tensor parallelism for torch's own ``nn.MultiheadAttention`` (the attention of ``nn.TransformerEncoderLayer`` and
``nn.TransformerDecoderLayer``, the most common user transformer).

Its q, k and v weights are one packed parameter, ``in_proj_weight`` ``[3E, E]`` (``[q | k | v]`` rows), and its
forward (``F.multi_head_attention_forward``) calls ``F.linear`` on them directly, so neither the probe nor a DTensor
style sees an ``nn.Linear`` to split. The packed weight is a fused projection of three equal parts like GPT-2's
``c_attn``: each rank holds its slice of q, k and v (whole heads, ``_StridedShard(0, split_factor=3)``), and
``out_proj`` (an ``nn.Linear``) is split by rows, so the attention costs one all-reduce forward and one backward,
as any other (Shoeybi et al., arXiv 1909.08053). torch's forward reads the full width from its input
(``unflatten(-1, (3, E))``), so the split module runs `local_forward`: the same computation on this rank's heads
(same masks, same softmax scaling, the weights averaged over all heads when asked for), written here because
torch's code cannot run on a slice. The parameters keep their names and full shapes, so checkpoints and
``state_dict`` see the model's own layout.

Kept whole, and said so at start-up: separate key/value widths (``kdim`` / ``vdim``), ``bias_k`` / ``bias_v`` and
``add_zero_attn``.
"""

from __future__ import annotations

import math
import types
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from lightning_par import _compat
from lightning_par.parallel.tensor.plan_types import HeadInfo, ModuleShape, TPPlanError
from lightning_par.parallel.tensor.sequence import SequenceState

_SOURCE = "nn.MultiheadAttention.head_dim"  # where a plan's head counts of this attention come from


def splittable(mod: nn.Module) -> bool:
    """Whether ``mod`` is an ``nn.MultiheadAttention`` this module can split (packed q/k/v of the embedding width)."""
    return (
        isinstance(mod, nn.MultiheadAttention)
        and mod._qkv_same_embed_dim
        and mod.in_proj_weight is not None
        and mod.bias_k is None
        and not mod.add_zero_attn
    )


def add_to_plan(
    mods: dict[str, nn.Module],
    pat: Callable[[str], str],
    styles: dict[str, str],
    heads: dict[str, HeadInfo],
    shapes: dict[str, ModuleShape],
) -> None:
    """Add each splittable attention of a block (``mods``: block-relative name -> module; ``pat`` makes the plan's
    pattern) to the plan being inferred, in place: the packed q/k/v split by columns as ``[q | k | v]``, ``out_proj``
    by rows, the per-rank head count."""
    for rel, mod in mods.items():
        if not splittable(mod):
            continue
        assert isinstance(mod, nn.MultiheadAttention)
        name, e = pat(rel), mod.embed_dim
        out = f"{name}.out_proj"
        heads[name] = HeadInfo(
            n_heads=mod.num_heads,
            n_kv_heads=mod.num_heads,
            head_dim=mod.head_dim,
            source=_SOURCE,
            local_attrs={"num_heads": "n_heads"},  # read by `local_forward`
            fused_split={name: (e, e, e)},
            projections=(name, out),
            region=name,
        )
        styles.update({name: "colwise_fused", out: "rowwise"})
        shapes.update({name: ModuleShape("attention", e, 3 * e), out: ModuleShape("linear", e, e)})


def check_pairs(styles: dict[str, str], heads: dict[str, HeadInfo]) -> None:
    """After the user's ``tp_plan``: each attention's packed q/k/v and its ``out_proj`` are split together or not at
    all (a split q/k/v with a whole out_proj, or the reverse, would compute something else)."""
    for name, head in heads.items():
        if head.source != _SOURCE:
            continue
        pair = (styles[name], styles[f"{name}.out_proj"])
        if pair not in (("colwise_fused", "rowwise"), ("replicate", "replicate")):
            raise TPPlanError(
                f"tp_plan maps {name} (nn.MultiheadAttention) to {pair[0]!r} and {name}.out_proj to {pair[1]!r}: its "
                f"packed q/k/v and out_proj split only together; map them to 'colwise_fused' and 'rowwise', or both "
                f"to 'replicate'"
            )


def apply_mha(mod: nn.Module, mesh: DeviceMesh, seq: SequenceState | None = None) -> None:
    """Split ``mod`` (`splittable`) over the 1-D tp ``mesh`` in place; its ``out_proj`` is split by the caller's
    ``RowwiseParallel`` style. Under sequence parallelism (``seq``) the attention weights it returns, like its
    output, hold this rank's part of the residual stream."""
    for pname in ("in_proj_weight", "in_proj_bias"):
        p = getattr(mod, pname)
        if p is not None:
            placement = _compat.StridedShard(0, split_factor=3)
            mod.register_parameter(pname, nn.Parameter(distribute_tensor(p, mesh, [placement]), p.requires_grad))
    _localise(mod, mesh, mesh.size(), mesh.get_local_rank(), seq)


def slice_for_rank(mod: nn.Module, rows: torch.Tensor, tp: int, rank: int) -> None:
    """Give ``mod`` (`splittable`) rank ``rank``'s rows of its packed q/k/v (``rows``, from `kv_heads.part_rows`)
    and `local_forward`, with no process group: a rank's copy for the checks before the split."""
    for pname in ("in_proj_weight", "in_proj_bias"):
        p = getattr(mod, pname)
        if p is not None:
            mod.register_parameter(pname, nn.Parameter(p.detach().index_select(0, rows), requires_grad=False))
    _localise(mod, None, tp, rank)


def _localise(mod: nn.Module, mesh: DeviceMesh | None, tp: int, rank: int, seq: SequenceState | None = None) -> None:
    mod._lp_mesh, mod._lp_tp, mod._lp_rank, mod._lp_seq = mesh, tp, rank, seq  # type: ignore[assignment]
    mod.forward = types.MethodType(local_forward, mod)  # type: ignore[method-assign]
    # nn.TransformerEncoderLayer takes a fused C++ path in eval mode (no gradients) that reads in_proj_weight itself
    # and skips this forward; it does so only while no module of the layer has hooks.
    mod.register_forward_pre_hook(_keep_python_path)


def _keep_python_path(mod: nn.Module, args: Any) -> None:
    return None


def _reduced_input(x: Any, mesh: DeviceMesh | None) -> torch.Tensor:
    """This rank's view of an input all heads read: its gradient here is this rank's heads' share, summed over tp
    (at the region's input for the replicated DTensor the region hands in; here for any other tensor, such as
    the encoder memory a decoder's cross-attention reads)."""
    if isinstance(x, DTensor):
        return x.to_local(grad_placements=[Partial()])
    if mesh is None or not x.requires_grad:
        return x  # type: ignore[no-any-return]
    return DTensor.from_local(x, mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])


def _float_mask(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    # nn.MultiheadAttention's convention: True (or -inf) where attention is not allowed; floats are added.
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(mask, float("-inf"))
    return mask.to(dtype)


def local_forward(
    self: Any,
    query: Any,
    key: Any,
    value: Any,
    key_padding_mask: torch.Tensor | None = None,
    need_weights: bool = True,
    attn_mask: torch.Tensor | None = None,
    average_attn_weights: bool = True,
    is_causal: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``nn.MultiheadAttention.forward`` on this rank's heads (``self.num_heads`` is the per-rank count)."""
    if is_causal and attn_mask is None:
        raise RuntimeError("Need attn_mask if specifying the is_causal hint (as nn.MultiheadAttention requires)")
    same = query is key and key is value
    q_in = _reduced_input(query, self._lp_mesh)
    k_in = q_in if key is query else _reduced_input(key, self._lp_mesh)
    v_in = k_in if value is key else _reduced_input(value, self._lp_mesh)
    unbatched = q_in.dim() == 2
    if unbatched:
        q_in, k_in, v_in = (t.unsqueeze(1) for t in (q_in, k_in, v_in))
    w = self.in_proj_weight.to_local() if isinstance(self.in_proj_weight, DTensor) else self.in_proj_weight
    b = self.in_proj_bias
    b = b.to_local() if isinstance(b, DTensor) else b
    if same:
        q, k, v = F.linear(q_in, w, b).chunk(3, dim=-1)
    else:
        ws, bs = w.chunk(3), b.chunk(3) if b is not None else (None, None, None)
        q, k, v = F.linear(q_in, ws[0], bs[0]), F.linear(k_in, ws[1], bs[1]), F.linear(v_in, ws[2], bs[2])
    if not self.batch_first or unbatched:  # (L, N, E): torch's default layout
        q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
    n, length, src = q.shape[0], q.shape[1], k.shape[1]
    h, d, heads = self.num_heads, self.head_dim, self.num_heads * self._lp_tp
    q, k, v = (t.reshape(n, t.shape[1], h, d).transpose(1, 2) for t in (q, k, v))
    mask = _float_mask(attn_mask, q.dtype)
    if mask is not None and mask.dim() == 3:  # (N * heads, L, S): this rank's heads
        mask = mask.view(n, heads, length, src)[:, self._lp_rank * h : (self._lp_rank + 1) * h]
    if (pad := _float_mask(key_padding_mask, q.dtype)) is not None:
        pad = pad.view(n, 1, 1, src)
        mask = pad if mask is None else mask + pad
    p = self.dropout if self.training else 0.0
    weights = None
    if need_weights:
        scores = torch.matmul(q * (1.0 / math.sqrt(d)), k.transpose(-2, -1))
        probs = torch.softmax(scores if mask is None else scores + mask, dim=-1)
        probs = F.dropout(probs, p) if p > 0 else probs
        out = torch.matmul(probs, v)
        weights = _all_heads(probs, average_attn_weights, heads, self._lp_mesh, self._lp_rank)
        if self._lp_seq is not None and self._lp_mesh is not None:  # the stream's part: (N, L, E) or (L, N, E)
            dim = (1 if average_attn_weights else 2) if self.batch_first else 0
            weights = _stream_part(weights, dim, self._lp_mesh, self._lp_seq)
        elif isinstance(weights, DTensor):
            weights = weights.full_tensor()
        if unbatched:
            weights = weights.squeeze(0)
    else:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p)
    out = out.transpose(1, 2).reshape(n, length, h * d)
    if not self.batch_first or unbatched:
        out = out.transpose(0, 1)
    out = self.out_proj(out)  # split by rows: summed over tp by its own style
    return (out.squeeze(1) if unbatched else out), weights


def _stream_part(full: Any, dim: int, mesh: DeviceMesh, seq: SequenceState) -> torch.Tensor:
    """This rank's part of ``full`` (a DTensor) along ``dim``, the stream's sequence-parallel dim: split as
    ``torch.chunk`` splits it, padded at the end like the stream (`sequence.pad_region_output`)."""
    local: torch.Tensor = full.redistribute(mesh, [Shard(dim)]).to_local()
    per = -(-seq.length // mesh.size())
    if local.shape[dim] < per:
        pad = local.new_zeros((*local.shape[:dim], per - local.shape[dim], *local.shape[dim + 1 :]))
        local = torch.cat([local, pad], dim)
    return local


def _all_heads(probs: torch.Tensor, average: bool, heads: int, mesh: DeviceMesh | None, rank: int) -> Any:
    """The attention weights of every head (or their mean), as the whole module returns them: a replicated DTensor
    over tp (a rank's copy, no process group: its share, summed over the copies by the checks before training)."""
    if average:
        local = probs.sum(dim=1) / heads
        if mesh is None:
            return local
        return DTensor.from_local(local, mesh, [Partial()], run_check=False)  # each rank's heads' share of the mean
    if mesh is None:  # a rank's copy: its heads in place, zeros elsewhere
        own = probs.new_zeros((probs.shape[0], heads, *probs.shape[2:]))
        own.narrow(1, rank * probs.shape[1], probs.shape[1]).copy_(probs)
        return own
    return DTensor.from_local(probs, mesh, [Shard(1)], run_check=False)

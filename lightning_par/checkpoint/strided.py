"""Checkpoint layout of fused tensor-parallel parameters (a ``[q | k | v]`` projection split chunk by chunk).

Such a parameter is a DTensor with a ``_StridedShard`` placement on the ``tp`` axis: each rank holds its slice
of every chunk, which is not one contiguous block of the full tensor, so DCP cannot describe it (it reports
overlapping chunks), and torch's redistribution of it nested under data-parallel sharding is not exact. We write
it as the full, replicated tensor instead (DCP stores a replicated tensor once) and slice it back on load, with
our own collectives on the layout we created. Every other tensor is saved as it is.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate

from lightning_par import _compat


def _tp_dim(t: DTensor) -> int | None:
    names = t.device_mesh.mesh_dim_names or ()
    for i, (name, pl) in enumerate(zip(names, t.placements)):
        if name == "tp" and isinstance(pl, _compat.StridedShard):
            return i
    return None


def is_fused(value: Any) -> bool:
    """Whether ``value`` is a DTensor split chunk by chunk over ``tp`` (a fused projection or its state)."""
    return isinstance(value, DTensor) and _tp_dim(value) is not None


def _row_dims(t: DTensor, tp_dim: int) -> list[int]:
    # Data-parallel mesh dims that split the tp-local rows (ZeRO), outermost first.
    return [i for i, pl in enumerate(t.placements) if i != tp_dim and not isinstance(pl, Replicate)]


def _all_gather_rows(local: torch.Tensor, group: dist.ProcessGroup, rows: int) -> torch.Tensor:
    """Concatenate every rank's row chunk (torch.chunk order, possibly uneven) of a ``rows``-row tensor."""
    n = dist.get_world_size(group)
    per = -(-rows // n)
    padded = F.pad(local, (0, 0) * (local.dim() - 1) + (0, per - local.shape[0]))
    out = [torch.empty_like(padded) for _ in range(n)]
    dist.all_gather(out, padded.contiguous(), group=group)  # gloo needs equal sizes: pad, then trim
    return torch.cat(out)[:rows]


def full_of_fused(t: DTensor) -> torch.Tensor:
    """The full tensor of a fused DTensor, identical on every rank (collectives over its mesh)."""
    tp_dim = _tp_dim(t)
    assert tp_dim is not None
    mesh, split = t.device_mesh, t.placements[tp_dim]
    tp = mesh.size(tp_dim)
    chunks, dim = int(split.split_factor), int(split.dim)  # type: ignore[attr-defined]
    # Data-parallel sharding splits the tp-local rows; dim 1 is split by tp for [in, out] weights (Conv1D).
    tp_rows = t.shape[0] // tp if dim == 0 else t.shape[0]
    local = t.to_local()
    for i in reversed(_row_dims(t, tp_dim)):
        local = _all_gather_rows(local, mesh.get_group(i), tp_rows)
    parts = [torch.empty_like(local) for _ in range(tp)]
    dist.all_gather(parts, local.contiguous(), group=mesh.get_group(tp_dim))
    # Rank r holds [c_0 slice r | c_1 slice r | ...] along `dim`; the full tensor is [c_0 | c_1 | ...].
    return torch.cat([part.chunk(chunks, dim)[j] for j in range(chunks) for part in parts], dim)


def local_of_fused(full: torch.Tensor, like: DTensor) -> torch.Tensor:
    """This rank's local tensor of ``like``'s layout, sliced from the full tensor (no communication)."""
    tp_dim = _tp_dim(like)
    assert tp_dim is not None
    mesh, split = like.device_mesh, like.placements[tp_dim]
    tp, r = mesh.size(tp_dim), mesh.get_local_rank(tp_dim)
    chunks, dim = int(split.split_factor), int(split.dim)  # type: ignore[attr-defined]
    local = torch.cat([c.chunk(tp, dim)[r] for c in full.chunk(chunks, dim)], dim)
    for i in _row_dims(like, tp_dim):
        local = local.chunk(mesh.size(i))[mesh.get_local_rank(i)]
    return local


@dataclasses.dataclass
class _Swap:
    box: dict[Any, Any]
    key: Any
    original: DTensor


def canonicalize(state: dict[str, Any]) -> tuple[dict[str, Any], list[_Swap]]:
    """A copy of the nested ``state`` with every fused DTensor replaced by its full replicated DTensor.

    Only the dicts on the way to a replaced tensor are copied: ``state`` (which may hold an optimizer's live
    state dicts) is never modified. Collective: every rank must call it with the same structure.

    Returns:
        the copy, and what was replaced, for `restore` after a load into the copy.
    """
    swaps: list[_Swap] = []

    def walk(box: dict[Any, Any]) -> dict[Any, Any]:
        out = box
        for key, value in box.items():
            new = walk(value) if isinstance(value, dict) else value
            if is_fused(value):
                mesh = value.device_mesh
                new = DTensor.from_local(full_of_fused(value), mesh, [Replicate()] * mesh.ndim, run_check=False)
            if new is not value:
                if out is box:
                    out = dict(box)
                out[key] = new
                if is_fused(value):
                    swaps.append(_Swap(out, key, value))
        return out

    return walk(state), swaps


@torch.no_grad()
def restore(swaps: list[_Swap]) -> None:
    """Copy each full tensor loaded into the copy back into the fused DTensor it stands for."""
    for s in swaps:
        full = s.box[s.key]
        s.original.to_local().copy_(local_of_fused(full.to_local(), s.original))


def _nested_split(t: DTensor) -> tuple[int, int] | None:
    """(tp mesh dim, tensor dim) when ``t`` is ZeRO-3 over tensor parallelism: one plain ``Shard(d)`` (tp) and
    data-parallel ``_StridedShard(d)`` splitting each tp-local tensor's rows (FSDP2's 2-D layout); else ``None``."""
    placements: list[Any] = list(t.placements)
    plain = [(i, int(pl.dim)) for i, pl in enumerate(placements)
             if pl.is_shard() and not isinstance(pl, _compat.StridedShard)]  # fmt: skip
    strided = [pl for pl in placements if isinstance(pl, _compat.StridedShard)]
    if len(plain) != 1 or not strided or any(int(pl.dim) != plain[0][1] for pl in strided):
        return None
    return plain[0]


def _full_of_nested(t: DTensor, tp_dim: int, dim: int) -> torch.Tensor:
    """The full tensor of FSDP2-over-tp layout with our own collectives (list all-gathers into buffers we own):
    the data-parallel shards of this tp rank's rows first, then the tp ranks' parts along ``dim`` (torch.chunk
    order, possibly uneven: padded for gloo, trimmed after). torch's own redistribution of this layout runs two
    all-gathers in an order it warns about."""
    mesh, n = t.device_mesh, t.shape[dim]
    tp, chunk = mesh.size(tp_dim), -(-t.shape[dim] // mesh.size(tp_dim))
    sizes = [max(0, min(n - r * chunk, chunk)) for r in range(tp)]
    local = t.to_local().movedim(dim, 0)
    for i in reversed(_row_dims(t, tp_dim)):
        local = _all_gather_rows(local, mesh.get_group(i), sizes[mesh.get_local_rank(tp_dim)])
    padded = F.pad(local, (0, 0) * (local.dim() - 1) + (0, chunk - local.shape[0])).contiguous()
    parts = [torch.empty_like(padded) for _ in range(tp)]
    dist.all_gather(parts, padded, group=mesh.get_group(tp_dim))
    return torch.cat([p[:k] for p, k in zip(parts, sizes)]).movedim(0, dim)


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The full tensor behind a (possibly sharded) parameter or state tensor; collective for DTensors.

    Like ``DTensor.full_tensor()``, but also exact for fused tensor-parallel projections nested under ZeRO, and
    gathered with explicit collectives for ZeRO-3 over tensor parallelism (`_full_of_nested`).
    """
    if is_fused(t):
        return full_of_fused(t)  # type: ignore[arg-type]
    if isinstance(t, DTensor) and (nested := _nested_split(t)) is not None:
        return _full_of_nested(t, *nested)
    return t.full_tensor() if isinstance(t, DTensor) else t

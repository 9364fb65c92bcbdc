"""Put a full tensor into this rank's layout of it, with no communication.

Every way a rank holds a parameter reduces to one of three cases, and each has an exact local slicing:

- a plain tensor of the full shape (replicated, ZeRO-0/1/2, a pipeline stage's own module): all of it;
- a DTensor (FSDP2's ``Shard(0)``, tensor parallelism, both nested; expert shards wrapped by `ExpertParallel`):
  DTensor's own chunking, ``distribute_tensor(..., src_data_rank=None)``;
- a fused projection split chunk by chunk over ``tp`` (`lightning_par.checkpoint.strided`): each chunk's slice,
  concatenated.

Initialisation off the meta device (`lightning_par.parallel.materialize`) and pretrained weights read from files
both end here, so that the two cannot disagree about which slice a rank owns.
"""

from __future__ import annotations

from math import prod
from typing import Optional

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from lightning_par import _compat
from lightning_par.checkpoint.strided import is_fused, local_of_fused
from lightning_par.utils import dtensors


def local_slice(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``full`` in the layout of ``like`` (a plain tensor or a DTensor of ``full``'s shape).

    Raises:
        ValueError: the shapes differ.
    """
    if tuple(full.shape) != tuple(like.shape):
        raise ValueError(f"a tensor of shape {tuple(full.shape)} cannot fill one of shape {tuple(like.shape)}")
    if not isinstance(like, DTensor):
        return full
    if is_fused(like):
        return local_of_fused(full, like)
    region = region_of(like)
    if region is not None:
        return full[region]  # a view: no copy of this rank's chunk before it is copied into place
    # src_data_rank=None: every rank slices its own chunk out of the full tensor it already has; nothing is sent.
    return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None).to_local()


@torch.no_grad()
def place_full(full: torch.Tensor, into: torch.Tensor) -> None:
    """Copy this rank's slice of ``full`` into ``into`` in place (its local storage when ``into`` is a DTensor).

    ``full`` may live on another device or have another dtype; it is cast and copied slice by slice.
    """
    local = local_slice(full.to(device=dtensors.local(into).device), into)
    dtensors.local(into).copy_(local)


def region_of(view: DTensor) -> Optional[tuple[slice, ...]]:
    """The one rectangle of the full tensor this rank's shard is, or ``None`` when it is not one rectangle."""
    placements, mesh = view.placements, view.device_mesh
    for i, pl in enumerate(placements):
        if isinstance(pl, _compat.StridedShard):
            # FSDP2 over a tensor-parallel Shard of the same dim: split_factor is the tp degree, and the rank's
            # rows are still contiguous; any other strided split owns several rectangles.
            after = [mesh.size(j) for j, q in enumerate(placements) if j > i and isinstance(q, Shard)]
            if int(pl.split_factor) != prod(after) or any(
                isinstance(q, Shard) and q.dim != pl.dim for j, q in enumerate(placements) if j > i
            ):
                return None
        elif not isinstance(pl, (Shard, Replicate)):
            return None  # Partial: not a layout a parameter is stored in
    # DTensor's checkpoint protocol (what DCP plans reads with): one chunk, this rank's sizes and global offsets.
    chunks = view.__create_chunk_list__()
    if len(chunks) != 1 or tuple(chunks[0].sizes) != tuple(view.to_local().shape):
        return None
    return tuple(slice(o, o + s) for o, s in zip(chunks[0].offsets, chunks[0].sizes))

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

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from lightning_par.checkpoint.strided import is_fused, local_of_fused


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
    # src_data_rank=None: every rank slices its own chunk out of the full tensor it already has; nothing is sent.
    return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None).to_local()


@torch.no_grad()
def place_full(full: torch.Tensor, into: torch.Tensor) -> None:
    """Copy this rank's slice of ``full`` into ``into`` in place (its local storage when ``into`` is a DTensor).

    ``full`` may live on another device or have another dtype; it is cast and copied slice by slice.
    """
    local = local_slice(full.to(device=_local(into).device), into)
    _local(into).copy_(local)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t

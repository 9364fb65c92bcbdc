"""ZeRO data parallelism (Rajbhandari et al., "ZeRO", arXiv 1910.02054).

Stage 3 is FSDP2 (`fully_shard`): parameters, gradients and optimizer state are sharded; each block is
all-gathered for its forward and again for its backward, and gradients are reduce-scattered (3 x Psi x (n-1)/n
bytes per step).

Stages 0-2 keep full parameters on every rank and share one bucketed engine (`zero.replicated.ReplicatedZero`):
- stage 0 (DDP): full gradients are all-reduced, bucket by bucket during the backward that precedes the step; the
  optimizer is untouched.
- stage 1: full gradients are kept through the backward passes of an accumulation; during the one that precedes
  the step each bucket is reduce-scattered as soon as its gradients are final, the rank updates only its shard of
  every parameter, and the shards are all-gathered back.
- stage 2: as stage 1, but each bucket is reduce-scattered as soon as its gradients are ready during backward and
  the full gradients are freed, so a rank only ever accumulates its gradient shard.
Stages 1 and 2 move 2 x Psi x (n-1)/n bytes per step, as DDP does.

A shard is a dim-0 slice of each parameter in ``torch.chunk`` order (ceil(d0/n) rows per rank, the last ranks
possibly short or empty), i.e. exactly the local part of a ``DTensor`` with ``Shard(0)`` placement. The optimizer
runs on plain "master" parameters that are views into the full parameters (no copy of the weights, no DTensor
dispatch per op); for checkpoints its state is wrapped as ``Shard(0)`` DTensors keyed like FSDP2's, so state
moves between stages and world sizes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from lightning_par.utils.dtensors import storages


class StepRoot(nn.Module):
    """A root module around the user's module whose forward the trainer redirects to ``training_step``.

    FSDP2 gathers the root's own parameters and finalises gradient reduction from hooks on the root's
    ``__call__``. Lightning calls ``training_step`` (not ``forward``), so without this root those hooks would not
    fire. The user's module keeps its parameter names: it is ``self.module`` here and checkpoints use it directly.
    """

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)


def apply_fsdp(
    root: nn.Module,
    blocks: Sequence[nn.Module],
    mesh: DeviceMesh,
    *,
    reshard_after_forward: bool = True,
    param_dtype: Optional[torch.dtype] = None,
    reduce_dtype: Optional[torch.dtype] = None,
    offload: bool = False,
    ignored_params: Optional[set[nn.Parameter]] = None,
    all_gather: Optional[Any] = None,
) -> nn.Module:
    """Shard ``root`` with FSDP2 (ZeRO-3), one communication unit per block plus the root for the rest.

    Args:
        root: the module whose forward the training step calls; it becomes the FSDP root.
        blocks: repeated blocks, each wrapped separately so only one block is unsharded at a time.
        mesh: 1-D (``dp_shard``) or 2-D (``dp_replicate``, ``dp_shard``) mesh; 2-D gives hybrid sharding.
        reshard_after_forward: free the gathered parameters after forward (ZeRO-3); False keeps them to backward.
        param_dtype: dtype parameters are gathered and computed in (mixed precision); the shards stay fp32.
        reduce_dtype: dtype gradients are reduce-scattered in.
        offload: keep sharded parameters, gradients and optimizer state in CPU memory between uses.
        ignored_params: parameters FSDP2 must leave alone (expert shards, reduced by expert parallelism).
        all_gather: every unit's all-gather instead of FSDP2's (`FSDPModule.set_custom_all_gather`; the int8 one of
            `lightning_par.parallel.compression.quantized`).
    """
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    # Pinned memory needs an accelerator (docs/testing.md); pinning only matters for async H2D copies anyway.
    off: OffloadPolicy = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if offload else OffloadPolicy()
    if mesh.ndim == 2 and mesh.size(0) == 1:
        mesh = mesh[(mesh.mesh_dim_names or ("", "dp_shard"))[1]]  # one replica: plain FSDP, no size-1 all-reduce
    for block in blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp, offload_policy=off,
                    ignored_params=ignored_params)  # fmt: skip
    # The root's own parameters (embeddings, head) are gathered for the whole step; resharding them after
    # forward would only re-gather them for backward straight away.
    fully_shard(
        root, mesh=mesh, reshard_after_forward=False, mp_policy=mp, offload_policy=off, ignored_params=ignored_params
    )
    if all_gather is not None:
        for unit in (*blocks, root):
            unit.set_custom_all_gather(all_gather)  # type: ignore[operator]
    return root


@torch.no_grad()
def sync_module_states(module: nn.Module, mesh: DeviceMesh) -> None:
    """Broadcast parameters and buffers from the first data-parallel rank, as DDP does at construction.

    Ranks may have initialised differently (no seed, or a seed offset per rank); replicas must start equal.

    Args:
        module: the model, before any sharding.
        mesh: the flattened ``dp`` mesh (1-D).
    """
    if mesh.size() == 1:
        return
    group = mesh.get_group()
    src = dist.get_global_rank(group, 0)
    tensors = [t for t in [*module.parameters(), *module.buffers()] if t.device.type != "meta"]
    for t in tensors:
        for part in storages(t):  # a quantised weight (NF4) as its codes and scalers
            dist.broadcast(part, src=src, group=group)
